// The quantized GEMM's per-ISA copies (quant_gemm.cc compiled once per ISA, see kda/common/isa_target.h),
// behind the table of weight_format.h. Private to the library and its tests.
#pragma once

#include "kda/kernels/gemm/quant_gemm.h"

namespace kda::kernels::gemm {

// x already quantized (quantize_activations): xq [M, in] (contiguous rows), sx its scales: [M] for
// int8 weights, [M, in / 32] for int4 ones. vnni:
// use AVX512_VNNI (the AVX-512 copy only, where the CPU has it; the others ignore it), which gives the
// same integer sums as the AVX-512BW instructions otherwise used.
using Int8Kernel = void(const int16_t* xq, const float* sx, int64_t M, const Int8Weights& w, float* y,
                        int64_t ldy, bool vnni);
using Int4Kernel = void(const int16_t* xq, const float* sx, int64_t M, const Int4Weights& w, float* y,
                        int64_t ldy, bool vnni);

namespace portable {
Int8Kernel gemm_int8;
Int4Kernel gemm_int4;
}  // namespace portable
namespace avx2 {
Int8Kernel gemm_int8;
Int4Kernel gemm_int4;
}  // namespace avx2
namespace avx512 {
Int8Kernel gemm_int8;
Int4Kernel gemm_int4;
}  // namespace avx512

// Whether this CPU has AVX512_VNNI (detected once); the table's AVX-512 entries pass it as `vnni`.
bool cpu_has_vnni();

}  // namespace kda::kernels::gemm
