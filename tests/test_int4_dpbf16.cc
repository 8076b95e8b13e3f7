// The int4 prefill GEMM on AVX512_BF16 (kernels/gemm/int4_dpbf16.h): bit for bit its reference on random
// shapes (row counts across a group of rows and a pass over the panels, channel counts with and without a
// whole last panel, the model's input widths, strided rows), NaN groups, and the checks before writing.
// tests/test_quant_prefill.cc holds the QuantLinear path that uses it to the scheme in double.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/int4_dpbf16.h"
#include "kda/kernels/gemm/weight_format.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace kg = kernels::gemm;

#define SKIP_WITHOUT_BF16() \
  if (!kg::cpu_has_int4_dpbf16()) GTEST_SKIP() << "this CPU (or build) has no AVX512_BF16"

kg::Int4Weights view_of(const kg::PackedMatrix& p) {
  const kg::PackedWeights v = p.view();
  return kg::Int4Weights{static_cast<const uint8_t*>(v.data), v.scale, v.in, v.out};
}

TEST(Int4Dpbf16, EqualsItsReferenceBitForBit) {
  SKIP_WITHOUT_BF16();
  struct Case {
    int64_t M, in, out;
  };
  const Case cases[] = {{1, 32, 1},      {5, 64, 17},     {6, 96, 32},    {7, 1024, 33},   {13, 2304, 64},
                        {65, 1024, 100}, {130, 2304, 48}, {193, 128, 31}, {400, 256, 130}, {12, 9216, 40}};
  uint64_t seed = 10;
  for (const Case& c : cases)
    for (const int64_t pad : {int64_t{0}, int64_t{3}}) {
      const int64_t ldx = c.in + pad, ldy = c.out + pad;
      std::vector<float> wf = testing::random_normal(static_cast<size_t>(c.in * c.out), ++seed, 0.05f);
      wf[0] *= 1e4f;  // an outlier: the rest of its group quantizes near zero
      const kg::PackedMatrix p(Weights::Int4, wf.data(), c.in, c.out);
      const kg::Int4Weights w = view_of(p);
      const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(c.M * ldx), ++seed);
      std::vector<float> want(static_cast<size_t>(c.M * ldy), -7.0f), y = want;
      kg::gemm_int4_dpbf16_reference(x.data(), c.M, ldx, w, want.data(), ldy);
      kg::gemm_int4_dpbf16(x.data(), c.M, ldx, w, y.data(), ldy);
      const std::string at = "M " + std::to_string(c.M) + " in " + std::to_string(c.in) + " out " +
                             std::to_string(c.out) + " pad " + std::to_string(pad);
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
TEST(Int4Dpbf16, TheReferenceIsTheSchemeInDouble) {
  const int64_t M = 3, in = 256, out = 5;
  const std::vector<float> wf = testing::random_normal(static_cast<size_t>(in * out), 3, 0.05f);
  const kg::PackedMatrix p(Weights::Int4, wf.data(), in, out);
  const std::vector<float> wd = kg::dequantize(p.view());
  const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(M * in), 4);
  std::vector<float> y(static_cast<size_t>(M * out));
  kg::gemm_int4_dpbf16_reference(x.data(), M, in, view_of(p), y.data(), out);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < out; ++n) {
      double ref = 0.0, mag = 0.0;
      for (int64_t k = 0; k < in; ++k) {
        const double t = static_cast<double>(bf16_to_f32(x[m * in + k])) * wd[n * in + k];
        ref += t;
        mag += std::fabs(t);
      }
      EXPECT_LE(std::fabs(y[m * out + n] - ref), 64 * 0x1p-24 * mag) << m << " " << n;
    }
}

// A group holding a NaN quantizes to scale NaN: its channel's outputs are NaN, the others as without it.
TEST(Int4Dpbf16, ANaNGroupGivesNaNOutputsInItsChannelOnly) {
  SKIP_WITHOUT_BF16();
  const int64_t M = 9, in = 128, out = 40;
  std::vector<float> wf = testing::random_normal(static_cast<size_t>(in * out), 5, 0.05f);
  const kg::PackedMatrix clean(Weights::Int4, wf.data(), in, out);
  wf[37 * in + 70] = std::numeric_limits<float>::quiet_NaN();
  const kg::PackedMatrix p(Weights::Int4, wf.data(), in, out);
  const std::vector<bf16_t> x = testing::random_bf16(static_cast<size_t>(M * in), 6);
  std::vector<float> y(static_cast<size_t>(M * out)), yc(y.size());
  kg::gemm_int4_dpbf16(x.data(), M, in, view_of(p), y.data(), out);
  kg::gemm_int4_dpbf16(x.data(), M, in, view_of(clean), yc.data(), out);
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < out; ++n)
      if (n == 37 ? !std::isnan(y[m * out + n]) : y[m * out + n] != yc[m * out + n]) ++bad;
  EXPECT_EQ(bad, 0);
}

TEST(Int4Dpbf16, RefusesBadArgumentsBeforeWriting) {
  SKIP_WITHOUT_BF16();
  const std::vector<float> wf = testing::random_normal(64 * 8, 7, 0.05f);
  const kg::PackedMatrix p(Weights::Int4, wf.data(), 64, 8);
  const kg::Int4Weights w = view_of(p);
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
  for (float v : y) EXPECT_EQ(v, 3.0f);
}

}  // namespace
}  // namespace kda
