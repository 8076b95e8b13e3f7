#include "kda/kernels/online_softmax.h"

#include <cmath>
#include <cstdint>

#include "kda/common/isa_target.h"
#include "kda/kernels/exp_simd.h"
#include "kda/kernels/online_softmax_isa.h"

// One copy per ISA (isa_target.h); online_softmax_dispatch.cc picks one per call.
KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS {
namespace {

// exp(x) for x <= 0, exactly 0 below -87 (and for -inf, a masked entry), where exp_simd would clamp.
inline float exp_or_zero(float x) { return x < -87.0f ? 0.0f : exp_simd(x); }

}  // namespace

void online_softmax_block(float* s, int64_t n, int64_t rows, float scale, float* mx, float* l, float* acc,
                          int64_t dv) {
  for (int64_t i = 0; i < rows; ++i) {
    float* r = s + i * n;
    float m = mx[i];
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) {
      r[j] *= scale;
      m = r[j] > m ? r[j] : m;
    }
    if (m == -INFINITY) {  // nothing seen yet: the block adds nothing
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) r[j] = 0.0f;
      continue;
    }
    const float alpha = exp_or_zero(mx[i] - m);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      r[j] = exp_or_zero(r[j] - m);
      sum += r[j];
    }
    l[i] = l[i] * alpha + sum;
    mx[i] = m;
    float* o = acc + i * dv;
#pragma omp simd
    for (int64_t c = 0; c < dv; ++c) o[c] *= alpha;
  }
}

}  // namespace kda::kernels::KDA_ISA_NS
KDA_ISA_POP
