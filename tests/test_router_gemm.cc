// The MoE router's logits (kernels/gemm/router_gemm.h): the kernel against its reference bit for bit on
// shapes across its blocks of 64 experts, its 16-expert vectors and its six-row tiles (the real 2304
// inputs by 16 and 256 experts among them), each row's bits whatever rows are beside it, the packing
// against W, and the checks before anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/kernels/gemm/router_gemm.h"
#include "support/test_support.h"

namespace kda {
namespace {

namespace kg = kernels::gemm;
using testing::random_normal;

int bits_differ(const std::vector<float>& a, const std::vector<float>& b) {
  int n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

TEST(RouterGemm, KernelGivesTheReferencesBitsOnEveryShape) {
  struct Shape {
    int64_t T, D, E;
  };
  const Shape shapes[] = {{1, 1, 1},      {1, 7, 15},     {2, 64, 16},    {5, 33, 17},    {6, 64, 63},
                          {7, 96, 64},    {13, 128, 65},  {16, 2304, 16}, {1, 2304, 256}, {16, 2304, 256},
                          {97, 256, 130}, {200, 2304, 8}, {0, 64, 16}};
  uint64_t seed = 1;
  for (const Shape& s : shapes) {
    const std::string what = std::to_string(s.T) + " rows, " + std::to_string(s.D) + " inputs, " +
                             std::to_string(s.E) + " experts";
    const std::vector<float> x = random_normal(static_cast<size_t>(s.T * s.D), seed++, 1.0f);
    const std::vector<float> w = random_normal(static_cast<size_t>(s.E * s.D), seed++, 0.05f);
    const std::vector<float> p = kg::pack_router(w, s.E, s.D);
    std::vector<float> got(static_cast<size_t>(s.T * s.E), -1.0f), want(got.size(), -2.0f);
    kg::router_logits(x.data(), s.T, s.D, p.data(), s.E, got.data());
    kg::router_logits_reference(x.data(), s.T, s.D, p.data(), s.E, want.data());
    EXPECT_EQ(bits_differ(got, want), 0) << what;
    // The reference is x W^T: within fp32 roundings of a double sum over W as given.
    std::vector<float> exact(got.size()), mag(got.size());
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t e = 0; e < s.E; ++e) {
        double sum = 0.0, abs_sum = 0.0;
        for (int64_t d = 0; d < s.D; ++d) {
          const double v = static_cast<double>(x[t * s.D + d]) * w[e * s.D + d];
          sum += v;
          abs_sum += std::fabs(v);
        }
        exact[t * s.E + e] = static_cast<float>(sum);
        mag[t * s.E + e] = static_cast<float>(abs_sum);
      }
    EXPECT_EQ(testing::fp32_sum_mismatches(want.data(), s.T, s.E, exact.data(), mag.data(), s.E, s.D, what),
              0);
    // Each row alone: its bits in the batch.
    std::vector<float> one(static_cast<size_t>(s.E));
    int moved = 0;
    for (int64_t t = 0; t < s.T; ++t) {
      kg::router_logits(x.data() + t * s.D, 1, s.D, p.data(), s.E, one.data());
      moved += std::memcmp(one.data(), got.data() + t * s.E, sizeof(float) * s.E) != 0;
    }
    EXPECT_EQ(moved, 0) << what;
  }
}

TEST(RouterGemm, BadArgumentsAreRefusedBeforeAnythingIsWritten) {
  const std::vector<float> x(64, 1.0f), p(64 * 4, 1.0f);
  std::vector<float> y(8, 7.0f);
  EXPECT_THROW(kg::router_logits(x.data(), -1, 64, p.data(), 4, y.data()), std::invalid_argument);
  EXPECT_THROW(kg::router_logits(x.data(), 1, 0, p.data(), 4, y.data()), std::invalid_argument);
  EXPECT_THROW(kg::router_logits(x.data(), 1, 64, p.data(), 0, y.data()), std::invalid_argument);
  EXPECT_THROW(kg::router_logits(nullptr, 1, 64, p.data(), 4, y.data()), std::invalid_argument);
  EXPECT_THROW(kg::router_logits(x.data(), 1, 64, p.data(), 4, nullptr), std::invalid_argument);
  EXPECT_THROW(kg::router_logits_reference(x.data(), 1, 64, nullptr, 4, y.data()), std::invalid_argument);
  EXPECT_EQ(y, std::vector<float>(8, 7.0f));
  EXPECT_THROW(kg::pack_router(std::vector<float>(10), 4, 3), std::invalid_argument);
  EXPECT_THROW(kg::pack_router(std::vector<float>(0), 0, 3), std::invalid_argument);
}

}  // namespace
}  // namespace kda
