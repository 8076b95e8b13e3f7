#include "kda/kernels/gemm/f32_block.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "kda/common/isa.h"

#if defined(KDA_WITH_AVX512) && defined(__GNUC__) && defined(__x86_64__)
#define KDA_F32_BLOCK_AVX512 1
#include "kda/kernels/kda/avx512.h"  // <immintrin.h>, its GCC 12 false warnings silenced
#endif

namespace kda::kernels::gemm {

namespace {

void check_args(const char* what, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                const float* B, int64_t ldb, const float* C, int64_t ldc) {
  const std::string f(what);
  if (M < 0 || N < 0 || K < 0)
    throw std::invalid_argument(f + ": negative sizes M " + std::to_string(M) + ", N " + std::to_string(N) +
                                ", K " + std::to_string(K));
  if (lda < K || ldb < N || ldc < N)
    throw std::invalid_argument(f + ": a row stride below its row's size (lda " + std::to_string(lda) +
                                ", ldb " + std::to_string(ldb) + ", ldc " + std::to_string(ldc) + ")");
  if (M > 0 && N > 0 && (C == nullptr || (K > 0 && (A == nullptr || B == nullptr))))
    throw std::invalid_argument(f + ": null data");
}

// Columns per pass of the plain loops: one row's partial sums stay in registers / L1.
constexpr int64_t kPlainCols = 256;

void plain(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
           int64_t ldb, float beta, float* C, int64_t ldc) {
  float acc[kPlainCols];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j0 = 0; j0 < N; j0 += kPlainCols) {
      const int64_t nn = std::min(kPlainCols, N - j0);
      std::fill(acc, acc + nn, 0.0f);
      for (int64_t p = 0; p < K; ++p) {
        const float a = A[i * lda + p];
        const float* b = B + p * ldb + j0;
        for (int64_t j = 0; j < nn; ++j) acc[j] += a * b[j];
      }
      float* c = C + i * ldc + j0;
      for (int64_t j = 0; j < nn; ++j) c[j] = beta == 0.0f ? alpha * acc[j] : alpha * acc[j] + beta * c[j];
    }
}

#if defined(KDA_F32_BLOCK_AVX512)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")

constexpr int kMR = 6;  // rows per tile: 6 x 2 accumulators, 2 B vectors, 1 broadcast
constexpr int64_t kNR = 32;

template <int N, class F>
inline void unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }
  (std::make_integer_sequence<int, N>{});
}

// Rows [0, MR) of A against columns [0, nn) (nn <= 32) of B: masked loads past nn (B's last row may end
// there), masked stores.
template <int MR>
void tile(int64_t nn, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float beta, float* C, int64_t ldc) {
  const __mmask16 m0 = nn >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << nn) - 1);
  const __mmask16 m1 = nn >= 32   ? __mmask16(0xFFFF)
                       : nn <= 16 ? __mmask16(0)
                                  : static_cast<__mmask16>((1u << (nn - 16)) - 1);
  __m512 acc[MR][2];
  unrolled<MR>([&](auto i) { acc[i][0] = acc[i][1] = _mm512_setzero_ps(); });
  if (nn == kNR) {  // a whole strip, the common case: plain loads (the masked loop timed slower on Zen 4)
    for (int64_t p = 0; p < K; ++p) {
      const __m512 b0 = _mm512_loadu_ps(B + p * ldb), b1 = _mm512_loadu_ps(B + p * ldb + 16);
      unrolled<MR>([&](auto i) {
        const __m512 a = _mm512_set1_ps(A[i * lda + p]);
        acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
      });
    }
  } else {
    for (int64_t p = 0; p < K; ++p) {
      const __m512 b0 = _mm512_maskz_loadu_ps(m0, B + p * ldb),
                   b1 = _mm512_maskz_loadu_ps(m1, B + p * ldb + 16);
      unrolled<MR>([&](auto i) {
        const __m512 a = _mm512_set1_ps(A[i * lda + p]);
        acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
      });
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  unrolled<MR>([&](auto i) {
    float* c = C + i * ldc;
    __m512 r0 = _mm512_mul_ps(va, acc[i][0]), r1 = _mm512_mul_ps(va, acc[i][1]);
    if (beta != 0.0f) {
      r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, c), r0);
      r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, c + 16), r1);
    }
    _mm512_mask_storeu_ps(c, m0, r0);
    _mm512_mask_storeu_ps(c + 16, m1, r1);
  });
}

using Tile = void (*)(int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float, float*,
                      int64_t);
constexpr Tile kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// A strip of 32 columns of B (K x 128 bytes) stays in L1 while every row tile of A passes it.
void avx512(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
            int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t j0 = 0; j0 < N; j0 += kNR) {
    const int64_t nn = std::min(kNR, N - j0);
    for (int64_t i0 = 0; i0 < M; i0 += kMR) {
      const auto mr = static_cast<int>(std::min<int64_t>(kMR, M - i0));
      kTiles[mr](nn, K, alpha, A + i0 * lda, lda, B + j0, ldb, beta, C + i0 * ldc + j0, ldc);
    }
  }
}

#pragma GCC pop_options

#endif

}  // namespace

void gemm_f32_block(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float beta, float* C, int64_t ldc) {
  check_args("gemm_f32_block", M, N, K, A, lda, B, ldb, C, ldc);
  if (M == 0 || N == 0) return;
#if defined(KDA_F32_BLOCK_AVX512)
  static const bool wide = best_isa() == Isa::Avx512;
  if (wide) return avx512(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
  plain(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm_f32_block_reference(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                              const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  check_args("gemm_f32_block_reference", M, N, K, A, lda, B, ldb, C, ldc);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float s = 0.0f;
      for (int64_t p = 0; p < K; ++p) s += A[i * lda + p] * B[p * ldb + j];
      float& c = C[i * ldc + j];
      c = beta == 0.0f ? alpha * s : alpha * s + beta * c;
    }
}

int64_t f32_block_ld(int64_t n) {
  int64_t ld = (std::max<int64_t>(n, 1) + 15) / 16 * 16;
  if ((ld / 16) % 2 == 0) ld += 16;
  return ld;
}

}  // namespace kda::kernels::gemm
