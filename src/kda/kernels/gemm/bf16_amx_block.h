// A block of the bf16 GEMM y = x W^T on AMX-BF16 tiles, on the calling thread, with W in gemm_bf16_vnni's
// layout (bf16_vnni.h: blocks of 64 channels, each K / 2 rows of 64 channels x 2 inputs). That layout is
// already the tiles' B operand: the 16 input pairs by 16 channels of a B tile are 16 of a block's pair
// rows, 64 bytes of each, 256 bytes apart; so W is read in place, with no per-call arrangement, and x's
// rows are the A operand as they lie. Meant for blocks a thread owns inside a parallel region (the MLA
// prefill's scores: a query block against a key block, dozens of rows by hundreds of keys by 192 inputs),
// where gemm_bf16_vnni runs at the AVX512_BF16 rate and AMX runs several times faster.
//
// The C tiles go 2 x 2 (32 rows by 32 channels), each summing its 16 x 16 outputs in fp32 over the
// inputs in steps of 32; a row's results do not depend on the rows beside it. Row and channel counts past
// whole tiles take narrower tiles (their loads and stores touch nothing past M rows or N channels). The
// tile unit treats denormal inputs and results as zero.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

namespace kda::kernels::gemm {

// Whether gemm_bf16_amx_block runs here (cpu_has_amx_bf16()) and takes K inputs (a multiple of 32).
bool bf16_amx_block_takes(int64_t K);

// y[M, N] (fp32, row stride ldy >= N) = x[M, K] (bf16, row stride ldx >= K) W^T, W [N, K] in
// gemm_bf16_vnni's layout. std::logic_error where !cpu_has_amx_bf16(); std::invalid_argument for K not a
// positive multiple of 32, N < 1, M < 0 or strides below K / N, before anything is written.
void gemm_bf16_amx_block(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                         float* y, int64_t ldy);

// The decode rows: y = x W^T as gemm_bf16_amx_block computes it (the same bits: each output summed from
// zero over the inputs in steps of 32), for the row counts of decode and verify steps, where a layer's
// projection is one pass over W per call of up to kAmxRows rows. Per 64-channel block of W, its four B
// tiles side by side summed into four C tiles of a group of up to 16 rows, the groups in turn: the first
// reads the block in address order, 4 KB per 32 inputs, prefetched two steps ahead into L1; the others
// find it in L2. Threads split the 64-channel blocks (inside a parallel region the calling thread does
// them all). y fp32, or bf16 rounded to nearest even (f32_to_bf16) as it is stored. W in gemm_bf16_vnni's
// layout, padded to whole blocks of 64 channels (the padding is read, never stored). The same errors as
// gemm_bf16_amx_block.
inline constexpr int64_t kAmxRows = 64;
void gemm_bf16_amx_rows(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                        float* y, int64_t ldy);
void gemm_bf16_amx_rows(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                        bf16_t* y, int64_t ldy);

// The reference, in every build: x and W widened to fp32, y[m, n] = sum_k x[m, k] W[n, k] in fp32, k
// ascending. The same argument checks.
void gemm_bf16_amx_block_reference(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K,
                                   int64_t N, float* y, int64_t ldy);

}  // namespace kda::kernels::gemm
