// The quantized GEMM's per-ISA copies (quant_gemm.cc compiled once per ISA, see kda/common/isa_target.h),
// behind the entry points of quant_gemm.h. Private to the library and its tests.
#pragma once

#include "kda/kernels/gemm/quant_gemm.h"

namespace kda::kernels::gemm {

#define KDA_QUANT_GEMM_DECLS                                                                           \
  void gemm_int8(const float* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy); \
  void gemm_int4(const float* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy);

namespace portable {
KDA_QUANT_GEMM_DECLS
}  // namespace portable
namespace avx2 {
KDA_QUANT_GEMM_DECLS
}  // namespace avx2
namespace avx512 {
KDA_QUANT_GEMM_DECLS
}  // namespace avx512

#undef KDA_QUANT_GEMM_DECLS

}  // namespace kda::kernels::gemm
