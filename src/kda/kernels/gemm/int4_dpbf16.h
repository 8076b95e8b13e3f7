// The int4 prefill GEMM y = x W^T on AVX512_BF16 (vdpbf16ps) for bf16 activations: W in its packed int4
// format (quant_gemm.h: nibbles, a scale per group of 32 inputs) is widened, a block of 32 output
// channels at a time, into a panel of the integer values (nibble - 8, exact in bf16) in the pair layout
// vdpbf16ps reads; every row of x then meets the panel from L2. A product x * (nibble - 8) is exact in
// fp32 (8 significant bits times 4), so the only roundings are the fp32 sums, and the group's scale is
// applied once per group. This runs the int4 prefill at the bf16 rate where oneDNN has no int4 GEMM: the
// alternatives were W dequantized to fp32 tiles (the fp32 rate) or split into two bf16 tiles hi + lo
// (twice the depth), both about half as fast on a CPU without AMX (docs/performance.md).
//
// Each output is, per group g of 32 inputs in ascending order, s_g = the sum of the group's 16 input
// pairs in ascending order as vdpbf16ps adds them (from zero; per pair the odd input's product, then the
// even one's, each an fp32 add rounded to nearest even, denormal inputs and results taken as zero), and
// y = fma(s_g, scale[n, g], y) from y = 0. The reference below does exactly that in plain loops; the
// kernel's bits equal it (tests/test_int4_dpbf16.cc), whatever the row count and the threads.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/quant_gemm.h"

namespace kda::kernels::gemm {

// Whether this CPU runs the kernel (AVX512_BF16, and a build with the AVX-512 copies).
bool cpu_has_int4_dpbf16();

// y[M, out] (row stride ldy >= out, fp32) = x[M, in] (bf16, row stride ldx >= in) W^T with W int4 (in a
// multiple of 32). Any M >= 0; meant for prefill row counts (tens of rows or more: each call widens W
// once per block of rows). std::logic_error where !cpu_has_int4_dpbf16(); std::invalid_argument for bad
// sizes, strides or null data, before anything is written.
void gemm_int4_dpbf16(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy);
// The reference, in every build: the same sums in the same order in plain loops; the same checks.
void gemm_int4_dpbf16_reference(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y,
                                int64_t ldy);

}  // namespace kda::kernels::gemm
