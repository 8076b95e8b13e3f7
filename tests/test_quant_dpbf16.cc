// The quantized GEMMs on AVX512_BF16 (kernels/gemm/quant_dpbf16.h), int8 and int4: bit for bit their
// references on random shapes (row counts across a group of rows, a pass over the panels and int4's
// streamed calls of at most 16 rows, channel counts with and without a whole last panel, the model's input
// widths, strided rows), the references against the scheme in double, NaN channels and groups, and the
// checks before writing. tests/test_quant_prefill.cc and test_quant_gemm.cc hold the QuantLinear path
// that uses them to the scheme in double.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/quant_dpbf16.h"
#include "kda/kernels/gemm/weight_format.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace kg = kernels::gemm;

#define SKIP_WITHOUT_BF16() \
  if (!kg::cpu_has_quant_dpbf16()) GTEST_SKIP() << "this CPU (or build) has no AVX512_BF16"

// The packed weights as each format's kernels take them, and the kernel and reference of the format.
template <class W, Weights F, auto Gemm, auto Reference>
struct Format {
  static constexpr Weights kFormat = F;
  static W view(const kg::PackedMatrix& p) {
    const kg::PackedWeights v = p.view();
    return W{static_cast<decltype(W::q)>(v.data), v.scale, v.in, v.out};
  }
  static void gemm(const bf16_t* x, int64_t M, int64_t ldx, const kg::PackedMatrix& p, float* y,
                   int64_t ldy) {
    Gemm(x, M, ldx, view(p), y, ldy);
  }
  static void reference(const bf16_t* x, int64_t M, int64_t ldx, const kg::PackedMatrix& p, float* y,
                        int64_t ldy) {
    Reference(x, M, ldx, view(p), y, ldy);
  }
};
using Int8 = Format<kg::Int8Weights, Weights::Int8, kg::gemm_int8_dpbf16, kg::gemm_int8_dpbf16_reference>;
using Int4 = Format<kg::Int4Weights, Weights::Int4, kg::gemm_int4_dpbf16, kg::gemm_int4_dpbf16_reference>;

template <class F>
void equalsItsReferenceBitForBit() {
  SKIP_WITHOUT_BF16();
  struct Case {
    int64_t M, in, out;
  };
  // int4 takes calls of at most 16 rows without a panel (each row count its own copy): 1, 5-7, 9, 12, 13, 16
  // of them below, channel counts that end a block of 16 and that do not.
  const Case cases[] = {{1, 32, 1},      {5, 64, 17},     {6, 96, 32},    {7, 1024, 33},   {13, 2304, 64},
                        {65, 1024, 100}, {130, 2304, 48}, {193, 128, 31}, {400, 256, 130}, {12, 9216, 40},
                        {16, 2304, 47},  {9, 1024, 16},   {17, 64, 20}};
  uint64_t seed = 10;
  for (const Case& c : cases)
    for (const int64_t pad : {int64_t{0}, int64_t{3}}) {
      const int64_t ldx = c.in + pad, ldy = c.out + pad;
      std::vector<float> wf = testing::random_normal(static_cast<size_t>(c.in * c.out), ++seed, 0.05f);
      wf[0] *= 1e4f;  // an outlier: the rest of its channel (int8) or group (int4) quantizes near zero
      const kg::PackedMatrix p(F::kFormat, wf.data(), c.in, c.out);
      const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(c.M * ldx), ++seed);
      std::vector<float> want(static_cast<size_t>(c.M * ldy), -7.0f), y = want;
      F::reference(x.data(), c.M, ldx, p, want.data(), ldy);
      F::gemm(x.data(), c.M, ldx, p, y.data(), ldy);
      const std::string at = std::string(to_string(F::kFormat)) + " M " + std::to_string(c.M) + " in " +
                             std::to_string(c.in) + " out " + std::to_string(c.out) + " pad " +
                             std::to_string(pad);
      int64_t bad = 0;
      for (int64_t m = 0; m < c.M; ++m) {
        for (int64_t n = 0; n < c.out; ++n)
          if (std::memcmp(&y[m * ldy + n], &want[m * ldy + n], sizeof(float)) != 0) ++bad;
        for (int64_t n = c.out; n < ldy; ++n) ASSERT_EQ(y[m * ldy + n], -7.0f) << at;  // the gap untouched
      }
      EXPECT_EQ(bad, 0) << at;
    }
}

// The reference is the scheme: within fp32 summation rounding of x W^T in double, W dequantized.
template <class F>
void theReferenceIsTheSchemeInDouble() {
  const int64_t M = 3, in = 256, out = 5;
  const std::vector<float> wf = testing::random_normal(static_cast<size_t>(in * out), 3, 0.05f);
  const kg::PackedMatrix p(F::kFormat, wf.data(), in, out);
  const std::vector<float> wd = kg::dequantize(p.view());
  const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(M * in), 4);
  std::vector<float> y(static_cast<size_t>(M * out));
  F::reference(x.data(), M, in, p, y.data(), out);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < out; ++n) {
      double ref = 0.0, mag = 0.0;
      for (int64_t k = 0; k < in; ++k) {
        const double t = static_cast<double>(bf16_to_f32(x[m * in + k])) * wd[n * in + k];
        ref += t;
        mag += std::fabs(t);
      }
      EXPECT_LE(std::fabs(y[m * out + n] - ref), 256 * 0x1p-24 * mag) << m << " " << n;
    }
}

// A weight NaN quantizes to scale NaN (int8: its channel's, int4: its group's): its channel's outputs are
// NaN, the others as without it.
template <class F>
void aNaNWeightGivesNaNOutputsInItsChannelOnly() {
  SKIP_WITHOUT_BF16();
  const int64_t M = 9, in = 128, out = 40;
  std::vector<float> wf = testing::random_normal(static_cast<size_t>(in * out), 5, 0.05f);
  const kg::PackedMatrix clean(F::kFormat, wf.data(), in, out);
  wf[37 * in + 70] = std::numeric_limits<float>::quiet_NaN();
  const kg::PackedMatrix p(F::kFormat, wf.data(), in, out);
  const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(M * in), 6);
  std::vector<float> y(static_cast<size_t>(M * out)), yc(y.size());
  F::gemm(x.data(), M, in, p, y.data(), out);
  F::gemm(x.data(), M, in, clean, yc.data(), out);
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < out; ++n)
      if (n == 37 ? !std::isnan(y[m * out + n]) : y[m * out + n] != yc[m * out + n]) ++bad;
  EXPECT_EQ(bad, 0);
}

TEST(QuantDpbf16, EqualsItsReferenceBitForBitInt8) { equalsItsReferenceBitForBit<Int8>(); }
TEST(QuantDpbf16, EqualsItsReferenceBitForBitInt4) { equalsItsReferenceBitForBit<Int4>(); }
TEST(QuantDpbf16, TheReferenceIsTheSchemeInDoubleInt8) { theReferenceIsTheSchemeInDouble<Int8>(); }
TEST(QuantDpbf16, TheReferenceIsTheSchemeInDoubleInt4) { theReferenceIsTheSchemeInDouble<Int4>(); }
TEST(QuantDpbf16, ANaNWeightGivesNaNOutputsInItsChannelOnlyInt8) {
  aNaNWeightGivesNaNOutputsInItsChannelOnly<Int8>();
}
TEST(QuantDpbf16, ANaNWeightGivesNaNOutputsInItsChannelOnlyInt4) {
  aNaNWeightGivesNaNOutputsInItsChannelOnly<Int4>();
}

TEST(QuantDpbf16, RefusesBadArgumentsBeforeWriting) {
  SKIP_WITHOUT_BF16();
  const std::vector<float> wf = testing::random_normal(64 * 8, 7, 0.05f);
  const kg::PackedMatrix p(Weights::Int4, wf.data(), 64, 8);
  const kg::Int4Weights w = Int4::view(p);
  const std::vector<bf16_t> x(2 * 64, bf16_t{0});
  std::vector<float> y(16, 3.0f);
  kg::Int4Weights odd = w;
  odd.in = 48;
  testing::expect_throw_with<std::invalid_argument>(
      [&] { kg::gemm_int4_dpbf16(x.data(), 1, 64, odd, y.data(), 8); }, "a positive multiple of 32");
  testing::expect_throw_with<std::invalid_argument>(
      [&] { kg::gemm_int4_dpbf16(x.data(), 1, 63, w, y.data(), 8); }, "row stride");
  testing::expect_throw_with<std::invalid_argument>(
      [&] { kg::gemm_int4_dpbf16(x.data(), 2, 64, w, y.data(), 7); }, "row stride");
  testing::expect_throw_with<std::invalid_argument>(
      [&] { kg::gemm_int4_dpbf16(x.data(), -1, 64, w, y.data(), 8); }, "bad sizes");
  testing::expect_throw_with<std::invalid_argument>(
      [&] { kg::gemm_int4_dpbf16(nullptr, 1, 64, w, y.data(), 8); }, "null data");
  const kg::PackedMatrix p8(Weights::Int8, wf.data(), 64, 8);
  kg::Int8Weights w8 = Int8::view(p8);
  w8.in = 40;
  testing::expect_throw_with<std::invalid_argument>(
      [&] { kg::gemm_int8_dpbf16(x.data(), 1, 64, w8, y.data(), 8); }, "a positive multiple of 32");
  for (float v : y) EXPECT_EQ(v, 3.0f);
}

}  // namespace
}  // namespace kda
