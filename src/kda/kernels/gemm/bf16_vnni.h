// The bf16 GEMM y = x W^T at the decode row counts on AVX512_BF16 (vdpbf16ps), W read in the blocked
// layout oneDNN's bf16 matmul keeps it in on such a CPU (its brgemm weights, BA16a64b2a: see below), so
// that one copy of W serves oneDNN's prefill calls and these. oneDNN's own kernels read a large W well
// below the memory bandwidth at these row counts (docs/performance.md, "bf16 decode on AVX512_BF16").
//
// Each output is summed as oneDNN's brgemm kernel sums it: the inputs in chunks of k_chunk (oneDNN 2.6:
// all of K up to 512 inputs, 512 up to 1024, 1024 beyond), each chunk's sum from zero in one fp32
// accumulator per (row, channel), vdpbf16ps over the chunk's input pairs in ascending order, the chunks'
// sums added in order. With oneDNN's chunk a row's bits are those of a oneDNN call of any row count
// (tests/test_bf16_vnni.cc checks it bit for bit; layers::Linear finds the chunk by asking oneDNN, and
// sends rows here only where the bits agree), and never depend on the rows beside it. Rows go in groups that
// share each weight load (the weights of a 64-channel block stay in L1 while the groups pass over a stretch
// of inputs); threads split the channels in columns of 16 (called inside a parallel region, the
// calling thread does them all).
//
// The layout (oneDNN's dims {K, N}, a = K, b = N): blocks of 64 output channels one after the other,
// each K / 2 rows of 64 channels x 2 inputs: the value W[n][k] of block nb = n / 64 sits at
// nb * 64 * K + (k / 2) * 128 + (n % 64) * 2 + k % 2. K is a multiple of 16 (oneDNN pads it to one; the
// kernel takes only K that need no padding), N padded up to a multiple of 64 with zero channels.
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

namespace kda::kernels::gemm {

constexpr int64_t kVnniBlockN = 64;  // output channels per block
constexpr int64_t kVnniBlockK = 16;  // K is a multiple of this

// Whether this CPU runs the kernel (AVX512_BF16, and a build with the AVX-512 copies).
bool cpu_has_bf16_vnni();
// Whether gemm_bf16_vnni takes K inputs (a positive multiple of 16).
inline bool bf16_vnni_takes(int64_t K) { return K > 0 && K % kVnniBlockK == 0; }
// Values of W in the layout: K x N rounded up to a multiple of 64.
inline int64_t bf16_vnni_size(int64_t K, int64_t N) {
  return K * ((N + kVnniBlockN - 1) / kVnniBlockN * kVnniBlockN);
}
// W [N, K] (checkpoint layout) into the layout above, padding channels zero (tests and benchmarks; a
// model's W gets there through oneDNN's reorder).
void pack_bf16_vnni(const bf16_t* w, int64_t K, int64_t N, bf16_t* packed);

// y[M, N] (row stride ldy >= N) = x[M, K] (bf16, row stride ldx >= K) W^T, fp32 out or bf16 out rounded
// to nearest even; k_chunk: the inputs per chunk (a multiple of 16; 0 or >= K: one chunk). Any M >= 0 (one
// pass over W per group of rows: meant for M up to a few dozen). std::logic_error where !cpu_has_bf16_vnni();
// std::invalid_argument for a K bf16_vnni_takes refuses, N < 1, M < 0, a bad k_chunk or strides below K / N,
// before anything is written.
void gemm_bf16_vnni(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, float* y,
                    int64_t ldy, int64_t k_chunk);
void gemm_bf16_vnni(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N, bf16_t* y,
                    int64_t ldy, int64_t k_chunk);

// The reference, in every build: plain loops doing what vdpbf16ps does per lane and input pair (the odd
// input's product added first, then the even one's, each an fp32 add rounded to nearest even; denormal
// inputs, products and sums taken as zero), pairs ascending, in the same chunks. The same argument checks.
void gemm_bf16_vnni_reference(const bf16_t* x, int64_t M, int64_t ldx, const bf16_t* w, int64_t K, int64_t N,
                              float* y, int64_t ldy, int64_t k_chunk);

}  // namespace kda::kernels::gemm
