// The quantized GEMM of quant_gemm.h on AMX tiles (Sapphire Rapids and later), for the decode and MoE
// row counts: the same activations (int16, quantize_activations) and the same integer sums, taken by the
// tile unit instead of VNNI. The AVX-512 kernels' work grows with the rows (one dot product instruction
// per row per 32 or 64 weights), so from a few rows on they, not memory, set the pace; a tile product
// takes 16 rows at once.
//
// Each int16 activation x is split into a signed high byte and an unsigned low one, x = 256 h + l.
//  - int8 (AMX-INT8): a weight tile (16 channels by 64 inputs, read in place) meets both: TDPBSSD (signed
//    by signed) for h and TDPBSUD (signed by unsigned) for l, each an exact int32 sum; per output the
//    exact sum 256 sum(q h) + sum(q l) (in int64), converted to fp32 once, then times the channel scale
//    and the row's scale: the portable kernel's value, bit for bit.
//  - int4: per group of 32 inputs the exact integer sum of (nibble - 8) x, times weight scale times
//    activation scale, added over the groups in order in fp32 (one FMA each): the same bits whatever
//    the tiles, so a row's value does not depend on the rows beside it. A block of 9..16 rows runs on
//    AMX-INT8 tiles: the weights unpacked to (nibble - 8) bytes, h and l as for int8 (a tile product of
//    one group's 32 inputs each), the two int32 sums combined and converted per group. A block of at
//    most 8 rows (M <= 8, or the last M % 16 rows) runs on AMX-BF16 tiles: the weights unpacked to
//    (nibble - 8) in bf16 (one vpsrlvw and one vpermw per channel and group), the activations as 256 h
//    and l in bf16 side by side in one tile (columns 0..7 and 8..15), so one product per group gives
//    both sums in fp32. Every bf16 value there is an integer and every partial sum stays below 2^24
//    (8 * 32768 * 32 = 2^23), so the two sums and their fp32 sum are exact: the vector unit is left an
//    add, a multiply and an FMA per 8 outputs (in 256-bit vectors, which take a third port), where int8
//    tiles leave a shift, an add, a conversion, a multiply and an FMA per 16 rows of one channel.
// The activations are the B operand, rearranged once per call into the tiles' interleaved layout (int4's
// bf16 block by the threads, a share of the groups each). Threads split the blocks of 16 channels; the
// channels past the last whole block go to the AVX-512 kernel.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/quant_gemm.h"

namespace kda::kernels::gemm {

// Whether this CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use the tile data
// (Linux's arch_prctl permission, asked once here): false on every other machine and build.
bool cpu_has_amx_int8();
// The same for AMX-BF16 (with AVX512_BF16), which the int4 kernel takes beside AMX-INT8.
bool cpu_has_amx_bf16();

// The row counts from which the entry points (weight_format.h) take the AMX kernels over the AVX-512
// ones: the crossovers measured on a Sapphire Rapids class Xeon (`kda bench --only qdecode`; int4 also
// at each row count from 4 to 8, both kernels called directly in turns). The AMX kernels' time
// hardly grows with the rows up to 16 (per block of weights the tile loads, products and stores cost
// the same whatever the rows), the AVX-512 ones' grows with every row; int4's AMX kernel, which also
// unpacks the nibbles and scales every group of 32, pays from more rows than int8's.
inline constexpr int64_t kAmxMinRowsInt8 = 4, kAmxMinRowsInt4 = 5;

// The AMX kernels, with quant_gemm_isa.h's signatures minus the VNNI choice (the channel tail goes to
// the AVX-512 kernel with VNNI where the CPU has it). std::logic_error where the CPU lacks the tiles a
// kernel takes (int8: cpu_has_amx_int8(), int4: that and cpu_has_amx_bf16()); int8
// needs in to be a multiple of 64 and at most 65536 (amx_takes; std::invalid_argument otherwise).
bool amx_takes(const Int8Weights& w);
void gemm_int8_amx(const int16_t* xq, const float* sx, int64_t M, const Int8Weights& w, float* y,
                   int64_t ldy);
void gemm_int4_amx(const int16_t* xq, const float* sx, int64_t M, const Int4Weights& w, float* y,
                   int64_t ldy);

// int4 weights against bf16 activations (the bf16 precision's prefill, and its decode from a few rows on:
// QuantLinear::kAmxBf16DecodeRowsInt4) on AMX-BF16 tiles, in one of two schemes by the call's rows:
//  - Fewer than kAmxBf16WidenedRows (at most 16 rows: decode batches): the scheme of gemm_int4_dpbf16
//    (quant_dpbf16.h). Per group of 32 inputs s_g, the sum of x times the (nibble - 8) integers (exact in
//    bf16: every product is exact in fp32), is one tile product from zero, summed in the tile unit's own
//    order (which is neither of vdpbf16ps's); then y = fma(s_g, scale[n, g], y) from y = 0 in ascending g,
//    as gemm_int4_dpbf16_reference. So the result is that reference's up to the fp32 rounding of each group
//    sum. Each weight is used once: per 16-channel block its groups are unpacked two groups ahead of their
//    product while the next block's bytes are prefetched; the sums are stored and scaled on the vector unit
//    while the next products run. The channels past the last whole block go to gemm_int4_dpbf16.
//  - More rows (prefill, verify and large batches): the weights widened to bf16, int4_widened of
//    (nibble - 8) * scale (a rounding of at most 2^-9 of each weight, small beside the int4 scheme's own:
//    kimi-linear-model.md's int4 bound), and y = x W^T summed over all the inputs in the tiles
//    (gemm_int4_widened_reference up to the tile unit's fp32 sums). The first scheme's per-group store and
//    scale, a quarter of its time and more at these row counts, are gone. Per pass two 16-channel blocks
//    are widened once into a panel (a vpermw table of the 16 scaled values per channel and group), then
//    each pair of 16-row blocks meets it in four sum tiles over all the groups; the next pass's panel is
//    widened between this pass's products (the vector unit's work beside the tile unit's) and the pass
//    after it prefetched into L2. Every channel, the last block's included, takes this scheme.
// In both a row's bits do not depend on the rows beside it (within calls of the same scheme). x is
// rearranged once per kAmxBf16ChunkRows rows into tiles (16 input pairs by 16 rows, in L2 while every block
// of W meets them). Threads split the 16-channel blocks (pairs of them, widened). y fp32 [M, ldy >= out]; x
// bf16 [M, ldx >= in], in a multiple of 32. std::logic_error where !cpu_has_amx_bf16();
// std::invalid_argument for bad sizes, strides or null data, before anything is written.
inline constexpr int64_t kAmxBf16ChunkRows = 256;
void gemm_int4_amx_bf16(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y, int64_t ldy);

// int8 weights against bf16 activations on AMX-BF16 tiles, the scheme of gemm_int8_dpbf16 (q exact in
// bf16, y = scale[n] times the fp32 sum of x q): gemm_int8_dpbf16_reference up to the order of the fp32
// sums. The work of gemm_int4_amx_bf16's widened calls, every row count: per pass two 16-channel blocks
// widened to bf16 (q as it is, in the inputs' order), each output summed over all the inputs in one tile,
// times its channel's scale as it is stored; the next pass widened between this one's products. The same
// threads, arguments and errors as gemm_int4_amx_bf16 (in a multiple of 32).
void gemm_int8_amx_bf16(const bf16_t* x, int64_t M, int64_t ldx, const Int8Weights& w, float* y, int64_t ldy);

// The calls that take the widened scheme: from this many rows.
inline constexpr int64_t kAmxBf16WidenedRows = 17;

// The widened weight of w, an int4 weight as the scheme gives it (the fp32 product (nibble - 8) * scale,
// dequantize's value): its bf16, rounded to nearest even, a value below fp32's normal range flushed to zero
// of its sign (as vcvtneps2bf16 does).
bf16_t int4_widened(float w);

// The reference of gemm_int4_amx_bf16's calls of kAmxBf16WidenedRows rows or more, in every build: W widened
// by int4_widened, y[m, n] = sum_k x[m, k] W[n, k] in fp32, k ascending. The same argument checks.
void gemm_int4_widened_reference(const bf16_t* x, int64_t M, int64_t ldx, const Int4Weights& w, float* y,
                                 int64_t ldy);

}  // namespace kda::kernels::gemm
