// The one-thread fp32 block GEMM (kernels/gemm/f32_block.h) that MLA's flash prefill runs per block:
// against its reference on random shapes (row counts across its 6-row tiles, column counts across its
// 32-column strips and their masked tails, K from 0, strided rows), alpha and beta as the attention uses
// them, a C that beta == 0 never reads, the leading dimensions it hands out, and the checks before writing.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/kernels/gemm/f32_block.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace kg = kernels::gemm;
using testing::random_normal;

struct Shape {
  int64_t M, N, K, pad;  // pad: extra floats in each row stride
  float alpha, beta;
};

// Both on the same inputs; each value within a few fp32 roundings of its sum of |products| (the two sum
// in the same order, the kernel may fuse each multiply-add).
void compare(const Shape& s, uint64_t seed) {
  const int64_t lda = s.K + s.pad, ldb = s.N + s.pad, ldc = s.N + 2 * s.pad;
  const std::vector<float> A = random_normal(static_cast<size_t>(std::max<int64_t>(s.M * lda, 1)), seed);
  const std::vector<float> B = random_normal(static_cast<size_t>(std::max<int64_t>(s.K * ldb, 1)), seed + 1);
  std::vector<float> C = random_normal(static_cast<size_t>(std::max<int64_t>(s.M * ldc, 1)), seed + 2);
  if (s.beta == 0.0f)  // never read: NaN would show
    for (int64_t i = 0; i < s.M; ++i)
      for (int64_t j = 0; j < s.N; ++j) C[i * ldc + j] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> got = C, want = C;
  kg::gemm_f32_block(s.M, s.N, s.K, s.alpha, A.data(), lda, B.data(), ldb, s.beta, got.data(), ldc);
  kg::gemm_f32_block_reference(s.M, s.N, s.K, s.alpha, A.data(), lda, B.data(), ldb, s.beta, want.data(),
                               ldc);
  int bad = 0;
  for (int64_t i = 0; i < s.M; ++i)
    for (int64_t j = 0; j < ldc; ++j) {
      const float g = got[i * ldc + j], w = want[i * ldc + j];
      if (j >= s.N) {  // beyond the row: untouched
        if (!(g == C[i * ldc + j])) ++bad;
        continue;
      }
      double mag = 0.0;
      for (int64_t p = 0; p < s.K; ++p) mag += std::fabs(A[i * lda + p] * B[p * ldb + j]);
      const double old = s.beta == 0.0f ? 0.0 : std::fabs(s.beta * C[i * ldc + j]);
      const double tol = 4e-7 * static_cast<double>(s.K + 2) * (std::fabs(s.alpha) * mag + old) + 1e-30;
      if (!(std::fabs(static_cast<double>(g) - w) <= tol)) ++bad;
    }
  EXPECT_EQ(bad, 0) << "M " << s.M << " N " << s.N << " K " << s.K << " pad " << s.pad << " beta " << s.beta;
}

TEST(F32Block, EqualsTheReferenceOnManyShapes) {
  const std::vector<Shape> shapes{
      {64, 256, 128, 0, 0.0722f, 0.0f},  // MLA's scores (nope), a whole block
      {64, 256, 64, 16, 0.0722f, 1.0f},  // the rope part added
      {64, 128, 256, 16, 1.0f, 1.0f},    // the values, into the running output
      {1, 1, 1, 0, 1.0f, 0.0f},         {5, 17, 3, 3, 1.0f, 1.0f},    {6, 32, 7, 0, -2.0f, 0.5f},
      {7, 33, 40, 1, 1.0f, 0.0f},       {13, 47, 129, 5, 0.5f, 1.0f}, {37, 250, 192, 7, 0.07f, 0.0f},
      {64, 31, 300, 2, 1.0f, 1.0f},     {2, 64, 0, 0, 1.0f, 1.0f},    {3, 16, 0, 4, 1.0f, 0.0f},
      {12, 96, 65, 0, 1.0f, -1.0f},     {61, 200, 1, 9, 3.0f, 0.0f},
  };
  uint64_t seed = 100;
  for (const Shape& s : shapes) compare(s, seed += 3);
}

TEST(F32Block, EmptyProductsWriteNothing) {
  std::vector<float> C(8, 5.0f);
  const float a = 1.0f, b = 2.0f;
  kg::gemm_f32_block(0, 4, 3, 1.0f, &a, 3, &b, 4, 0.0f, C.data(), 4);
  kg::gemm_f32_block(2, 0, 3, 1.0f, &a, 3, &b, 0, 0.0f, C.data(), 4);
  for (float c : C) EXPECT_EQ(c, 5.0f);
}

TEST(F32Block, LeadingDimensionsAreAnOddNumberOfCacheLines) {
  for (int64_t n : {1, 15, 16, 17, 128, 256, 1000, 1024, 2048, 4096, 5000}) {
    const int64_t ld = kg::f32_block_ld(n);
    EXPECT_GE(ld, n);
    EXPECT_EQ(ld % 16, 0) << n;
    EXPECT_EQ((ld / 16) % 2, 1) << n;
    EXPECT_LE(ld, n + 32) << n;
  }
}

TEST(F32Block, BadArgumentsAreRefusedBeforeWriting) {
  std::vector<float> A(64, 1.0f), B(64, 1.0f), C(64, 7.0f);
  for (auto gemm : {kg::gemm_f32_block, kg::gemm_f32_block_reference}) {
    EXPECT_THROW(gemm(-1, 4, 4, 1.0f, A.data(), 4, B.data(), 4, 0.0f, C.data(), 4), std::invalid_argument);
    EXPECT_THROW(gemm(2, 4, 4, 1.0f, A.data(), 3, B.data(), 4, 0.0f, C.data(), 4), std::invalid_argument);
    EXPECT_THROW(gemm(2, 4, 4, 1.0f, A.data(), 4, B.data(), 3, 0.0f, C.data(), 4), std::invalid_argument);
    EXPECT_THROW(gemm(2, 4, 4, 1.0f, A.data(), 4, B.data(), 4, 0.0f, C.data(), 3), std::invalid_argument);
    EXPECT_THROW(gemm(2, 4, 4, 1.0f, nullptr, 4, B.data(), 4, 0.0f, C.data(), 4), std::invalid_argument);
    EXPECT_THROW(gemm(2, 4, 4, 1.0f, A.data(), 4, nullptr, 4, 0.0f, C.data(), 4), std::invalid_argument);
    EXPECT_THROW(gemm(2, 4, 4, 1.0f, A.data(), 4, B.data(), 4, 0.0f, nullptr, 4), std::invalid_argument);
    for (float c : C) EXPECT_EQ(c, 7.0f);
  }
}

}  // namespace
}  // namespace kda
