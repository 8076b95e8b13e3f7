// chunk_kda_opt's product C = init + sum A B (chunk/gemm.cc), AVX-512 body: one register-blocked
// micro-kernel, kMR rows x 16 kNV columns of accumulators in zmm registers, A broadcast element by
// element, B rows loaded as vectors. A column strip of B (128 x 48 floats of the state, 24 KB) stays in
// L1 while all row blocks pass it. Included by chunk/gemm.cc in its AVX-512 copy only.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/chunk/stager.h"

#if !defined(KDA_ISA_AVX512)
#error "arch/avx512/chunk_gemm.h is the AVX-512 copy's body"
#endif

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

constexpr int kMR = 8;  // micro-tile rows
constexpr int kNV = 3;  // micro-tile columns, in 16-float vectors

// acc[0:MR, 0:NV] += A[r0:r0+MR, 0:kd] B[0:kd, j0:j0+16NV]; the last vector of each B row is masked.
// With PF, every kPfEvery-th step prefetches the next line of pf's list.
template <int MR, int NV, bool AT, bool PF>
inline void kloop(const Seg& s, int kd, int r0, int j0, __mmask16 tail, __m512 (&acc)[MR][NV], PfLines* pf) {
  const float* b = s.b + j0;
  const float* a = AT ? s.a + r0 : s.a + r0 * s.lda;
  int countdown = 1;
  for (int d = 0; d < kd; ++d, b += s.ldb) {
    if constexpr (PF) {
      if (--countdown == 0) {
        countdown = kPfEvery;
        if (pf->n > 0) {
          _mm_prefetch(*pf->p, _MM_HINT_T0);
          ++pf->p;
          --pf->n;
        }
      }
    }
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(tail, b + 16 * v) : _mm512_loadu_ps(b + 16 * v);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(AT ? a[d * s.lda + i] : a[i * s.lda + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
    }
  }
}

template <int MR, int NV, bool PF = false>
inline void tile(const Seg* segs, int nseg, const Init& init, int r0, int j0, __mmask16 tail, float* c,
                 int64_t ldc, PfLines* pf = nullptr) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if (init.src != nullptr) {
      const __m512 sc = _mm512_set1_ps(init.scale != nullptr ? init.scale[r0 + i] : 1.0f);
      const float* p = init.src + (r0 + i) * init.ld + j0;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __m512 x = v == NV - 1 ? _mm512_maskz_loadu_ps(tail, p + 16 * v) : _mm512_loadu_ps(p + 16 * v);
        acc[i][v] = _mm512_mul_ps(sc, x);
      }
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    }
  }
  for (int q = 0; q < nseg; ++q) {
    const Seg& s = segs[q];
    const int kd = s.lower ? std::min(s.kd, r0 + MR) : s.kd;
    if (s.at) {
      kloop<MR, NV, true, PF>(s, kd, r0, j0, tail, acc, pf);
    } else {
      kloop<MR, NV, false, PF>(s, kd, r0, j0, tail, acc, pf);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float* p = c + (r0 + i) * ldc + j0;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if (v == NV - 1) {
        _mm512_mask_storeu_ps(p + 16 * v, tail, acc[i][v]);
      } else {
        _mm512_storeu_ps(p + 16 * v, acc[i][v]);
      }
    }
  }
}

// All rows of one column strip [j0, j0 + 16 NV), kMR at a time, then the remainder rows.
// Inlined into gemm, as the compiler chose when gemm and its callers shared one file.
template <int NV>
[[gnu::always_inline]] inline void strip_rows(int M, const Seg* segs, int nseg, const Init& init, int j0,
                                              __mmask16 tail, float* c, int64_t ldc, Stager* pf) {
  int r0 = 0;
  for (; r0 + kMR <= M; r0 += kMR) {
    if (pf != nullptr) {
      tile<kMR, NV, true>(segs, nseg, init, r0, j0, tail, c, ldc, &pf->lines());
      pf->tile_done();
    } else {
      tile<kMR, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
    }
  }
  static_assert(kMR <= 8, "remainder dispatch below covers up to 7 rows");
  switch (M - r0) {
    case 1:
      tile<1, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 2:
      tile<2, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 3:
      tile<3, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 4:
      tile<4, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 5:
      tile<5, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 6:
      tile<6, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    case 7:
      tile<7, NV>(segs, nseg, init, r0, j0, tail, c, ldc);
      break;
    default:
      break;
  }
}

// gemm's body: the column strips of C, each [j0, j0 + 16 kNV) wide (the last one masked).
[[gnu::always_inline]] inline void gemm_body(int M, int N, const Seg* segs, int nseg, const Init& init,
                                             float* c, int64_t ldc, Stager* pf) {
  static_assert(kNV >= 1 && kNV <= 4, "strip dispatch below covers 1..4 vectors");
  for (int j0 = 0; j0 < N; j0 += 16 * kNV) {
    const int nw = std::min(16 * kNV, N - j0);
    const __mmask16 tail = nw % 16 == 0 ? 0xFFFF : static_cast<__mmask16>((1u << (nw % 16)) - 1);
    switch ((nw + 15) / 16) {
      case 1:
        strip_rows<1>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
      case 2:
        if constexpr (kNV >= 2) strip_rows<2>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
      case 3:
        if constexpr (kNV >= 3) strip_rows<3>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
      default:
        if constexpr (kNV >= 4) strip_rows<4>(M, segs, nseg, init, j0, tail, c, ldc, pf);
        break;
    }
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
