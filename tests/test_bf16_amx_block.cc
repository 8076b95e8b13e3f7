// A block of the bf16 GEMM on AMX-BF16 tiles with W in gemm_bf16_vnni's layout
// (kernels/gemm/bf16_amx_block.h): every row count 1..70 and channel counts past whole tiles and blocks of
// 64 (the MLA prefill's query and key blocks among them) against the reference, within fp32 summation
// rounding; strided rows; y's columns past N left alone; a row's bits independent of the rows beside it;
// bad arguments refused before anything is written. The kernel's tests are skipped where the CPU (or the
// build) has no AMX-BF16; the reference's run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/bf16_amx.h"
#include "kda/kernels/gemm/bf16_amx_block.h"
#include "kda/kernels/gemm/bf16_vnni.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace qg = kernels::gemm;
using testing::abs_bf16;
using testing::random_bf16;

// W [N, K] (row-major) and the same in gemm_bf16_vnni's layout.
struct Weights {
  std::vector<bf16_t> plain, packed;
  Weights(int64_t K, int64_t N, uint64_t seed)
      : plain(random_bf16(static_cast<size_t>(K * N), seed)),
        packed(static_cast<size_t>(qg::bf16_vnni_size(K, N))) {
    qg::pack_bf16_vnni(plain.data(), K, N, packed.data());
  }
};

TEST(Bf16AmxBlock, ReferenceIsTheExactSumWithinFp32Rounding) {
  const int64_t M = 5, K = 96, N = 70, ldx = K + 3, ldy = N + 2;
  const auto x = random_bf16(static_cast<size_t>(M * ldx), 1);
  const Weights w(K, N, 2);
  std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
  qg::gemm_bf16_amx_block_reference(x.data(), M, ldx, w.packed.data(), K, N, y.data(), ldy);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double exact = 0.0, mag = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(bf16_to_f32(x[m * ldx + k])) * bf16_to_f32(w.plain[n * K + k]);
        exact += p;
        mag += std::fabs(p);
      }
      EXPECT_LE(std::fabs(y[m * ldy + n] - exact), K * std::ldexp(mag, -24) + 1e-30) << m << ", " << n;
    }
    for (int64_t n = N; n < ldy; ++n) EXPECT_EQ(y[m * ldy + n], 7.0f);
  }
  EXPECT_THROW(qg::gemm_bf16_amx_block_reference(x.data(), M, ldx, w.packed.data(), 48, N, y.data(), ldy),
               std::invalid_argument);
  EXPECT_THROW(qg::gemm_bf16_amx_block_reference(x.data(), M, ldx, w.packed.data(), K, N, y.data(), N - 1),
               std::invalid_argument);
}

TEST(Bf16AmxBlock, TakesMultiplesOf32InputsWhereTheCpuHasAmx) {
  EXPECT_FALSE(qg::bf16_amx_block_takes(0));
  EXPECT_FALSE(qg::bf16_amx_block_takes(48));
  EXPECT_FALSE(qg::bf16_amx_block_takes(200));
  EXPECT_EQ(qg::bf16_amx_block_takes(192), qg::cpu_has_amx_bf16());
  EXPECT_EQ(qg::bf16_amx_block_takes(32), qg::cpu_has_amx_bf16());
}

// |y - y_ref| within 2 K 2^-24 sum |x w| (two fp32 sums of the same exact products in different orders),
// every row count 1..70 against the reference's first rows; the columns past N untouched.
TEST(Bf16AmxBlock, MatchesTheReferenceAtEveryRowCount) {
  SKIP_WITHOUT_AMX_BF16();
  constexpr int64_t kMaxRows = 70;
  uint64_t seed = 10;
  struct Shape {
    int64_t K, N;
  };
  for (const Shape s : {Shape{192, 256}, Shape{192, 200}, Shape{192, 17}, Shape{32, 1}, Shape{64, 15},
                        Shape{96, 33}, Shape{160, 64}, Shape{192, 100}, Shape{320, 48}}) {
    const int64_t ldx = s.K + 16, ldy = s.N + 5;
    const auto x = random_bf16(static_cast<size_t>(kMaxRows * ldx), ++seed);
    const Weights w(s.K, s.N, ++seed);
    std::vector<float> ref(static_cast<size_t>(kMaxRows * s.N)), mag(ref.size());
    const std::vector<bf16_t> wabs = abs_bf16(w.packed);
    qg::gemm_bf16_amx_block_reference(x.data(), kMaxRows, ldx, w.packed.data(), s.K, s.N, ref.data(), s.N);
    qg::gemm_bf16_amx_block_reference(abs_bf16(x).data(), kMaxRows, ldx, wabs.data(), s.K, s.N, mag.data(),
                                      s.N);
    for (int64_t M = 1; M <= kMaxRows; ++M) {
      std::vector<float> y(static_cast<size_t>(M * ldy), 7.0f);
      qg::gemm_bf16_amx_block(x.data(), M, ldx, w.packed.data(), s.K, s.N, y.data(), ldy);
      const std::string what =
          "K " + std::to_string(s.K) + " N " + std::to_string(s.N) + " M " + std::to_string(M);
      ASSERT_EQ(testing::fp32_sum_mismatches(y.data(), M, ldy, ref.data(), mag.data(), s.N, s.K, what), 0)
          << what;
    }
  }
}

// A row computes the same bits alone as at any place in a block of any size.
TEST(Bf16AmxBlock, ARowsBitsDoNotDependOnTheRowsBesideIt) {
  SKIP_WITHOUT_AMX_BF16();
  constexpr int64_t kRows = 80, K = 192, N = 230;
  const auto x = random_bf16(static_cast<size_t>(kRows * K), 100);
  const Weights w(K, N, 101);
  std::vector<std::vector<float>> alone(kRows, std::vector<float>(N));
  for (int64_t m = 0; m < kRows; ++m)
    qg::gemm_bf16_amx_block(x.data() + m * K, 1, K, w.packed.data(), K, N, alone[m].data(), N);
  for (int64_t M : {2, 15, 16, 17, 31, 32, 33, 64, 80}) {
    for (int64_t m0 : {int64_t{0}, kRows - M, (kRows - M) / 2}) {
      std::vector<float> y(static_cast<size_t>(M * N));
      qg::gemm_bf16_amx_block(x.data() + m0 * K, M, K, w.packed.data(), K, N, y.data(), N);
      for (int64_t m = 0; m < M; ++m)
        ASSERT_EQ(std::memcmp(y.data() + m * N, alone[m0 + m].data(), sizeof(float) * N), 0)
            << "row " << m0 + m << " in a block of " << M << " from row " << m0;
    }
  }
}

// The fp32 entry points of both kernels.
using Fp32Kernel = void (*)(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, float*,
                            int64_t);

// Bad sizes and strides are refused before y is written; no rows is nothing to do.
void expect_refuses_bad_arguments(Fp32Kernel kernel) {
  const int64_t M = 4, K = 64, N = 20;
  const auto x = random_bf16(static_cast<size_t>(M * K), 5);
  const Weights w(K, N, 6);
  std::vector<float> y(static_cast<size_t>(M * N), 7.0f);
  const auto call = [&](int64_t m, int64_t ldx, int64_t k, int64_t n, int64_t ldy) {
    kernel(x.data(), m, ldx, w.packed.data(), k, n, y.data(), ldy);
  };
  EXPECT_THROW(call(M, K, 48, N, N), std::invalid_argument);
  EXPECT_THROW(call(M, K, 0, N, N), std::invalid_argument);
  EXPECT_THROW(call(M, K - 1, K, N, N), std::invalid_argument);
  EXPECT_THROW(call(M, K, K, N, N - 1), std::invalid_argument);
  EXPECT_THROW(call(M, K, K, 0, N), std::invalid_argument);
  EXPECT_THROW(call(-1, K, K, N, N), std::invalid_argument);
  for (float v : y) ASSERT_EQ(v, 7.0f);
  call(0, K, K, N, N);
  for (float v : y) ASSERT_EQ(v, 7.0f);
}

TEST(Bf16AmxBlock, RefusesBadArgumentsBeforeWriting) {
  SKIP_WITHOUT_AMX_BF16();
  expect_refuses_bad_arguments(qg::gemm_bf16_amx_block);
}

// The decode rows kernel gives the block kernel's bits at every row count of a decode or verify call (one
// group of 16 rows, several in one pass over W, past one pass of kAmxRows), on the model's projection
// widths (64-channel blocks whole and partial) and odd ones, strided rows; a bf16 y is its fp32 y rounded
// to nearest even; y's columns past N left alone.
TEST(Bf16AmxRows, GivesTheBlockKernelsBitsAtEveryRowCount) {
  SKIP_WITHOUT_AMX_BF16();
  struct Shape {
    int64_t K, N;
  };
  uint64_t seed = 200;
  for (const Shape s : {Shape{2304, 12576}, Shape{4096, 2304}, Shape{2304, 2048}, Shape{1024, 2304},
                        Shape{128, 4096}, Shape{192, 200}, Shape{32, 1}, Shape{64, 15}, Shape{96, 70}}) {
    const int64_t ldx = s.K + 32, ldy = s.N + 3, kRows = qg::kAmxRows + 17;
    const auto x = random_bf16(static_cast<size_t>(kRows * ldx), ++seed);
    const Weights w(s.K, s.N, ++seed);
    for (int64_t M :
         std::initializer_list<int64_t>{1, 2, 3, 5, 8, 13, 16, 17, 33, 48, 63, qg::kAmxRows, kRows}) {
      const std::string what =
          "K " + std::to_string(s.K) + " N " + std::to_string(s.N) + " M " + std::to_string(M);
      std::vector<float> want(static_cast<size_t>(M * ldy), 7.0f), got(want.size(), 7.0f);
      qg::gemm_bf16_amx_block(x.data(), M, ldx, w.packed.data(), s.K, s.N, want.data(), ldy);
      qg::gemm_bf16_amx_rows(x.data(), M, ldx, w.packed.data(), s.K, s.N, got.data(), ldy);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), sizeof(float) * got.size()), 0) << what;
      std::vector<bf16_t> got16(static_cast<size_t>(M * ldy), bf16_t{0x7777});
      qg::gemm_bf16_amx_rows(x.data(), M, ldx, w.packed.data(), s.K, s.N, got16.data(), ldy);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < s.N; ++n)
          ASSERT_EQ(got16[m * ldy + n], f32_to_bf16(want[m * ldy + n]))
              << what << " row " << m << " ch " << n;
        for (int64_t n = s.N; n < ldy; ++n) ASSERT_EQ(got16[m * ldy + n], bf16_t{0x7777}) << what;
      }
    }
  }
}

TEST(Bf16AmxRows, RefusesBadArgumentsBeforeWriting) {
  SKIP_WITHOUT_AMX_BF16();
  expect_refuses_bad_arguments(static_cast<Fp32Kernel>(qg::gemm_bf16_amx_rows));
}

}  // namespace
}  // namespace kda
