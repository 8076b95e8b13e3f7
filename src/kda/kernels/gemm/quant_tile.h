// The quantized weights as bf16 tiles for a bf16 matmul (QuantLinear's prefill path in the bf16
// precision, where the activations are bf16 values already), written so that the matmul's products are
// the scheme's own, not a rounding of them:
//  - int8: the integers q themselves (|q| <= 127 is exact in bf16's 8-bit significand); the channel's
//    scale is applied to the fp32 sums afterwards (scale_columns), so y = s_n * sum_k x_k q_nk, which
//    is x W^T with W = q s exactly up to fp32 summation order.
//  - int4: W = (nibble - 8) * scale is not a bf16 value (the group scale is fp32), so each dequantized
//    weight is split into two bf16 values hi + lo (hi W rounded to nearest, lo the rest rounded to
//    nearest; 16 significant bits): |W - (hi + lo)| <= 2^-16 |W|, within the fp32 summation rounding
//    bound the tests hold a dot product of 128 or more terms to (2 in 2^-24 sum |x w|).
//    A row of the tile holds hi for every input, then lo for every input, and x is taken twice ([x, x]):
//    one matmul of twice the depth.
// Beside each its reference (plain scalar code, the same values bit for bit); tests compare them.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/weight_format.h"

namespace kda::kernels::gemm {

// The depth of the bf16 tile for W's format: in (int8) or 2 * in (int4's hi, lo).
int64_t bf16_tile_depth(const PackedWeights& w);

// Rows [n0, n1) of W (int8 or int4) as bf16 tile rows into out [(n1 - n0), ld >= bf16_tile_depth(w)].
// std::invalid_argument for a bf16 W or a short ld.
void bf16_tile_rows(const PackedWeights& w, int64_t n0, int64_t n1, bf16_t* out, int64_t ld);
void bf16_tile_rows_reference(const PackedWeights& w, int64_t n0, int64_t n1, bf16_t* out, int64_t ld);

// Rows [n0, n1) of W as the tile oneDNN's bf16 matmul reads without a reorder: the weights [K, N] =
// [bf16_tile_depth, n1 - n0] (W^T) in its layout BA16a64b2a (the AMX / AVX512_BF16 brgemm kernels'
// own): blocks of 64 channels by 16 inputs, the blocks of one 64-channel group in input order, the
// groups in channel order; inside a block, input pairs (2k, 2k + 1) of each channel adjacent. K is
// padded to a multiple of 16 and N to one of 64 with zeros, as oneDNN requires of padding:
// out holds bf16_blocked_tile_size(w, n1 - n0) values. The same values as bf16_tile_rows.
int64_t bf16_blocked_tile_size(const PackedWeights& w, int64_t channels);
void bf16_tile_blocked(const PackedWeights& w, int64_t n0, int64_t n1, bf16_t* out);

// y[m, c] = src[m, c] * scale[c] (scale null: src[m, c]) for m < M, c < n: int8's channel scales on
// the tile's fp32 sums, as they are copied into y's columns.
void scale_columns(const float* src, int64_t lds, int64_t M, const float* scale, int64_t n, float* y,
                   int64_t ldy);
// The same into bf16 y, each value rounded to nearest even after its scale.
void scale_columns(const float* src, int64_t lds, int64_t M, const float* scale, int64_t n, bf16_t* y,
                   int64_t ldy);

}  // namespace kda::kernels::gemm
