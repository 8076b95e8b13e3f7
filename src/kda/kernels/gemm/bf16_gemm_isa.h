// The bf16 GEMM's per-ISA copies (bf16_gemm.cc compiled once per ISA, see kda/common/isa_target.h),
// behind the table of weight_format.h. Private to the library and its tests.
#pragma once

#include <algorithm>

#include "kda/kernels/gemm/bf16_gemm.h"

namespace kda::kernels::gemm {

// The packed W's geometry (bf16_gemm.h): groups of kPackGroup inputs, taken in K-chunks of at most
// kChunkGroups groups (equal but the last); chunk after chunk, each chunk's blocks of kPackChannels
// channels one after the other, each block's groups, each group's channels of kPackGroup weights.
constexpr int64_t kChunkGroups = 32;
struct PackShape {
  static constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
  int64_t groups, chunk_groups, chunks, blocks;
  PackShape(int64_t in, int64_t out)
      : groups(ceil_div(in, kPackGroup)),
        chunk_groups(ceil_div(groups, ceil_div(groups, kChunkGroups))),  // as equal as the chunks can be
        chunks(ceil_div(groups, chunk_groups)),
        blocks(ceil_div(out, kPackChannels)) {}
  int64_t size() const { return groups * blocks * kPackChannels * kPackGroup; }
  int64_t groups_in(int64_t c) const { return std::min(chunk_groups, groups - c * chunk_groups); }
  // The first value of block nb's part of chunk c.
  int64_t offset(int64_t c, int64_t nb) const {
    return (c * chunk_groups * blocks + nb * groups_in(c)) * kPackChannels * kPackGroup;
  }
};

// Channels [nb * 4, nb * 4 + nn) of the packed W (block nb, nn = its real channels) widened to fp32
// rows of `in` values: out [nn, in].
inline void widen_block(const Bf16Weights& w, int64_t nb, float* out) {
  const PackShape ps(w.in, w.out);
  const int64_t nn = std::min(kPackChannels, w.out - nb * kPackChannels);
  for (int64_t c = 0; c < ps.chunks; ++c) {
    const bf16_t* b = w.w + ps.offset(c, nb);
    for (int64_t g = 0; g < ps.groups_in(c); ++g) {
      const int64_t k0 = (c * ps.chunk_groups + g) * kPackGroup, n = std::min(kPackGroup, w.in - k0);
      for (int64_t j = 0; j < nn; ++j) {
        const bf16_t* src = b + (g * kPackChannels + j) * kPackGroup;
        for (int64_t t = 0; t < n; ++t) out[j * w.in + k0 + t] = bf16_to_f32(src[t]);
      }
    }
  }
}

using Bf16Kernel = void(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy);

namespace portable {
Bf16Kernel gemm_bf16;
}  // namespace portable
namespace avx2 {
Bf16Kernel gemm_bf16;
}  // namespace avx2
namespace avx512 {
Bf16Kernel gemm_bf16;
}  // namespace avx512

}  // namespace kda::kernels::gemm
