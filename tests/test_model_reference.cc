// The whole decoder's float64 reference (tests/support/model_reference) against the vendored model dumps
// (every case: logits, hidden_final, KDA states, MLA cache rows, the selected experts, the routing margin;
// the bf16 emulation's logits), and the test checkpoints it reads (tests/support/model_checkpoint):
// written as the real checkpoint is laid out, parsed and opened by the library, read back unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
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

[[maybe_unused]] double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
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
    if (c.count("prefill_len")) {  // decode_tail: the states after its prefill
      const int32_t P = c.at("prefill_len").to_i32().at(0);
      const std::vector<int32_t> head(ids.begin(), ids.begin() + P);
      const ModelReference p = testing::reference_model(cfg, w, head, {});
      for (int i : cfg.kda_layer_ids()) {
        const std::string s = std::to_string(i);
        EXPECT_LE(worst(p.kda_recurrent_state.at(i), c.at("prefill_kda_recurrent_state_" + s).to_f32(), 1e-8,
                        kStoredRtol),
                  1.0);
        EXPECT_LE(
            worst(p.kda_conv_state.at(i), c.at("prefill_kda_conv_state_" + s).to_f32(), 1e-8, kStoredRtol),
            1.0);
      }
    }
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

// The tiny dumps' shapes with other weights: small enough for many reference runs.
io::KimiLinearConfig small_config() { return tiny().cfg; }

TEST(ModelCheckpoint, WrittenFolderParsesOpensAndReadsBack) {
  io::KimiLinearConfig cfg = small_config();
  cfg.routed_scaling_factor = 1.5;
  cfg.rms_norm_eps = 3e-6;
  const TensorMap w = testing::random_model_weights(cfg, 7, io::StDType::BF16);
  // Every key of the real layout: the tiny dumps' key set, shapes included.
  ASSERT_EQ(w.size(), tiny().w.size());
  for (const auto& [k, t] : tiny().w) {
    ASSERT_TRUE(w.count(k)) << k;
    EXPECT_EQ(w.at(k).shape, t.shape) << k;
    const bool f32 = k.ends_with(".A_log") || k.ends_with(".dt_bias");
    EXPECT_EQ(w.at(k).dtype, f32 ? io::StDType::F32 : io::StDType::BF16) << k;
  }
  const auto dir = testing::make_temp_dir("model_ckpt");
  testing::write_model_checkpoint(dir, cfg, w, 3);

  const io::KimiLinearConfig back = io::load_model_config(dir);
  testing::expect_same_stack_config(back, cfg);
  EXPECT_EQ(back.vocab_size, cfg.vocab_size);
  EXPECT_EQ(back.num_attention_heads, cfg.num_attention_heads);
  EXPECT_EQ(back.kv_lora_rank, cfg.kv_lora_rank);
  EXPECT_EQ(back.qk_nope_head_dim, cfg.qk_nope_head_dim);
  EXPECT_EQ(back.qk_rope_head_dim, cfg.qk_rope_head_dim);
  EXPECT_EQ(back.v_head_dim, cfg.v_head_dim);
  EXPECT_EQ(back.intermediate_size, cfg.intermediate_size);
  EXPECT_EQ(back.num_experts, cfg.num_experts);
  EXPECT_EQ(back.num_experts_per_token, cfg.num_experts_per_token);
  EXPECT_EQ(back.num_shared_experts, cfg.num_shared_experts);
  EXPECT_EQ(back.moe_intermediate_size, cfg.moe_intermediate_size);
  EXPECT_EQ(back.first_k_dense_replace, cfg.first_k_dense_replace);
  EXPECT_EQ(back.routed_scaling_factor, cfg.routed_scaling_factor);
  EXPECT_EQ(back.rms_norm_eps, cfg.rms_norm_eps);

  // Three shards named as the real ones, split in key order: the embedding in the first, the LM head
  // in the last; the index maps every key.
  for (int k = 1; k <= 3; ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-00003.safetensors", k);
    EXPECT_TRUE(std::filesystem::exists(dir / name)) << name;
  }
  const auto map =
      io::parse_safetensors_index(testing::read_file(dir / "model.safetensors.index.json"), "index");
  EXPECT_EQ(map.size(), w.size());
  EXPECT_EQ(map.at("model.embed_tokens.weight"), "model-00001-of-00003.safetensors");
  EXPECT_EQ(map.at("lm_head.weight"), "model-00003-of-00003.safetensors");

  const io::Checkpoint ckpt(dir);
  for (const auto& [k, t] : w) {
    ASSERT_TRUE(ckpt.contains(k)) << k;
    EXPECT_EQ(ckpt.get(k).dtype, t.dtype) << k;
    EXPECT_EQ(ckpt.load_f32(k, t.shape), t.values) << k;
  }
  const TensorMap r = testing::read_model_weights(dir);
  ASSERT_EQ(r.size(), w.size());
  for (const auto& [k, t] : w) {
    EXPECT_EQ(r.at(k).shape, t.shape) << k;
    EXPECT_EQ(r.at(k).dtype, t.dtype) << k;
    EXPECT_EQ(r.at(k).values, t.values) << k;
  }
  testing::expect_throw_with<std::invalid_argument>(
      [&] { testing::write_model_checkpoint(dir / "x", cfg, w, 0); }, "shards");
}

// A varlen batch (0- and 1-token segments included) equals each sequence alone; the packed MLA rows and
// per-sequence states land where the dumps put them.
TEST(ModelReference, VarlenBatchEqualsEachSequenceAlone) {
  const io::KimiLinearConfig cfg = small_config();
  const TensorMap w = testing::random_model_weights(cfg, 11, io::StDType::F32);
  const std::vector<int32_t> lens = {3, 0, 1, 9};
  std::vector<int32_t> ids, cu = {0};
  for (int32_t n : lens) {
    for (int32_t j = 0; j < n; ++j) ids.push_back((37 * static_cast<int32_t>(ids.size()) + 5) % 512);
    cu.push_back(static_cast<int32_t>(ids.size()));
  }
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    ModelReferenceOptions o;
    o.bf16 = bf16;
    const ModelReference all = testing::reference_model(cfg, w, ids, cu, o);
    const int64_t V = cfg.vocab_size, D = cfg.hidden_size, R = cfg.kv_lora_rank;
    for (size_t n = 0; n < lens.size(); ++n) {
      const std::vector<int32_t> one(ids.begin() + cu[n], ids.begin() + cu[n + 1]);
      const ModelReference alone = testing::reference_model(cfg, w, one, {0, lens[n]}, o);
      for (int64_t j = 0; j < lens[n] * V; ++j) ASSERT_EQ(all.logits[cu[n] * V + j], alone.logits[j]);
      for (int64_t j = 0; j < lens[n] * D; ++j)
        ASSERT_EQ(all.hidden_final[cu[n] * D + j], alone.hidden_final[j]);
      for (int i : cfg.kda_layer_ids()) {
        const auto& S = alone.kda_recurrent_state.at(i);
        EXPECT_TRUE(std::equal(S.begin(), S.end(), all.kda_recurrent_state.at(i).begin() + n * S.size()));
        const auto& C = alone.kda_conv_state.at(i);
        EXPECT_TRUE(std::equal(C.begin(), C.end(), all.kda_conv_state.at(i).begin() + n * C.size()));
      }
      for (int i : cfg.mla_layer_ids())
        EXPECT_TRUE(std::equal(alone.mla_ckv.at(i).begin(), alone.mla_ckv.at(i).end(),
                               all.mla_ckv.at(i).begin() + cu[n] * R));
    }
    // An empty segment's states are zeros; the 1-token segment's conv state holds [0, 0, x0].
    const auto& S0 = all.kda_recurrent_state.at(0);
    const size_t per_seq = S0.size() / lens.size();
    EXPECT_EQ(std::count(S0.begin() + per_seq, S0.begin() + 2 * per_seq, 0.0), static_cast<long>(per_seq));
    const int64_t C3 = 3 * cfg.projection_size(), Wm1 = cfg.short_conv_kernel_size - 1;
    const double* c2 = &all.kda_conv_state.at(0)[2 * Wm1 * C3];
    for (int64_t j = 0; j < (Wm1 - 1) * C3; ++j) ASSERT_EQ(c2[j], 0.0);
    EXPECT_NE(std::count(c2 + (Wm1 - 1) * C3, c2 + Wm1 * C3, 0.0), C3);
  }
}

// The combine option: with a zero correction bias c = s and the two combines agree exactly; with a
// bias they differ while the first MoE layer's routing (which the combine cannot reach) stays the same.
TEST(ModelReference, BiasedCombineDiffersOnlyThroughTheBias) {
  const io::KimiLinearConfig cfg = small_config();
  TensorMap w = testing::random_model_weights(cfg, 13, io::StDType::F32);
  const std::vector<int32_t> ids = {1, 100, 200, 300, 400, 500, 17};
  ModelReferenceOptions biased;
  biased.combine = testing::RefCombine::Biased;
  const ModelReference u = testing::reference_model(cfg, w, ids, {}),
                       b = testing::reference_model(cfg, w, ids, {}, biased);
  EXPECT_EQ(u.moe_topk.at(1), b.moe_topk.at(1));
  EXPECT_GT(rel_l2(b.logits, u.logits), 1e-4);
  for (auto& [k, t] : w)
    if (k.ends_with("e_score_correction_bias")) std::fill(t.values.begin(), t.values.end(), 0.0f);
  EXPECT_EQ(testing::reference_model(cfg, w, ids, {}).logits,
            testing::reference_model(cfg, w, ids, {}, biased).logits);
}

// The int8 / int4 schemes move the logits by a small, ordered amount; kv_norm_eps is read.
TEST(ModelReference, QuantizedSchemesAndKvNormEps) {
  const io::KimiLinearConfig cfg = small_config();
  const TensorMap w = testing::random_model_weights(cfg, 17, io::StDType::F32);
  const std::vector<int32_t> ids = {3, 30, 300, 33, 330};
  const ModelReference exact = testing::reference_model(cfg, w, ids, {});
  ModelReferenceOptions o;
  o.quant = ModelReferenceOptions::Quant::Int8;
  const double e8 = rel_l2(testing::reference_model(cfg, w, ids, {}, o).logits, exact.logits);
  o.quant = ModelReferenceOptions::Quant::Int4;
  const double e4 = rel_l2(testing::reference_model(cfg, w, ids, {}, o).logits, exact.logits);
  std::printf("scheme rel L2 of the logits: int8 %.3g, int4 %.3g\n", e8, e4);
  EXPECT_GT(e8, 1e-5);
  EXPECT_LT(e8, 5e-2);
  EXPECT_GT(e4, 4 * e8);
  EXPECT_LT(e4, 1.0);  // int4 flips some routing decisions at these widths
  ModelReferenceOptions eps;
  eps.kv_norm_eps = 1e-6;
  const ModelReference m = testing::reference_model(cfg, w, ids, {}, eps);
  EXPECT_NE(m.mla_ckv.at(3), exact.mla_ckv.at(3));
  EXPECT_LT(rel_l2(m.mla_ckv.at(3), exact.mla_ckv.at(3)), 1e-3);
}

TEST(ModelReference, DrawClearTokensReachesItsMargin) {
  const io::KimiLinearConfig cfg = small_config();
  const TensorMap w = testing::random_model_weights(cfg, 19, io::StDType::BF16);
  const std::vector<int32_t> lens = {20, 1, 9};
  const auto ids = testing::draw_clear_tokens(cfg, w, lens, 5, 2e-2);
  ASSERT_EQ(ids.size(), 30u);
  EXPECT_EQ(ids, testing::draw_clear_tokens(cfg, w, lens, 5, 2e-2));
  const std::vector<int32_t> cu = {0, 20, 21, 30};
  ModelReferenceOptions o;
  o.bf16 = true;
  EXPECT_GE(testing::reference_model(cfg, w, ids, cu).routing_min_margin, 2e-2);
  EXPECT_GE(testing::reference_model(cfg, w, ids, cu, o).routing_min_margin, 2e-2);
  // Plain ids of the same count do not all clear it (the draw is what makes them clear).
  std::vector<int32_t> plain(30);
  for (int j = 0; j < 30; ++j) plain[j] = (j * 97 + 3) % 512;
  EXPECT_LT(testing::reference_model(cfg, w, plain, cu).routing_min_margin, 2e-2);
}

TEST(ModelReference, BadInputIsAClearError) {
  const auto& [cfg, w] = tiny();
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        testing::reference_model(cfg, w, {1, 512}, {});
      },
      "512");
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        testing::reference_model(cfg, w, {1, -1}, {});
      },
      "-1");
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        testing::reference_model(cfg, w, {1, 2, 3}, {0, 2});
      },
      "cu_seqlens");
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        testing::reference_model(cfg, w, {1, 2, 3}, {0, 2, 1, 3});
      },
      "cu_seqlens");
  TensorMap missing = w;
  missing.erase("model.layers.3.self_attn.kv_b_proj.weight");
  testing::expect_throw_with<std::invalid_argument>([&] { testing::reference_model(cfg, missing, {1}, {}); },
                                                    "model.layers.3.self_attn.kv_b_proj.weight");
  TensorMap shaped = w;
  shaped.at("model.layers.1.block_sparse_moe.experts.5.w2.weight").shape = {64, 256};
  testing::expect_throw_with<std::invalid_argument>([&] { testing::reference_model(cfg, shaped, {1}, {}); },
                                                    "experts.5.w2.weight' has shape [64, 256]");
}

}  // namespace
}  // namespace kda
