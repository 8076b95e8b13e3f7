// The bf16 GEMM's per-ISA copies (bf16_gemm.cc compiled once per ISA, see kda/common/isa_target.h),
// behind the entry points of bf16_gemm.h. Private to the library and its tests.
#pragma once

#include "kda/kernels/gemm/bf16_gemm.h"

namespace kda::kernels::gemm {

namespace portable {
void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy);
}  // namespace portable
namespace avx2 {
void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy);
}  // namespace avx2
namespace avx512 {
void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy);
}  // namespace avx512

}  // namespace kda::kernels::gemm
