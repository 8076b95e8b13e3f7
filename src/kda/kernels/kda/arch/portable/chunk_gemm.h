// chunk_kda_opt's product C = init + sum A B (chunk/gemm.cc), the portable and AVX2 copies' body: the
// same products as the AVX-512 micro-kernel, plain loops a row at a time (the compiler vectorizes the
// inner loop for the copy's ISA). Staging runs all at once before the products.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/chunk/stager.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

[[gnu::always_inline]] inline void gemm_body(int M, int N, const Seg* segs, int nseg, const Init& init,
                                             float* c, int64_t ldc, Stager* pf) {
  if (pf != nullptr) pf->finish();
  float acc[kChunk];  // one row, kChunk columns at a time
  for (int i = 0; i < M; ++i) {
    for (int j0 = 0; j0 < N; j0 += kChunk) {
      const int nw = std::min(kChunk, N - j0);
      const float sc = init.scale != nullptr ? init.scale[i] : 1.0f;
      for (int j = 0; j < nw; ++j) acc[j] = init.src != nullptr ? sc * init.src[i * init.ld + j0 + j] : 0.0f;
      for (int q = 0; q < nseg; ++q) {
        const Seg& s = segs[q];
        const int kd = s.lower ? std::min(s.kd, i + 1) : s.kd;
        for (int d = 0; d < kd; ++d) {
          const float x = s.at ? s.a[d * s.lda + i] : s.a[i * s.lda + d];
          const float* b = s.b + d * s.ldb + j0;
#pragma omp simd
          for (int j = 0; j < nw; ++j) acc[j] += x * b[j];
        }
      }
      for (int j = 0; j < nw; ++j) c[i * ldc + j0 + j] = acc[j];
    }
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
