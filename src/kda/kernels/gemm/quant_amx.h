// The quantized GEMM of quant_gemm.h on AMX-INT8 tiles (Sapphire Rapids and later), for the decode and
// MoE row counts: the same activations (int16, quantize_activations) and the same integer sums, taken
// by the tile unit instead of VNNI. The AVX-512 kernels' work grows with the rows (one dot product
// instruction per row per 32 or 64 weights), so from a few rows on they, not memory, set the pace; a
// tile product takes 16 rows at once.
//
// Each int16 activation x is split into a signed high byte and an unsigned low one, x = 256 h + l, and a
// weight tile (16 channels by 64 inputs, or one int4 group of 32) meets both: TDPBSSD (signed by signed)
// for h and TDPBSUD (signed by unsigned) for l, each an exact int32 sum. The weights are the tiles' A
// operand, read in place (int8) or unpacked from their nibbles to (nibble - 8) bytes per call (int4); the
// activations are the B operand, rearranged once per call into the tiles' 4-byte interleaved layout.
//  - int8: per output the exact sum 256 sum(q h) + sum(q l) (in int64), converted to fp32 once, then
//    times the channel scale and the row's scale: the portable kernel's value, bit for bit.
//  - int4: per group the exact integer sum of (nibble - 8) x, converted and scaled by weight scale times
//    activation scale, added over the groups in order in fp32 (one FMA each).
// Threads split the blocks of 16 channels; the channels past the last whole block go to the AVX-512
// kernel.
#pragma once

#include <cstdint>

#include "kda/kernels/gemm/quant_gemm.h"

namespace kda::kernels::gemm {

// Whether this CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use the tile data
// (Linux's arch_prctl permission, asked once here): false on every other machine and build.
bool cpu_has_amx_int8();

// The row counts from which the entry points (weight_format.h) take the AMX kernels over the AVX-512
// ones: the crossovers `kda bench --only qdecode` shows on a Sapphire Rapids Xeon. The AMX kernels' time
// hardly grows with the rows up to 16 (per block of weights the tile loads, products and stores cost
// the same whatever the rows), the AVX-512 ones' grows with every row; int4's AMX kernel, which also
// unpacks the nibbles and scales every group of 32, pays from more rows than int8's.
inline constexpr int64_t kAmxMinRowsInt8 = 4, kAmxMinRowsInt4 = 7;

// The AMX kernels, with quant_gemm_isa.h's signatures minus the VNNI choice (the channel tail goes to
// the AVX-512 kernel with VNNI where the CPU has it). std::logic_error where !cpu_has_amx_int8(); int8
// needs in to be a multiple of 64 and at most 65536 (amx_takes; std::invalid_argument otherwise).
bool amx_takes(const Int8Weights& w);
void gemm_int8_amx(const int16_t* xq, const float* sx, int64_t M, const Int8Weights& w, float* y,
                   int64_t ldy);
void gemm_int4_amx(const int16_t* xq, const float* sx, int64_t M, const Int4Weights& w, float* y,
                   int64_t ldy);

}  // namespace kda::kernels::gemm
