// The bf16 GEMM on AMX-BF16 tiles (kernels/gemm/bf16_amx.h), called directly at every decode row count
// 1..64 (and past one pass of 64) on the LM head's widths and on odd shapes (channel counts past whole
// blocks of 16, odd multiples of 32 inputs, strided rows): within fp32 summation rounding of the
// reference; a row's bits independent of the rows beside it; NaN activations and weights confined to
// their row and channel; the padding columns of y left alone; bad arguments refused before anything is
// written. The kernel's tests are skipped where the CPU (or the build) has no AMX-BF16; the reference's
// run everywhere. The tiled layout of W gives the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/bf16_amx.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace qg = kernels::gemm;
using testing::abs_bf16;
using testing::random_bf16;

struct Shape {
  int64_t K, N;
};
// The LM head's row block and the widths of smaller vocabularies' blocks, a projection's, and odd ones:
// channels past whole blocks of 16 (the last block's narrower tiles), inputs an odd multiple of 32.
constexpr Shape kShapes[] = {{2304, 29127}, {2304, 12576}, {2304, 576}, {2336, 100}, {224, 33},
                             {96, 37},      {32, 15},      {160, 48},   {32, 1}};
constexpr int64_t kMaxRows = 64;

// The kernel on rows [m0, m0 + M) of x [rows, ldx] into a fresh y [M, ldy] filled with 7 (its padding
// columns must keep it).
std::vector<float> amx(const std::vector<bf16_t>& x, int64_t m0, int64_t M, int64_t ldx,
                       const std::vector<bf16_t>& w, const Shape& s, int64_t ldy) {
  std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
  qg::gemm_bf16_amx(x.data() + m0 * ldx, M, ldx, w.data(), s.K, s.N, y.data(), ldy);
  return y;
}

TEST(Bf16Amx, ReferenceIsTheExactSumWithinFp32Rounding) {
  const Shape s{96, 21};
  const int64_t M = 5, ldx = s.K + 3, ldy = s.N + 2;
  const auto x = random_bf16(static_cast<size_t>(M * ldx), 1),
             w = random_bf16(static_cast<size_t>(s.K * s.N), 2);
  std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
  qg::gemm_bf16_amx_reference(x.data(), M, ldx, w.data(), s.K, s.N, y.data(), ldy);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < s.N; ++n) {
      double exact = 0.0, mag = 0.0;
      for (int64_t k = 0; k < s.K; ++k) {
        const double p = static_cast<double>(bf16_to_f32(x[m * ldx + k])) * bf16_to_f32(w[n * s.K + k]);
        exact += p;
        mag += std::fabs(p);
      }
      EXPECT_LE(std::fabs(y[m * ldy + n] - exact), s.K * std::ldexp(mag, -24) + 1e-30) << m << ", " << n;
    }
    for (int64_t n = s.N; n < ldy; ++n) EXPECT_EQ(y[m * ldy + n], 7.0f);
  }
  EXPECT_THROW(qg::gemm_bf16_amx_reference(x.data(), M, s.K - 1, w.data(), s.K, s.N, y.data(), ldy),
               std::invalid_argument);
  EXPECT_THROW(qg::gemm_bf16_amx_reference(x.data(), M, ldx, w.data(), s.K, s.N, y.data(), s.N - 1),
               std::invalid_argument);
  EXPECT_THROW(qg::gemm_bf16_amx_reference(x.data(), -1, ldx, w.data(), s.K, s.N, y.data(), ldy),
               std::invalid_argument);
}

TEST(Bf16Amx, TakesMultiplesOf32Inputs) {
  EXPECT_TRUE(qg::bf16_amx_takes(32));
  EXPECT_TRUE(qg::bf16_amx_takes(2304));
  EXPECT_FALSE(qg::bf16_amx_takes(0));
  EXPECT_FALSE(qg::bf16_amx_takes(48));
  EXPECT_FALSE(qg::bf16_amx_takes(2305));
}

// Every row count 1..64 against the reference's first rows: |y - y_ref| within 2 K 2^-24 sum |x w| (two
// fp32 sums of the same exact products in different orders); the padding columns untouched.
TEST(Bf16Amx, MatchesTheReferenceAtEveryRowCount) {
  SKIP_WITHOUT_AMX_BF16();
  uint64_t seed = 10;
  for (const Shape& s : kShapes) {
    const int64_t ldx = s.K + 16, ldy = s.N + 5;
    const auto x = random_bf16(static_cast<size_t>(kMaxRows * ldx), ++seed);
    const auto w = random_bf16(static_cast<size_t>(s.K * s.N), ++seed);
    std::vector<float> ref(static_cast<size_t>(kMaxRows * s.N)), mag(ref.size());
    qg::gemm_bf16_amx_reference(x.data(), kMaxRows, ldx, w.data(), s.K, s.N, ref.data(), s.N);
    qg::gemm_bf16_amx_reference(abs_bf16(x).data(), kMaxRows, ldx, abs_bf16(w).data(), s.K, s.N, mag.data(),
                                s.N);
    for (int64_t M = 1; M <= kMaxRows; ++M) {
      const std::vector<float> y = amx(x, 0, M, ldx, w, s, ldy);
      const std::string what =
          "K " + std::to_string(s.K) + " N " + std::to_string(s.N) + " M " + std::to_string(M);
      ASSERT_EQ(testing::fp32_sum_mismatches(y.data(), M, ldy, ref.data(), mag.data(), s.N, s.K, what), 0)
          << what;
    }
  }
}

// A row computes the same bits alone, at any place in a batch of any size (one or several groups of 16,
// narrow tiles or wide), and past one pass of 64 rows.
TEST(Bf16Amx, ARowsBitsDoNotDependOnTheRowsBesideIt) {
  SKIP_WITHOUT_AMX_BF16();
  constexpr int64_t kRows = 150;
  uint64_t seed = 100;
  for (const Shape& s : {Shape{2304, 29127}, Shape{2304, 576}, Shape{224, 33}, Shape{96, 37}}) {
    const int64_t ldx = s.K, ldy = s.N;
    const auto x = random_bf16(static_cast<size_t>(kRows * ldx), ++seed);
    const auto w = random_bf16(static_cast<size_t>(s.K * s.N), ++seed);
    std::vector<std::vector<float>> alone(kRows);
    for (int64_t m = 0; m < kRows; ++m) alone[m] = amx(x, m, 1, ldx, w, s, ldy);
    for (int64_t M : {2, 3, 15, 16, 17, 31, 33, 48, 63, 64, 65, 129, 150}) {
      for (int64_t m0 : {int64_t{0}, kRows - M, (kRows - M) / 2}) {
        const std::vector<float> y = amx(x, m0, M, ldx, w, s, ldy);
        for (int64_t m = 0; m < M; ++m)
          ASSERT_EQ(std::memcmp(y.data() + m * ldy, alone[m0 + m].data(), sizeof(float) * s.N), 0)
              << "K " << s.K << " N " << s.N << ": row " << m0 + m << " in a batch of " << M << " from row "
              << m0;
      }
    }
  }
}

TEST(Bf16Amx, NansStayInTheirRowAndChannel) {
  SKIP_WITHOUT_AMX_BF16();
  const Shape s{128, 37};
  const int64_t M = 20;
  auto x = random_bf16(static_cast<size_t>(M * s.K), 7), w = random_bf16(static_cast<size_t>(s.K * s.N), 8);
  const bf16_t nan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  x[3 * s.K + 5] = nan;     // row 3
  w[34 * s.K + 100] = nan;  // channel 34, in the last block of 5
  const std::vector<float> y = amx(x, 0, M, s.K, w, s, s.N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < s.N; ++n)
      EXPECT_EQ(std::isnan(y[m * s.N + n]), m == 3 || n == 34) << m << ", " << n;
}

// W in the tiled layout (bf16_amx_tile_rows from fp32 or bf16 rows, in pieces as the LM head is built)
// gives the [N, K] layout's bits at every row count, on the shapes above (a last block of fewer than 16
// channels included); bad rows are refused.
TEST(Bf16Amx, TiledLayoutGivesThePlainLayoutsBits) {
  uint64_t seed = 300;
  for (const Shape& s : kShapes) {
    const auto w = random_bf16(static_cast<size_t>(s.K * s.N), ++seed);
    std::vector<float> wf(w.size());
    for (size_t i = 0; i < w.size(); ++i) wf[i] = bf16_to_f32(w[i]);
    std::vector<bf16_t> tiled(static_cast<size_t>(qg::bf16_amx_tiled_size(s.N, s.K))), from_f32(tiled.size());
    const int64_t half = s.N / 2;  // two pieces, as build_head's blocks
    qg::bf16_amx_tile_rows(w.data(), 0, half, s.K, tiled.data());
    qg::bf16_amx_tile_rows(w.data() + half * s.K, half, s.N, s.K, tiled.data());
    qg::bf16_amx_tile_rows(wf.data(), 0, s.N, s.K, from_f32.data());
    for (int64_t n = 0; n < s.N; ++n)
      for (int64_t k = 0; k < s.K; ++k) {
        ASSERT_EQ(tiled[qg::bf16_amx_tiled_index(n, k, s.K)], w[n * s.K + k]) << n << ", " << k;
        ASSERT_EQ(from_f32[qg::bf16_amx_tiled_index(n, k, s.K)], w[n * s.K + k]) << n << ", " << k;
      }
    if (!qg::cpu_has_amx_bf16()) continue;
    const int64_t ldx = s.K + 32, ldy = s.N + 3, rows = kMaxRows + 3;
    const auto x = random_bf16(static_cast<size_t>(rows * ldx), ++seed);
    for (int64_t M : {int64_t{1}, int64_t{3}, int64_t{16}, int64_t{17}, kMaxRows, rows}) {
      const std::vector<float> want = amx(x, 0, M, ldx, w, s, ldy);
      std::vector<float> got(want.size(), 7.0f);
      qg::gemm_bf16_amx_tiled(x.data(), M, ldx, tiled.data(), s.K, s.N, got.data(), ldy);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * got.size()), 0)
          << "K " << s.K << " N " << s.N << " M " << M;
    }
  }
  std::vector<bf16_t> out(static_cast<size_t>(qg::bf16_amx_tiled_size(4, 64)));
  const std::vector<float> r(4 * 64, 1.0f);
  EXPECT_THROW(qg::bf16_amx_tile_rows(r.data(), 0, 4, 48, out.data()), std::invalid_argument);  // K
  EXPECT_THROW(qg::bf16_amx_tile_rows(r.data(), 3, 2, 64, out.data()), std::invalid_argument);
  EXPECT_THROW(qg::bf16_amx_tile_rows(r.data(), -1, 2, 64, out.data()), std::invalid_argument);
}

TEST(Bf16Amx, RefusesBadArgumentsBeforeWriting) {
  SKIP_WITHOUT_AMX_BF16();
  const Shape s{64, 20};
  const auto x = random_bf16(static_cast<size_t>(4 * 96), 1),
             w = random_bf16(static_cast<size_t>(96 * 20), 2);
  std::vector<float> y(static_cast<size_t>(4 * 24), 7.0f);
  const auto call = [&](int64_t M, int64_t ldx, int64_t K, int64_t N, int64_t ldy) {
    qg::gemm_bf16_amx(x.data(), M, ldx, w.data(), K, N, y.data(), ldy);
  };
  EXPECT_THROW(call(4, 96, 48, s.N, 24), std::invalid_argument);  // K not a multiple of 32
  EXPECT_THROW(call(4, 96, 0, s.N, 24), std::invalid_argument);
  EXPECT_THROW(call(4, 63, s.K, s.N, 24), std::invalid_argument);  // ldx < K
  EXPECT_THROW(call(4, 96, s.K, s.N, 19), std::invalid_argument);  // ldy < N
  EXPECT_THROW(call(4, 96, s.K, 0, 24), std::invalid_argument);
  EXPECT_THROW(call(-1, 96, s.K, s.N, 24), std::invalid_argument);
  for (float v : y) ASSERT_EQ(v, 7.0f);
  EXPECT_NO_THROW(call(0, 96, s.K, s.N, 24));
  for (float v : y) ASSERT_EQ(v, 7.0f);
  EXPECT_THROW(qg::gemm_bf16_amx_tiled(x.data(), 4, 96, w.data(), 48, s.N, y.data(), 24),
               std::invalid_argument);
  EXPECT_THROW(qg::gemm_bf16_amx_tiled(x.data(), 4, 63, w.data(), s.K, s.N, y.data(), 24),
               std::invalid_argument);
  for (float v : y) ASSERT_EQ(v, 7.0f);
}

}  // namespace
}  // namespace kda
