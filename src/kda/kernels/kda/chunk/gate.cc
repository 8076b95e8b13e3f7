// chunk_kda_opt, the gate's decays (step 2, and the anchors applied after step 3). Every decay
// exp(Gamma_r - Gamma_s), r >= s, is a product of at most three factors, each <= 1 and each built over
// exactly the rows it spans: a running product of the per-step factors exp(g_i) inside one block of kSub
// rows and, across blocks, exp of a running sum taken at block boundaries. No positive exponent and no
// difference of two cumulative sums is ever formed.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kda/common/isa_target.h"
#include "kda/kernels/kda/chunk/common.h"
#include "kda/kernels/kda/vec_math.h"

KDA_ISA_PUSH
namespace kda::kernels::KDA_ISA_NS::chunk {

using vecmath::exp_approx;

// Step 2: in-block decays and the block anchors.
[[gnu::noinline]] void decays(int K, int L, Scratch& w) {
  float* __restrict P = w.P;
  for (int n = 0; n < L; n += kSub) {
    const int e = std::min(n + kSub, L) - 1;
    // Row factors from the block's first row: P = prod_{n<i<=r} exp(g_i).
    for (int r = n; r <= e; ++r) {
      const float* __restrict E = w.E + r * K;
      const float* __restrict Q = w.Q + r * K;
      const float* __restrict Kh = w.Kh + r * K;
      float* __restrict Xq = w.Xq + r * K;
      float* __restrict Xk = w.Xk + r * K;
      const float nb = -w.B[r];
      const bool first = r == n;
#pragma omp simd
      for (int d = 0; d < K; ++d) {
        const float p = first ? 1.0f : P[d] * E[d];
        P[d] = p;
        Xq[d] = Q[d] * p;
        Xk[d] = nb * Kh[d] * p;
      }
    }
    // Column factors to the block's last row: P = prod_{s<i<=e} exp(g_i).
    for (int s = e; s >= n; --s) {
      const float* __restrict E = w.E + (s + 1) * K;  // only read for s < e
      const float* __restrict Kh = w.Kh + s * K;
      float* __restrict Kc = w.Kc + s * K;
      const bool first = s == e;
#pragma omp simd
      for (int d = 0; d < K; ++d) {
        const float p = first ? 1.0f : P[d] * E[d];
        P[d] = p;
        Kc[d] = Kh[d] * p;
      }
    }
  }
  // Anchors, running sums over whole rows: forward from the chunk start to each block's first row (and
  // to the last row), backward from the chunk end to each block's last row (exclusive).
  float* __restrict acc = w.acc;
#pragma omp simd
  for (int d = 0; d < K; ++d) acc[d] = 0.0f;
  for (int r = 0; r < L; ++r) {
    const float* __restrict G = w.G + r * K;
#pragma omp simd
    for (int d = 0; d < K; ++d) acc[d] += G[d];
    if (r % kSub == 0) {
      float* __restrict fa = w.fa + (r / kSub) * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) fa[d] = exp_approx(acc[d]);
    }
  }
#pragma omp simd
  for (int d = 0; d < K; ++d) w.last[d] = exp_approx(acc[d]);
#pragma omp simd
  for (int d = 0; d < K; ++d) acc[d] = 0.0f;
  for (int r = L - 1; r >= 0; --r) {
    if (r == L - 1 || r % kSub == kSub - 1) {
      float* __restrict ra = w.ra + (r / kSub) * K;
#pragma omp simd
      for (int d = 0; d < K; ++d) ra[d] = exp_approx(acc[d]);
    }
    const float* __restrict G = w.G + r * K;
#pragma omp simd
    for (int d = 0; d < K; ++d) acc[d] += G[d];
  }
}

// Turns Xq, Xk, Kc into Qf = Q exp(Gamma), Wn = -beta K exp(Gamma), Kr = K exp(Gamma_last - Gamma).
[[gnu::noinline]] void apply_anchors(int K, int L, Scratch& w) {
  for (int r = 0; r < L; ++r) {
    const float* __restrict fa = w.fa + (r / kSub) * K;
    const float* __restrict ra = w.ra + (r / kSub) * K;
    float* __restrict Xq = w.Xq + r * K;
    float* __restrict Xk = w.Xk + r * K;
    float* __restrict Kc = w.Kc + r * K;
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      Xq[d] *= fa[d];
      Xk[d] *= fa[d];
      Kc[d] *= ra[d];
    }
  }
}

}  // namespace kda::kernels::KDA_ISA_NS::chunk
KDA_ISA_POP
