// The bf16 GEMM's entry points (the copy for best_isa()), the widening and the reference.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kda/common/isa.h"
#include "kda/kernels/gemm/bf16_gemm.h"
#include "kda/kernels/gemm/bf16_gemm_isa.h"

namespace kda::kernels::gemm {
namespace {

void check_call(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, const float* y, int64_t ldy) {
  if (w.in <= 0 || w.out <= 0 || w.w == nullptr) throw std::invalid_argument("bf16 gemm: empty weights");
  if (M < 0 || ldx < w.in || ldy < w.out) throw std::invalid_argument("bf16 gemm: bad M or row strides");
  if (M > 0 && (x == nullptr || y == nullptr)) throw std::invalid_argument("bf16 gemm: null x or y");
}

}  // namespace

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

void gemm(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy, Isa isa) {
  check_call(x, M, ldx, w, y, ldy);
  require_isa(isa);
  if (M == 0) return;
  switch (isa) {
    case Isa::Avx512:
#if defined(KDA_WITH_AVX512)
      return avx512::gemm_bf16(x, M, ldx, w, y, ldy);
#endif
      break;
    case Isa::Avx2:
#if defined(KDA_WITH_AVX2)
      return avx2::gemm_bf16(x, M, ldx, w, y, ldy);
#endif
      break;
    default:
      break;
  }
  portable::gemm_bf16(x, M, ldx, w, y, ldy);
}

void gemm(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy) {
  gemm(x, M, ldx, w, y, ldy, best_isa());
}

void gemm_reference(const float* x, int64_t M, int64_t ldx, const Bf16Weights& w, float* y, int64_t ldy) {
  check_call(x, M, ldx, w, y, ldy);
  std::vector<float> wf(static_cast<size_t>(w.in * w.out));
  widen_rows(w, 0, w.out, wf.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < w.out; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < w.in; ++k) s += x[m * ldx + k] * wf[n * w.in + k];
      y[m * ldy + n] = s;
    }
}

}  // namespace kda::kernels::gemm
