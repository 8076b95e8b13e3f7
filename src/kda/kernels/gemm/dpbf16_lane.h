// vdpbf16ps's arithmetic on one fp32 lane, for the plain-loop references beside the kernels built on it
// (bf16_vnni.h, int4_dpbf16.h): denormal inputs and results as zero (keeping the sign), the rest IEEE fp32
// with rounding to nearest even (a product of two bf16 values is exact in fp32 unless it overflows or is
// denormal); per input pair the odd input's product is added first, then the even one's.
#pragma once

#include <cmath>

namespace kda::kernels::gemm {

inline float dpbf16_daz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

// acc after one vdpbf16ps lane step on the pair (a0, a1) x (b0, b1), all already widened to fp32.
inline float dpbf16_pair(float acc, float a0, float a1, float b0, float b1) {
  acc = dpbf16_daz(acc + dpbf16_daz(dpbf16_daz(a1) * dpbf16_daz(b1)));
  return dpbf16_daz(acc + dpbf16_daz(dpbf16_daz(a0) * dpbf16_daz(b0)));
}

}  // namespace kda::kernels::gemm
