// The SwiGLU MLPs' activation: a[t, i] = silu(h[t, i]) * h[t, I + i] over T rows of h [T, 2I] (the gate
// columns, then the up columns of the fused gate|up projection). fp32 in and out, or bf16 values in and
// out (the bf16 mode's rounding points: the projection's output and the product, rounded to nearest even
// once). exp is exp_simd (exp_simd.h, within 1.5 ulp), so a row's results are within 2e-7 relative of
// silu with libm's expf (layers/moe/swiglu.h's silu_mul_reference, the test's reference), in a loop that
// vectorises. Rows are split over the threads. Private to the library and its tests.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

namespace kda::kernels {

void silu_mul(const float* h, int64_t T, int64_t I, float* a);
void silu_mul(const bf16_t* h, int64_t T, int64_t I, bf16_t* a);

}  // namespace kda::kernels
