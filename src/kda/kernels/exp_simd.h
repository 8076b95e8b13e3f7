// exp for the element-wise kernels compiled once per ISA (short conv's silu, the MLPs' silu * up): a
// form `omp simd` vectorises. Private to the library.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "kda/common/isa_target.h"

// One copy per ISA (isa_target.h): the includer's copy is compiled for its target.
KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS {

// exp(x) in a form `omp simd` vectorises (glibc's expf only vectorises under -ffast-math): Cody-Waite
// reduction x = n ln2 + r, |r| <= ln2/2, and Cephes' expf polynomial: within 1.5 ulp of exp, silu within
// 2e-7 relative. x is clamped to where 2^n is a normal float, so silu(z < -87) is ~1e-36 instead of
// z e^z: zero at any tolerance. NaN propagates.
inline float exp_simd(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const float t = std::fma(x, 1.44269504088896341f, shifter);
  const float n = t - shifter;
  float r = std::fma(n, -0.693359375f, x);  // ln2 split in two so that n * ln2_hi is exact
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.0f;
  const int32_t two_n = (std::bit_cast<int32_t>(t) - 0x4B400000 + 127) << 23;
  return p * std::bit_cast<float>(two_n);
}

}  // namespace kda::kernels::KDA_ISA_NS
KDA_ISA_POP
