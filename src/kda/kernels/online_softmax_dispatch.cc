// online_softmax_block's entry point, the copy for the fastest ISA this CPU runs (best_isa()), and its
// reference. Only the copies in the build are referenced.
#include <algorithm>
#include <cmath>

#include "kda/common/isa.h"
#include "kda/kernels/online_softmax.h"
#include "kda/kernels/online_softmax_isa.h"

namespace kda::kernels {

void online_softmax_block(float* s, int64_t n, int64_t rows, float scale, float* mx, float* l, float* acc,
                          int64_t dv) {
  switch (best_isa()) {
#if defined(KDA_WITH_AVX512)
    case Isa::Avx512:
      return avx512::online_softmax_block(s, n, rows, scale, mx, l, acc, dv);
#endif
#if defined(KDA_WITH_AVX2)
    case Isa::Avx2:
      return avx2::online_softmax_block(s, n, rows, scale, mx, l, acc, dv);
#endif
    default:
      return portable::online_softmax_block(s, n, rows, scale, mx, l, acc, dv);
  }
}

void online_softmax_block_reference(float* s, int64_t n, int64_t rows, float scale, float* mx, float* l,
                                    float* acc, int64_t dv) {
  for (int64_t i = 0; i < rows; ++i) {
    float* r = s + i * n;
    float m = mx[i];
    for (int64_t j = 0; j < n; ++j) {
      r[j] *= scale;
      m = std::max(m, r[j]);
    }
    if (m == -INFINITY) {
      std::fill(r, r + n, 0.0f);
      continue;
    }
    const float alpha = std::exp(mx[i] - m);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      r[j] = std::exp(r[j] - m);
      sum += r[j];
    }
    l[i] = l[i] * alpha + sum;
    mx[i] = m;
    for (int64_t c = 0; c < dv; ++c) acc[i * dv + c] *= alpha;
  }
}

}  // namespace kda::kernels
