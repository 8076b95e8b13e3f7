// KimiMLAAttention against the float64 reference of the spec's MLA (tests/support/mla_reference): fp32
// within 1e-4 + 1e-4|b| on the output and 1e-5 + 1e-5|b| on the cache rows, small widths on many shapes
// and the real ones on a few tokens; the absorbed form equal to the plain one; a cached prefix + new
// tokens, chunked prefill and decode steps equal to the whole sequence at once; varlen batches with 0-
// and 1-token rows; bf16 by the rel-L2 rule; TP 2 equal to TP 1; int8 / int4 near fp32; stale (poisoned)
// freed slots never read; bad input a clear error that changes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/distributed/in_process.h"
#include "kda/io/safetensors.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/quant_linear.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kimi_mla.h"
#include "support/mla_reference.h"
#include "support/test_support.h"

namespace kda {
namespace {

using model_executor::ForwardBatch;
using models::KimiMLAAttention;
using models::MlaForm;
using models::MlaLayerWeights;

constexpr int kLayer = 1;  // mla_test_config's MLA layer

io::KimiLinearConfig small_config() { return testing::mla_test_config(64, 4, 16, 8, 16, 32); }
io::KimiLinearConfig real_config() { return testing::mla_test_config(2304, 32, 128, 64, 128, 512); }

std::unique_ptr<mem_cache::MemoryPools> make_pools(const io::KimiLinearConfig& cfg, int64_t kv_slots,
                                                   Precision dtype = Precision::FP32,
                                                   int64_t max_requests = 8) {
  const mem_cache::RecurrentStatePoolConfig rc{.layer_ids = {0},
                                               .size = max_requests,
                                               .num_heads = 1,
                                               .head_k_dim = 1,
                                               .head_v_dim = 1,
                                               .conv_kernel = 4,
                                               .conv_dim = 1};
  const mem_cache::MLATokenToKVPoolConfig kc{.layer_ids = {kLayer},
                                             .size = kv_slots,
                                             .kv_lora_rank = cfg.kv_lora_rank,
                                             .qk_rope_head_dim = cfg.qk_rope_head_dim,
                                             .dtype = dtype};
  return std::make_unique<mem_cache::MemoryPools>(rc, max_requests, kc);
}

// One step of a plan: tokens per sequence (0: a 0-token row), DECODE when `decode`.
struct Step {
  std::vector<int32_t> lens;
  bool decode = false;
};

// What run_plan gives: each sequence's outputs [n_i, D] in token order, and its request.
struct PlanResult {
  std::vector<std::vector<float>> outs;
  std::vector<int32_t> reqs;
  const std::vector<float>& operator[](size_t i) const { return outs[i]; }
};

// Runs the sequences (xs[i]: [n_i, D]) through the steps on fresh requests of `pools`.
PlanResult run_plan(KimiMLAAttention& layer, mem_cache::MemoryPools& pools,
                    const std::vector<std::vector<float>>& xs, const std::vector<Step>& plan) {
  const int64_t D = layer.hidden_size();
  const size_t n = xs.size();
  auto& rtp = pools.req_to_token_pool;
  const std::vector<int32_t> reqs = rtp.alloc(static_cast<int64_t>(n));
  std::vector<std::vector<float>> outs(n);
  for (size_t i = 0; i < n; ++i) outs[i].assign(xs[i].size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<int32_t> done(n, 0);
  for (const Step& st : plan) {
    std::vector<int32_t> prefix(done.begin(), done.end());
    for (size_t i = 0; i < n; ++i)
      if ((done[i] + st.lens[i]) * D > static_cast<int64_t>(xs[i].size()))
        throw std::invalid_argument("the plan runs past sequence " + std::to_string(i));
    rtp.alloc_tokens(reqs, st.lens);
    const ForwardBatch fb =
        st.decode ? ForwardBatch::decode(reqs) : ForwardBatch::extend(reqs, st.lens, prefix);
    std::vector<float> x, y;
    for (size_t i = 0; i < n; ++i)
      x.insert(x.end(), xs[i].begin() + done[i] * D, xs[i].begin() + (done[i] + st.lens[i]) * D);
    const int64_t T = static_cast<int64_t>(x.size()) / D;
    y.assign(static_cast<size_t>(T * D), std::numeric_limits<float>::quiet_NaN());
    layer.forward(x.data(), T, fb, pools, y.data());
    int64_t row = 0;
    for (size_t i = 0; i < n; ++i) {
      std::copy_n(y.begin() + row * D, st.lens[i] * D, outs[i].begin() + done[i] * D);
      row += st.lens[i];
      done[i] += st.lens[i];
    }
  }
  for (size_t i = 0; i < n; ++i)
    EXPECT_EQ(done[i] * D, static_cast<int64_t>(xs[i].size())) << "the plan runs sequence " << i << " partly";
  return {outs, reqs};
}

std::vector<float> to_f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const auto w = to_f32(want);
  EXPECT_LE(testing::max_error_ratio(got.data(), w.data(), got.size(), tol, tol), 1.0) << what;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_LE(testing::max_error_ratio(got.data(), want.data(), got.size(), tol, tol), 1.0) << what;
}

// The request's cache rows c_hat [n, R] and k_pe [n, dr] as the pool holds them.
std::pair<std::vector<float>, std::vector<float>> cache_rows(mem_cache::MemoryPools& pools,
                                                             const io::KimiLinearConfig& cfg, int32_t req) {
  const auto slots = pools.req_to_token_pool.req_to_token(req);
  std::vector<float> ckv(slots.size() * cfg.kv_lora_rank), kpe(slots.size() * cfg.qk_rope_head_dim);
  pools.token_to_kv_pool->read_kv(kLayer, slots, ckv.data(), kpe.data());
  return {ckv, kpe};
}

std::vector<float> inputs(const io::KimiLinearConfig& cfg, int64_t n, uint64_t seed) {
  return testing::random_normal(static_cast<size_t>(n * cfg.hidden_size), seed);
}

const char* form_name(MlaForm f) {
  return f == MlaForm::Plain ? "plain" : f == MlaForm::Absorbed ? "absorbed" : "auto";
}

// Every sequence of the plan against the reference on its whole sequence (out and cache rows).
void check_plan_against_reference(const io::KimiLinearConfig& cfg, MlaForm form,
                                  const std::vector<int64_t>& seq_lens, const std::vector<Step>& plan,
                                  const std::string& what, uint64_t seed = 7) {
  const auto w = MlaLayerWeights::synthetic(cfg, seed);
  KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32, {}, Weights::BF16, {.form = form});
  int64_t total = 0;
  for (const int64_t n : seq_lens) total += n;
  auto pools = make_pools(cfg, total + 4);
  std::vector<std::vector<float>> xs;
  for (size_t i = 0; i < seq_lens.size(); ++i) xs.push_back(inputs(cfg, seq_lens[i], seed * 100 + i));
  const auto res = run_plan(layer, *pools, xs, plan);
  const auto& outs = res.outs;
  const auto& reqs = res.reqs;
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::string tag = what + " " + form_name(form) + " seq " + std::to_string(i);
    const auto ref = testing::reference_mla(cfg, w, xs[i].data(), seq_lens[i]);
    expect_close(outs[i], ref.out, 1e-4, tag + " out");
    const auto [ckv, kpe] = cache_rows(*pools, cfg, reqs[i]);
    expect_close(ckv, ref.ckv, 1e-5, tag + " c_hat");
    expect_close(kpe, ref.kpe, 1e-5, tag + " k_pe");
  }
}

class MlaForms : public ::testing::TestWithParam<MlaForm> {};

TEST_P(MlaForms, OneSequenceMatchesTheReference) {
  for (const int64_t T : {1, 63, 64, 65, 300})
    check_plan_against_reference(small_config(), GetParam(), {T}, {{{static_cast<int32_t>(T)}}},
                                 "T " + std::to_string(T));
}

TEST_P(MlaForms, VarlenWithEmptyAndOneTokenRows) {
  check_plan_against_reference(small_config(), GetParam(), {5, 0, 1, 70, 0}, {{{5, 0, 1, 70, 0}}}, "varlen");
}

TEST_P(MlaForms, ChunkedPrefillAndDecodeStepsMatchTheWholeSequence) {
  // Three chunks (a cached prefix + new tokens each time), then decode steps, over two sequences of
  // different lengths.
  std::vector<Step> plan = {{{20, 3}}, {{1, 30}}, {{45, 2}}};
  for (int k = 0; k < 8; ++k) plan.push_back({{1, 1}, true});
  check_plan_against_reference(small_config(), GetParam(), {74, 43}, plan, "chunked+decode");
}

INSTANTIATE_TEST_SUITE_P(Forms, MlaForms, ::testing::Values(MlaForm::Plain, MlaForm::Absorbed, MlaForm::Auto),
                         [](const auto& i) { return std::string(form_name(i.param)); });

TEST(Mla, RealWidthsOnAFewTokens) {
  // hidden 2304, 32 heads of 128 + 64 / 128, kv_lora 512: a 5-token prefill then 2 decode steps, and a
  // 1-token sequence beside it, in every form (the weights and the reference built once).
  const auto cfg = real_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 11);
  const std::vector<std::vector<float>> xs = {inputs(cfg, 7, 1), inputs(cfg, 1, 2)};
  std::vector<testing::MlaReference> refs;
  for (const auto& x : xs)
    refs.push_back(
        testing::reference_mla(cfg, w, x.data(), static_cast<int64_t>(x.size()) / cfg.hidden_size));
  for (const MlaForm f : {MlaForm::Plain, MlaForm::Absorbed, MlaForm::Auto}) {
    KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32, {}, Weights::BF16, {.form = f});
    auto pools = make_pools(cfg, 16);
    const auto res = run_plan(layer, *pools, xs, {{{5, 1}}, {{1, 0}, false}, {{1, 0}, false}});
    for (size_t i = 0; i < xs.size(); ++i) {
      const std::string tag = std::string(form_name(f)) + " seq " + std::to_string(i);
      expect_close(res.outs[i], refs[i].out, 1e-4, tag + " out");
      const auto [ckv, kpe] = cache_rows(*pools, cfg, res.reqs[i]);
      expect_close(ckv, refs[i].ckv, 1e-5, tag + " c_hat");
      expect_close(kpe, refs[i].kpe, 1e-5, tag + " k_pe");
    }
  }
}

// Rows [r] of x ([n, D]) in the given order: a sequence made of some tokens of another.
std::vector<float> pick_rows(const std::vector<float>& x, int64_t D, const std::vector<int64_t>& rows) {
  std::vector<float> out;
  for (const int64_t r : rows) out.insert(out.end(), x.begin() + r * D, x.begin() + (r + 1) * D);
  return out;
}

std::vector<float> rows_of(const std::vector<double>& v, int64_t D, int64_t r0, int64_t r1) {
  return std::vector<float>(v.begin() + r0 * D, v.begin() + r1 * D);
}

TEST(Mla, TargetVerifyChainAndTreeThenAccept) {
  // A 20-token prefix, then a verify row of the last accepted token and 4 drafts: as a chain (causal,
  // then 3 tokens accepted with truncate_tokens) and as a tree (drafts 0 and 1 children of the accepted
  // token, 2 of 0, 3 of 2; the path 0, 2, 3 accepted with accept_tokens). Each token's output equals the
  // reference over the prefix and its ancestors; a decode step after the accept equals the reference over
  // the accepted sequence.
  const auto cfg = small_config();
  const int64_t D = cfg.hidden_size, P = 20;
  const auto w = MlaLayerWeights::synthetic(cfg, 23);
  const auto x = inputs(cfg, P + 6, 3);  // prefix, the verify row's 5 tokens, one more decode token
  std::vector<int64_t> prefix_rows;
  for (int64_t i = 0; i < P; ++i) prefix_rows.push_back(i);
  auto with = [&](std::vector<int64_t> tail) {
    std::vector<int64_t> r = prefix_rows;
    r.insert(r.end(), tail.begin(), tail.end());
    return r;
  };
  for (const MlaForm f : {MlaForm::Plain, MlaForm::Absorbed, MlaForm::Auto}) {
    for (const bool tree : {false, true}) {
      const std::string tag = std::string(form_name(f)) + (tree ? " tree" : " chain");
      KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32, {}, Weights::BF16, {.form = f});
      auto pools = make_pools(cfg, 64);
      auto& rtp = pools->req_to_token_pool;
      const auto reqs = rtp.alloc(1);
      std::vector<float> y(static_cast<size_t>(6 * D));
      rtp.alloc_tokens(reqs, std::vector<int32_t>{static_cast<int32_t>(P)});
      std::vector<float> ypre(static_cast<size_t>(P * D));
      layer.forward(x.data(), P, ForwardBatch::extend(reqs, {static_cast<int32_t>(P)}, {0}), *pools,
                    ypre.data());
      rtp.alloc_tokens(reqs, std::vector<int32_t>{5});
      const std::vector<int32_t> parents = tree ? std::vector<int32_t>{-1, -1, 0, 2} : std::vector<int32_t>{};
      layer.forward(x.data() + P * D, 5, ForwardBatch::target_verify(reqs, {4}, parents), *pools, y.data());
      // Each verify token against the reference over the prefix and its ancestors (itself last).
      const std::vector<std::vector<int64_t>> paths =
          tree ? std::vector<std::vector<int64_t>>{{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 3, 4}}
               : std::vector<std::vector<int64_t>>{{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}};
      for (int64_t t = 0; t < 5; ++t) {
        std::vector<int64_t> tail;
        for (const int64_t m : paths[t]) tail.push_back(P + m);
        const auto seq = pick_rows(x, D, with(tail));
        const int64_t n = static_cast<int64_t>(seq.size()) / D;
        const auto ref = testing::reference_mla(cfg, w, seq.data(), n);
        expect_close(std::vector<float>(y.begin() + t * D, y.begin() + (t + 1) * D),
                     rows_of(ref.out, D, n - 1, n), 1e-4, tag + " verify token " + std::to_string(t));
      }
      // Accept 0 (the last accepted token) and a path of drafts, then decode one more token.
      std::vector<int64_t> accepted;
      if (tree) {
        rtp.accept_tokens(reqs[0], P, std::vector<int32_t>{0, 1, 3, 4});
        accepted = {P + 0, P + 1, P + 3, P + 4};
      } else {
        rtp.truncate_tokens(reqs[0], P + 3);
        accepted = {P + 0, P + 1, P + 2};
      }
      EXPECT_EQ(pools->token_to_kv_pool->available(), 64 - P - static_cast<int64_t>(accepted.size())) << tag;
      rtp.alloc_tokens(reqs, std::vector<int32_t>{1});
      layer.forward(x.data() + (P + 5) * D, 1, ForwardBatch::decode(reqs), *pools, y.data());
      accepted.push_back(P + 5);
      const auto seq = pick_rows(x, D, with(accepted));
      const int64_t n = static_cast<int64_t>(seq.size()) / D;
      const auto ref = testing::reference_mla(cfg, w, seq.data(), n);
      expect_close(std::vector<float>(y.begin(), y.begin() + D), rows_of(ref.out, D, n - 1, n), 1e-4,
                   tag + " decode after accept");
    }
  }
}

TEST(Mla, KvNormEpsOption) {
  // Small inputs make mean(c^2) comparable to eps, so the HF remote code's 1e-6 and rms_norm_eps (1e-5)
  // give visibly different c_hat: the option must be the one used.
  const auto cfg = small_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 29);
  auto x = inputs(cfg, 9, 4);
  for (auto& v : x) v *= 1e-3f;
  KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32, {}, Weights::BF16, {.kv_norm_eps = 1e-6});
  auto pools = make_pools(cfg, 16);
  const auto res = run_plan(layer, *pools, {x}, {{{9}}});
  const auto want = testing::reference_mla(cfg, w, x.data(), 9, false, 1e-6);
  const auto other = testing::reference_mla(cfg, w, x.data(), 9, false, 0.0);
  const auto [ckv, kpe] = cache_rows(*pools, cfg, res.reqs[0]);
  expect_close(ckv, want.ckv, 1e-5, "c_hat with kv_norm_eps 1e-6");
  expect_close(res.outs[0], want.out, 1e-4, "out with kv_norm_eps 1e-6");
  const auto o = to_f32(other.ckv);
  EXPECT_GT(testing::max_error_ratio(ckv.data(), o.data(), ckv.size(), 1e-5, 1e-5), 10.0);
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        KimiMLAAttention bad(cfg, kLayer, w, Precision::FP32, {}, Weights::BF16, {.kv_norm_eps = -1.0});
      },
      "kv_norm_eps");
}

TEST(Mla, AbsorbedEqualsPlainExtendAndDecode) {
  const auto cfg = small_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 3);
  const std::vector<std::vector<float>> xs = {inputs(cfg, 125, 1), inputs(cfg, 9, 2)};
  std::vector<Step> plan = {{{100, 4}}, {{20, 0}}};
  for (int k = 0; k < 5; ++k) plan.push_back({{1, 1}, true});
  std::vector<PlanResult> outs;
  for (const MlaForm f : {MlaForm::Plain, MlaForm::Absorbed}) {
    KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32, {}, Weights::BF16, {.form = f});
    auto pools = make_pools(cfg, 200);
    outs.push_back(run_plan(layer, *pools, xs, plan));
  }
  for (size_t i = 0; i < xs.size(); ++i)
    expect_close(outs[1][i], outs[0][i], 1e-4, "seq " + std::to_string(i));
}

TEST(Mla, Bf16WithinTwiceTheEmulationsDistanceFromFloat64) {
  const auto cfg = small_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 5);
  for (const MlaForm f : {MlaForm::Plain, MlaForm::Absorbed}) {
    KimiMLAAttention layer(cfg, kLayer, w, Precision::BF16, {}, Weights::BF16, {.form = f});
    auto pools = make_pools(cfg, 200, Precision::BF16);
    const std::vector<std::vector<float>> xs = {inputs(cfg, 65, 1), inputs(cfg, 1, 2), inputs(cfg, 40, 3)};
    // The inputs are bf16 values, as the decoder's normed hidden state is in the bf16 mode.
    std::vector<std::vector<float>> xb = xs;
    for (auto& x : xb) round_bf16_inplace(x.data(), x.size());
    std::vector<Step> plan = {{{60, 1, 30}}, {{5, 0, 2}}};
    for (int k = 0; k < 8; ++k) plan.push_back({{0, 0, 1}, false});
    const auto res = run_plan(layer, *pools, xb, plan);
    const auto& outs = res.outs;
    const auto& reqs = res.reqs;
    for (size_t i = 0; i < xs.size(); ++i) {
      const int64_t n = static_cast<int64_t>(xs[i].size()) / cfg.hidden_size;
      const auto exact = to_f32(testing::reference_mla(cfg, w, xb[i].data(), n).out);
      const auto emul = to_f32(testing::reference_mla(cfg, w, xb[i].data(), n, true).out);
      for (const float v : outs[i]) ASSERT_TRUE(std::isfinite(v));
      const double emul_err = testing::rel_l2(emul.data(), exact.data(), exact.size());
      const double err = testing::rel_l2(outs[i].data(), exact.data(), exact.size());
      EXPECT_GT(emul_err, 0.0);
      EXPECT_LE(err, 2.0 * emul_err) << form_name(f) << " seq " << i;
      // The cache holds bf16 values of c_hat.
      const auto [ckv, kpe] = cache_rows(*pools, cfg, reqs[i]);
      for (const float v : ckv) EXPECT_EQ(v, round_bf16(v));
    }
  }
}

TEST(Mla, TensorParallel2EqualsTp1) {
  const auto cfg = small_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 9);
  const std::vector<std::vector<float>> xs = {inputs(cfg, 53, 1), inputs(cfg, 6, 2)};
  std::vector<Step> plan = {{{30, 3}}, {{20, 0}}, {{0, 0}}};
  for (int k = 0; k < 3; ++k) plan.push_back({{1, 1}, true});
  KimiMLAAttention one(cfg, kLayer, w, Precision::FP32);
  auto pools1 = make_pools(cfg, 100);
  const auto ref = run_plan(one, *pools1, xs, plan);
  const int tp = 2;
  std::vector<PlanResult> got(tp);
  distributed::InProcessGroup group(tp);
  group.run([&](int r, distributed::Communicator& comm) {
    KimiMLAAttention layer(cfg, kLayer, w.shard(cfg, r, tp), Precision::FP32, {r, tp, &comm});
    EXPECT_EQ(layer.local_heads(), cfg.num_attention_heads / tp);
    auto pools = make_pools(cfg, 100);
    got[r] = run_plan(layer, *pools, xs, plan);
  });
  for (int r = 0; r < tp; ++r)
    for (size_t i = 0; i < xs.size(); ++i)
      expect_close(got[r][i], ref[i], 1e-4, "rank " + std::to_string(r) + " seq " + std::to_string(i));
  testing::expect_throw_with<std::invalid_argument>([&] { w.shard(cfg, 0, 3); }, "cannot split 4 MLA heads");
}

// The scheme's weights in float64: each projection quantized and dequantized as the layer's kernels see it.
MlaLayerWeights dequantized(const io::KimiLinearConfig& cfg, const MlaLayerWeights& w, Weights q) {
  const int64_t D = cfg.hidden_size, Hm = cfg.num_attention_heads, dn = cfg.qk_nope_head_dim,
                dr = cfg.qk_rope_head_dim, dv = cfg.v_head_dim, R = cfg.kv_lora_rank;
  auto dq = [&](const std::vector<float>& v, int64_t in, int64_t out) {
    return layers::QuantLinear(in, out, v, q, Precision::FP32).dequantized();
  };
  MlaLayerWeights d = w;
  d.q_proj = dq(w.q_proj, D, Hm * (dn + dr));
  d.kv_a_proj_with_mqa = dq(w.kv_a_proj_with_mqa, D, R + dr);
  d.kv_b_proj = dq(w.kv_b_proj, R, Hm * (dn + dv));
  d.o_proj = dq(w.o_proj, Hm * dv, D);
  return d;
}

TEST(Mla, QuantizedWeightsMatchTheirSchemeAndStayNearFp32) {
  const auto cfg = small_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 13);
  const std::vector<std::vector<float>> xs = {inputs(cfg, 40, 1)};
  const std::vector<Step> plan = {{{36}}, {{1}, true}, {{3}}};
  KimiMLAAttention fp(cfg, kLayer, w, Precision::FP32);
  auto p0 = make_pools(cfg, 64);
  const auto ref = run_plan(fp, *p0, xs, plan)[0];
  for (const Weights q : {Weights::Int8, Weights::Int4}) {
    // The same model with the scheme's weights, in float64: the kernels' own error is fp32's.
    const auto scheme = testing::reference_mla(cfg, dequantized(cfg, w, q), xs[0].data(), 40);
    for (const MlaForm f : {MlaForm::Plain, MlaForm::Absorbed}) {
      const std::string tag = std::string(to_string(q)) + " " + form_name(f);
      KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32, {}, q, {.form = f});
      EXPECT_LT(layer.weight_bytes(), fp.weight_bytes());
      auto p = make_pools(cfg, 64);
      const auto got = run_plan(layer, *p, xs, plan)[0];
      expect_close(got, scheme.out, 1e-4, tag + " against its scheme in float64");
      const double err = testing::rel_l2(got.data(), ref.data(), ref.size());
      EXPECT_GT(err, 0.0) << tag;
      EXPECT_LT(err, q == Weights::Int8 ? 0.02 : 0.3) << tag;
    }
  }
}

TEST(Mla, StaleRowsOfFreedSlotsAreNeverRead) {
  // A request runs and is freed; every free row is poisoned with NaN; a new request on the same pool gets
  // the freed slots and must give exactly what a fresh pool gives.
  const auto cfg = small_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 17);
  KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32, {}, Weights::BF16, {.form = MlaForm::Auto});
  const std::vector<std::vector<float>> first = {inputs(cfg, 30, 1)}, second = {inputs(cfg, 25, 2)};
  std::vector<Step> plan = {{{10}}, {{12}}};
  for (int k = 0; k < 3; ++k) plan.push_back({{1}, true});
  auto fresh = make_pools(cfg, 40);
  const auto want = run_plan(layer, *fresh, second, plan)[0];

  auto pools = make_pools(cfg, 40);
  pools->req_to_token_pool.free(run_plan(layer, *pools, first, {{{30}}}).reqs);
  auto& kv = *pools->token_to_kv_pool;
  const auto view = kv.get_kv_buffer(kLayer);
  for (int64_t s = 0; s < view.num_slots; ++s)
    if (!kv.is_allocated(static_cast<int32_t>(s)))
      std::fill_n(view.kv_f32 + s * view.row_elems, view.row_elems, std::numeric_limits<float>::quiet_NaN());
  const auto got = run_plan(layer, *pools, second, plan)[0];
  for (const float v : got) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(got, want);
}

TEST(Mla, BadInputIsAClearErrorThatChangesNothing) {
  const auto cfg = small_config();
  const auto w = MlaLayerWeights::synthetic(cfg, 19);
  KimiMLAAttention layer(cfg, kLayer, w, Precision::FP32);
  auto pools = make_pools(cfg, 32);
  auto& rtp = pools->req_to_token_pool;
  const auto reqs = rtp.alloc(1);
  const std::vector<int32_t> four = {4};
  rtp.alloc_tokens(reqs, four);
  const auto x = inputs(cfg, 4, 1);
  std::vector<float> out(4 * cfg.hidden_size, 7.0f);
  const auto before = cache_rows(*pools, cfg, reqs[0]);
  const std::vector<float> untouched = out;
  // The batch claims a cached prefix the pool does not hold.
  testing::expect_throw_with<std::invalid_argument>(
      [&] { layer.forward(x.data(), 4, ForwardBatch::extend(reqs, {4}, {2}), *pools, out.data()); },
      "call alloc_tokens");
  // Rows and tokens disagree.
  testing::expect_throw_with<std::invalid_argument>(
      [&] { layer.forward(x.data(), 3, ForwardBatch::extend(reqs, {4}, {0}), *pools, out.data()); },
      "3 hidden-state rows");
  testing::expect_throw_with<std::runtime_error>(
      [&] {
        ForwardBatch draft = ForwardBatch::extend(reqs, {4}, {0});
        draft.forward_mode = model_executor::ForwardMode::DRAFT_EXTEND;
        layer.forward(x.data(), 4, draft, *pools, out.data());
      },
      "not supported by the MLA layer");
  auto no_kv = std::make_unique<mem_cache::MemoryPools>(mem_cache::RecurrentStatePoolConfig{.layer_ids = {0},
                                                                                            .size = 2,
                                                                                            .num_heads = 1,
                                                                                            .head_k_dim = 1,
                                                                                            .head_v_dim = 1,
                                                                                            .conv_kernel = 4,
                                                                                            .conv_dim = 1},
                                                        2);
  const auto r2 = no_kv->req_to_token_pool.alloc(1);
  testing::expect_throw_with<std::invalid_argument>(
      [&] { layer.forward(x.data(), 4, ForwardBatch::extend(r2, {4}, {0}), *no_kv, out.data()); },
      "no MLA KV pool");
  EXPECT_EQ(out, untouched);
  EXPECT_EQ(cache_rows(*pools, cfg, reqs[0]), before);
  // The good call then runs; IDLE gives zeros.
  layer.forward(x.data(), 4, ForwardBatch::extend(reqs, {4}, {0}), *pools, out.data());
  for (const float v : out) EXPECT_TRUE(std::isfinite(v));
  ForwardBatch idle;
  idle.forward_mode = model_executor::ForwardMode::IDLE;
  layer.forward(x.data(), 0, idle, *pools, out.data());
  // Construction errors name what is wrong.
  testing::expect_throw_with<std::invalid_argument>([&] { KimiMLAAttention bad(cfg, 0, w, Precision::FP32); },
                                                    "not an MLA layer");
  auto short_w = w;
  short_w.kv_b_proj.pop_back();
  testing::expect_throw_with<std::invalid_argument>(
      [&] { KimiMLAAttention bad(cfg, kLayer, short_w, Precision::FP32); }, "kv_b_proj");
  // A packed layer (o_proj packed) whose kv_b_proj is neither packed nor given in fp32, in every weights
  // mode.
  auto no_kvb = w;
  no_kvb.kv_b_proj.clear();
  const int64_t o_in = cfg.num_attention_heads * cfg.v_head_dim;
  for (const Weights f : {Weights::Int8, Weights::Int4}) {
    no_kvb.packed["o_proj"] =
        std::make_shared<const kernels::gemm::PackedMatrix>(f, w.o_proj.data(), o_in, cfg.hidden_size);
    testing::expect_throw_with<std::invalid_argument>(
        [&] { KimiMLAAttention bad(cfg, kLayer, no_kvb, Precision::FP32, {}, f); },
        "kv_b_proj holds 0 values");
  }
}

TEST(Mla, LoadsTheTinyModelsMlaLayer) {
  const auto dir = testing::model_dumps_dir();
  const auto cfg = io::load_model_config(dir);
  io::Checkpoint ckpt(dir);
  ASSERT_TRUE(cfg.is_mla_layer(3));
  const auto w = MlaLayerWeights::load(ckpt, cfg, 3);
  EXPECT_EQ(w.q_proj.size(), size_t{4} * 48 * 256);
  EXPECT_EQ(w.kv_b_proj.size(), size_t{4} * 64 * 64);
  const auto half = MlaLayerWeights::load(ckpt, cfg, 3, 1, 2);
  const auto cut = w.shard(cfg, 1, 2);
  EXPECT_EQ(half.q_proj, cut.q_proj);
  EXPECT_EQ(half.kv_b_proj, cut.kv_b_proj);
  EXPECT_EQ(half.o_proj, cut.o_proj);
  EXPECT_EQ(half.kv_a_proj_with_mqa, w.kv_a_proj_with_mqa);
  auto layer = KimiMLAAttention::from_checkpoint(ckpt, cfg, 3, Precision::FP32);
  EXPECT_EQ(layer->layer_idx(), 3);
  testing::expect_throw_with<std::invalid_argument>([&] { MlaLayerWeights::load(ckpt, cfg, 2); },
                                                    "not an MLA layer");
}

}  // namespace
}  // namespace kda
