#include "support/ref_math.h"

namespace kda::testing {

namespace {

constexpr int64_t kRowTile = 16;  // weight rows a thread keeps in cache while tokens stream past
constexpr int64_t kTokens = 4;    // activation rows dotted with each weight row per pass

}  // namespace

void ref_gemm(const float* W, int64_t rows, int64_t cols, const double* X, int64_t n, int64_t ldx, double* Y,
              int64_t ldy) {
  // A tile of weight rows stays in cache while the activations pass by four rows at a time, so that
  // neither is re-read from memory per output; the widening to double happens in the dot itself.
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
  const bool parallel = rows * cols * n > (int64_t{1} << 18);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t o0 = tile * kRowTile, o1 = o0 + kRowTile < rows ? o0 + kRowTile : rows;
    int64_t t = 0;
    for (; t + kTokens <= n; t += kTokens) {
      const double *x0 = X + t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
      for (int64_t o = o0; o < o1; ++o) {
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
}

}  // namespace kda::testing
