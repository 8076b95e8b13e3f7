// Vectorisable exp / softplus for the optimized KDA kernels.
//
// Plain scalar functions without branches or library calls, so that a `#pragma omp simd` loop around them
// becomes straight AVX-512 (or AVX2) code; libm's expf / log1pf would keep such loops scalar.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "kda/common/bf16.h"
#include "kda/common/isa_target.h"
#include "kda/kernels/kda/avx512.h"

// One copy per ISA (isa_target.h): the scalar functions too, whose AVX-512 build is VEX/EVEX code.
KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::vecmath {

// expf for the kernels' arguments (a decay: always <= 0 there): Cephes range reduction + degree-6
// polynomial, ~1 ulp. Below -87 the result flushes to 0, which is the right answer for a decay (the
// channel is forgotten) and keeps 2^n a normal number, so no subnormal ever enters a product.
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.5f), 88.0f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float pow2n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * pow2n;
}

// softplus(z) = z for z > 20, else log1p(e^z); computed as max(z,0) + log1p(e^-|z|) so that it
// vectorises: with w = e^-|z| in (0,1], log1p(w) = 2 atanh(s), s = w / (2 + w) <= 1/3, whose odd series
// is below fp32 resolution after s^15. For z > 20 the correction is < 2.1e-9 and rounds away.
inline float softplus_approx(float z) {
  const float w = exp_approx(-std::fabs(z));
  const float s = w / (2.0f + w);
  const float s2 = s * s;
  float p = 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return std::max(z, 0.0f) + 2.0f * s * p;
}

#if defined(KDA_ISA_AVX512)
// exp_approx on 16 lanes: the same reduction and polynomial, with 2^n applied by vscalefps instead of
// integer exponent arithmetic (fewer instructions where the gate's two exps per element dominate).
// No clamp of x: vscalefps takes any n (the lanes below -87 are zeroed by the mask anyway, and above
// 88 the result overflows to inf, as expf does).
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);  // else 0, as above
  return _mm512_maskz_scalef_ps(kept, p, n);
}

// softplus_approx on 16 lanes.
inline __m512 softplus16(__m512 z) {
  const __m512 w = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
  // s = w / (2 + w) by reciprocal estimate and one Newton step (~2^-28 relative), not a division,
  // whose unit takes ~6 cycles per 16 lanes.
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(2.0f), w);
  __m512 rc = _mm512_rcp14_ps(den);
  rc = _mm512_mul_ps(rc, _mm512_fnmadd_ps(den, rc, _mm512_set1_ps(2.0f)));
  const __m512 s = _mm512_mul_ps(w, rc);
  const __m512 s2 = _mm512_mul_ps(s, s);
  __m512 p = _mm512_set1_ps(1.0f / 15.0f);
  for (const float c : {1.0f / 13.0f, 1.0f / 11.0f, 1.0f / 9.0f, 1.0f / 7.0f, 1.0f / 5.0f, 1.0f / 3.0f, 1.0f})
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(c));
  return _mm512_fmadd_ps(_mm512_add_ps(s, s), p, _mm512_max_ps(z, _mm512_setzero_ps()));
}
#endif

// An input element as fp32, from fp32 or bf16 (a bf16 value is the top half of its fp32).
inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return bf16_to_f32(x); }

// The factors of use_qk_l2norm_in_kernel, eps inside the sqrt (spec step 5): q-hat = q * rq with
// rq = scale / sqrt(|q|^2 + 1e-6) (the attention scale folded in), k-hat = k * rk. In: float or bf16_t.
// The squares are summed in 16 lanes, then a fixed tree, so that fp32 and bf16 rows of the same values
// give the same bits: an `omp simd` reduction leaves the order to the vectoriser, which chose
// differently for the two types.
template <class In>
void l2norm_factors(const In* q, const In* k, int K, float scale, float& rq, float& rk) {
  constexpr int W = 16;
  float sq[W] = {}, sk[W] = {};
  int d0 = 0;
  for (; d0 + W <= K; d0 += W) {
#pragma omp simd
    for (int i = 0; i < W; ++i) {
      const float x = to_f32(q[d0 + i]), y = to_f32(k[d0 + i]);
      sq[i] += x * x;
      sk[i] += y * y;
    }
  }
  for (int i = 0; d0 + i < K; ++i) {
    const float x = to_f32(q[d0 + i]), y = to_f32(k[d0 + i]);
    sq[i] += x * x;
    sk[i] += y * y;
  }
  for (int w = W / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) {
      sq[i] += sq[i + w];
      sk[i] += sk[i + w];
    }
  }
  rq = scale / std::sqrt(sq[0] + 1e-6f);
  rk = 1.0f / std::sqrt(sk[0] + 1e-6f);
}

}  // namespace kda::kernels::KDA_ISA_NS::vecmath
KDA_ISA_POP
