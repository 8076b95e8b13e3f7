// int4 weights against bf16 activations on AMX-BF16 tiles (gemm_int4_amx_bf16, quant_amx.h; QuantLinear's
// amx bf16 path): calls of at most 16 rows give the dpbf16 scheme's value (gemm_int4_dpbf16_reference)
// within the fp32 rounding of its group sums, with a channel tail in the dpbf16 kernel's bits; calls of
// more rows the widened scheme's (gemm_int4_widened_reference) within the fp32 rounding of its sums, every
// channel included; both at the model's widths and odd ones, row counts across the kernel's chunks of rows
// and its passes of two channel blocks and two row blocks; a row's bits independent of the rows beside it
// within each scheme; outputs past `out` untouched; bad arguments refused before anything is written.
// Skipped where the CPU lacks AMX-BF16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/quant_amx.h"
#include "kda/kernels/gemm/quant_dpbf16.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/weight_format.h"
#include "support/gemm_check.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace qg = kernels::gemm;
using testing::expect_throw_with;
using testing::random_normal;

qg::Int4Weights int4_of(const qg::PackedMatrix& p) {
  const qg::PackedWeights v = p.view();
  return {static_cast<const uint8_t*>(v.data), v.scale, v.in, v.out};
}

std::vector<bf16_t> bf16_rows(int64_t M, int64_t ld, uint64_t seed) {
  const std::vector<float> x = random_normal(static_cast<size_t>(M * ld), seed);
  std::vector<bf16_t> xb(x.size());
  f32_to_bf16_array(x.data(), xb.data(), xb.size());
  return xb;
}

// The absolute products' sum of row m of x against channel n of W (wd: W as fp32 [out, in]).
double magnitude(const std::vector<bf16_t>& x, int64_t ldx, int64_t m, const std::vector<float>& wd,
                 int64_t in, int64_t n) {
  double mag = 0.0;
  for (int64_t k = 0; k < in; ++k)
    mag += std::fabs(static_cast<double>(bf16_to_f32(x[m * ldx + k])) * wd[n * in + k]);
  return mag;
}

// A call's shape: W [out, in], M rows.
struct GemmCase {
  int64_t in, out, M;
  std::string name() const {
    return std::to_string(in) + "x" + std::to_string(out) + " M=" + std::to_string(M);
  }
  // Random weights of this shape in `fmt`, weight `outlier` a thousand times the others: the rest of its
  // group (int4) or channel (int8) quantize near zero.
  qg::PackedMatrix weights(Weights fmt, uint64_t seed, int64_t outlier) const {
    std::vector<float> w = random_normal(static_cast<size_t>(in * out), seed + in, 0.05f);
    w[outlier] *= 1e3f;
    return qg::PackedMatrix(fmt, w.data(), in, out);
  }
};

// A row's bits whatever the rows beside it: rows [m0, m0 + k) of a call of M rows (its output y) called
// alone, from the first, middle and last row, k up to each of `counts` where same_scheme(k).
template <class W, class Gemm, class Same>
void expect_rows_keep_their_bits(Gemm gemm, const W& w, const std::vector<bf16_t>& x, int64_t ldx, int64_t M,
                                 const std::vector<float>& y, int64_t ldy, const std::vector<int64_t>& counts,
                                 Same same_scheme, const std::string& what) {
  for (int64_t m0 : {int64_t{0}, M / 2, M - 1})
    for (int64_t most : counts) {
      const int64_t k = std::min<int64_t>(M - m0, most);
      if (!same_scheme(k)) continue;
      std::vector<float> part(static_cast<size_t>(k * ldy));
      gemm(x.data() + m0 * ldx, k, ldx, w, part.data(), ldy);
      int diff = 0;
      for (int64_t i = 0; i < k; ++i)
        for (int64_t n = 0; n < w.out; ++n) diff += part[i * ldy + n] != y[(m0 + i) * ldy + n];
      EXPECT_EQ(diff, 0) << what << " rows from " << m0 << ", " << k << " at a time";
    }
}

TEST(QuantAmxBf16, Int4IsTheDpbf16SchemeUpTo16RowsAndTheWidenedOneAbove) {
  if (!qg::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 on this CPU or in this build";
  // The model's input widths (2304, the expert's down 1024), channels in a multiple of 16, of 32 (whole
  // passes of two blocks) or with a tail past the last whole block, one group, fewer channels than a
  // block; rows across the 256-row chunks, an odd number of row blocks, and calls of one row block (at
  // most 16 rows: the dpbf16 scheme, the weights streamed).
  const GemmCase cases[] = {{2304, 256, 64}, {1024, 272, 300}, {2304, 48, 517}, {96, 37, 17},
                            {32, 16, 1},     {160, 15, 40},    {128, 260, 256}, {64, 33, 257},
                            {2304, 80, 16},  {1024, 50, 5},    {64, 32, 9},     {64, 7, 33}};
  for (const GemmCase& c : cases) {
    const std::string what = c.name();
    const qg::PackedMatrix p = c.weights(Weights::Int4, 50, 0);
    const qg::Int4Weights w = int4_of(p);
    const int64_t ldx = c.in + 16, ldy = c.out + 5, G = c.in / qg::kInt4Group;
    const bool widened = c.M > 16;
    const std::vector<bf16_t> x = bf16_rows(c.M, ldx, 60 + c.M);
    std::vector<float> y(static_cast<size_t>(c.M * ldy), 3.0f), ref(static_cast<size_t>(c.M * c.out));
    qg::gemm_int4_amx_bf16(x.data(), c.M, ldx, w, y.data(), ldy);
    if (widened)
      qg::gemm_int4_widened_reference(x.data(), c.M, ldx, w, ref.data(), c.out);
    else
      qg::gemm_int4_dpbf16_reference(x.data(), c.M, ldx, w, ref.data(), c.out);
    const std::vector<float> wd = qg::dequantize(p.view());
    const int64_t whole = widened ? c.out : c.out / 16 * 16;
    int bad = 0, tail_bad = 0, past = 0;
    for (int64_t m = 0; m < c.M; ++m) {
      for (int64_t n = 0; n < c.out; ++n) {
        const float got = y[m * ldy + n], want = ref[m * c.out + n];
        if (n >= whole) {  // the channel tail of a dpbf16 call: gemm_int4_dpbf16, its reference's bits
          tail_bad += got != want;
          continue;
        }
        // dpbf16: each group sum rounded in fp32 over at most 32 terms on both sides, and the totals' FMAs
        // round again per group: (64 + 2 G) units of 2^-24 of the absolute products' sum. Widened: one fp32
        // sum over all the inputs on both sides, 2 in units (the widened weights' magnitudes are the
        // scheme's within 2^-8).
        const double units = widened ? 2.0 * c.in : 64.0 + 2.0 * G;
        const double bound = units * std::ldexp(1.01 * magnitude(x, ldx, m, wd, c.in, n), -24) + 1e-30;
        bad += !(std::fabs(static_cast<double>(got) - want) <= bound);
      }
      for (int64_t n = c.out; n < ldy; ++n) past += y[m * ldy + n] != 3.0f;
    }
    EXPECT_EQ(bad, 0) << what;
    EXPECT_EQ(tail_bad, 0) << what;
    EXPECT_EQ(past, 0) << what;
    // A row's bits whatever the rows beside it: rows [m0, m0 + k) of the call above, called alone in calls
    // of the same scheme (at most 16 rows, streamed; or more, in one or two row blocks a pass).
    expect_rows_keep_their_bits(
        qg::gemm_int4_amx_bf16, w, x, ldx, c.M, y, ldy,
        widened ? std::vector<int64_t>{17, 33, 48} : std::vector<int64_t>{16, 5, 1},
        [&](int64_t k) { return widened == (k > 16); }, what);
  }
}

// The widened weight is the bf16 of the fp32 product, rounded to nearest even, tiny products flushed:
// the values the kernel's vcvtneps2bf16 gives.
TEST(QuantAmxBf16, TheWidenedWeightIsTheBf16OfItsProduct) {
  EXPECT_EQ(qg::int4_widened(0.0f), f32_to_bf16(0.0f));
  EXPECT_EQ(qg::int4_widened(-3.5f), f32_to_bf16(-3.5f));
  // bf16's unit at 3 is 2^-6, at 1 2^-7.
  EXPECT_EQ(bf16_to_f32(qg::int4_widened(3.0f + 0.75f * std::ldexp(1.0f, -6))), 3.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(bf16_to_f32(qg::int4_widened(1.0f + std::ldexp(1.0f, -8))), 1.0f);  // half a unit: to even
  EXPECT_EQ(bf16_to_f32(qg::int4_widened(3.0f + 1.5f * std::ldexp(1.0f, -6))), 3.0f + std::ldexp(1.0f, -5));
  const float tiny = std::ldexp(1.0f, -128);  // below the normal range
  EXPECT_EQ(qg::int4_widened(tiny), f32_to_bf16(0.0f));
  EXPECT_EQ(qg::int4_widened(-tiny), f32_to_bf16(-0.0f));
  EXPECT_EQ(bf16_to_f32(qg::int4_widened(std::ldexp(1.0f, -126))), std::ldexp(1.0f, -126));
}

// The kernel widens every weight to int4_widened's value, bit for bit: rows of x that pick one input each
// (a call of 64 rows, the widened scheme) give W's widened columns exactly. Channel 0's first group has
// the scale 1 + 2^-8, whose products land on ties and between bf16 values; channel 1's first group
// a scale below the normal range (every product flushed); the rest random.
TEST(QuantAmxBf16, TheKernelWidensEachWeightAsInt4Widened) {
  if (!qg::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 on this CPU or in this build";
  const int64_t in = 64, out = 40;  // two passes of two blocks, the last block short
  std::vector<float> wsrc = random_normal(static_cast<size_t>(in * out), 71, 0.05f);
  for (int64_t k = 0; k < 32; ++k) {
    wsrc[k] = static_cast<float>(k % 15 - 7) * (1.0f + std::ldexp(1.0f, -8));
    wsrc[in + k] = static_cast<float>(k % 15 - 7) * std::ldexp(1.0f, -140);
  }
  const qg::PackedMatrix p(Weights::Int4, wsrc.data(), in, out);
  const qg::Int4Weights w = int4_of(p);
  ASSERT_EQ(w.scale[0], 1.0f + std::ldexp(1.0f, -8));
  const std::vector<float> wd = qg::dequantize(p.view());
  std::vector<bf16_t> x(static_cast<size_t>(in * in), f32_to_bf16(0.0f));
  for (int64_t m = 0; m < in; ++m) x[m * in + m] = f32_to_bf16(1.0f);
  std::vector<float> y(static_cast<size_t>(in * out));
  qg::gemm_int4_amx_bf16(x.data(), in, in, w, y.data(), out);
  int bad = 0;
  for (int64_t m = 0; m < in; ++m)
    for (int64_t n = 0; n < out; ++n) bad += y[m * out + n] != bf16_to_f32(qg::int4_widened(wd[n * in + m]));
  EXPECT_EQ(bad, 0);
}

// int8 weights on the same widened tiles (gemm_int8_amx_bf16): the dpbf16 scheme's value (q exact in bf16,
// the channel scale on the sum) within the fp32 rounding of the sums, at the model's widths and odd ones,
// rows across the chunks and the passes, a short last channel block; a row's bits independent of the rows
// beside it; outputs past `out` untouched.
TEST(QuantAmxBf16, Int8IsTheDpbf16SchemeWithinItsSumsRounding) {
  if (!qg::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 on this CPU or in this build";
  const GemmCase cases[] = {{2304, 256, 64}, {1024, 272, 300}, {2304, 48, 517}, {96, 37, 17},
                            {32, 16, 1},     {160, 15, 40},    {64, 33, 257},   {1024, 50, 5}};
  for (const GemmCase& c : cases) {
    const std::string what = c.name();
    const qg::PackedMatrix p = c.weights(Weights::Int8, 80, 3);
    const qg::PackedWeights v = p.view();
    const qg::Int8Weights w{static_cast<const int8_t*>(v.data), v.scale, v.in, v.out};
    const int64_t ldx = c.in + 16, ldy = c.out + 5;
    const std::vector<bf16_t> x = bf16_rows(c.M, ldx, 90 + c.M);
    std::vector<float> y(static_cast<size_t>(c.M * ldy), 3.0f), ref(static_cast<size_t>(c.M * c.out));
    qg::gemm_int8_amx_bf16(x.data(), c.M, ldx, w, y.data(), ldy);
    qg::gemm_int8_dpbf16_reference(x.data(), c.M, ldx, w, ref.data(), c.out);
    // One fp32 sum over all the inputs on both sides (in units of 2^-24 each), then the scale.
    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_f32(x[i]);
    testing::expect_close_fp32(xf, ldx, qg::dequantize(v), c.M, c.in, c.out, y.data(), ldy, ref.data(), c.out,
                               what);
    int past = 0;
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = c.out; n < ldy; ++n) past += y[m * ldy + n] != 3.0f;
    EXPECT_EQ(past, 0) << what;
    expect_rows_keep_their_bits(
        qg::gemm_int8_amx_bf16, w, x, ldx, c.M, y, ldy, {1, 17, 33}, [](int64_t) { return true; }, what);
  }
}

// One AMX entry point's argument checks (w: 64 inputs by 20 channels): every bad call refused, naming what
// is wrong, before anything is written; a call of no rows reads and writes nothing.
template <class W, class Gemm>
void expect_bad_arguments_refused(Gemm gemm, const W& w) {
  const std::vector<bf16_t> x = bf16_rows(4, 64, 4);
  std::vector<float> y(4 * 20, 7.0f);
  if (!qg::cpu_has_amx_bf16()) {
    EXPECT_THROW(gemm(x.data(), 4, 64, w, y.data(), 20), std::logic_error);
  } else {
    W odd = w;
    odd.in = 48;
    expect_throw_with<std::invalid_argument>([&] { gemm(x.data(), 4, 64, odd, y.data(), 20); },
                                             "a positive multiple of 32");
    expect_throw_with<std::invalid_argument>([&] { gemm(x.data(), 4, 63, w, y.data(), 20); }, "row stride");
    expect_throw_with<std::invalid_argument>([&] { gemm(x.data(), 4, 64, w, y.data(), 19); }, "row stride");
    expect_throw_with<std::invalid_argument>([&] { gemm(nullptr, 4, 64, w, y.data(), 20); }, "null data");
    expect_throw_with<std::invalid_argument>([&] { gemm(x.data(), -1, 64, w, y.data(), 20); }, "bad sizes");
    gemm(nullptr, 0, 64, w, nullptr, 20);  // no rows: nothing read or written
  }
  EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float v) { return v == 7.0f; }));
}

TEST(QuantAmxBf16, BadArgumentsAreRefusedBeforeAnythingIsWritten) {
  const std::vector<float> wsrc = random_normal(64 * 20, 3, 0.05f);
  const qg::PackedMatrix p4(Weights::Int4, wsrc.data(), 64, 20), p8(Weights::Int8, wsrc.data(), 64, 20);
  expect_bad_arguments_refused(qg::gemm_int4_amx_bf16, int4_of(p4));
  expect_bad_arguments_refused(
      qg::gemm_int8_amx_bf16,
      qg::Int8Weights{static_cast<const int8_t*>(p8.view().data), p8.view().scale, 64, 20});
}

}  // namespace
}  // namespace kda
