// The whole decoder's float64 reference (tests/support/model_reference) against the vendored model dumps
// (every case: logits, hidden_final, KDA states, MLA cache rows, the selected experts, the routing margin;
// the bf16 emulation's logits), and the test checkpoints it reads (tests/support/model_checkpoint):
// written as the real checkpoint is laid out, parsed and opened by the library, read back unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "support/model_checkpoint.h"
#include "support/model_reference.h"
#include "support/test_support.h"

namespace kda {
namespace {

using testing::ModelReference;
using testing::ModelReferenceOptions;
using testing::TensorMap;

// Worst |a - b| / (atol + rtol |b|).
double worst(const std::vector<double>& a, const std::vector<float>& b, double atol, double rtol) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    w = std::max(w, std::fabs(a[i] - b[i]) / (atol + rtol * std::fabs(static_cast<double>(b[i]))));
  return w;
}

double rel_l2(const std::vector<double>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < b.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / den);
}

double scalar_f64(const io::NpyArray& a) {
  EXPECT_EQ(a.dtype, io::NpyDType::F64);
  double v = 0.0;
  std::memcpy(&v, a.bytes.data(), sizeof v);
  return v;
}

struct Tiny {
  io::KimiLinearConfig cfg = io::load_model_config(testing::model_dumps_dir());
  TensorMap w = testing::read_model_weights(testing::model_dumps_dir());
};

const Tiny& tiny() {
  static const Tiny t;
  return t;
}

const char* const kCases[] = {"T1", "T7", "T64", "T65", "T200", "varlen_3", "decode_tail"};

// The dumps store the float64 results as float32: 2^-24 relative apart at most, and values near zero
// inherit an absolute error of the float32 rounding of the sums around them.
constexpr double kStoredRtol = 1.2e-7;

TEST(ModelReference, ReproducesEveryTinyCase) {
  const auto& [cfg, w] = tiny();
  for (const char* name : kCases) {
    SCOPED_TRACE(name);
    const auto c = io::read_npz(testing::model_dumps_dir() / (std::string(name) + ".npz"));
    const auto ids = c.at("input_ids").to_i32();
    const std::vector<int32_t> cu =
        c.count("cu_seqlens") ? c.at("cu_seqlens").to_i32() : std::vector<int32_t>{};
    const ModelReference r = testing::reference_model(cfg, w, ids, cu);
    EXPECT_LE(worst(r.logits, c.at("logits").to_f32(), 1e-7, kStoredRtol), 1.0);
    EXPECT_LE(worst(r.hidden_final, c.at("hidden_final").to_f32(), 1e-7, kStoredRtol), 1.0);
    for (int i : cfg.kda_layer_ids()) {
      const std::string s = std::to_string(i);
      EXPECT_LE(
          worst(r.kda_recurrent_state.at(i), c.at("kda_recurrent_state_" + s).to_f32(), 1e-8, kStoredRtol),
          1.0)
          << "layer " << i;
      EXPECT_LE(worst(r.kda_conv_state.at(i), c.at("kda_conv_state_" + s).to_f32(), 1e-8, kStoredRtol), 1.0)
          << "layer " << i;
    }
    for (int i : cfg.mla_layer_ids()) {
      const std::string s = std::to_string(i);
      EXPECT_LE(worst(r.mla_ckv.at(i), c.at("mla_ckv_" + s).to_f32(), 1e-8, kStoredRtol), 1.0)
          << "layer " << i;
      EXPECT_LE(worst(r.mla_kpe.at(i), c.at("mla_kpe_" + s).to_f32(), 1e-8, kStoredRtol), 1.0)
          << "layer " << i;
    }
    for (const auto& [i, topk] : r.moe_topk) EXPECT_EQ(topk, c.at("moe_topk_" + std::to_string(i)).to_i32());
    EXPECT_EQ(r.moe_topk.size(), 3u);
    EXPECT_NEAR(r.routing_min_margin, scalar_f64(c.at("routing_min_margin")), 1e-9);
  }
}

TEST(ModelReference, Bf16EmulationReproducesLogitsBf16) {
  const auto& [cfg, w] = tiny();
  ModelReferenceOptions o;
  o.bf16 = true;
  for (const char* name : kCases) {
    SCOPED_TRACE(name);
    const auto c = io::read_npz(testing::model_dumps_dir() / (std::string(name) + ".npz"));
    const auto ids = c.at("input_ids").to_i32();
    const std::vector<int32_t> cu =
        c.count("cu_seqlens") ? c.at("cu_seqlens").to_i32() : std::vector<int32_t>{};
    const ModelReference r = testing::reference_model(cfg, w, ids, cu, o);
    const double err = rel_l2(r.logits, c.at("logits_bf16").to_f32());
    std::printf("%s: bf16 emulation vs logits_bf16 rel L2 %.3g\n", name, err);
    EXPECT_LE(err, 1e-6);
    EXPECT_NEAR(r.routing_min_margin, scalar_f64(c.at("routing_min_margin_bf16")), 1e-6);
  }
}
}  // namespace
}  // namespace kda
