// The bf16 GEMM y = x W^T at the decode row counts on AMX-BF16 tiles (Sapphire Rapids and later), W read
// in place in its checkpoint layout [N, K]. oneDNN's bf16 matmul on such a CPU reads a large W at memory
// speed only at one row into a strided output (its plain-layout gemm); from two rows on it wants W in a
// blocked layout of its own (a second copy where one W serves both) and its brgemm kernel there reads W
// well below the bandwidth at a few rows. Here a tile product takes 16 rows of x at once, so a call costs
// one pass over W from 1 to 64 rows.
//
// W's rows are the tiles' A operand (16 channels by 32 inputs, stride 2K bytes); x is rearranged once per
// call into the B operand's layout (pairs of consecutive inputs as 32-bit words, 16 rows per tile); up to
// four groups of 16 rows share each A tile load, each group summing into its own fp32 C tile (16
// channels by 16 rows), stored transposed into y. Every output is an fp32 sum of exact bf16 products
// over the inputs in ascending steps of 32 whatever M is: a row's result does not depend on the rows beside
// it. The tile unit treats denormal inputs and results as zero. Threads split the blocks of 16 channels;
// the last block, of fewer channels, takes tiles of fewer rows. A block's lines are prefetched two steps
// ahead into L1; memory's reads are the hardware prefetchers' (no software prefetch of the next block).
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

namespace kda::kernels::gemm {

// Whether this CPU has AMX-TILE and AMX-BF16 (with AVX512_BF16) and the kernel lets this process use the
// tile data (Linux's arch_prctl permission): false on every other machine and build. Defined in
// quant_amx.cc, whose int4 kernel needs the same, beside cpu_has_amx_int8.
bool cpu_has_amx_bf16();

// Whether gemm_bf16_amx takes K inputs: a positive multiple of 32 (one tile row of bf16).
inline bool bf16_amx_takes(int64_t K) { return K > 0 && K % 32 == 0; }

// y[M, N] (fp32, row stride ldy >= N) = x[M, K] (bf16, row stride ldx >= K) W^T, W [N, K] bf16 (row stride
// K). Any M >= 0: one pass over W per 64 rows. std::logic_error where !cpu_has_amx_bf16();
// std::invalid_argument for a K that bf16_amx_takes refuses, N < 1, M < 0, or strides below K / N, before
// anything is written.
void gemm_bf16_amx(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, float* y,
                   int64_t ldy);

// The tiled layout of W: per block of 16 channels (the last one padded to 16 rows, never read) its K / 32
// tiles of 16 channels by 32 inputs, each 1 KB in one run, value (n, k) at bf16_amx_tiled_index(n, k, K)
// of bf16_amx_tiled_size(N, K) values. A block is then one run of bytes rather than 16 channel rows 2K
// bytes apart: at one row the kernel reads the LM head faster in this layout (at the read ceiling, where
// 16 channel runs per thread hold the hardware prefetchers below it), from 32 rows slower (one run per
// thread waits on memory at the tile products' pace): docs/performance.md, "The LM head in tile order".
// 2 to 16 rows take four blocks a pass here (four runs per thread, each x tile loaded once for them):
// "The LM head's rows four blocks a pass".
inline int64_t bf16_amx_tiled_size(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * K; }
inline int64_t bf16_amx_tiled_index(int64_t n, int64_t k, int64_t K) {
  return n / 16 * 16 * K + k / 32 * 512 + n % 16 * 32 + k % 32;
}
// Rows [n0, n1) of W, `rows` [n1 - n0, K] (fp32 rounded to nearest even, or bf16), into `tiled` (of
// bf16_amx_tiled_size(N, K) values for some N >= n1), in every build. std::invalid_argument for a K that
// bf16_amx_takes refuses or a bad range.
void bf16_amx_tile_rows(const float* rows, int64_t n0, int64_t n1, int64_t K, bf16_t* tiled);
void bf16_amx_tile_rows(const bf16_t* rows, int64_t n0, int64_t n1, int64_t K, bf16_t* tiled);
// gemm_bf16_amx on W in the tiled layout: the same bits, the same errors.
void gemm_bf16_amx_tiled(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                         float* y, int64_t ldy);

// The reference, in every build: x and W widened to fp32, y[m, n] = sum_k x[m, k] W[n, k] in fp32, k
// ascending. The same argument checks (any K > 0).
void gemm_bf16_amx_reference(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                             float* y, int64_t ldy);

}  // namespace kda::kernels::gemm
