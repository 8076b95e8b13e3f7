// chunk_kda_opt's small blocks, the portable and AVX2 copies' bodies: the same steps as the AVX-512
// ones (the 16 x 16 transpose, the diagonal blocks' pairs, the diagonal blocks of T), plain loops.
#pragma once

#include <cstdint>
#include <cstring>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

inline void transpose16(const float* src, int64_t lds, int nd, float* dst, int64_t ldd) {
  for (int d = 0; d < nd; ++d) {
    for (int i = 0; i < 16; ++i) dst[d * ldd + i] = src[i * lds + d];
  }
}

template <int NR>
inline void diag_pairs(int K, int s, int r0, const float* Q, const float* Kh, const float* E, const float* B,
                       float* Pst, float* Aqk, float* NAkk) {
  constexpr int C = kChunk;
  if (r0 == s) std::memcpy(Pst, Kh + s * K, K * sizeof(float));
  for (int i = 0; i < NR; ++i) {
    const int r = r0 + i;
    const float* __restrict e = E + r * K;
    const float* __restrict q = Q + r * K;
    const float* __restrict k = Kh + r * K;
    float dq = 0.0f, dk = 0.0f;
    if (r > s) {
      for (int d = 0; d < K; ++d) Pst[d] *= e[d];
    }
    for (int d = 0; d < K; ++d) {
      dq += q[d] * Pst[d];
      dk += k[d] * Pst[d];
    }
    Aqk[r * C + s] = dq;
    if (r > s) NAkk[r * C + s] = -B[r] * dk;
  }
}

inline void invert_diagonal_blocks(const float* NAkk, float* T) {
  constexpr int C = kChunk;
  for (int b = 0; b < kBlocks; ++b) {
    const int o = b * kSub;
    for (int r = 0; r < kSub; ++r) {
      float* row = T + (o + r) * C + o;
      for (int x = 0; x < kSub; ++x) row[x] = x == r ? 1.0f : 0.0f;
      for (int j = 0; j < r; ++j) {
        const float c = NAkk[(o + r) * C + o + j];
        for (int x = 0; x <= j; ++x) row[x] += c * T[(o + j) * C + o + x];
      }
    }
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
