// The bf16 format's packing and widening (the table of weight_format.h points here).
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kda/kernels/gemm/bf16_gemm.h"
#include "kda/kernels/gemm/bf16_gemm_isa.h"

namespace kda::kernels::gemm {

int64_t packed_size(int64_t in, int64_t out) { return PackShape(in, out).size(); }

void pack(const bf16_t* w, int64_t in, int64_t out, bf16_t* packed) {
  if (in <= 0 || out <= 0 || w == nullptr || packed == nullptr)
    throw std::invalid_argument("bf16 gemm: pack of empty weights");
  const PackShape ps(in, out);
  std::fill(packed, packed + ps.size(), bf16_t{0});
  for (int64_t c = 0; c < ps.chunks; ++c)
    for (int64_t nb = 0; nb < ps.blocks; ++nb)
      for (int64_t g = 0; g < ps.groups_in(c); ++g) {
        const int64_t k0 = (c * ps.chunk_groups + g) * kPackGroup, n = std::min(kPackGroup, in - k0);
        for (int64_t j = 0; j < kPackChannels && nb * kPackChannels + j < out; ++j) {
          const bf16_t* row = w + (nb * kPackChannels + j) * in + k0;
          std::copy(row, row + n, packed + ps.offset(c, nb) + (g * kPackChannels + j) * kPackGroup);
        }
      }
}

void widen_rows(const Bf16Weights& w, int64_t n0, int64_t n1, float* out) {
  std::vector<float> block(static_cast<size_t>(kPackChannels * w.in));
  for (int64_t n = n0; n < n1;) {  // the blocks that hold rows [n0, n1)
    const int64_t nb = n / kPackChannels, first = nb * kPackChannels;
    widen_block(w, nb, block.data());
    const int64_t last = std::min({n1, first + kPackChannels, w.out});
    std::copy(block.begin() + (n - first) * w.in, block.begin() + (last - first) * w.in,
              out + (n - n0) * w.in);
    n = last;
  }
}

}  // namespace kda::kernels::gemm
