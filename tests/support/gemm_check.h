// What the weight-only GEMM tests share (bf16, int8, int4): the ISA copies this build and CPU run, and
// the comparison of a kernel's y with its reference within fp32 summation rounding, and a reference in
// double.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/common/isa.h"

namespace kda::testing {

std::vector<Isa> available_isas();

// |y - y_ref| within fp32 summation rounding: 2 (kernel and reference) * in * 2^-24 * sum_k |x_k w_k|,
// w the fp32 weights [out, in] the kernels see; x [M, ldx], y [M, ldy], yref [M, ldr].
void expect_close_fp32(const std::vector<float>& x, int64_t ldx, const std::vector<float>& wf, int64_t M,
                       int64_t in, int64_t out, const float* y, int64_t ldy, const float* yref, int64_t ldr,
                       const std::string& what);

// x W^T summed in double, rounded to fp32: x [M, ldx], wf [out, in]; y [M, out].
std::vector<float> gemm_double(const std::vector<float>& x, int64_t ldx, const std::vector<float>& wf,
                               int64_t M, int64_t in, int64_t out);

}  // namespace kda::testing
