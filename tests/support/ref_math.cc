#include "support/ref_math.h"

#include <vector>

namespace kda::testing {

void ref_gemm(const float* W, int64_t rows, int64_t cols, const double* X, int64_t n, int64_t ldx, double* Y,
              int64_t ldy) {
  // Each thread widens one weight row at a time and dots it with four activation rows per pass, so
  // that a weight row is read once per four tokens from cache and the dots vectorize.
  const bool parallel = rows * cols * n > (int64_t{1} << 16);
#pragma omp parallel if (parallel)
  {
    std::vector<double> wd(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t o = 0; o < rows; ++o) {
      const float* wr = W + o * cols;
      for (int64_t i = 0; i < cols; ++i) wd[i] = wr[i];
      const double* w = wd.data();
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
        const double *x0 = X + t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t i = 0; i < cols; ++i) {
          a0 += w[i] * x0[i];
          a1 += w[i] * x1[i];
          a2 += w[i] * x2[i];
          a3 += w[i] * x3[i];
        }
        Y[t * ldy + o] = a0;
        Y[(t + 1) * ldy + o] = a1;
        Y[(t + 2) * ldy + o] = a2;
        Y[(t + 3) * ldy + o] = a3;
      }
      for (; t < n; ++t) {
        const double* x = X + t * ldx;
        double a = 0.0;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < cols; ++i) a += w[i] * x[i];
        Y[t * ldy + o] = a;
      }
    }
  }
}

}  // namespace kda::testing
