// GEMM y = x W^T with bf16 weights, for CPUs without bf16 GEMM hardware: W [out, in] stored as bf16, packed
// in blocks of output channels (pack()), x and y fp32. oneDNN's bf16 matmul on such a CPU (AVX-512 without
// AVX512_BF16) is fast only at M = 1: from 2 rows on it converts and multiplies as a compute-bound kernel, so
// verifying 4 drafted tokens cost as much as decoding them one by one. These kernels read each weight once
// per call (a block of output channels stays in L1 while every row of x passes over it), widen bf16 to fp32
// in registers (a shift: bf16 is the top half of an fp32) and accumulate in fp32, so 1 row or 64 cost about
// one pass over W (more rows: one pass per 64). Each row's sums run in the same order at any M, so a row's
// result does not depend on its batch. OpenMP threads split the output channels. Beside the kernels a
// reference (weight_format.h): widen W to fp32, then plain loops (the tests compare the two).
#pragma once

#include <cstdint>

#include "kda/common/bf16.h"

namespace kda::kernels::gemm {

// W packed for the kernels by pack(): the inputs in groups of kPackGroup, the groups in K-chunks of
// up to 1024 inputs (equal but the last); chunk after chunk, the chunk's blocks of kPackChannels output
// channels, each block's groups, each group's channels of 32 weights one after the other; zero-padded.
// A call then reads W as one sequential stream per thread and chunk (from the checkpoint layout
// [out, in] a block of 4 channels was 4 streams 2 * in bytes apart, which the hardware prefetchers kept
// fewer lines in flight for), and a chunk of x rows stays in L1 while its blocks pass (5 whole rows of
// 2304 inputs did not, beside the weight stream). The measurements are in the performance docs.
constexpr int64_t kPackChannels = 4, kPackGroup = 32;
struct Bf16Weights {
  const bf16_t* w = nullptr;  // packed, packed_size(in, out) values
  int64_t in = 0, out = 0;
};

// Values of the packed form of W [out, in].
int64_t packed_size(int64_t in, int64_t out);
// W [out, in] (the checkpoint layout) -> packed [packed_size(in, out)].
void pack(const bf16_t* w, int64_t in, int64_t out, bf16_t* packed);

// Rows [n0, n1) of W widened to fp32 into out [(n1 - n0), in].
void widen_rows(const Bf16Weights& w, int64_t n0, int64_t n1, float* out);

// The entry points, the reference and the packing into owned storage: weight_format.h.

}  // namespace kda::kernels::gemm
