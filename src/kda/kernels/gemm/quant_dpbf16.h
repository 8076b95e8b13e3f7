// The quantized GEMM y = x W^T on AVX512_BF16 (vdpbf16ps) for bf16 activations, at prefill row counts and
// decode batches from 9 rows: W in its packed int8 or int4 format (quant_gemm.h) is widened, a block of 32
// output channels at a time, into a panel of the scheme's integers (int8's q, int4's nibble - 8: exact in
// bf16) in the pair layout vdpbf16ps reads; every row of x then meets the panel from L2. A product of a
// bf16 x and such an integer is exact in fp32 (8 significant bits times at most 8), so the only roundings
// are the fp32 sums, and the scale (int8: the channel's; int4: each group's) is applied to the sums. This
// runs the quantized GEMMs at the bf16 rate without AMX: the integer decode kernels take int16 activations
// at half that rate, and oneDNN has no int4 GEMM (its fp32 matmul on dequantized tiles runs at the fp32
// rate; docs/performance.md).
//
// Each output is summed in an order fixed by the scheme, the same whatever the row count and threads:
//  - int8: s = the sum of all input pairs in ascending order as vdpbf16ps adds them (from zero; per pair
//    the odd input's product, then the even one's, each an fp32 add rounded to nearest even, denormal
//    inputs and results taken as zero), y = s * scale[n].
//  - int4: per group g of 32 inputs in ascending order, s_g = its 16 pairs summed so from zero, and
//    y = fma(s_g, scale[n, g], y) from y = 0.
// The references below do exactly that in plain loops; the kernels' bits equal them
// (tests/test_quant_dpbf16.cc).
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/quant_gemm.h"

namespace kda::kernels::gemm {

// Whether this CPU runs the kernels (AVX512_BF16, and a build with the AVX-512 copies).
bool cpu_has_quant_dpbf16();

// y[M, out] (row stride ldy >= out, fp32) = x[M, in] (bf16, row stride ldx >= in) W^T. Any M >= 0; meant
// for 9 rows or more (each call widens W once per pass of up to 192 rows; int4's calls of at most 16 rows
// widen each group of 16 channels in registers and meet every row there, with no panel). int4: in a
// multiple of 32.
// std::logic_error where !cpu_has_quant_dpbf16(); std::invalid_argument for bad sizes, strides or null data,
// before anything is written.
void gemm_int8_dpbf16(const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy);
void gemm_int4_dpbf16(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy);
// The checks the int4 and int8 entry points make, for kernels of the same signature elsewhere (quant_amx.h):
// std::invalid_argument naming `what` for bad sizes, strides or null data.
void check_int4_dpbf16_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w,
                            const float* y, int64_t ldy);
void check_int8_dpbf16_args(const char* what, const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w,
                            const float* y, int64_t ldy);
// The references, in every build: the same sums in the same order in plain loops; the same checks.
void gemm_int8_dpbf16_reference(const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y,
                                int64_t ldy);
void gemm_int4_dpbf16_reference(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y,
                                int64_t ldy);

}  // namespace kda::kernels::gemm
