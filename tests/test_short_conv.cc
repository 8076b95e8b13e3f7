// Short convolution (spec step 2) against a float64 reference written here: varlen, state shifting,
// padded rows, decode == extend, bf16 state, bf16 input, bf16 output, validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kda/kernels/short_conv.h"
#include "support/test_support.h"

namespace kda::kernels {
namespace {

using kda::testing::max_error_ratio;
using kda::testing::random_normal;
using kda::testing::random_uniform;

float to_f32(float v) { return v; }
float to_f32(bf16_t v) { return bf16_to_f32(v); }
template <class S>
S from_f32(float v);
template <>
float from_f32<float>(float v) {
  return v;
}
template <>
bf16_t from_f32<bf16_t>(float v) {
  return f32_to_bf16(v);
}

// One call's inputs. Empty cu / indices / init stand for null pointers.
struct Problem {
  int64_t T = 0, C = 0, x_stride = 0, N = 1, num_slots = 0;
  int W = 4;
  std::vector<float> x, w;
  std::vector<int32_t> cu, indices;
  std::vector<uint8_t> init;
  bool round = false;
};

Problem make_problem(const std::vector<int32_t>& lens, int64_t C, int W, int64_t x_stride, uint64_t seed) {
  Problem p;
  p.C = C;
  p.W = W;
  p.x_stride = x_stride;
  p.N = static_cast<int64_t>(lens.size());
  p.cu = {0};
  for (const int32_t l : lens) p.cu.push_back(p.cu.back() + l);
  p.T = p.cu.back();
  p.x = random_normal(p.T * x_stride, seed);
  p.w = random_uniform(C * W, seed + 1, -0.6f, 0.6f);
  return p;
}

template <class S>
ShortConvArgs<S> args_of(const Problem& p, S* state, float* y) {
  ShortConvArgs<S> a;
  a.x = p.x.data();
  a.x_stride = p.x_stride;
  a.T = p.T;
  a.C = p.C;
  a.weight = p.w.data();
  a.W = p.W;
  a.cu_seqlens = p.cu.empty() ? nullptr : p.cu.data();
  a.N = p.N;
  a.state = state;
  a.indices = p.indices.empty() ? nullptr : p.indices.data();
  a.num_slots = p.num_slots;
  a.has_initial_state = p.init.empty() ? nullptr : p.init.data();
  a.round_output_bf16 = p.round;
  a.y = y;
  return a;
}

// The spec's formula in float64, one sequence at a time, over (history ++ segment); `state` (may be null)
// is updated to the expected pool contents. Decode is the same with cu_seqlens = 0, 1, ..., N.
template <class S>
std::vector<float> reference(const Problem& p, S* state, bool decode = false) {
  const int64_t H = p.W - 1;
  std::vector<float> y(p.T * p.C, 0.0f);
  for (int64_t i = 0; i < p.N; ++i) {
    const int64_t bos = decode ? i : (p.cu.empty() ? 0 : p.cu[i]);
    const int64_t len = decode ? 1 : (p.cu.empty() ? p.T : p.cu[i + 1]) - bos;
    const int64_t slot = p.indices.empty() ? i : p.indices[i];
    if (slot < 0) continue;
    const bool read = state && (p.init.empty() || p.init[i]);
    S* st = state ? state + slot * H * p.C : nullptr;
    for (int64_t c = 0; c < p.C; ++c) {
      std::vector<double> ext(H + len);  // oldest first
      for (int64_t r = 0; r < H; ++r) ext[r] = read ? to_f32(st[r * p.C + c]) : 0.0;
      for (int64_t j = 0; j < len; ++j) ext[H + j] = p.x[(bos + j) * p.x_stride + c];
      for (int64_t j = 0; j < len; ++j) {
        double z = 0.0;
        for (int k = 0; k < p.W; ++k) z += static_cast<double>(p.w[c * p.W + k]) * ext[j + k];
        const float v = static_cast<float>(z / (1.0 + std::exp(-z)));
        y[(bos + j) * p.C + c] = p.round ? round_bf16(v) : v;
      }
      if (st && len > 0) {
        for (int64_t r = 0; r < H; ++r) st[r * p.C + c] = from_f32<S>(static_cast<float>(ext[len + r]));
      }
    }
  }
  return y;
}

template <class S>
bool same_bits(const std::vector<S>& a, const std::vector<S>& b) {
  if (a.size() != b.size()) return false;
  return a.empty() ||
         std::memcmp(a.data(), b.data(), a.size() * sizeof(S)) == 0;  // empty: data() may be null
}

template <class S>
std::vector<S> random_pool(int64_t n, uint64_t seed) {
  const auto v = random_normal(n, seed);
  std::vector<S> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<S>(v[i]);
  return out;
}

// Extend over a varlen batch into a larger pool with permuted slots, a padded row and mixed
// has_initial_state, against the reference: outputs within 1e-6, pool bit-identical to the expected one
// (untouched slots included).
template <class S>
void check_varlen(int W, int64_t C, int64_t x_stride, uint64_t seed) {
  SCOPED_TRACE("W=" + std::to_string(W) + " C=" + std::to_string(C) +
               " x_stride=" + std::to_string(x_stride));
  // 0-, 1- and 2-token segments are shorter than W-1; 300 spans several time chunks of the kernel.
  Problem p = make_problem({5, 0, 1, 2, 3, 300, 1, 2, 7}, C, W, x_stride, seed);
  p.num_slots = 12;
  p.indices = {7, 2, 11, 0, -1, 5, 9, 3, 10};
  p.init = {1, 0, 1, 1, 1, 0, 0, 1, 0};  // the empty segment without initial state keeps its slot too
  const int64_t H = W - 1;
  std::vector<S> pool = random_pool<S>(p.num_slots * H * C, seed + 7);
  std::vector<S> expect_pool = pool;
  const std::vector<float> expect_y = reference(p, expect_pool.data());

  std::vector<float> y(p.T * C, NAN);
  short_conv_extend(args_of(p, pool.data(), y.data()));
  EXPECT_LE(max_error_ratio(y.data(), expect_y.data(), y.size(), 1e-6, 1e-6), 1.0);
  EXPECT_TRUE(same_bits(pool, expect_pool));
  // The padded row (sequence 4, tokens 8..10) is exactly zero.
  for (int64_t t = p.cu[4]; t < p.cu[5]; ++t) {
    for (int64_t c = 0; c < C; ++c) ASSERT_EQ(y[t * C + c], 0.0f);
  }
}

TEST(ShortConv, VarlenMatchesReferenceFp32) {
  check_varlen<float>(4, 37, 37, 1);
  check_varlen<float>(4, 300, 320, 2);  // two channel blocks, x a slice of a wider row
  check_varlen<float>(2, 19, 40, 3);
  check_varlen<float>(1, 23, 23, 4);  // no history at all
}

TEST(ShortConv, VarlenMatchesReferenceBf16State) {
  // x is not bf16-representable here, so the state must hold bf16(x), rounded on write.
  check_varlen<bf16_t>(4, 37, 45, 5);
  check_varlen<bf16_t>(2, 260, 260, 6);
  check_varlen<bf16_t>(1, 8, 8, 7);
}

TEST(ShortConv, NullStateMeansZeroHistory) {
  Problem p = make_problem({3, 1, 6}, 29, 4, 31, 11);
  const std::vector<float> expect = reference<float>(p, nullptr);
  std::vector<float> y(p.T * p.C, NAN);
  short_conv_extend(args_of<float>(p, nullptr, y.data()));
  EXPECT_LE(max_error_ratio(y.data(), expect.data(), y.size(), 1e-6, 1e-6), 1.0);
}

TEST(ShortConv, NullCuSeqlensIsOneSequence) {
  Problem p = make_problem({9}, 16, 4, 16, 12);
  p.cu.clear();
  p.num_slots = 1;
  std::vector<float> pool = random_pool<float>(3 * 16, 13), expect_pool = pool;
  const std::vector<float> expect = reference(p, expect_pool.data());
  std::vector<float> y(p.T * p.C, NAN);
  short_conv_extend(args_of(p, pool.data(), y.data()));
  EXPECT_LE(max_error_ratio(y.data(), expect.data(), y.size(), 1e-6, 1e-6), 1.0);
  EXPECT_TRUE(same_bits(pool, expect_pool));
}

// Shorter-than-W-1 segments with has_initial_state false: the missing older rows become zeros.
TEST(ShortConv, ShortSegmentWithoutInitialStateShiftsInZeros) {
  Problem p = make_problem({1, 2}, 3, 4, 3, 14);
  p.num_slots = 2;
  p.init = {0, 1};
  std::vector<float> pool = random_pool<float>(2 * 3 * 3, 15);
  const std::vector<float> old = pool;
  std::vector<float> y(p.T * p.C);
  short_conv_extend(args_of(p, pool.data(), y.data()));
  for (int64_t c = 0; c < 3; ++c) {
    EXPECT_EQ(pool[0 * 3 + c], 0.0f);  // slot 0: [0, 0, x0]
    EXPECT_EQ(pool[1 * 3 + c], 0.0f);
    EXPECT_EQ(pool[2 * 3 + c], p.x[0 * 3 + c]);
    EXPECT_EQ(pool[9 + 0 * 3 + c], old[9 + 2 * 3 + c]);  // slot 1: [old2, x1, x2]
    EXPECT_EQ(pool[9 + 1 * 3 + c], p.x[1 * 3 + c]);
    EXPECT_EQ(pool[9 + 2 * 3 + c], p.x[2 * 3 + c]);
  }
}

// Extend over all tokens == extend over all but the last k, then k decode steps: outputs and final
// state bit-identical (the conv state holds raw inputs, exact in fp32 and for bf16-representable x).
template <class S>
void check_decode_equals_extend(int W, bool bf16_inputs, uint64_t seed) {
  SCOPED_TRACE("W=" + std::to_string(W));
  const std::vector<int32_t> lens = {3, 4, 5, 9};  // prefixes of 0, 1, 2 and 6 tokens before 3 decodes
  const int k = 3;
  const int64_t C = 45, xs = 50, N = 4, H = W - 1;
  Problem full = make_problem(lens, C, W, xs, seed);
  if (bf16_inputs) {
    for (float& v : full.x) v = round_bf16(v);
  }
  full.num_slots = 6;
  full.indices = {4, 1, 5, 2};
  full.round = bf16_inputs;
  std::vector<S> pool_full = random_pool<S>(full.num_slots * H * C, seed + 3);
  std::vector<S> pool_split = pool_full;
  std::vector<float> y_full(full.T * C);
  short_conv_extend(args_of(full, pool_full.data(), y_full.data()));

  // The prefixes, then one token of every sequence per decode step.
  Problem pre = full;
  pre.cu = {0};
  pre.x.clear();
  for (int64_t i = 0; i < N; ++i) {
    const int32_t n = lens[i] - k;
    pre.cu.push_back(pre.cu.back() + n);
    pre.x.insert(pre.x.end(), full.x.begin() + full.cu[i] * xs, full.x.begin() + (full.cu[i] + n) * xs);
  }
  pre.T = pre.cu.back();
  std::vector<float> y_pre(pre.T * C);
  short_conv_extend(args_of(pre, pool_split.data(), y_pre.data()));
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < lens[i] - k; ++j) {
      ASSERT_EQ(std::memcmp(&y_pre[(pre.cu[i] + j) * C], &y_full[(full.cu[i] + j) * C], C * sizeof(float)),
                0);
    }
  }
  for (int step = 0; step < k; ++step) {
    Problem dec = full;
    dec.cu.clear();  // ignored by decode
    dec.T = N;
    dec.x.clear();
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = full.cu[i] + lens[i] - k + step;
      dec.x.insert(dec.x.end(), full.x.begin() + t * xs, full.x.begin() + (t + 1) * xs);
    }
    std::vector<float> y_dec(N * C);
    short_conv_decode(args_of(dec, pool_split.data(), y_dec.data()));
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = full.cu[i] + lens[i] - k + step;
      ASSERT_EQ(std::memcmp(&y_dec[i * C], &y_full[t * C], C * sizeof(float)), 0)
          << "step " << step << " seq " << i;
    }
  }
  EXPECT_TRUE(same_bits(pool_split, pool_full));
}

TEST(ShortConv, DecodeStepsEqualExtendFp32) {
  check_decode_equals_extend<float>(4, false, 21);
  check_decode_equals_extend<float>(2, false, 22);
  check_decode_equals_extend<float>(1, false, 23);
}

TEST(ShortConv, DecodeStepsEqualExtendBf16) {
  check_decode_equals_extend<bf16_t>(4, true, 24);
  check_decode_equals_extend<bf16_t>(2, true, 25);
}

TEST(ShortConv, DecodeMatchesReferenceWithPaddedRow) {
  Problem p = make_problem({1, 1, 1, 1, 1}, 270, 4, 300, 31);
  p.cu.clear();
  p.num_slots = 8;
  p.indices = {6, -1, 0, 3, 7};
  p.init = {1, 1, 0, 1, 1};
  std::vector<float> pool = random_pool<float>(8 * 3 * 270, 32), expect_pool = pool;
  const std::vector<float> expect = reference(p, expect_pool.data(), /*decode=*/true);
  std::vector<float> y(p.T * p.C, NAN);
  short_conv_decode(args_of(p, pool.data(), y.data()));
  EXPECT_LE(max_error_ratio(y.data(), expect.data(), y.size(), 1e-6, 1e-6), 1.0);
  EXPECT_TRUE(same_bits(pool, expect_pool));
  for (int64_t c = 0; c < p.C; ++c) ASSERT_EQ(y[1 * p.C + c], 0.0f);
}

TEST(ShortConv, RoundOutputIsRoundedFp32Result) {
  Problem p = make_problem({4, 1, 12}, 33, 4, 33, 41);
  p.num_slots = 3;
  std::vector<bf16_t> pool0 = random_pool<bf16_t>(3 * 3 * 33, 42), pool1 = pool0;
  std::vector<float> y(p.T * p.C), y_round(p.T * p.C);
  short_conv_extend(args_of(p, pool0.data(), y.data()));
  p.round = true;
  short_conv_extend(args_of(p, pool1.data(), y_round.data()));
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y_round[i], round_bf16(y[i])) << i;
  EXPECT_TRUE(same_bits(pool0, pool1));
}

// The bf16 mode's input rounding point applied by the conv as it reads x gives the bits of a conv over
// pre-rounded inputs: outputs and the state written back (an fp32 state shows whether the rounded value
// is what is kept), for the model's W = 4 and a generic W, extend and then one decode step.
template <class S>
void check_round_input(int W) {
  SCOPED_TRACE("W=" + std::to_string(W));
  Problem p = make_problem({6, 1, 40, 2}, 300, W, 310, 61);
  p.num_slots = 4;
  p.indices = {2, 0, 3, 1};
  p.init = {1, 1, 0, 1};
  Problem pre = p;
  for (float& v : pre.x) v = round_bf16(v);
  Problem d = make_problem({1, 1, 1, 1}, 300, W, 310, 63);
  d.num_slots = 4;
  d.indices = p.indices;
  Problem dpre = d;
  for (float& v : dpre.x) v = round_bf16(v);
  for (const bool out_round : {false, true}) {
    p.round = pre.round = d.round = dpre.round = out_round;
    // A state the bf16 mode wrote holds bf16 values, whichever its storage type.
    std::vector<S> pool_a = random_pool<S>(4 * (W - 1) * 300, 62);
    for (S& v : pool_a) v = from_f32<S>(round_bf16(to_f32(v)));
    std::vector<S> pool_b = pool_a;
    std::vector<float> ya(p.T * p.C, NAN), yb(p.T * p.C, NAN);
    auto a = args_of(p, pool_a.data(), ya.data());
    a.round_input_bf16 = true;
    short_conv_extend(a);
    short_conv_extend(args_of(pre, pool_b.data(), yb.data()));
    EXPECT_TRUE(same_bits(ya, yb));
    EXPECT_TRUE(same_bits(pool_a, pool_b));
    std::vector<float> da(4 * 300), db(4 * 300);
    auto ad = args_of(d, pool_a.data(), da.data());
    ad.round_input_bf16 = true;
    short_conv_decode(ad);
    short_conv_decode(args_of(dpre, pool_b.data(), db.data()));
    EXPECT_TRUE(same_bits(da, db));
    EXPECT_TRUE(same_bits(pool_a, pool_b));
  }
}

TEST(ShortConv, RoundInputEqualsPreRoundedInput) {
  check_round_input<float>(4);
  check_round_input<float>(3);
  check_round_input<bf16_t>(4);
}

// Few sequences over many channels: the work is split over channel spans as well as time chunks.
// Outputs into a padded row stride leave the padding as it was.
TEST(ShortConv, ChannelSpansAndPaddedOutputStride) {
  Problem p = make_problem({5, 2}, 3000, 4, 3008, 71);
  p.num_slots = 2;
  std::vector<float> pool = random_pool<float>(2 * 3 * 3000, 72), expect_pool = pool;
  const std::vector<float> expect = reference(p, expect_pool.data());
  const int64_t ys = 3000 + 17;
  std::vector<float> y(p.T * ys, -7.0f);
  auto a = args_of(p, pool.data(), y.data());
  a.y_stride = ys;
  short_conv_extend(a);
  std::vector<float> dense(p.T * p.C);
  for (int64_t t = 0; t < p.T; ++t) {
    std::copy(y.begin() + t * ys, y.begin() + t * ys + p.C, dense.begin() + t * p.C);
    for (int64_t c = p.C; c < ys; ++c) ASSERT_EQ(y[t * ys + c], -7.0f);
  }
  EXPECT_LE(max_error_ratio(dense.data(), expect.data(), dense.size(), 1e-6, 1e-6), 1.0);
  EXPECT_TRUE(same_bits(pool, expect_pool));
  a.y_stride = p.C - 1;
  EXPECT_THROW(short_conv_extend(a), std::invalid_argument);
}

// bf16 outputs (y_bf16) are the fp32 outputs with round_output_bf16, converted: f32_to_bf16 of them, bit
// for bit. One call is run both ways on copies of the pool, the bf16 one with round_output_bf16 as given
// (implied either way), into a padded row stride. The padding keeps a signalling-NaN sentinel that
// f32_to_bf16 never produces, so an element left unwritten cannot pass; both pools must end the same.
constexpr bf16_t kUnwritten = 0x7fa5;

template <class S>
void expect_bf16_output_matches(const Problem& p, bool decode, bool round_in, bool round_flag, int64_t ys,
                                std::vector<S>& pool_f, std::vector<S>& pool_b) {
  std::vector<float> yf(p.T * ys, NAN);
  std::vector<bf16_t> yb(p.T * ys, kUnwritten);
  Problem pf = p, pb = p;
  pf.round = true;
  pb.round = round_flag;
  auto af = args_of(pf, pool_f.data(), yf.data());
  auto ab = args_of(pb, pool_b.data(), static_cast<float*>(nullptr));
  ab.y_bf16 = yb.data();
  for (auto* a : {&af, &ab}) {
    a->round_input_bf16 = round_in;
    a->y_stride = ys;
    decode ? short_conv_decode(*a) : short_conv_extend(*a);
  }
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t c = 0; c < p.C; ++c) {
      ASSERT_EQ(yb[t * ys + c], f32_to_bf16(yf[t * ys + c])) << "t " << t << " c " << c;
    }
    for (int64_t c = p.C; c < ys; ++c) ASSERT_EQ(yb[t * ys + c], kUnwritten) << "t " << t << " c " << c;
  }
  EXPECT_TRUE(same_bits(pool_f, pool_b));
}

// Extend over a varlen batch (a 0-length segment, a padded row, segments shorter than W-1 and one over
// several time chunks), then one decode step with a padded row, each in both output types.
template <class S>
void check_bf16_output_varlen(int W, bool round_in, bool round_flag, uint64_t seed) {
  SCOPED_TRACE("W=" + std::to_string(W) + " round_in=" + std::to_string(round_in) +
               " round_flag=" + std::to_string(round_flag));
  const int64_t C = 300, ys = C + 5, H = W - 1;  // two channel blocks, the second partial
  Problem p = make_problem({5, 0, 1, 2, 70, 3}, C, W, 310, seed);
  p.num_slots = 7;
  p.indices = {3, 0, 6, -1, 1, 2};
  p.init = {1, 0, 1, 1, 0, 1};
  std::vector<S> pool_f = random_pool<S>(p.num_slots * H * C, seed + 1), pool_b = pool_f;
  expect_bf16_output_matches(p, /*decode=*/false, round_in, round_flag, ys, pool_f, pool_b);
  Problem d = make_problem({1, 1, 1, 1, 1, 1}, C, W, 310, seed + 2);
  d.cu.clear();
  d.num_slots = p.num_slots;
  d.indices = {-1, 0, 6, 3, 1, 2};
  expect_bf16_output_matches(d, /*decode=*/true, round_in, round_flag, ys, pool_f, pool_b);

  // The padded rows are zeros (+0) in bf16 too.
  std::vector<bf16_t> yb(p.T * C, kUnwritten);
  auto a = args_of(p, pool_b.data(), static_cast<float*>(nullptr));
  a.y_bf16 = yb.data();
  short_conv_extend(a);
  for (int64_t t = p.cu[3]; t < p.cu[4]; ++t) {
    for (int64_t c = 0; c < C; ++c) ASSERT_EQ(yb[t * C + c], 0) << "t " << t << " c " << c;
  }
}

TEST(ShortConv, Bf16OutputIsRoundedFp32OutputVarlen) {
  uint64_t seed = 91;
  for (const int W : {4, 3, 5}) {
    for (const bool round_in : {false, true}) {
      for (const bool round_flag : {false, true}) {
        check_bf16_output_varlen<float>(W, round_in, round_flag, seed += 3);
        check_bf16_output_varlen<bf16_t>(W, round_in, round_flag, seed += 3);
      }
    }
  }
}

// Few tokens over many channels: outputs split over channel spans, extend then decode.
template <class S>
void check_bf16_output_channel_spans(int W, bool round_in, uint64_t seed) {
  SCOPED_TRACE("W=" + std::to_string(W) + " round_in=" + std::to_string(round_in));
  const int64_t C = 3000, ys = C + 17, H = W - 1;
  Problem p = make_problem({5, 2}, C, W, 3008, seed);
  p.num_slots = 2;
  std::vector<S> pool_f = random_pool<S>(2 * H * C, seed + 1), pool_b = pool_f;
  expect_bf16_output_matches(p, /*decode=*/false, round_in, /*round_flag=*/false, ys, pool_f, pool_b);
  Problem d = make_problem({1, 1}, C, W, 3008, seed + 2);
  d.cu.clear();
  d.num_slots = 2;
  d.indices = {1, 0};
  expect_bf16_output_matches(d, /*decode=*/true, round_in, /*round_flag=*/false, ys, pool_f, pool_b);
}

TEST(ShortConv, Bf16OutputIsRoundedFp32OutputChannelSpans) {
  for (const bool round_in : {false, true}) {
    check_bf16_output_channel_spans<float>(4, round_in, 131);
    check_bf16_output_channel_spans<float>(3, round_in, 134);
    check_bf16_output_channel_spans<bf16_t>(4, round_in, 137);
    check_bf16_output_channel_spans<bf16_t>(5, round_in, 140);
  }
}

// bf16 inputs (x_bf16) give the bits of fp32 inputs (x) holding the same values: outputs (fp32 or bf16,
// into a padded row stride whose padding must stay as it was) and the pool. round_f / round_b are the two
// calls' round_input_bf16: rounding a bf16 value is exact, so they may differ where the history is bf16
// values (any bf16 state, or an fp32 state the bf16 mode wrote); an fp32 state holding other values is
// run with equal flags.
template <class S, class OutT>
void expect_bf16_input_matches(const Problem& p, bool decode, bool round_f, bool round_b, int64_t ys,
                               std::vector<S>& pool_f, std::vector<S>& pool_b) {
  std::vector<bf16_t> xb(p.x.size());
  for (size_t i = 0; i < xb.size(); ++i) {
    xb[i] = f32_to_bf16(p.x[i]);
    ASSERT_EQ(bf16_to_f32(xb[i]), p.x[i]) << "x must hold bf16 values";
  }
  std::vector<OutT> yf(p.T * ys, from_f32<OutT>(-7.0f)), yb = yf;
  auto af = args_of(p, pool_f.data(), static_cast<float*>(nullptr));
  auto ab = args_of(p, pool_b.data(), static_cast<float*>(nullptr));
  ab.x = nullptr;
  ab.x_bf16 = xb.data();
  af.round_input_bf16 = round_f;
  ab.round_input_bf16 = round_b;
  for (auto [a, y] : {std::pair{&af, &yf}, std::pair{&ab, &yb}}) {
    if constexpr (std::is_same_v<OutT, float>) {
      a->y = y->data();
    } else {
      a->y_bf16 = y->data();
    }
    a->y_stride = ys;
    decode ? short_conv_decode(*a) : short_conv_extend(*a);
  }
  EXPECT_TRUE(same_bits(yf, yb));
  EXPECT_TRUE(same_bits(pool_f, pool_b));
}

// Problem whose x holds bf16 values.
Problem make_bf16_problem(const std::vector<int32_t>& lens, int64_t C, int W, int64_t x_stride,
                          uint64_t seed) {
  Problem p = make_problem(lens, C, W, x_stride, seed);
  for (float& v : p.x) v = round_bf16(v);
  return p;
}

// Extend over a varlen batch (a 0-length segment, a padded row, segments shorter than W-1 and one over
// several time chunks), then one decode step with a padded row; then few sequences over many channels
// (channel spans), extend and decode. Each call with fp32 and with bf16 x on copies of one pool.
template <class S, class OutT>
void check_bf16_input(int W, bool round_f, bool round_b, uint64_t seed) {
  SCOPED_TRACE("W=" + std::to_string(W) + " round_f=" + std::to_string(round_f) +
               " round_b=" + std::to_string(round_b));
  const int64_t H = W - 1;
  // A pool of bf16 values unless both calls round alike (see expect_bf16_input_matches).
  auto pool_of = [&](int64_t n, uint64_t s) {
    std::vector<S> pool = random_pool<S>(n, s);
    if (round_f != round_b) {
      for (S& v : pool) v = from_f32<S>(round_bf16(to_f32(v)));
    }
    return pool;
  };
  {
    const int64_t C = 300, ys = C + 5;  // two channel blocks, the second partial
    Problem p = make_bf16_problem({5, 0, 1, 2, 70, 3}, C, W, 310, seed);
    p.num_slots = 7;
    p.indices = {3, 0, 6, -1, 1, 2};
    p.init = {1, 0, 1, 1, 0, 1};
    p.round = round_f;  // round_output_bf16 (y only), both calls
    std::vector<S> pool_f = pool_of(p.num_slots * H * C, seed + 1), pool_b = pool_f;
    expect_bf16_input_matches<S, OutT>(p, /*decode=*/false, round_f, round_b, ys, pool_f, pool_b);
    Problem d = make_bf16_problem({1, 1, 1, 1, 1, 1}, C, W, 310, seed + 2);
    d.cu.clear();
    d.num_slots = p.num_slots;
    d.indices = {-1, 0, 6, 3, 1, 2};
    d.round = round_b;
    expect_bf16_input_matches<S, OutT>(d, /*decode=*/true, round_f, round_b, ys, pool_f, pool_b);
  }
  {
    const int64_t C = 3000, ys = C + 17;
    Problem p = make_bf16_problem({5, 2}, C, W, 3008, seed + 3);
    p.num_slots = 2;
    std::vector<S> pool_f = pool_of(2 * H * C, seed + 4), pool_b = pool_f;
    expect_bf16_input_matches<S, OutT>(p, /*decode=*/false, round_f, round_b, ys, pool_f, pool_b);
    Problem d = make_bf16_problem({1, 1}, C, W, 3008, seed + 5);
    d.cu.clear();
    d.num_slots = 2;
    d.indices = {1, 0};
    expect_bf16_input_matches<S, OutT>(d, /*decode=*/true, round_f, round_b, ys, pool_f, pool_b);
  }
}

TEST(ShortConv, Bf16InputIsFp32InputOfSameValues) {
  uint64_t seed = 151;
  for (const int W : {4, 3, 5, 1}) {
    for (const bool round_f : {false, true}) {
      for (const bool round_b : {false, true}) {
        check_bf16_input<float, float>(W, round_f, round_b, seed += 6);
        check_bf16_input<float, bf16_t>(W, round_f, round_b, seed += 6);
        check_bf16_input<bf16_t, float>(W, round_f, round_b, seed += 6);
        check_bf16_input<bf16_t, bf16_t>(W, round_f, round_b, seed += 6);
      }
    }
  }
}

// The conv state keeps bf16 inputs as given: exact in a bf16 state, widened in an fp32 one.
template <class S>
void check_bf16_input_state() {
  const int64_t C = 40, W = 4, H = W - 1;
  Problem p = make_bf16_problem({7, 2}, C, W, 44, 171);
  p.num_slots = 2;
  p.init = {1, 1};
  std::vector<bf16_t> xb(p.x.size());
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = f32_to_bf16(p.x[i]);
  std::vector<S> pool = random_pool<S>(2 * H * C, 172);
  const std::vector<S> old = pool;
  std::vector<bf16_t> y(p.T * C);
  auto a = args_of(p, pool.data(), static_cast<float*>(nullptr));
  a.x = nullptr;
  a.x_bf16 = xb.data();
  a.y_bf16 = y.data();
  short_conv_extend(a);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t r = 0; r < H; ++r) {  // slot 0: x4, x5, x6
      ASSERT_EQ(pool[r * C + c], from_f32<S>(bf16_to_f32(xb[(4 + r) * p.x_stride + c])));
    }
    // slot 1: [old2, x7, x8]
    ASSERT_EQ(pool[H * C + c], old[H * C + 2 * C + c]);
    ASSERT_EQ(pool[H * C + C + c], from_f32<S>(bf16_to_f32(xb[7 * p.x_stride + c])));
    ASSERT_EQ(pool[H * C + 2 * C + c], from_f32<S>(bf16_to_f32(xb[8 * p.x_stride + c])));
  }
}

TEST(ShortConv, Bf16InputStateKeepsInputs) {
  check_bf16_input_state<float>();
  check_bf16_input_state<bf16_t>();
}

TEST(ShortConv, ValidationErrorsLeavePoolUnchanged) {
  const Problem good = make_problem({3, 2, 4}, 10, 4, 12, 51);
  std::vector<float> pool = random_pool<float>(5 * 3 * 10, 52);
  const std::vector<float> before = pool;
  std::vector<float> y(good.T * good.C, 1.0f);
  std::vector<bf16_t> yb(good.T * good.C, 0x3f80);
  const std::vector<float> y0 = y;
  const std::vector<bf16_t> yb0 = yb;
  const std::vector<bf16_t> xb(good.T * good.x_stride, 0x3f80);
  // `edit` edits the arguments' inputs and outputs (x and y set, x_bf16 and y_bf16 null unless it says
  // otherwise).
  auto expect_rejected = [&](const std::function<void(Problem&)>& mutate, const std::string& needle,
                             bool decode = false,
                             const std::function<void(ShortConvArgs<float>&)>& edit = {}) {
    Problem p = good;
    p.num_slots = 5;
    p.indices = {4, 0, 2};
    mutate(p);
    auto a = args_of(p, pool.data(), y.data());
    if (edit) edit(a);
    try {
      if (decode) {
        short_conv_decode(a);
      } else {
        short_conv_extend(a);
      }
      ADD_FAILURE() << "no exception for '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(same_bits(pool, before)) << needle;
    EXPECT_TRUE(same_bits(y, y0)) << needle;
    EXPECT_TRUE(same_bits(yb, yb0)) << needle;
  };
  expect_rejected([](Problem& p) { p.cu = {0, 4, 3, 9}; }, "non-decreasing");
  expect_rejected([](Problem& p) { p.cu = {1, 3, 5, 9}; }, "cu_seqlens[0]");
  expect_rejected([](Problem& p) { p.cu = {0, 3, 5, 8}; }, "must equal T");
  expect_rejected([](Problem& p) { p.indices = {4, 5, 2}; }, "indices[1] = 5");
  expect_rejected([](Problem& p) { p.indices = {4, -2, 2}; }, "indices[1] = -2");
  expect_rejected([](Problem& p) { p.indices = {2, 0, 2}; }, "slot 2 is named by sequences 0 and 2");
  expect_rejected([](Problem& p) { p.x_stride = 9; }, "x_stride");
  expect_rejected([](Problem& p) { p.W = 0; }, "W must be >= 1");
  expect_rejected([](Problem& p) { p.cu.clear(); }, "cu_seqlens is null");
  expect_rejected(
      [](Problem& p) {
        p.indices.clear();
        p.num_slots = 2;
      },
      "N = 3 > num_slots = 2");
  expect_rejected([](Problem& p) { p.T = 3; }, "must equal T = 3");
  expect_rejected([](Problem& p) { p.T = 5; }, "decode takes one token", /*decode=*/true);
  expect_rejected(
      [](Problem& p) {
        p.T = 3;
        p.indices = {1, 1, -1};
      },
      "slot 1 is named", /*decode=*/true);
  // Exactly one input, x or x_bf16, and one output, y or y_bf16, extend and decode.
  for (const bool decode : {false, true}) {
    auto as_decode = [decode](Problem& p) {
      if (decode) p.T = p.N;
    };
    expect_rejected(as_decode, "x and x_bf16 are both set", decode,
                    [&](ShortConvArgs<float>& a) { a.x_bf16 = xb.data(); });
    expect_rejected(as_decode, "x and x_bf16 are both null", decode,
                    [](ShortConvArgs<float>& a) { a.x = nullptr; });
    expect_rejected(as_decode, "weight must not be null", decode,
                    [](ShortConvArgs<float>& a) { a.weight = nullptr; });
    expect_rejected(as_decode, "y and y_bf16 are both set", decode,
                    [&](ShortConvArgs<float>& a) { a.y_bf16 = yb.data(); });
    expect_rejected(as_decode, "y and y_bf16 are both null", decode,
                    [](ShortConvArgs<float>& a) { a.y = nullptr; });
    // bf16 input, so its validation is the same.
    expect_rejected(as_decode, "y and y_bf16 are both null", decode, [&](ShortConvArgs<float>& a) {
      a.x = nullptr;
      a.x_bf16 = xb.data();
      a.y = nullptr;
    });
  }
}

// W = 1 with unit weights is silu itself: checks it over the whole range, the saturated ends included.
TEST(ShortConv, SiluAccurateOverWideRange) {
  Problem p;
  p.W = 1;
  p.T = 4;
  p.C = 50001;
  p.x_stride = p.C;
  p.cu = {0, 4};
  p.w.assign(p.C, 1.0f);
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t c = 0; c < p.C; ++c) p.x.push_back(-100.0f + 200.0f * c / (p.C - 1) + 1e-3f * t);
  }
  const std::vector<float> expect = reference<float>(p, nullptr);
  std::vector<float> y(p.T * p.C);
  short_conv_extend(args_of<float>(p, nullptr, y.data()));
  EXPECT_LE(max_error_ratio(y.data(), expect.data(), y.size(), 1e-6, 1e-6), 1.0);
  // Relative accuracy where the output is not negligible (a few ulp).
  for (size_t i = 0; i < y.size(); ++i) {
    if (std::fabs(expect[i]) > 1e-20f) {
      ASSERT_LE(std::fabs(y[i] - expect[i]), 4e-7f * std::fabs(expect[i])) << i;
    }
  }
}

TEST(ShortConv, EmptyBatchAndEmptySegmentsOnly) {
  Problem p = make_problem({0, 0}, 8, 4, 8, 61);
  p.num_slots = 2;
  std::vector<float> pool = random_pool<float>(2 * 3 * 8, 62);
  const std::vector<float> before = pool;
  short_conv_extend(args_of(p, pool.data(), static_cast<float*>(nullptr)));
  EXPECT_TRUE(same_bits(pool, before));  // a zero-length segment leaves its slot as it is
}

}  // namespace
}  // namespace kda::kernels
