// A small fp32 GEMM for one thread, C = alpha A B + beta C (all row-major), for kernels that run one block
// per thread inside their own parallel region (MLA's blocked prefill attention). oneDNN's sgemm packs its
// operands into buffers it allocates and frees on every call; above the library's mmap threshold
// (common/allocator.h) each call maps fresh pages, faults them in and unmaps them (thousands of calls
// per prefill). This one reads A and B in place and allocates nothing: the caller lays B out so that its
// rows stream well (f32_block_ld).
//
// Each C value is sum_{p = 0..K-1} A[i, p] B[p, j] in that order from zero (fp32, the kernels may fuse
// each multiply-add), then times alpha, plus beta C where beta != 0 (C is not read where beta == 0).
#pragma once

#include <cstdint>

namespace kda::kernels::gemm {

// C[M, N] (row stride ldc >= N) = alpha A[M, K] (lda >= K) B[K, N] (ldb >= N) + beta C, on the calling
// thread; the AVX-512 kernel where best_isa() allows it, else plain loops. M, N, K >= 0 (K == 0: C =
// beta C). std::invalid_argument for bad sizes, strides or null data, before anything is written.
void gemm_f32_block(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float beta, float* C, int64_t ldc);
// The reference: the same sums in plain loops (unfused), the same checks.
void gemm_f32_block_reference(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                              const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// A leading dimension of at least n floats for a B the kernel streams row after row: an odd number of
// 64-byte lines, so that consecutive rows fall in different L1 sets (at a multiple of 4 KiB every row
// would fall in the same few sets and evict the rows before it).
int64_t f32_block_ld(int64_t n);

}  // namespace kda::kernels::gemm
