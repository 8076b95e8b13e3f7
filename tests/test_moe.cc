// The MoE and dense MLPs (models/kimi_moe): the router's selection and combine weights against their
// reference, KimiMLP and KimiMoE against the float64 reference (tests/support/moe_reference) in fp32
// and bf16, at small and real widths, the grouped (prefill) and side-by-side (decode) paths, loading from
// the tiny model dumps and broken copies of them, tensor parallelism and int8 / int4 weights.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kda/common/seeded.h"
#include "kda/distributed/in_process.h"
#include "kda/io/config.h"
#include "kda/io/safetensors.h"
#include "kda/kernels/silu_mul_isa.h"
#include "kda/layers/moe/router.h"
#include "kda/layers/moe/swiglu.h"
#include "kda/models/kimi_moe.h"
#include "support/moe_reference.h"
#include "support/test_support.h"

namespace kda {
namespace {

using models::KimiMLP;
using models::KimiMoE;
using models::MlpWeights;
using models::MoeCombine;
using models::MoeOptions;
using models::MoeWeights;
using ::testing::HasSubstr;

// A config whose layer 1 is a MoE (layer 0 dense), as the real model's pattern starts.
io::KimiLinearConfig moe_config(int64_t D, int E, int k, int64_t Ie, int S, bool renormalize = true) {
  io::KimiLinearConfig c;
  c.hidden_size = D;
  c.rms_norm_eps = 1e-5;
  c.num_hidden_layers = 2;
  c.has_model_fields = true;
  c.intermediate_size = 4 * D;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.num_experts = E;
  c.num_experts_per_token = k;
  c.num_shared_experts = S;
  c.moe_intermediate_size = Ie;
  c.moe_renormalize = renormalize;
  c.routed_scaling_factor = 2.446;
  return c;
}

std::vector<float> to_f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// fp32 bound of the spec: |a - b| <= 1e-4 + 1e-4 |b|.
void expect_fp32_close(const std::vector<float>& got, const std::vector<double>& want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const auto w = to_f32(want);
  EXPECT_LE(testing::max_error_ratio(got.data(), w.data(), w.size(), 1e-4, 1e-4), 1.0) << what;
}

void expect_finite(const std::vector<float>& v, const std::string& what) {
  EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); })) << what;
}

// ------------------------------------------------------------------------------------------------
// Router

TEST(MoeRouter, FastPathEqualsReferenceExactly) {
  for (int E : {4, 8, 64, 256})
    for (int k : {1, 2, 8})
      for (bool renorm : {true, false})
        for (bool biased : {false, true}) {
          if (k > E) continue;
          const int64_t T = 70;
          // Coarse logits and biases (multiples of 1/8): many exact ties in c.
          auto logits = testing::random_normal(static_cast<size_t>(T * E), 100 + E + k);
          for (auto& l : logits) l = std::round(l * 8.0f) / 8.0f;
          auto bias = testing::random_normal(static_cast<size_t>(E), 7 + E, 0.1f);
          if (k == 2) std::fill(bias.begin(), bias.end(), 0.0f);
          const layers::moe::RouterParams p{E, k, renorm, 2.446f, biased};
          std::vector<int32_t> ids(T * k), ids_ref(T * k);
          std::vector<float> w(T * k), w_ref(T * k);
          layers::moe::select_experts(logits.data(), T, bias.data(), p, ids.data(), w.data());
          layers::moe::select_experts_reference(logits.data(), T, bias.data(), p, ids_ref.data(),
                                                w_ref.data());
          EXPECT_EQ(ids, ids_ref) << "E " << E << " k " << k;
          EXPECT_EQ(w, w_ref) << "E " << E << " k " << k;
        }
}

TEST(MoeRouter, BiasSelectsTiesGoToTheLowerIdAndWeightsFollowTheCombine) {
  // s = sigmoid(l): experts 0..3 with logits 0, 0, 1, 2; the bias lifts expert 1 above expert 3.
  const std::vector<float> logits = {0.0f, 0.0f, 1.0f, 2.0f};
  const std::vector<float> bias = {0.0f, 0.5f, 0.0f, 0.0f};
  const float s0 = 0.5f, s2 = 1.0f / (1.0f + std::exp(-1.0f)), s3 = 1.0f / (1.0f + std::exp(-2.0f));
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  // c = 0.5, 1.0, 0.731, 0.881 -> experts 1 and 3.
  layers::moe::select_experts(logits.data(), 1, bias.data(), {4, 2, true, 2.0f, false}, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(w[0], s0 / (s0 + s3) * 2.0f);  // unbiased: s, not c
  EXPECT_FLOAT_EQ(w[1], s3 / (s0 + s3) * 2.0f);
  layers::moe::select_experts(logits.data(), 1, bias.data(), {4, 2, true, 2.0f, true}, ids.data(), w.data());
  EXPECT_FLOAT_EQ(w[0], (s0 + 0.5f) / (s0 + 0.5f + s3) * 2.0f);  // biased: c
  // Renormalize off: w = s * factor.
  layers::moe::select_experts(logits.data(), 1, bias.data(), {4, 2, false, 2.0f, false}, ids.data(),
                              w.data());
  EXPECT_FLOAT_EQ(w[0], s0 * 2.0f);
  EXPECT_FLOAT_EQ(w[1], s3 * 2.0f);
  // k = 1: never renormalized (w = s * factor even with moe_renormalize).
  layers::moe::select_experts(logits.data(), 1, bias.data(), {4, 1, true, 2.0f, false}, ids.data(), w.data());
  EXPECT_EQ(ids[0], 1);
  EXPECT_FLOAT_EQ(w[0], s0 * 2.0f);
  // Ties: equal c everywhere -> the lowest ids, in id order.
  const std::vector<float> flat(6, 0.25f), no_bias(6, 0.0f);
  std::vector<int32_t> ids3(3);
  std::vector<float> w3(3);
  layers::moe::select_experts(flat.data(), 1, no_bias.data(), {6, 3, true, 1.0f, false}, ids3.data(),
                              w3.data());
  EXPECT_EQ(ids3, (std::vector<int32_t>{0, 1, 2}));
  // A tie between expert 4 and expert 2 for the last place: 2 wins.
  const std::vector<float> l2 = {0.0f, 3.0f, 1.0f, -1.0f, 1.0f};
  layers::moe::select_experts(l2.data(), 1, no_bias.data(), {5, 2, true, 1.0f, false}, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(s2, 1.0f / (1.0f + std::exp(-1.0f)));
  EXPECT_THROW(layers::moe::select_experts(logits.data(), 1, bias.data(), {4, 5, true, 1.0f, false},
                                           ids.data(), w.data()),
               std::invalid_argument);
}

TEST(MoeRouter, CombineNames) {
  EXPECT_EQ(models::parse_moe_combine("unbiased"), MoeCombine::Unbiased);
  EXPECT_EQ(models::parse_moe_combine("biased"), MoeCombine::Biased);
  EXPECT_STREQ(models::to_string(MoeCombine::Biased), "biased");
  EXPECT_STREQ(models::to_string(MoeCombine::Unbiased), "unbiased");
  testing::expect_throw_with<std::invalid_argument>([] { models::parse_moe_combine("sigmoid"); }, "sigmoid");
}

TEST(MoeSynthetic, SeededUniformsHaveUnitVarianceAndDependOnTheKeyOnly) {
  std::vector<float> a(100000), b(100000), c(100000);
  seeded_uniforms(9, 3, 7, static_cast<int64_t>(a.size()), a.data());
  seeded_uniforms(9, 3, 7, 1000, b.data());  // a prefix draws the same values
  seeded_uniforms(9, 3, 8, static_cast<int64_t>(c.size()), c.data());
  EXPECT_TRUE(std::equal(b.begin(), b.begin() + 1000, a.begin()));
  EXPECT_NE(a, c);
  double mean = 0.0, var = 0.0;
  for (float v : a) {
    ASSERT_LT(std::fabs(v), 1.7320509f);
    mean += v;
    var += static_cast<double>(v) * v;
  }
  mean /= a.size();
  var = var / a.size() - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(var, 1.0, 0.02);
}

// The entry point (this CPU's copy) and the portable copy, which every build has, against the reference
// (libm's expf), at widths with and without a vector tail.
TEST(MoeSwiglu, SiluMulRowsEqualTheReference) {
  using F32 = void (*)(const float*, int64_t, int64_t, float*);
  using B16 = void (*)(const bf16_t*, int64_t, int64_t, bf16_t*);
  const std::pair<F32, B16> copies[] = {{&layers::moe::silu_mul, &layers::moe::silu_mul},
                                        {&kernels::portable::silu_mul, &kernels::portable::silu_mul}};
  for (const auto& [f32, b16] : copies)
    for (int64_t I : {1, 17, 1024}) {
      const int64_t T = I == 1024 ? 40 : 9;  // 40 x 1024: past the parallel threshold
      auto h = testing::random_normal(static_cast<size_t>(T * 2 * I), I, 2.0f);
      h[0] = -120.0f;  // exp(120) overflows: silu is 0 to fp32 tolerance, not NaN
      h[1 % h.size()] = 95.0f;
      std::vector<float> a(T * I), ref(T * I);
      f32(h.data(), T, I, a.data());
      layers::moe::silu_mul_reference(h.data(), T, I, ref.data(), false);
      EXPECT_LE(testing::max_error_ratio(a.data(), ref.data(), a.size(), 1e-6, 1e-6), 1.0) << "I " << I;
      std::vector<bf16_t> h16(h.size()), a16(T * I);
      f32_to_bf16_array(h.data(), h16.data(), h.size());
      std::vector<float> hr(h.size()), ar(T * I);
      bf16_to_f32_array(h16.data(), hr.data(), h.size());
      b16(h16.data(), T, I, a16.data());
      layers::moe::silu_mul_reference(hr.data(), T, I, ref.data(), true);
      bf16_to_f32_array(a16.data(), ar.data(), ar.size());
      // One bf16 ulp where exp's last fp32 bits decide the rounding.
      EXPECT_LE(testing::max_error_ratio(ar.data(), ref.data(), ar.size(), 1e-30, 1.0 / 128), 1.0)
          << "I " << I;
    }
}

TEST(MoeSwiglu, PiecesSplitIntoSlicesOf32Rows) {
  using layers::moe::SwigluPieces;
  EXPECT_EQ(SwigluPieces::pieces_for(1024, Weights::BF16, 2), 2);
  EXPECT_EQ(SwigluPieces::pieces_for(1024, Weights::Int4, 8), 8);
  EXPECT_EQ(SwigluPieces::pieces_for(96, Weights::Int8, 2), 1);  // 48-row slices would be padded
  EXPECT_EQ(SwigluPieces::pieces_for(96, Weights::Int8, 3), 3);
  EXPECT_EQ(SwigluPieces::pieces_for(32, Weights::BF16, 2), 1);
  EXPECT_EQ(SwigluPieces::pieces_for(64, Weights::Int4, 1), 1);
  testing::expect_throw_with<std::invalid_argument>([] { SwigluPieces::pieces_for(64, Weights::BF16, 0); },
                                                    "0 pieces");
}

// The sliced MLP against the float64 reference and against its own slices run one by one (the decode
// jobs), in fp32 and bf16, and its sizes against the whole MLP's.
TEST(MoeSwiglu, PiecesEqualTheWholeMlp) {
  using layers::moe::SwigluMlp;
  using layers::moe::SwigluPieces;
  const int64_t D = 256, I = 128;
  const MlpWeights w = MlpWeights::synthetic(D, I, 13);
  for (Precision p : {Precision::FP32, Precision::BF16}) {
    const SwigluMlp whole(D, I, w.gate_proj, w.up_proj, w.down_proj, p, Weights::BF16);
    const SwigluPieces sliced(D, I, w.gate_proj, w.up_proj, w.down_proj, p, Weights::BF16, 4);
    ASSERT_EQ(sliced.pieces(), 4);
    EXPECT_EQ(sliced.weight_bytes(), whole.weight_bytes());
    layers::moe::SwigluScratch s;
    std::vector<float> part;
    for (int64_t T : {1, 9, 70}) {
      auto x = testing::random_normal(static_cast<size_t>(T * D), T);
      if (p == Precision::BF16) round_bf16_inplace(x.data(), x.size());
      const bool bf16 = p == Precision::BF16;
      std::vector<float> a(x.size()), b(x.size()), jobs(x.size(), 0.0f), piece(x.size());
      whole.forward(x.data(), T, D, a.data(), D, bf16, s);
      sliced.forward(x.data(), T, D, b.data(), D, bf16, s, part);
      for (int k = 0; k < sliced.pieces(); ++k) {
        sliced.forward_piece(k, x.data(), T, D, piece.data(), D, s);
        SwigluPieces::add_part(jobs.data(), D, piece.data(), D, T, D);
      }
      if (bf16) round_bf16_inplace(jobs.data(), jobs.size());
      const std::string what = std::string(to_string(p)) + " T " + std::to_string(T);
      // The slices' partial sums add in piece order both ways: the same bits.
      EXPECT_EQ(b, jobs) << what;
      if (!bf16) {
        expect_fp32_close(b, testing::mlp_reference(w, x, T, false), what);
        EXPECT_LE(testing::max_error_ratio(b.data(), a.data(), a.size(), 1e-5, 1e-5), 1.0) << what;
      } else {
        for (float v : b) ASSERT_EQ(v, round_bf16(v)) << what;
        // The same rounding points as the whole MLP; only the fp32 order of the down sums differs.
        EXPECT_LE(testing::max_error_ratio(b.data(), a.data(), a.size(), 1e-3, 1.0 / 64), 1.0) << what;
      }
    }
  }
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        SwigluPieces(D, I, w.gate_proj, w.up_proj, std::vector<float>(5), Precision::FP32, Weights::BF16, 2);
      },
      "down_proj");
}

// bf16 rows in (and out) give the bits of fp32 rows in with the roundings between: x is what gate_up
// rounds fp32 x to, and a bf16 output is down's output rounded as round_out rounds it. Whole MLPs with
// every weights mode; in pieces only fp32 out (their partials are summed first); fp32 precision refuses.
TEST(MoeSwiglu, Bf16RowsGiveTheBitsOfFp32Rows) {
  using layers::moe::SwigluMlp;
  using layers::moe::SwigluPieces;
  const int64_t D = 256, I = 128;
  const MlpWeights w = MlpWeights::synthetic(D, I, 17);
  for (Weights wt : {Weights::BF16, Weights::Int8, Weights::Int4}) {
    const SwigluMlp mlp(D, I, w.gate_proj, w.up_proj, w.down_proj, Precision::BF16, wt);
    const SwigluPieces sliced(D, I, w.gate_proj, w.up_proj, w.down_proj, Precision::BF16, wt, 2);
    layers::moe::SwigluScratch s;
    std::vector<float> part;
    for (int64_t T : {1, 5, 64, 130}) {
      const std::string what = std::string(to_string(wt)) + " T " + std::to_string(T);
      auto x = testing::random_normal(static_cast<size_t>(T * D), 30 + T);
      std::vector<bf16_t> x16(x.size());
      f32_to_bf16_array(x.data(), x16.data(), x.size());
      std::vector<float> want(x.size()), got(x.size()), got_sliced(x.size()), want_sliced(x.size());
      mlp.forward(x.data(), T, D, want.data(), D, true, s);
      mlp.forward(x16.data(), T, D, got.data(), D, true, s);
      EXPECT_EQ(got, want) << what;
      std::vector<bf16_t> y16(x.size());
      mlp.forward(x16.data(), T, D, y16.data(), D, s);
      for (size_t i = 0; i < y16.size(); ++i) ASSERT_EQ(bf16_to_f32(y16[i]), want[i]) << what << " at " << i;
      sliced.forward(x.data(), T, D, want_sliced.data(), D, true, s, part);
      sliced.forward(x16.data(), T, D, got_sliced.data(), D, true, s, part);
      EXPECT_EQ(got_sliced, want_sliced) << what;
      testing::expect_throw_with<std::logic_error>(
          [&] { sliced.forward(x16.data(), T, D, y16.data(), D, s); }, "2 pieces");
    }
  }
  const SwigluMlp fp32(D, I, w.gate_proj, w.up_proj, w.down_proj, Precision::FP32, Weights::BF16);
  layers::moe::SwigluScratch s;
  std::vector<bf16_t> x16(static_cast<size_t>(D)), y16(x16.size());
  testing::expect_throw_with<std::logic_error>([&] { fp32.forward(x16.data(), 1, D, y16.data(), D, s); },
                                               "fp32 precision");
}

// ------------------------------------------------------------------------------------------------
// KimiMLP

TEST(KimiMlp, Fp32EqualsFloat64) {
  struct Shape {
    int64_t D, I;
    std::vector<int64_t> Ts;
  };
  // Small widths at many token counts; the real expert (2304 x 1024) and dense MLP (2304 x 9216) at few.
  for (const Shape& s :
       {Shape{64, 96, {1, 7, 63, 64, 65, 300}}, Shape{2304, 1024, {1, 5}}, Shape{2304, 9216, {2}}}) {
    const MlpWeights w = MlpWeights::synthetic(s.D, s.I, 11);
    KimiMLP mlp(w, Precision::FP32);
    EXPECT_EQ(mlp.weight_bytes(), 3 * s.D * s.I * 4);
    for (int64_t T : s.Ts) {
      const auto x = testing::random_normal(static_cast<size_t>(T * s.D), T);
      std::vector<float> out(x.size());
      mlp.forward(x.data(), T, out.data());
      expect_fp32_close(out, testing::mlp_reference(w, x, T, false),
                        "D " + std::to_string(s.D) + " I " + std::to_string(s.I) + " T " + std::to_string(T));
    }
  }
}

TEST(KimiMlp, Bf16EqualsTheEmulation) {
  for (int64_t I : {96, 1024}) {
    const int64_t D = 256, T = 65;
    const MlpWeights w = MlpWeights::synthetic(D, I, 3);
    KimiMLP mlp(w, Precision::BF16);
    EXPECT_EQ(mlp.weight_bytes(), 3 * D * I * 2);
    auto x = testing::random_normal(static_cast<size_t>(T * D), 5);
    round_bf16_inplace(x.data(), x.size());
    std::vector<float> out(x.size());
    mlp.forward(x.data(), T, out.data());
    expect_finite(out, "bf16 MLP");
    const auto emu = to_f32(testing::mlp_reference(w, x, T, true));
    const auto exact = to_f32(testing::mlp_reference(w, x, T, false));
    // Every output is a bf16 value; against the emulation of the same rounding points it differs only
    // where an fp32 sum's last bits flip a rounding (a bf16 ulp, 2^-8 relative, on a few elements), far
    // below the rounding error itself (the emulation against float64).
    for (float v : out) EXPECT_EQ(v, round_bf16(v));
    const double err = testing::rel_l2(out.data(), emu.data(), out.size());
    const double scheme = testing::rel_l2(emu.data(), exact.data(), out.size());
    EXPECT_LE(err, 0.25 * scheme) << "I " << I << ": vs emulation " << err << ", emulation vs float64 "
                                  << scheme;
    EXPECT_LE(testing::max_error_ratio(out.data(), emu.data(), out.size(), 1e-2, 1.0 / 64), 1.0);
  }
}

// ------------------------------------------------------------------------------------------------
// KimiMoE

struct MoeCase {
  io::KimiLinearConfig cfg;
  MoeWeights w;
  int k;
};

MoeCase make_case(int64_t D, int E, int k, int64_t Ie, int S, uint64_t seed, bool renormalize = true) {
  MoeCase c{moe_config(D, E, k, Ie, S, renormalize), {}, k};
  c.w = MoeWeights::synthetic(c.cfg, 1, seed, {});
  return c;
}

std::vector<float> run_moe(KimiMoE& moe, const std::vector<float>& x, int64_t T) {
  std::vector<float> out(static_cast<size_t>(T * moe.hidden()));
  moe.forward(x.data(), T, out.data());
  return out;
}

TEST(KimiMoe, Fp32EqualsFloat64AtManyTokenCounts) {
  for (int S : {1, 0})
    for (bool renorm : {true, false}) {
      const MoeCase c = make_case(64, 16, 4, 32, S, 21 + S, renorm);
      for (MoeCombine combine : {MoeCombine::Unbiased, MoeCombine::Biased}) {
        auto moe = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32, {}, Weights::BF16, {combine, 0});
        EXPECT_EQ(moe->num_experts(), 16);
        EXPECT_EQ(moe->top_k(), 4);
        for (int64_t T : {1, 7, 16, 17, 63, 64, 65, 300}) {  // side by side up to 64 (16 rows per expert)
          const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, T, 1e-3, false);
          const auto ref = testing::moe_reference(c.w, c.cfg, c.k, combine, x, T, false);
          const auto out = run_moe(*moe, x, T);
          const std::string what = std::string("S ") + std::to_string(S) + " renorm " +
                                   std::to_string(renorm) + " " + models::to_string(combine) + " T " +
                                   std::to_string(T);
          EXPECT_EQ(moe->last_topk(), ref.topk) << what;
          expect_fp32_close(out, ref.y, what);
        }
      }
    }
}

TEST(KimiMoe, BiasedAndUnbiasedCombinesDiffer) {
  const MoeCase c = make_case(64, 8, 2, 32, 1, 5);
  const int64_t T = 20;
  const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, 9, 1e-3, false);
  auto u =
      KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32, {}, Weights::BF16, {MoeCombine::Unbiased, 0});
  auto b = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32, {}, Weights::BF16, {MoeCombine::Biased, 0});
  const auto yu = run_moe(*u, x, T), yb = run_moe(*b, x, T);
  EXPECT_EQ(u->last_topk(), b->last_topk());  // the bias selects in both
  EXPECT_GT(testing::rel_l2(yu.data(), yb.data(), yu.size()), 1e-4);
}

TEST(KimiMoe, RealWidthsEqualFloat64) {
  // hidden 2304, experts of 1024 (8 of them: the widths are real, the count is not), top 2 + 1 shared.
  const MoeCase c = make_case(2304, 8, 2, 1024, 1, 77);
  auto moe = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32);
  for (int64_t T : {1, 72}) {  // side by side, grouped (18 rows per expert)
    const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, 100 + T, 1e-3, false);
    const auto ref = testing::moe_reference(c.w, c.cfg, c.k, MoeCombine::Unbiased, x, T, false);
    const auto out = run_moe(*moe, x, T);
    EXPECT_EQ(moe->last_topk(), ref.topk);
    expect_fp32_close(out, ref.y, "T " + std::to_string(T));
  }
}

TEST(KimiMoe, SharedAndUnpickedExperts) {
  MoeCase c = make_case(64, 8, 2, 32, 1, 8);
  // Experts 5 and 6 win every token (their bias dwarfs every s); expert 0 never does.
  c.w.bias = {-10.0f, 0.0f, 0.0f, 0.0f, 0.0f, 10.0f, 10.0f, 0.0f};
  auto moe = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32);
  for (int64_t T : {3, 100}) {
    const auto x = testing::random_normal(static_cast<size_t>(T * 64), T);
    const auto ref = testing::moe_reference(c.w, c.cfg, c.k, MoeCombine::Unbiased, x, T, false);
    const auto out = run_moe(*moe, x, T);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(moe->last_topk()[t * 2] + moe->last_topk()[t * 2 + 1], 11);
    }
    expect_fp32_close(out, ref.y, "T " + std::to_string(T));
  }
}

TEST(KimiMoe, BatchEqualsEachTokenAlone) {
  for (Precision p : {Precision::FP32, Precision::BF16}) {
    const MoeCase c = make_case(128, 16, 4, 64, 1, 31);
    auto moe = KimiMoE::from_weights(c.w, c.cfg, 1, p);
    const int64_t T = 100;  // grouped path (25 rows per expert); each token alone runs side by side
    const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, 4, 1e-3, p == Precision::BF16);
    const auto batch = run_moe(*moe, x, T);
    const auto batch_topk = moe->last_topk();
    std::vector<float> alone(batch.size());
    for (int64_t t = 0; t < T; ++t) {
      moe->forward(x.data() + t * 128, 1, alone.data() + t * 128);
      EXPECT_TRUE(std::equal(moe->last_topk().begin(), moe->last_topk().end(), batch_topk.begin() + t * 4));
    }
    // fp32: GEMMs of different row counts sum in different orders; bf16: that may flip a rounding (one ulp).
    if (p == Precision::FP32)
      EXPECT_LE(testing::max_error_ratio(alone.data(), batch.data(), batch.size(), 1e-5, 1e-5), 1.0);
    else
      EXPECT_LE(testing::max_error_ratio(alone.data(), batch.data(), batch.size(), 1e-3, 1.0 / 64), 1.0);
  }
}

// bf16 experts on AMX: an expert's count of 65-96 rows runs in calls of at most 64 on the AMX decode kernel
// (kimi_moe.cc, kChunkedRows), where a row's bits do not depend on the rows beside it. With every token
// picking every expert (80 rows each) and no shared expert, the batch gives each token the bits it gets
// alone (one row per call, side by side): a chunk written to the wrong rows, or left out, fails it. (At
// these widths oneDNN's padded call gives those bits too.) Skipped where the experts' projections do not
// take that kernel.
TEST(KimiMoe, Bf16ExpertRowsPast64RunInChunksWithEachRowsBits) {
  const MoeCase c = make_case(256, 4, 4, 128, 0, 83);
  const layers::Linear probe(256, 256, std::vector<float>(256 * 256, 0.01f), Precision::BF16);
  if (probe.bf16_gemm() != layers::Bf16Gemm::OneDnnAmx) GTEST_SKIP() << "no AMX decode kernel for bf16 here";
  auto moe = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::BF16);
  const int64_t T = 80;
  const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, 9, 1e-3, true);
  const auto batch = run_moe(*moe, x, T);
  std::vector<float> alone(batch.size());
  for (int64_t t = 0; t < T; ++t) moe->forward(x.data() + t * 256, 1, alone.data() + t * 256);
  int diff = 0;
  for (size_t i = 0; i < batch.size(); ++i) diff += batch[i] != alone[i];
  EXPECT_EQ(diff, 0);
  const auto emu = testing::moe_reference(c.w, c.cfg, c.k, MoeCombine::Unbiased, x, T, true);
  const auto e = to_f32(emu.y);
  EXPECT_LE(testing::max_error_ratio(batch.data(), e.data(), e.size(), 1e-2, 1.0 / 64), 1.0);
}

// Experts in slices (the decode jobs) or whole: the same sums up to the fp32 order of the down partials
// (bf16: the same rounding points), side by side and grouped, with bf16 and int4 weights (whose groups of
// 32 inputs a slice keeps). int8 scales each down channel, and each row of its input, over the slice's
// inputs: a finer quantization, within the int8 bound of the whole one.
TEST(KimiMoe, SlicedExpertsEqualWholeOnes) {
  const MoeCase c = make_case(128, 8, 2, 128, 1, 71);
  for (Precision p : {Precision::FP32, Precision::BF16})
    for (Weights wt : {Weights::BF16, Weights::Int8, Weights::Int4}) {
      auto whole = KimiMoE::from_weights(c.w, c.cfg, 1, p, {}, wt, {MoeCombine::Unbiased, 0, 1});
      auto sliced = KimiMoE::from_weights(c.w, c.cfg, 1, p, {}, wt, {MoeCombine::Unbiased, 0, 4});
      if (wt == Weights::Int8)  // a scale per down channel and slice
        EXPECT_EQ(sliced->weight_bytes() - whole->weight_bytes(), 9 * 3 * 128 * int64_t{sizeof(float)});
      else
        EXPECT_EQ(sliced->weight_bytes(), whole->weight_bytes());
      for (int64_t T : {1, 3, 90}) {  // side by side, and grouped at 90 (22 rows per expert)
        const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, 7 + T, 1e-3, p == Precision::BF16);
        const auto a = run_moe(*whole, x, T), b = run_moe(*sliced, x, T);
        EXPECT_EQ(whole->last_topk(), sliced->last_topk());
        const std::string what = std::string(to_string(p)) + " " + to_string(wt) + " T " + std::to_string(T);
        if (wt == Weights::Int8)
          EXPECT_LE(testing::rel_l2(b.data(), a.data(), a.size()), 2e-2) << what;
        else if (p == Precision::FP32)
          EXPECT_LE(testing::max_error_ratio(b.data(), a.data(), a.size(), 1e-5, 1e-5), 1.0) << what;
        else
          EXPECT_LE(testing::max_error_ratio(b.data(), a.data(), a.size(), 1e-3, 1.0 / 64), 1.0) << what;
      }
    }
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32, {}, Weights::BF16,
                              {MoeCombine::Unbiased, 0, 0});
      },
      "slices per expert");
}

TEST(KimiMoe, Bf16EqualsTheEmulation) {
  const MoeCase c = make_case(256, 16, 4, 64, 1, 41);
  auto moe = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::BF16);
  for (int64_t T : {1, 7, 65, 200}) {
    const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, 50 + T, 1e-3, true);
    const auto out = run_moe(*moe, x, T);
    expect_finite(out, "bf16 MoE");
    for (float v : out) ASSERT_EQ(v, round_bf16(v));  // y rounded once
    const auto emu = testing::moe_reference(c.w, c.cfg, c.k, MoeCombine::Unbiased, x, T, true);
    const auto exact = to_f32(testing::moe_reference(c.w, c.cfg, c.k, MoeCombine::Unbiased, x, T, false).y);
    EXPECT_EQ(moe->last_topk(), emu.topk);
    const auto e = to_f32(emu.y);
    const double err = testing::rel_l2(out.data(), e.data(), e.size());
    const double scheme = testing::rel_l2(e.data(), exact.data(), e.size());
    // As for KimiMLP: the same rounding points, so only a few last-bit flips apart.
    EXPECT_LE(err, 0.25 * scheme) << "T " << T << ": vs emulation " << err << ", emulation vs float64 "
                                  << scheme;
  }
}

TEST(KimiMoe, QuantizedWeightsStayNearFp32) {
  const MoeCase c = make_case(256, 8, 2, 64, 1, 61);
  const int64_t T = 80;  // grouped (20 rows per expert)
  const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, 3, 1e-3, false);
  auto f = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32);
  const auto ref = run_moe(*f, x, T);
  for (Precision p : {Precision::FP32, Precision::BF16})
    for (auto [wt, bound] : {std::pair{Weights::Int8, 2e-2}, std::pair{Weights::Int4, 0.25}}) {
      auto q = KimiMoE::from_weights(c.w, c.cfg, 1, p, {}, wt);
      for (int64_t n : {T, int64_t{1}}) {  // grouped and side by side
        const auto out = run_moe(*q, x, n);
        expect_finite(out, to_string(wt));
        EXPECT_TRUE(std::equal(q->last_topk().begin(), q->last_topk().end(), f->last_topk().begin()))
            << "the router stays fp32 in every weights mode";
        EXPECT_LE(testing::rel_l2(out.data(), ref.data(), out.size()), bound)  // first n rows of ref
            << to_string(wt) << " " << to_string(p) << " T " << n;
        if (n == T) run_moe(*f, x, T);  // restore f's last_topk for the T = 1 comparison
      }
      EXPECT_LT(q->weight_bytes(), f->weight_bytes());
    }
}

TEST(KimiMoe, SyntheticEqualsItsWeightsAndSizesAdd) {
  io::KimiLinearConfig cfg = moe_config(64, 16, 8, 32, 1);
  // Fewer experts than top_k: top_k is clamped.
  auto few = KimiMoE::synthetic(cfg, 1, 5, Precision::FP32, {}, Weights::BF16, {MoeCombine::Unbiased, 4});
  EXPECT_EQ(few->num_experts(), 4);
  EXPECT_EQ(few->top_k(), 4);
  cfg.num_experts_per_token = 2;
  const MoeWeights w = MoeWeights::synthetic(cfg, 1, 5, {});
  auto a = KimiMoE::synthetic(cfg, 1, 5, Precision::FP32);
  auto b = KimiMoE::from_weights(w, cfg, 1, Precision::FP32);
  const auto x = testing::random_normal(64 * 30, 2);
  EXPECT_EQ(run_moe(*a, x, 30), run_moe(*b, x, 30));
  // An expert's weights do not depend on how many experts there are.
  const MoeWeights w4 = MoeWeights::synthetic(cfg, 1, 5, {MoeCombine::Unbiased, 4});
  EXPECT_EQ(w4.experts[3].down_proj, w.experts[3].down_proj);
  const int64_t expert = 3 * 64 * 32 * 4, router = 16 * 64 * 4 + 16 * 4;
  EXPECT_EQ(a->weight_bytes(), router + 17 * expert);
  EXPECT_EQ(a->active_weight_bytes(), router + 3 * expert);
  // What a forward read: the union of its tokens' experts, once each.
  auto fresh = KimiMoE::synthetic(cfg, 1, 5, Precision::FP32);
  EXPECT_EQ(fresh->last_weight_bytes(), 0);
  run_moe(*fresh, x, 1);
  EXPECT_EQ(fresh->last_weight_bytes(), fresh->active_weight_bytes());
  run_moe(*fresh, x, 30);
  const std::set<int32_t> picked(fresh->last_topk().begin(), fresh->last_topk().end());
  EXPECT_GT(picked.size(), 2u);
  EXPECT_EQ(fresh->last_weight_bytes(), router + (1 + static_cast<int64_t>(picked.size())) * expert);
  run_moe(*fresh, x, 0);
  EXPECT_EQ(fresh->last_weight_bytes(), 0);
  auto bf = KimiMoE::synthetic(cfg, 1, 5, Precision::BF16);
  EXPECT_EQ(bf->weight_bytes(), router + 17 * expert / 2);  // the router stays fp32
  testing::expect_throw_with<std::invalid_argument>([&] { KimiMoE::synthetic(cfg, 0, 5, Precision::FP32); },
                                                    "dense MLP");
}

// ------------------------------------------------------------------------------------------------
// Loading from the tiny model dumps

TEST(KimiMoeLoad, TinyDumpsLayers) {
  const auto dir = testing::model_dumps_dir();
  const io::KimiLinearConfig cfg = io::load_model_config(dir);
  const io::Checkpoint ckpt(dir);
  const int64_t D = cfg.hidden_size, Ie = cfg.moe_intermediate_size;
  for (int layer = 1; layer <= 3; ++layer) {
    auto moe = KimiMoE::from_checkpoint(ckpt, cfg, layer, Precision::FP32);
    EXPECT_EQ(moe->num_experts(), 8);
    EXPECT_EQ(moe->top_k(), 2);
    EXPECT_EQ(moe->weight_bytes(), (8 * D + 8 + (8 + 1) * 3 * Ie * D) * 4);
    // The loaded layer computes the reference over the checkpoint's own tensors.
    const std::string pre = "model.layers." + std::to_string(layer) + ".block_sparse_moe.";
    MoeWeights w;
    w.router = ckpt.load_f32(pre + "gate.weight", {8, D});
    w.bias = ckpt.load_f32(pre + "gate.e_score_correction_bias", {8});
    for (int e = 0; e < 8; ++e)
      w.experts.push_back(MlpWeights::load(ckpt, pre + "experts." + std::to_string(e), true, D, Ie));
    w.shared = MlpWeights::load(ckpt, pre + "shared_experts", false, D, Ie);
    const int64_t T = 30;
    const auto x = testing::clear_routing_inputs(w, cfg, 2, T, layer, 1e-3, false);
    const auto ref = testing::moe_reference(w, cfg, 2, MoeCombine::Unbiased, x, T, false);
    const auto out = run_moe(*moe, x, T);
    EXPECT_EQ(moe->last_topk(), ref.topk);
    expect_fp32_close(out, ref.y, "layer " + std::to_string(layer));
  }
  // Layer 0 is dense: a MoE there is refused; its MLP loads with intermediate_size.
  testing::expect_throw_with<std::invalid_argument>(
      [&] { KimiMoE::from_checkpoint(ckpt, cfg, 0, Precision::FP32); }, "dense MLP");
  const MlpWeights dense = MlpWeights::load(ckpt, "model.layers.0.mlp", false, D, cfg.intermediate_size);
  EXPECT_EQ(dense.gate_proj.size(), static_cast<size_t>(cfg.intermediate_size * D));
  KimiMLP mlp(dense, Precision::FP32);
  const auto x = testing::random_normal(static_cast<size_t>(5 * D), 1);
  std::vector<float> out(x.size());
  mlp.forward(x.data(), 5, out.data());
  expect_fp32_close(out, testing::mlp_reference(dense, x, 5, false), "dense layer 0");
  // More experts than the checkpoint's is not a thing a checkpoint can give.
  EXPECT_THROW(
      KimiMoE::from_checkpoint(ckpt, cfg, 1, Precision::FP32, {}, Weights::BF16, {MoeCombine::Unbiased, 4}),
      std::invalid_argument);
}

// Layer 1's MoE tensors of the tiny dumps, as a single-file checkpoint, with `edit` applied.
std::filesystem::path broken_copy(const std::string& tag,
                                  const std::function<void(std::map<std::string, io::StTensor>&)>& edit) {
  const auto dir = testing::model_dumps_dir();
  const io::Checkpoint ckpt(dir);
  std::map<std::string, io::StTensor> tensors;
  for (const char* shard : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    const io::SafetensorsFile f(dir / shard);
    for (const auto& name : f.names()) {
      if (name.rfind("model.layers.1.block_sparse_moe.", 0) != 0) continue;
      const auto* v = f.find(name);
      tensors[name] = io::StTensor{v->shape, ckpt.load_f32(name, v->shape), io::StDType::F32};
    }
  }
  edit(tensors);
  const auto out = testing::make_temp_dir("moe_" + tag) / "model.safetensors";
  io::write_safetensors(out, tensors);
  return out;
}

TEST(KimiMoeLoad, MissingOrMisShapedExpertTensorNamesKeyAndShapes) {
  const io::KimiLinearConfig cfg = io::load_model_config(testing::model_dumps_dir());
  const std::string key = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  {
    const io::Checkpoint ok(broken_copy("ok", [](auto&) {}));
    EXPECT_NO_THROW(KimiMoE::from_checkpoint(ok, cfg, 1, Precision::BF16));
  }
  {
    const io::Checkpoint c(broken_copy("missing", [&](auto& t) { t.erase(key); }));
    testing::expect_throw_with<std::runtime_error>(
        [&] { KimiMoE::from_checkpoint(c, cfg, 1, Precision::FP32); }, key);
  }
  {
    const io::Checkpoint c(broken_copy("shape", [&](auto& t) {
      t[key].shape = {256, 63};
      t[key].values.resize(256 * 63);
    }));
    try {
      KimiMoE::from_checkpoint(c, cfg, 1, Precision::FP32);
      ADD_FAILURE() << "a [256, 63] w2 loaded";
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(), HasSubstr(key));
      EXPECT_THAT(e.what(), HasSubstr("63"));
      EXPECT_THAT(e.what(), HasSubstr("64"));
    }
  }
  {
    const std::string router = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias";
    const io::Checkpoint c(broken_copy("bias", [&](auto& t) { t.erase(router); }));
    testing::expect_throw_with<std::runtime_error>(
        [&] { KimiMoE::from_checkpoint(c, cfg, 1, Precision::FP32); }, router);
  }
  {
    const std::string shared = "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight";
    const io::Checkpoint c(broken_copy("shared", [&](auto& t) { t.erase(shared); }));
    testing::expect_throw_with<std::runtime_error>(
        [&] { KimiMoE::from_checkpoint(c, cfg, 1, Precision::FP32); }, shared);
  }
}

// ------------------------------------------------------------------------------------------------
// Tensor parallelism

TEST(KimiMoeTp, Tp2EqualsTp1) {
  const MoeCase c = make_case(128, 16, 4, 64, 1, 91);
  const MlpWeights dense = MlpWeights::synthetic(128, 256, 4);
  for (int64_t T : {3, 100}) {  // side by side, grouped
    const auto x = testing::clear_routing_inputs(c.w, c.cfg, c.k, T, T, 1e-3, false);
    auto one = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32);
    const auto ref = run_moe(*one, x, T);
    KimiMLP mlp1(dense, Precision::FP32);
    std::vector<float> dref(x.size());
    mlp1.forward(x.data(), T, dref.data());
    for (int tp : {2, 4}) {
      distributed::InProcessGroup group(tp);
      std::vector<std::vector<float>> got(tp), dgot(tp);
      group.run([&](int r, distributed::Communicator& comm) {
        auto moe = KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32, {r, tp, &comm});
        got[r] = run_moe(*moe, x, T);
        KimiMLP mlp(dense.shard(r, tp), Precision::FP32, {r, tp, &comm});
        EXPECT_EQ(mlp.intermediate(), 256 / tp);
        dgot[r].resize(x.size());
        mlp.forward(x.data(), T, dgot[r].data());
      });
      for (int r = 0; r < tp; ++r) {
        EXPECT_LE(testing::max_error_ratio(got[r].data(), ref.data(), ref.size(), 1e-4, 1e-4), 1.0)
            << "MoE tp " << tp << " rank " << r << " T " << T;
        EXPECT_LE(testing::max_error_ratio(dgot[r].data(), dref.data(), dref.size(), 1e-4, 1e-4), 1.0)
            << "dense tp " << tp << " rank " << r;
      }
    }
  }
}

TEST(KimiMoeTp, CheckpointShardsEqualTp1) {
  // Rank r reads only its rows of every expert and of the dense MLP from the tiny dumps.
  const auto dir = testing::model_dumps_dir();
  const io::KimiLinearConfig cfg = io::load_model_config(dir);
  const io::Checkpoint ckpt(dir);
  const int64_t D = cfg.hidden_size, T = 40;
  const auto x = testing::random_normal(static_cast<size_t>(T * D), 12);
  auto one = KimiMoE::from_checkpoint(ckpt, cfg, 2, Precision::FP32);
  const auto ref = run_moe(*one, x, T);
  KimiMLP dense1(MlpWeights::load(ckpt, "model.layers.0.mlp", false, D, cfg.intermediate_size),
                 Precision::FP32);
  std::vector<float> dref(x.size());
  dense1.forward(x.data(), T, dref.data());
  const int tp = 2;
  distributed::InProcessGroup group(tp);
  std::vector<std::vector<float>> got(tp), dgot(tp, std::vector<float>(x.size()));
  group.run([&](int r, distributed::Communicator& comm) {
    auto moe = KimiMoE::from_checkpoint(ckpt, cfg, 2, Precision::FP32, {r, tp, &comm});
    got[r] = run_moe(*moe, x, T);
    KimiMLP dense(MlpWeights::load(ckpt, "model.layers.0.mlp", false, D, cfg.intermediate_size, r, tp),
                  Precision::FP32, {r, tp, &comm});
    dense.forward(x.data(), T, dgot[r].data());
  });
  for (int r = 0; r < tp; ++r) {
    EXPECT_LE(testing::max_error_ratio(got[r].data(), ref.data(), ref.size(), 1e-4, 1e-4), 1.0)
        << "rank " << r;
    EXPECT_LE(testing::max_error_ratio(dgot[r].data(), dref.data(), dref.size(), 1e-4, 1e-4), 1.0)
        << "rank " << r;
  }
}

TEST(KimiMoeTp, IndivisibleIntermediateIsAClearError) {
  const MoeCase c = make_case(64, 4, 2, 48, 1, 1);
  distributed::InProcessGroup group(5);  // no collective runs: building is rank-local
  auto comm = group.member(0);
  testing::expect_throw_with<std::invalid_argument>(
      [&] {
        KimiMoE::from_weights(c.w, c.cfg, 1, Precision::FP32, {0, 5, comm.get()});
      },
      "48");
  testing::expect_throw_with<std::invalid_argument>([&] { c.w.experts[0].shard(0, 5); }, "48");
  const io::Checkpoint ckpt(testing::model_dumps_dir());
  testing::expect_throw_with<std::invalid_argument>(
      [&] { MlpWeights::load(ckpt, "model.layers.0.mlp", false, 256, 256, 0, 3); }, "256");
}

}  // namespace
}  // namespace kda
