// Float64 building blocks of the test references (layer_reference, model_reference): a GEMM of double
// activations by fp32 weights, and the bf16 rounding of a double.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

namespace kda::testing {

// Y[t * ldy + o] = sum_i W[o * cols + i] * X[t * ldx + i] for t < n, o < rows: W row-major [rows, cols]
// (PyTorch's [out, in]), accumulated in double. OpenMP over the output rows.
void ref_gemm(const float* W, int64_t rows, int64_t cols, const double* X, int64_t n, int64_t ldx, double* Y,
              int64_t ldy);

// The bf16 value nearest a double, as a double: through fp32 as a bf16 cast of a double tensor goes.
inline double ref_round_bf16(double x) { return round_bf16(static_cast<float>(x)); }

}  // namespace kda::testing
