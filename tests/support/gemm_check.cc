#include "support/gemm_check.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kda::testing {

std::vector<Isa> available_isas() {
  std::vector<Isa> v;
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512})
    if (isa_available(isa)) v.push_back(isa);
  return v;
}

void expect_close_fp32(const std::vector<float>& x, int64_t ldx, const std::vector<float>& wf, int64_t M,
                       int64_t in, int64_t out, const float* y, int64_t ldy, const float* yref, int64_t ldr,
                       const std::string& what) {
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < out; ++n) {
      double mag = 0.0;
      for (int64_t k = 0; k < in; ++k) mag += std::fabs(static_cast<double>(x[m * ldx + k]) * wf[n * in + k]);
      const double tol = 2.0 * static_cast<double>(in) * std::ldexp(1.0, -24) * mag + 1e-30;
      const double d = std::fabs(static_cast<double>(y[m * ldy + n]) - yref[m * ldr + n]);
      if (!(d <= tol) && bad++ < 5)
        ADD_FAILURE() << what << ": y[" << m << ", " << n << "] = " << y[m * ldy + n] << ", reference "
                      << yref[m * ldr + n] << " (tolerance " << tol << ")";
    }
  EXPECT_EQ(bad, 0) << what;
}

std::vector<float> gemm_double(const std::vector<float>& x, int64_t ldx, const std::vector<float>& wf,
                               int64_t M, int64_t in, int64_t out) {
  std::vector<float> y(static_cast<size_t>(M * out));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < out; ++n) {
      double s = 0.0;
      for (int64_t k = 0; k < in; ++k) s += static_cast<double>(x[m * ldx + k]) * wf[n * in + k];
      y[m * out + n] = static_cast<float>(s);
    }
  return y;
}

}  // namespace kda::testing
