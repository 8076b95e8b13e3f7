// The bf16 GEMM's per-ISA copies (bf16_gemm.cc compiled once per ISA, see kda/common/isa_target.h),
// behind the entry points of bf16_gemm.h. Private to the library and its tests.
#pragma once

#include <algorithm>

#include "kda/kernels/gemm/bf16_gemm.h"

namespace kda::kernels::gemm {

// Groups of kPackGroup inputs per channel in the packed W, and the values of one block of channels.
inline int64_t packed_groups(int64_t in) { return (in + kPackGroup - 1) / kPackGroup; }
inline int64_t packed_block_size(int64_t in) { return packed_groups(in) * kPackChannels * kPackGroup; }

// Channels [nb * 4, nb * 4 + nn) of the packed W (block nb, nn = its real channels) widened to fp32
// rows of `in` values: out [nn, in].
inline void widen_block(const Bf16Weights& w, int64_t nb, float* out) {
  const int64_t nn = std::min(kPackChannels, w.out - nb * kPackChannels), groups = packed_groups(w.in);
  const bf16_t* b = w.w + nb * packed_block_size(w.in);
  for (int64_t j = 0; j < nn; ++j)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * kPackGroup, n = std::min(kPackGroup, w.in - k0);
      const bf16_t* src = b + (g * kPackChannels + j) * kPackGroup;
      for (int64_t t = 0; t < n; ++t) out[j * w.in + k0 + t] = bf16_to_f32(src[t]);
    }
}

namespace portable {
void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy);
}  // namespace portable
namespace avx2 {
void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy);
}  // namespace avx2
namespace avx512 {
void gemm_bf16(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy);
}  // namespace avx512

}  // namespace kda::kernels::gemm
