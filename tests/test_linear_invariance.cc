// With batch invariance asked for (layers/onednn_isa.h, `--batch-invariant`), a bf16 Linear gives a row the
// same bits whatever rows share its call: a token computes the same in a
// decode step alone or beside other requests' tokens, in a verify row and in a prefill, and a MoE
// expert's row the same whatever tokens the router sends beside it. Checked at the model's projection
// shapes, at row counts from one decode row to a prefill chunk, at two row offsets, and with the
// primitives built for several thread counts (oneDNN's matmul picks its blocking from the thread count,
// on AMX how many threads split K), whatever multiplies on this CPU: the widened kernels, oneDNN's
// AVX512_BF16 matmul or its AMX one.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/layers/linear.h"
#include "kda/layers/onednn_isa.h"
#include "support/test_support.h"

namespace kda {
namespace {

using testing::random_normal;

struct Shape {
  int64_t in, out;
  const char* what;
};
// K = 2304 and 4096 are above the 1024 inputs from which oneDNN's AMX matmul may split K among threads;
// 1024 and 128 are not.
constexpr Shape kShapes[] = {{2304, 4096, "KDA q|k|v"},       {2304, 2048, "MoE expert gate|up"},
                             {1024, 2304, "MoE expert down"}, {4096, 2304, "o_proj"},
                             {2304, 576, "MLA kv_a"},         {128, 4096, "KDA f_b"}};
constexpr int64_t kRows[] = {1, 2, 3, 5, 8, 16, 64, 65, 128, 300};
constexpr int64_t kOffset = 7, kRefRows = 300 + kOffset;

// Sets the OpenMP thread count of the calling thread for a scope (the primitives a Linear builds read it).
class Threads {
 public:
  explicit Threads(int n) : old_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(old_); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int old_;
};

// This binary asks for batch invariance before its first kernel, as `--batch-invariant` does; the
// environment may have chosen oneDNN's ISA for it (then the tests are skipped with the reason).
[[maybe_unused]] ::testing::Environment* const kBatchInvariance = testing::ask_batch_invariance();

#define SKIP_UNLESS_INVARIANT() \
  if (!testing::batch_invariance_refused().empty()) GTEST_SKIP() << testing::batch_invariance_refused()

std::vector<int> thread_counts() {
  std::vector<int> t{omp_get_max_threads(), 16, 64};
  std::sort(t.begin(), t.end());
  t.erase(std::unique(t.begin(), t.end()), t.end());
  return t;
}

// kRefRows random rows of sh.in inputs, in bf16 (what a bf16 projection reads).
std::vector<bf16_t> random_bf16_rows(const Shape& sh, uint64_t seed) {
  const std::vector<float> xf = random_normal(static_cast<size_t>(kRefRows * sh.in), seed);
  std::vector<bf16_t> x(xf.size());
  f32_to_bf16_array(xf.data(), x.data(), x.size());
  return x;
}

// One call on all kRefRows rows of x: the reference each smaller call's rows are compared with.
template <class Y>
std::vector<Y> all_rows(const layers::Linear& lin, const std::vector<bf16_t>& x) {
  std::vector<Y> y(static_cast<size_t>(kRefRows * lin.out_features()));
  lin.forward(x.data(), kRefRows, lin.in_features(), y.data(), lin.out_features());
  return y;
}

// Rows [s, s + M) of x alone against the same rows of one call on all of x, bit for bit; the number of
// rows that differ.
template <class Y>
int64_t rows_differing(const layers::Linear& lin, const std::vector<bf16_t>& x, const std::vector<Y>& ref,
                       int64_t s, int64_t M) {
  const int64_t in = lin.in_features(), out = lin.out_features();
  std::vector<Y> y(static_cast<size_t>(M * out));
  lin.forward(x.data() + s * in, M, in, y.data(), out);
  int64_t bad = 0;
  for (int64_t i = 0; i < M; ++i)
    bad += std::memcmp(y.data() + i * out, ref.data() + (s + i) * out, sizeof(Y) * out) != 0;
  return bad;
}

TEST(LinearInvariance, ARowsBitsDoNotDependOnTheRowsBesideIt) {
  SKIP_UNLESS_INVARIANT();
  for (const Shape& sh : kShapes) {
    const std::vector<float> w = random_normal(static_cast<size_t>(sh.in * sh.out), 3, 0.02f);
    const std::vector<bf16_t> x = random_bf16_rows(sh, 4);
    for (int threads : thread_counts()) {
      const Threads scope(threads);
      const layers::Linear lin(sh.in, sh.out, w, Precision::BF16);
      const std::vector<float> ref = all_rows<float>(lin, x);
      for (int64_t M : kRows)
        for (int64_t s : {int64_t{0}, kOffset})
          EXPECT_EQ(rows_differing(lin, x, ref, s, M), 0)
              << sh.what << " " << sh.in << "->" << sh.out << ", " << M << " rows from row " << s << ", "
              << threads << " threads";
    }
  }
}

// The bf16 output (what a MoE expert's gate|up and the KDA projection write) is the fp32 one rounded, so
// it too is the same at any row count.
TEST(LinearInvariance, Bf16OutputRowsToo) {
  SKIP_UNLESS_INVARIANT();
  const Shape sh = kShapes[1];
  const std::vector<float> w = random_normal(static_cast<size_t>(sh.in * sh.out), 5, 0.02f);
  const std::vector<bf16_t> x = random_bf16_rows(sh, 6);
  for (int threads : thread_counts()) {
    const Threads scope(threads);
    const layers::Linear lin(sh.in, sh.out, w, Precision::BF16);
    const std::vector<float> ref = all_rows<float>(lin, x);
    const std::vector<bf16_t> ref16 = all_rows<bf16_t>(lin, x);
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(ref16[i], f32_to_bf16(ref[i])) << i;
    for (int64_t M : {1, 2, 5, 65})
      EXPECT_EQ(rows_differing(lin, x, ref16, kOffset, M), 0) << M << " rows, " << threads << " threads";
  }
}

// With AMX in oneDNN's reach the rows above differ (tiles block a call by its row count): asking for
// invariance caps oneDNN below AMX, and asking again is a no-op.
TEST(LinearInvariance, AskingCapsOneDnnBelowAmx) {
  SKIP_UNLESS_INVARIANT();
  EXPECT_FALSE(layers::onednn_bf16_uses_amx()) << "AMX on this CPU: " << layers::cpu_has_amx_bf16();
  const layers::Linear lin(64, 32, std::vector<float>(64 * 32, 0.5f), Precision::BF16);
  std::vector<float> x(64, 1.0f), y(32);
  lin.forward(x.data(), 1, y.data());
  EXPECT_NO_THROW(layers::make_bf16_batch_invariant());
  EXPECT_FALSE(layers::onednn_bf16_uses_amx());
}

}  // namespace
}  // namespace kda
