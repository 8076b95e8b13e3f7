// KimiLinearForCausalLM against the float64 reference of the whole decoder (tests/support/model_reference)
// on random checkpoints in the real layout at real widths (hidden 2304, MLA 32 heads x
// 192/128, kv_lora 512, experts of 1024; KDA 4 x 128) with 2-3 layers, few experts and a small vocabulary:
// sequences of 1, 63, 64, 65 and 300 tokens, varlen batches with 0- and 1-token segments, fp32 within the
// spec's bounds, int8 / int4 weights by the spec's rule, BF16-stored checkpoints.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kda/io/kimi_linear_48b.h"
#include "kda/models/kimi_linear_case.h"
#include "kda/models/kimi_linear_model.h"
#include "support/model_checkpoint.h"
#include "support/model_reference.h"
#include "support/test_support.h"

namespace kda {
namespace {

using models::KimiLinearForCausalLM;
using models::ModelOptions;

// The real model's widths, `layers` decoder layers of its pattern (KDA, then MLA where `mla` says),
// `experts` routed experts, a small vocabulary.
io::KimiLinearConfig real_width_config(int layers, std::vector<int> mla_layers, int experts, int64_t vocab) {
  io::KimiLinearConfig cfg = io::kimi_linear_48b_config();
  cfg.num_hidden_layers = layers;
  cfg.kda_layers.clear();
  cfg.full_attn_layers.clear();
  for (int i = 0; i < layers; ++i) {
    bool is_mla = false;
    for (const int m : mla_layers) is_mla |= m == i;
    (is_mla ? cfg.full_attn_layers : cfg.kda_layers).push_back(i + 1);
  }
  // KDA heads of the real head_dim but fewer of them: the float64 reference's KDA recurrence at 32 heads
  // would dominate the run (the KDA layer's real shapes are tested on their own in test_layer).
  cfg.num_heads = 4;
  cfg.num_experts = experts;
  cfg.num_experts_per_token = std::min(cfg.num_experts_per_token, 2);
  cfg.vocab_size = vocab;
  cfg.intermediate_size = 2048;  // the dense MLP (layer 0); 9216 in the real model
  return cfg;
}

struct Fixture {
  io::KimiLinearConfig cfg;
  testing::TensorMap w;
  std::filesystem::path dir;
};

const Fixture& fixture(int layers, std::vector<int> mla, const std::string& tag,
                       io::StDType dtype = io::StDType::F32) {
  static std::map<std::string, Fixture> cache;
  auto it = cache.find(tag);
  if (it != cache.end()) return it->second;
  Fixture f;
  f.cfg = real_width_config(layers, std::move(mla), 8, 1000);
  f.w = testing::random_model_weights(f.cfg, 1234 + layers, dtype);
  f.dir = testing::make_temp_dir("model_ref_" + tag);
  testing::write_model_checkpoint(f.dir, f.cfg, f.w, 3);
  // What the reference reads: the values as stored (BF16 rounding included).
  f.w = testing::read_model_weights(f.dir);
  return cache.emplace(tag, std::move(f)).first->second;
}

std::vector<float> to_f32(const std::vector<double>& v) { return {v.begin(), v.end()}; }

// Uniform token ids. draw_clear_tokens runs the reference token by token (quadratic in T through the MLA
// layers), too slow for these lengths at real widths; fp32 moves a routing score by ~1e-6, so instead
// every test asserts the reference's own minimum routing margin is far above that.
std::vector<int32_t> uniform_tokens(int64_t T, int64_t vocab, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& t : ids) t = static_cast<int32_t>(g() % static_cast<uint64_t>(vocab));
  return ids;
}
constexpr double kFp32Margin = 1e-4;

void expect_matches_reference(const models::ModelCaseResult& r, const testing::ModelReference& ref,
                              const std::string& what) {
  const auto logits = to_f32(ref.logits), hidden = to_f32(ref.hidden_final);
  ASSERT_EQ(r.logits.size(), logits.size()) << what;
  EXPECT_LE(testing::max_error_ratio(r.logits.data(), logits.data(), logits.size(), 1e-4, 1e-4), 1.0) << what;
  EXPECT_LE(testing::max_error_ratio(r.hidden_final.data(), hidden.data(), hidden.size(), 1e-4, 1e-4), 1.0)
      << what;
  for (const auto& [id, s] : r.kda_recurrent_state) {
    const auto want = to_f32(ref.kda_recurrent_state.at(id));
    EXPECT_LE(testing::max_error_ratio(s.data(), want.data(), want.size(), 1e-5, 1e-5), 1.0)
        << what << " kda " << id;
  }
  for (const auto& [id, s] : r.mla_ckv) {
    const auto want = to_f32(ref.mla_ckv.at(id));
    EXPECT_LE(testing::max_error_ratio(s.data(), want.data(), want.size(), 1e-5, 1e-5), 1.0)
        << what << " ckv " << id;
    const auto kpe = to_f32(ref.mla_kpe.at(id));
    const auto& got = r.mla_kpe.at(id);
    EXPECT_LE(testing::max_error_ratio(got.data(), kpe.data(), kpe.size(), 1e-5, 1e-5), 1.0)
        << what << " kpe " << id;
  }
}

TEST(KimiLinearModelVsReference, RealWidthsSingleSequences) {
  // Layer 0 KDA + dense MLP, layer 1 MLA + MoE.
  const auto& f = fixture(2, {1}, "2layers");
  ModelOptions o;
  auto model = KimiLinearForCausalLM::from_pretrained(f.dir, o);
  for (const int T : {1, 63, 64, 65, 300}) {
    const auto ids = uniform_tokens(T, f.cfg.vocab_size, 77 + T);
    const auto ref = testing::reference_model(f.cfg, f.w, ids, {});
    ASSERT_GE(ref.routing_min_margin, kFp32Margin) << "T " << T << ": pick another seed";
    expect_matches_reference(models::run_model_case(*model, ids, {}), ref, "T " + std::to_string(T));
  }
}

TEST(KimiLinearModelVsReference, RealWidthsVarlenWithEmptyAndOneTokenSegments) {
  // KDA + dense, KDA + MoE, MLA + MoE: the MLA layer's input has been through two KDA layers and a MoE.
  const auto& f = fixture(3, {2}, "3layers");
  auto model = KimiLinearForCausalLM::from_pretrained(f.dir, {});
  const std::vector<int32_t> lens = {5, 0, 1, 66, 0, 17};
  std::vector<int32_t> cu = {0};
  for (const int32_t l : lens) cu.push_back(cu.back() + l);
  const auto ids = uniform_tokens(cu.back(), f.cfg.vocab_size, 5);
  const auto ref = testing::reference_model(f.cfg, f.w, ids, cu);
  ASSERT_GE(ref.routing_min_margin, kFp32Margin) << "pick another seed";
  expect_matches_reference(models::run_model_case(*model, ids, cu), ref, "varlen");
  models::ModelCaseOptions co;
  co.prefill_chunks = 3;
  co.decode_tail = 4;
  expect_matches_reference(models::run_model_case(*model, ids, cu, co), ref, "varlen, 3 chunks + 4 decodes");
}

TEST(KimiLinearModelVsReference, QuantizedWeightsWithinTheSpecRule) {
  const auto& f = fixture(2, {1}, "2layers");
  const auto ids = uniform_tokens(40, f.cfg.vocab_size, 11);
  const auto exact = to_f32(testing::reference_model(f.cfg, f.w, ids, {}).logits);
  for (const auto [wmode, q] : {std::pair{Weights::Int8, testing::ModelReferenceOptions::Quant::Int8},
                                std::pair{Weights::Int4, testing::ModelReferenceOptions::Quant::Int4}}) {
    testing::ModelReferenceOptions ro;
    ro.quant = q;
    const auto sref = testing::reference_model(f.cfg, f.w, ids, {}, ro);
    ASSERT_GE(sref.routing_min_margin, kFp32Margin) << to_string(wmode) << ": pick another seed";
    const auto scheme = to_f32(sref.logits);
    const double bound = 1.1 * testing::rel_l2(scheme.data(), exact.data(), exact.size());
    ModelOptions o;
    o.weights = wmode;
    auto model = KimiLinearForCausalLM::from_pretrained(f.dir, o);
    const auto r = models::run_model_case(*model, ids, {});
    const double err = testing::rel_l2(r.logits.data(), exact.data(), exact.size());
    EXPECT_LE(err, bound) << to_string(wmode);
    EXPECT_GT(err, 0.0) << to_string(wmode);
  }
}

TEST(KimiLinearModelVsReference, Bf16CheckpointFp32AndBf16Modes) {
  const auto& f = fixture(2, {1}, "2layers_bf16", io::StDType::BF16);
  // bf16 moves routing scores by up to ~1e-2: tokens drawn with the spec's 2e-2 margin.
  const auto ids = testing::draw_clear_tokens(f.cfg, f.w, {12}, 3, 2e-2);
  const auto ref = testing::reference_model(f.cfg, f.w, ids, {});
  {
    auto model = KimiLinearForCausalLM::from_pretrained(f.dir, {});
    expect_matches_reference(models::run_model_case(*model, ids, {}), ref, "bf16 checkpoint, fp32 mode");
  }
  testing::ModelReferenceOptions ro;
  ro.bf16 = true;
  const auto emu = to_f32(testing::reference_model(f.cfg, f.w, ids, {}, ro).logits);
  const auto exact = to_f32(ref.logits);
  ModelOptions o;
  o.precision = Precision::BF16;
  auto model = KimiLinearForCausalLM::from_pretrained(f.dir, o);
  const auto r = models::run_model_case(*model, ids, {});
  EXPECT_LE(testing::rel_l2(r.logits.data(), exact.data(), exact.size()),
            2.0 * testing::rel_l2(emu.data(), exact.data(), exact.size()));
}

// The spec's loading bound: peak RSS while loading <= the resident weights + one shard's largest tensor
// group + 1 GiB. Measured from a peak reset just before the load (/proc/self/clear_refs).
TEST(KimiLinearModelVsReference, LoadingPeakRssWithinTheBound) {
  if (testing::kSanitizedMalloc) GTEST_SKIP() << "a sanitizer's allocator measures its own bookkeeping";
  const auto& f = fixture(2, {1}, "2layers_bf16", io::StDType::BF16);
  std::uintmax_t largest_shard = 0;
  for (const auto& e : std::filesystem::directory_iterator(f.dir))
    if (e.path().extension() == ".safetensors") largest_shard = std::max(largest_shard, e.file_size());
  for (const auto p : {Precision::FP32, Precision::BF16}) {
    if (!(std::ofstream("/proc/self/clear_refs") << "5")) GTEST_SKIP() << "cannot reset the peak RSS";
    const int64_t before = testing::proc_status_kb("VmRSS");
    if (before < 0) GTEST_SKIP() << "no /proc/self/status";
    ModelOptions o;
    o.precision = p;
    auto model = KimiLinearForCausalLM::from_pretrained(f.dir, o);
    const int64_t peak = (testing::proc_status_kb("VmHWM") - before) * 1024;
    const int64_t bound = model->weight_bytes() + static_cast<int64_t>(largest_shard) + (int64_t{1} << 30);
    std::printf("loading %s: peak RSS growth %.1f MB, resident weights %.1f MB, largest shard %.1f MB\n",
                to_string(p), peak / 1e6, model->weight_bytes() / 1e6, largest_shard / 1e6);
    EXPECT_LE(peak, bound) << to_string(p);
    // At this scale the spec's 1 GiB of slack would hide a loader that kept every shard's pages resident
    // (+150 MB here) or an fp32 copy of the model (+468 MB): the peak stays within the weights + one
    // shard + 192 MB. The experts are built two at a time, one per thread, each holding its fp32 gate, up,
    // down and stacked gate + up while it packs (47 MB at these shapes); whether the two threads' peaks
    // coincide moves the load's peak by about that much (bf16: 405-451 MB measured beside other tests,
    // where a slack of 128 MB allowed 450).
    EXPECT_LE(peak, model->weight_bytes() + static_cast<int64_t>(largest_shard) + (int64_t{192} << 20))
        << to_string(p);
  }
}

}  // namespace
}  // namespace kda
