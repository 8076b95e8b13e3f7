// chunk_kda_opt, step 3: the chunk's intra-chunk attention, Aqk (q against k, lower with its diagonal)
// and Akk (k against k, strictly lower, times beta), from the decay factors of step 2. Blocks below the
// diagonal are products (q_r * rowdecay) . (k_s * coldecay); the diagonal blocks go pair by pair.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/vec_math.h"
#if defined(KDA_ISA_AVX512)
#include "kda/kernels/kda/arch/avx512/chunk_blocks.h"
#else
#include "kda/kernels/kda/arch/portable/chunk_blocks.h"
#endif

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

using vecmath::exp_approx;

namespace {

// One diagonal block's pairs: rows [n, n + m).
void diagonal_block(int K, int n, int m, const float* Q, const float* Kh, const float* E, const float* B,
                    float* Pst, float* Aqk, float* NAkk) {
  for (int s = n; s < n + m; ++s) {
    for (int r0 = s; r0 < n + m; r0 += 8) {
      switch (std::min(8, n + m - r0)) {
        case 1:
          diag_pairs<1>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 2:
          diag_pairs<2>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 3:
          diag_pairs<3>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 4:
          diag_pairs<4>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 5:
          diag_pairs<5>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 6:
          diag_pairs<6>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        case 7:
          diag_pairs<7>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
        default:
          diag_pairs<8>(K, s, r0, Q, Kh, E, B, Pst, Aqk, NAkk);
          break;
      }
    }
  }
}

}  // namespace

// Step 3: Aqk (lower, with diagonal; scale already in Q) and NAkk = -Akk (strictly lower, times beta_r).
[[gnu::noinline]] void build_attention(int K, int L, Scratch& w) {
  constexpr int C = kChunk;
  // Every entry the later steps read is written below, except two kinds, zeroed here: Aqk above the
  // diagonal inside the diagonal blocks (the lower-triangular product Aqk Vn reads whole micro-tile rows)
  // and, in a short chunk, the NAkk rows beyond it (invert_diagonal_blocks works on all four blocks).
  for (int r = 0; r < L; ++r) {
    const int n = r / kSub * kSub;
    std::memset(w.Aqk + r * C + n, 0, sizeof(float) * kSub);
  }
  if (L < C) std::memset(w.NAkk + L * C, 0, sizeof(float) * (C - L) * C);
  // Key side of the blocks below the diagonal, transposed: every block but the last.
  const int nkey = (L - 1) / kSub * kSub;
  for (int s = 0; s < nkey; s += kSub) {
    for (int d = 0; d < K; d += 16)
      transpose16(w.Kc + s * K + d, K, std::min(16, K - d), w.KcT + d * C + s, C);
  }
  float* __restrict acc = w.acc;
  for (int n = kSub; n < L; n += kSub) {
    const int m = std::min(kSub, L - n);  // rows n..n+m-1
    const int b = n / kSub;
    // Block-to-block decays exp(sum_{e'<i<=n} g_i) for the earlier blocks' last rows e' = n-1, n-17, ...,
    // a running sum from row n down, over exactly the rows it spans.
    {
      const float* __restrict G = w.G + n * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) acc[d] = G[d];
    }
    for (int j = b - 1; j >= 0; --j) {
      if (j < b - 1) {
        for (int r = (j + 1) * kSub; r < (j + 2) * kSub; ++r) {
          const float* __restrict G = w.G + r * K;
#pragma omp simd
          for (int d = 0; d < K; ++d) acc[d] += G[d];
        }
      }
      float* __restrict Mj = w.M + j * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) Mj[d] = exp_approx(acc[d]);
    }
    for (int d = 0; d < K; ++d) {
      const float* __restrict src = w.KcT + d * C;
      float* __restrict dst = w.Bn + d * C;
      for (int j = 0; j < b; ++j) {
        const float f = w.M[j * K + d];
#pragma omp simd
        for (int x = 0; x < kSub; ++x) dst[j * kSub + x] = src[j * kSub + x] * f;
      }
    }
    const Seg sq{w.Xq + n * K, K, false, w.Bn, C, K, false};
    gemm(m, n, &sq, 1, Init{}, w.Aqk + n * C, C);
    const Seg sk{w.Xk + n * K, K, false, w.Bn, C, K, false};
    gemm(m, n, &sk, 1, Init{}, w.NAkk + n * C, C);
  }
  for (int n = 0; n < L; n += kSub) {
    diagonal_block(K, n, std::min(kSub, L - n), w.Q, w.Kh, w.E, w.B, w.P, w.Aqk, w.NAkk);
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
