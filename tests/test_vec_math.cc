// The kernels' exp and softplus approximations (kernels/kda/vec_math.h), scalar and 16-lane, against
// float64 libm over the ranges the gate sends through them, and at the edges the comments promise:
// 0 below -87 (a forgotten channel, never a subnormal), inf above the fp32 range, softplus(z) = z for
// large z. The scalar functions are the portable copy's (those of the other copies are the same C++);
// the 16-lane ones the AVX-512 copy's, where the build has it and the CPU runs it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kda/common/isa.h"
#include "kda/kernels/kda/vec_math.h"
#include "support/vec_math_lanes.h"

namespace kda::kernels::portable::vecmath {
namespace {

// Points spread over [lo, hi], both ends included.
std::vector<float> grid(float lo, float hi, int n) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = lo + (hi - lo) * static_cast<float>(i) / static_cast<float>(n - 1);
  return v;
}

double rel_err(double got, double want) { return std::fabs(got - want) / std::fabs(want); }

double softplus64(double z) { return z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z)); }

#if defined(KDA_TEST_AVX512_LANES)
bool have_lanes() { return isa_available(Isa::Avx512); }
// f (one of vec_math_lanes.h) applied to xs.
std::vector<float> lanes(const std::vector<float>& xs, void (*f)(const float*, float*, size_t)) {
  std::vector<float> out(xs.size());
  f(xs.data(), out.data(), xs.size());
  return out;
}
constexpr auto exp16 = testing::avx512::exp16_lanes;
constexpr auto softplus16 = testing::avx512::softplus16_lanes;
#endif

// exp over the decays' range: within 2e-7 of the float64 value (measured 8.3e-8, ~1.4 ulp).
TEST(VecMath, ExpMatchesLibmOverTheDecayRange) {
  const auto xs = grid(-87.0f, 0.0f, 20001);
  double worst = 0;
  for (float x : xs) worst = std::max(worst, rel_err(exp_approx(x), std::exp(static_cast<double>(x))));
  EXPECT_LT(worst, 2e-7);
#if defined(KDA_TEST_AVX512_LANES)
  if (have_lanes()) {
    const auto ys = lanes(xs, exp16);
    double worst16 = 0;
    for (size_t i = 0; i < xs.size(); ++i)
      worst16 = std::max(worst16, rel_err(ys[i], std::exp(static_cast<double>(xs[i]))));
    EXPECT_LT(worst16, 2e-7);
  }
#endif
}

TEST(VecMath, ExpEdges) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {-87.01f, -90.0f, -1e30f, -inf}) EXPECT_EQ(exp_approx(x), 0.0f) << x;
  EXPECT_EQ(exp_approx(0.0f), 1.0f);
#if defined(KDA_TEST_AVX512_LANES)
  if (have_lanes()) {
    const std::vector<float> xs = {-87.01f, -90.0f, -1e30f, -inf, 0.0f, 200.0f, inf, 10.0f};
    const auto ys = lanes(xs, exp16);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(ys[i], 0.0f) << xs[i];
    EXPECT_EQ(ys[4], 1.0f);
    EXPECT_EQ(ys[5], inf);
    EXPECT_EQ(ys[6], inf);
    EXPECT_LT(rel_err(ys[7], std::exp(10.0)), 2e-7);
  }
#endif
}

// softplus over the raw gate's range (f + dt_bias): within 4e-7 of the float64 value (measured 2.2e-7
// scalar, 2.6e-7 in lanes), and z itself above 20.
TEST(VecMath, SoftplusMatchesLibm) {
  const auto zs = grid(-80.0f, 60.0f, 28001);
  double worst = 0;
  for (float z : zs) worst = std::max(worst, rel_err(softplus_approx(z), softplus64(z)));
  EXPECT_LT(worst, 4e-7);
#if defined(KDA_TEST_AVX512_LANES)
  if (have_lanes()) {
    const auto ys = lanes(zs, softplus16);
    double worst16 = 0;
    for (size_t i = 0; i < zs.size(); ++i) worst16 = std::max(worst16, rel_err(ys[i], softplus64(zs[i])));
    EXPECT_LT(worst16, 4e-7);
    for (size_t i = 0; i < zs.size(); ++i) {
      if (zs[i] > 20.0f) {
        ASSERT_EQ(ys[i], zs[i]) << zs[i];
      }
    }
  }
#endif
  for (float z : zs) {
    if (z > 20.0f) {
      ASSERT_EQ(softplus_approx(z), z) << z;
    }
  }
}

}  // namespace
}  // namespace kda::kernels::portable::vecmath
