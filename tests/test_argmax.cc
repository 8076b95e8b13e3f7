// The greedy pick (sampling/argmax.h): the blocked argmax against its one-id-at-a-time reference on rows
// of many widths (under, at and past a block, the real vocabulary), with and without masks (dense,
// sparse, none allowed, only the last id), ties within and across blocks, signed zeros, -inf rows and
// NaNs (at the first allowed id, elsewhere, everywhere, masked out), and the NaN flag the serving loop
// refuses a row by; a step's rows at once against each alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kda/sampling/argmax.h"
#include "support/test_support.h"

namespace kda {
namespace {

using sampling::argmax_allowed;
using sampling::argmax_allowed_reference;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<uint8_t> random_mask(int64_t V, double density, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::bernoulli_distribution keep(density);
  std::vector<uint8_t> m(static_cast<size_t>(V));
  for (auto& b : m) b = keep(g) ? 1 : 0;
  return m;
}

// The pick and its NaN flag, against the reference's, for one mask (null: none).
void expect_same_pick(const std::vector<float>& row, const uint8_t* mask, const std::string& what) {
  const int64_t V = static_cast<int64_t>(row.size());
  bool nan = false, ref_nan = true;
  EXPECT_EQ(argmax_allowed(row.data(), V, mask, &nan),
            argmax_allowed_reference(row.data(), V, mask, &ref_nan))
      << what;
  EXPECT_EQ(nan, ref_nan) << what;
  EXPECT_EQ(argmax_allowed(row.data(), V, mask), argmax_allowed_reference(row.data(), V, mask)) << what;
}

// The pick with and without each mask, against the reference.
void expect_same(const std::vector<float>& row, const std::string& what, uint64_t seed) {
  const int64_t V = static_cast<int64_t>(row.size());
  expect_same_pick(row, nullptr, what + ", no mask");
  std::vector<std::vector<uint8_t>> masks = {random_mask(V, 0.5, seed), random_mask(V, 0.01, seed + 1),
                                             std::vector<uint8_t>(static_cast<size_t>(V), 0)};
  masks.push_back(masks.back());
  masks.back().back() = 1;  // only the last id
  for (size_t i = 0; i < masks.size(); ++i)
    expect_same_pick(row, masks[i].data(), what + ", mask " + std::to_string(i));
}

TEST(Argmax, BlockedEqualsTheScanOnRandomRows) {
  for (int64_t V : {1, 2, 15, 16, 17, 255, 256, 257, 258, 1000, 4096, 163840}) {
    const std::vector<float> row = testing::random_normal(static_cast<size_t>(V), 10 + V);
    expect_same(row, "V=" + std::to_string(V), 20 + V);
  }
}

TEST(Argmax, TiesGoToTheLowestAllowedId) {
  for (int64_t V : {40, 300, 1000, 163840}) {
    std::vector<float> row = testing::random_normal(static_cast<size_t>(V), 30 + V);
    // The maximum at several ids, in one block and across blocks.
    for (int64_t at : {V / 3, V / 3 + 1, V / 2, V - 1}) row[at] = 50.0f;
    expect_same(row, "ties V=" + std::to_string(V), 40 + V);
    EXPECT_EQ(argmax_allowed(row.data(), V, nullptr), V / 3);
    // Rows of one value: the first allowed id.
    std::vector<float> flat(static_cast<size_t>(V), 1.5f);
    expect_same(flat, "flat V=" + std::to_string(V), 50 + V);
    std::vector<float> low(static_cast<size_t>(V), -kInf);
    expect_same(low, "-inf V=" + std::to_string(V), 60 + V);
    EXPECT_EQ(argmax_allowed(low.data(), V, nullptr), 0);
    // Signed zeros compare equal: the first of them.
    std::vector<float> zeros(static_cast<size_t>(V), -1.0f);
    zeros[V / 2] = -0.0f;
    zeros[V - 1] = 0.0f;
    expect_same(zeros, "zeros V=" + std::to_string(V), 70 + V);
    EXPECT_EQ(argmax_allowed(zeros.data(), V, nullptr), V / 2);
  }
}

TEST(Argmax, NaNsNeverWinButAtTheFirstAllowedId) {
  for (int64_t V : {20, 300, 163840}) {
    std::vector<float> row = testing::random_normal(static_cast<size_t>(V), 80 + V);
    row[V / 2] = kNaN;
    row[V - 1] = kNaN;
    expect_same(row, "NaNs inside V=" + std::to_string(V), 90 + V);
    bool nan = false;
    argmax_allowed(row.data(), V, nullptr, &nan);
    EXPECT_TRUE(nan) << V;
    // A NaN at a disallowed id is not the row's: only the NaN ids masked out.
    std::vector<uint8_t> skip(static_cast<size_t>(V), 1);
    skip[V / 2] = skip[V - 1] = 0;
    argmax_allowed(row.data(), V, skip.data(), &nan);
    EXPECT_FALSE(nan) << V;
    row[0] = kNaN;  // the first id: it stays, as in the scan
    expect_same(row, "NaN first V=" + std::to_string(V), 100 + V);
    EXPECT_EQ(argmax_allowed(row.data(), V, nullptr), 0);
    std::vector<float> all(static_cast<size_t>(V), kNaN);
    expect_same(all, "all NaN V=" + std::to_string(V), 110 + V);
    std::vector<float> huge = testing::random_normal(static_cast<size_t>(V), 120 + V);
    huge[V / 3] = kInf;
    huge[V / 4] = kNaN;
    expect_same(huge, "inf and NaN V=" + std::to_string(V), 130 + V);
  }
}

TEST(Argmax, NoAllowedIdGivesMinusOne) {
  const std::vector<float> row = testing::random_normal(300, 7);
  const std::vector<uint8_t> none(300, 0);
  EXPECT_EQ(argmax_allowed(row.data(), 300, none.data()), -1);
  EXPECT_EQ(argmax_allowed(row.data(), 0, nullptr), -1);
}

// The rows of a step at once (argmax_allowed_rows, the threads sharing them): each row's pick and NaN flag
// those of the row alone, in the order given (rows apart in memory, a NaN row among them), and no row at
// all writes nothing.
TEST(Argmax, RowsAtOnceEqualEachRowAlone) {
  const int64_t V = 163840;
  const std::vector<uint8_t> mask = random_mask(V, 0.9, 41);
  for (const int64_t M : {1, 2, 5, 16}) {
    std::vector<std::vector<float>> rows;
    for (int64_t m = 0; m < M; ++m) rows.push_back(testing::random_normal(static_cast<size_t>(V), 200 + m));
    if (M > 2) rows[1][V / 2] = kNaN;
    std::vector<const float*> ptrs;
    for (int64_t m = M - 1; m >= 0; --m) ptrs.push_back(rows[static_cast<size_t>(m)].data());
    for (const uint8_t* allowed : {static_cast<const uint8_t*>(nullptr), mask.data()}) {
      std::vector<int32_t> ids(static_cast<size_t>(M), -7);
      std::vector<uint8_t> nans(static_cast<size_t>(M), 7);
      sampling::argmax_allowed_rows(ptrs.data(), M, V, allowed, ids.data(), nans.data());
      for (int64_t m = 0; m < M; ++m) {
        bool nan = false;
        EXPECT_EQ(ids[static_cast<size_t>(m)], argmax_allowed(ptrs[static_cast<size_t>(m)], V, allowed, &nan))
            << "M " << M << " row " << m;
        EXPECT_EQ(nans[static_cast<size_t>(m)], nan ? 1 : 0) << "M " << M << " row " << m;
      }
      if (M > 2) {
        EXPECT_EQ(nans[static_cast<size_t>(M - 2)], 1) << "the NaN row, M " << M;
      }
    }
  }
  int32_t untouched = 5;
  sampling::argmax_allowed_rows(nullptr, 0, V, nullptr, &untouched, nullptr);
  EXPECT_EQ(untouched, 5);
}

}  // namespace
}  // namespace kda
