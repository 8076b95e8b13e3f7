// The AVX-512 copy's 16-lane exp and softplus (kernels/kda/vec_math.h) over arrays, for test_vec_math:
// compiled in their own file as the AVX-512 kernels are, callable only where the CPU runs AVX-512.
#pragma once

#include <cstddef>

namespace kda::testing::avx512 {

// y[i] = exp16 / softplus16 of x[i], 16 at a time (the tail lanes padded with 0 and dropped).
void exp16_lanes(const float* x, float* y, size_t n);
void softplus16_lanes(const float* x, float* y, size_t n);

}  // namespace kda::testing::avx512
