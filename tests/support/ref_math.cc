#include "support/ref_math.h"

#include <algorithm>

namespace kda::testing {

namespace {

constexpr int64_t kRowTile = 16;  // weight rows a thread keeps in cache while tokens stream past
constexpr int64_t kTokens = 4;    // activation rows dotted with each weight row per pass

}  // namespace

namespace {

// GCC compiles the tile once per listed ISA and the baseline and picks one at load time (as
// kda/common/isa_target.h's KDA_TARGET_CLONES, whose build flags the test support does not get); not
// under ThreadSanitizer, which dies in the ifunc resolver.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define REF_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define REF_TARGET_CLONES
#endif

// Output rows [o0, o1) for every token: a tile of weight rows stays in cache while the activations pass
// by four rows at a time, so that neither is re-read from memory per output; the widening to double
// happens in the dot itself. A leaf, so that it can be cloned per ISA.
REF_TARGET_CLONES void gemm_tile(const float* W, int64_t o0, int64_t o1, int64_t cols, const double* X,
                                 int64_t n, int64_t ldx, double* Y, int64_t ldy) {
  int64_t t = 0;
  for (; t + kTokens <= n; t += kTokens) {
    const double *x0 = X + t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    int64_t o = o0;
    for (; o + 2 <= o1; o += 2) {  // two weight rows by four tokens: eight sums per pass
      const float *w0 = W + o * cols, *w1 = w0 + cols;
      double a00 = 0.0, a01 = 0.0, a02 = 0.0, a03 = 0.0, a10 = 0.0, a11 = 0.0, a12 = 0.0, a13 = 0.0;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13)
      for (int64_t i = 0; i < cols; ++i) {
        const double u = w0[i], v = w1[i];
        a00 += u * x0[i];
        a01 += u * x1[i];
        a02 += u * x2[i];
        a03 += u * x3[i];
        a10 += v * x0[i];
        a11 += v * x1[i];
        a12 += v * x2[i];
        a13 += v * x3[i];
      }
      Y[t * ldy + o] = a00;
      Y[(t + 1) * ldy + o] = a01;
      Y[(t + 2) * ldy + o] = a02;
      Y[(t + 3) * ldy + o] = a03;
      Y[t * ldy + o + 1] = a10;
      Y[(t + 1) * ldy + o + 1] = a11;
      Y[(t + 2) * ldy + o + 1] = a12;
      Y[(t + 3) * ldy + o + 1] = a13;
    }
    for (; o < o1; ++o) {
      const float* w = W + o * cols;
      double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t i = 0; i < cols; ++i) {
        const double wi = w[i];
        a0 += wi * x0[i];
        a1 += wi * x1[i];
        a2 += wi * x2[i];
        a3 += wi * x3[i];
      }
      Y[t * ldy + o] = a0;
      Y[(t + 1) * ldy + o] = a1;
      Y[(t + 2) * ldy + o] = a2;
      Y[(t + 3) * ldy + o] = a3;
    }
  }
  for (; t < n; ++t) {
    const double* x = X + t * ldx;
    for (int64_t o = o0; o < o1; ++o) {
      const float* w = W + o * cols;
      double a = 0.0;
#pragma omp simd reduction(+ : a)
      for (int64_t i = 0; i < cols; ++i) a += static_cast<double>(w[i]) * x[i];
      Y[t * ldy + o] = a;
    }
  }
}

}  // namespace

void ref_gemm(const float* W, int64_t rows, int64_t cols, const double* X, int64_t n, int64_t ldx, double* Y,
              int64_t ldy) {
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
  const bool parallel = rows * cols * n > (int64_t{1} << 18);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t tile = 0; tile < tiles; ++tile)
    gemm_tile(W, tile * kRowTile, std::min(rows, (tile + 1) * kRowTile), cols, X, n, ldx, Y, ldy);
}

}  // namespace kda::testing
