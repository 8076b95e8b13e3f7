// chunk_kda_opt's small blocks, AVX-512 bodies: the 16 x 16 transpose (step 3), the diagonal blocks'
// pairs of Aqk and Akk (step 3) and the substitution that inverts the diagonal blocks of T (step 4).
// Included by chunk/intra.cc and chunk/wy.cc in their AVX-512 copies only.
#pragma once

#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/chunk/common.h"

#if !defined(KDA_ISA_AVX512)
#error "arch/avx512/chunk_blocks.h is the AVX-512 copy's body"
#endif

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

inline __mmask16 tail_mask(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// Lane i of the result is the sum of the 16 lanes of v[i].
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i) {
    a[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] =
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i], 128-bit lane l, element e: a partial sum of v[4i + e]; now sum the four lanes.
  const __m512 c0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// dst[d, 0:16] = src[0:16, d] for d < nd (nd <= 16): one 16 x 16 block, src rows lds apart (all 16 rows
// valid; columns beyond nd are not read), dst rows ldd apart.
inline void transpose16(const float* src, int64_t lds, int nd, float* dst, int64_t ldd) {
  const __mmask16 m = tail_mask(nd);
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps(m, src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      const __m512d x = _mm512_castps_pd(t[4 * i + j]), y = _mm512_castps_pd(t[4 * i + j + 2]);
      r[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      r[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  // r[4i + c], 128-bit lane l: column 4l + c of rows 4i..4i+3. Gather lanes across the four row groups.
  for (int c = 0; c < 4; ++c) {
    const __m512 x01lo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);  // lanes 0,1 of rows 0-3, 4-7
    const __m512 x01hi = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);  // lanes 2,3
    const __m512 x23lo = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 x23hi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_f32x4(x01lo, x23lo, 0x88);       // lane 0: column c
    t[4 + c] = _mm512_shuffle_f32x4(x01lo, x23lo, 0xDD);   // lane 1: column 4 + c
    t[8 + c] = _mm512_shuffle_f32x4(x01hi, x23hi, 0x88);   // lane 2: column 8 + c
    t[12 + c] = _mm512_shuffle_f32x4(x01hi, x23hi, 0xDD);  // lane 3: column 12 + c
  }
  for (int d = 0; d < nd; ++d) _mm512_storeu_ps(dst + d * ldd, t[d]);
}

// Pairs (r, s) of one diagonal block, r in [r0, r0 + NR), r >= s: with p = k_s * prod_{s<i<=r} exp(g_i)
// (running product from s; Pst holds it between calls), Aqk[r, s] = q_r . p and, for r > s,
// NAkk[r, s] = -beta_r k_r . p.
template <int NR>
inline void diag_pairs(int K, int s, int r0, const float* Q, const float* Kh, const float* E, const float* B,
                       float* Pst, float* Aqk, float* NAkk) {
  constexpr int C = kChunk;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int d = 0; d < K; d += 16) {
    const __mmask16 m = tail_mask(K - d);
    __m512 p = _mm512_maskz_loadu_ps(m, (r0 == s ? Kh + s * K : Pst) + d);
    for (int i = 0; i < NR; ++i) {
      const int r = r0 + i;
      if (r > s) p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(m, E + r * K + d));
      acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, Q + r * K + d), p, acc[i]);
      acc[8 + i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, Kh + r * K + d), p, acc[8 + i]);
    }
    _mm512_mask_storeu_ps(Pst + d, m, p);
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int i = 0; i < NR; ++i) {
    const int r = r0 + i;
    Aqk[r * C + s] = sums[i];
    if (r > s) NAkk[r * C + s] = -B[r] * sums[8 + i];
  }
}

// T_bb = (I - NAkk_bb)^-1 for the four 16 x 16 diagonal blocks of T (row stride C), side by side so that
// four independent substitution chains hide the FMA latency: T[r, :] = e_r + sum_{j<r} NAkk[r, j] T[j, :].
// NAkk must be finite in every block (rows beyond the chunk zero).
inline void invert_diagonal_blocks(const float* NAkk, float* T) {
  constexpr int C = kChunk;
  for (int r = 0; r < kSub; ++r) {
    __m512 t[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      t[b] = _mm512_maskz_mov_ps(static_cast<__mmask16>(1u << r), _mm512_set1_ps(1.0f));
    }
    for (int j = 0; j < r; ++j) {
      for (int b = 0; b < kBlocks; ++b) {
        const int o = b * kSub;
        t[b] = _mm512_fmadd_ps(_mm512_set1_ps(NAkk[(o + r) * C + o + j]), _mm512_load_ps(T + (o + j) * C + o),
                               t[b]);
      }
    }
    for (int b = 0; b < kBlocks; ++b) _mm512_store_ps(T + (b * kSub + r) * C + b * kSub, t[b]);
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
