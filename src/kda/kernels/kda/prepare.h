// Step 1 of the spec's forward for one token row of one head, shared by the optimized kernels: q-hat
// (the attention scale folded in), k-hat, the gate g (fused: g = -exp(A_log) softplus(f + dt_bias)) and
// exp(g), as fp32 rows, from fp32 or bf16 inputs.
#pragma once

#include <cmath>
#include <cstdint>

#include "kda/common/bf16.h"
#include "kda/common/isa_target.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/impl.h"
#include "kda/kernels/kda/vec_math.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::prep {

using vecmath::exp_approx;
using vecmath::softplus_approx;
using vecmath::to_f32;

// What step 1 needs to know of one head.
struct HeadPrep {
  int K = 0;
  float scale = 1.0f;
  bool l2norm = false;
  bool gate = false;            // g is the raw gate f: g = neg_a * softplus(f + bias)
  float neg_a = 0.0f;           // -exp(A_log[h])
  const float* bias = nullptr;  // dt_bias + h K, or null
};

inline HeadPrep head_prep(const KdaArgs& a, int h, float scale) {
  HeadPrep p;
  p.K = a.K;
  p.scale = scale;
  p.l2norm = a.use_qk_l2norm_in_kernel;
  p.gate = a.use_gate_in_kernel;
  if (p.gate) {
    p.neg_a = -std::exp(a.A_log[h]);
    if (a.dt_bias != nullptr) p.bias = a.dt_bias + static_cast<int64_t>(h) * a.K;
  }
  return p;
}

#if defined(KDA_ISA_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 maskz_load16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 maskz_load16(__mmask16 m, const bf16_t* p) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// One token row of one head: Q = scale q-hat, Kh = k-hat, G = g (gate fused), E = exp(g).
// The norms are summed in a fixed order (16 lanes, then a fixed tree), whatever the rows' alignment.
// In (q and k) and GIn (g) are each float, or bf16_t for bf16 inputs; a bf16 value widens exactly, so
// the rows are those of fp32 inputs holding the same values.
template <class In, class GIn>
inline void prepare_row(const HeadPrep& p, const In* __restrict q, const In* __restrict k,
                        const GIn* __restrict g, float* __restrict Q, float* __restrict Kh,
                        float* __restrict G, float* __restrict E) {
  const int K = p.K;
  float rq = p.scale, rk = 1.0f;
  int d0 = 0;
#if defined(KDA_ISA_AVX512)
  if (p.l2norm) {
    __m512 sq = _mm512_setzero_ps(), sk = _mm512_setzero_ps();
    for (int d = 0; d < K; d += 16) {
      const __mmask16 m =
          K - d >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - d)) - 1);
      const __m512 x = maskz_load16(m, q + d), y = maskz_load16(m, k + d);
      sq = _mm512_fmadd_ps(x, x, sq);
      sk = _mm512_fmadd_ps(y, y, sk);
    }
    rq = p.scale / std::sqrt(_mm512_reduce_add_ps(sq) + 1e-6f);
    rk = 1.0f / std::sqrt(_mm512_reduce_add_ps(sk) + 1e-6f);
  }
  const __m512 vq = _mm512_set1_ps(rq), vk = _mm512_set1_ps(rk), na = _mm512_set1_ps(p.neg_a);
  for (; d0 + 16 <= K; d0 += 16) {
    _mm512_storeu_ps(Q + d0, _mm512_mul_ps(load16(q + d0), vq));
    _mm512_storeu_ps(Kh + d0, _mm512_mul_ps(load16(k + d0), vk));
    __m512 x = load16(g + d0);
    if (p.gate) {
      if (p.bias != nullptr) x = _mm512_add_ps(x, _mm512_loadu_ps(p.bias + d0));
      x = _mm512_mul_ps(na, vecmath::softplus16(x));
    }
    _mm512_storeu_ps(G + d0, x);
    _mm512_storeu_ps(E + d0, vecmath::exp16(x));
  }
#else
  if (p.l2norm) vecmath::l2norm_factors(q, k, K, p.scale, rq, rk);
#endif
  for (int d = d0; d < K; ++d) {
    Q[d] = to_f32(q[d]) * rq;
    Kh[d] = to_f32(k[d]) * rk;
    const float gd = to_f32(g[d]);
    const float x = p.gate ? p.neg_a * softplus_approx(gd + (p.bias != nullptr ? p.bias[d] : 0.0f)) : gd;
    G[d] = x;
    E[d] = exp_approx(x);
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::prep
KDA_ISA_POP
