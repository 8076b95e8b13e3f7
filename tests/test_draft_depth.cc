// Adaptive draft depth (serving/draft_depth.h) on synthetic timings and acceptances: the controller
// maximises expected tokens per unit of measured step cost, declines to speculate when verify steps cost
// more than they win, re-probes after declining, ignores steps with no drafts, and is deterministic.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "kda/serving/draft_depth.h"

namespace kda::serving {
namespace {

// Records `n` steps at each depth with cost[d] seconds (cost[0] the plain decode step).
void feed(VerifyCostModel& m, const std::vector<double>& cost, int64_t rows, int n = 5) {
  for (int i = 0; i < n; ++i)
    for (size_t d = 0; d < cost.size(); ++d) m.record(static_cast<int32_t>(d), rows, cost[d]);
}

// Observations of a chain whose every draft is accepted with probability `a` (deterministic draws).
void train(DraftDepthController& c, double a, int32_t depth, int n, uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < n; ++i) {
    int32_t k = 0;
    while (k < depth && u(rng) < a) ++k;
    c.observe(depth, k);
  }
}

double expected(double a, int d) { return (1.0 - std::pow(a, d + 1)) / (1.0 - a); }

TEST(VerifyCostModel, RatioToPlainDecodeIsTheMedianAndRobustToOutliers) {
  VerifyCostModel m(4);
  EXPECT_TRUE(std::isinf(m.relative_cost(1, 1)));  // no baseline yet
  for (int i = 0; i < 8; ++i) m.record(0, 1, 0.010);
  m.record(0, 1, 5.0);  // one stalled step
  for (int i = 0; i < 5; ++i) m.record(2, 1, 0.030);
  EXPECT_DOUBLE_EQ(m.relative_cost(0, 1), 1.0);
  EXPECT_NEAR(m.relative_cost(2, 1), 3.0, 1e-12);
  EXPECT_EQ(m.samples(2, 1), 5);
  EXPECT_EQ(m.samples(3, 1), 0);
}

TEST(VerifyCostModel, UnmeasuredDepthsAreCostedAsTheDeepestMeasuredBelowAndBorrowNearestBucket) {
  VerifyCostModel m(4);
  feed(m, {0.01}, 1);
  EXPECT_DOUBLE_EQ(m.relative_cost(1, 1), 1.0);  // depth 1 first, optimistic: a plain step's cost
  EXPECT_TRUE(std::isinf(m.relative_cost(2, 1)));
  feed(m, {0.01, 0.02}, 1);
  EXPECT_DOUBLE_EQ(m.relative_cost(2, 1), 2.0);  // depth 1's, until measured
  EXPECT_DOUBLE_EQ(m.relative_cost(4, 1), 2.0);
  m.record(3, 1, 0.05);
  EXPECT_DOUBLE_EQ(m.relative_cost(4, 1), 5.0);  // depth 3 is the deepest measured below
  EXPECT_DOUBLE_EQ(m.relative_cost(2, 1), 2.0);
  // 5 rows (bucket 2) has no measurement: bucket 0's ratios stand in.
  EXPECT_DOUBLE_EQ(m.relative_cost(1, 5), 2.0);
  feed(m, {0.04, 0.05}, 5);
  EXPECT_DOUBLE_EQ(m.relative_cost(1, 5), 1.25);
  EXPECT_DOUBLE_EQ(m.relative_cost(1, 1), 2.0);
}

TEST(VerifyCostModel, OneSlowFirstSampleDoesNotRuleADepthOut) {
  VerifyCostModel m(2);
  feed(m, {0.01}, 1);
  m.record(1, 1, 1.0);
  m.record(1, 1, 0.012);
  EXPECT_NEAR(m.relative_cost(1, 1), 1.2, 1e-12);
}

TEST(VerifyCostModel, BadArgumentsThrow) {
  EXPECT_THROW(VerifyCostModel(-1), std::invalid_argument);
  EXPECT_THROW(VerifyCostModel(65), std::invalid_argument);
  VerifyCostModel m(2);
  EXPECT_THROW(m.record(3, 1, 0.1), std::invalid_argument);
  EXPECT_THROW(m.record(-1, 1, 0.1), std::invalid_argument);
  EXPECT_THROW(m.record(1, 0, 0.1), std::invalid_argument);
  EXPECT_THROW(m.record(1, 1, -0.1), std::invalid_argument);
  EXPECT_THROW(m.record(1, 1, NAN), std::invalid_argument);
  EXPECT_THROW(m.relative_cost(3, 1), std::invalid_argument);
  EXPECT_EQ(m.samples(1, 1), 0);  // nothing recorded by the failed calls
}

TEST(DraftDepthController, PicksZeroWhenVerifyCostOutgrowsExpectedTokens) {
  // A MoE-like cost: each draft adds most of a decode step's expert reads.
  VerifyCostModel m(4);
  feed(m, {1.0, 1.9, 2.7, 3.5, 4.3}, 1);
  DraftDepthController c(4);
  train(c, 0.7, 4, 200);
  EXPECT_EQ(c.choose(m, 1), 0);
  EXPECT_EQ(c.last_choice(), 0);
}

TEST(DraftDepthController, PicksTheBestDepthOfSyntheticTables) {
  struct Case {
    std::vector<double> cost;
    double a;
  };
  const std::vector<Case> cases = {
      {{1.0, 1.05, 1.1, 1.15, 1.2}, 0.9},  // cheap verify, high acceptance: deep
      {{1.0, 1.05, 1.1, 1.15, 1.2}, 0.5}, {{1.0, 1.3, 1.6, 1.9, 2.2}, 0.9},
      {{1.0, 1.3, 1.6, 1.9, 2.2}, 0.7},   {{1.0, 1.1, 2.5, 2.6, 2.7}, 0.8},  // a step in cost past depth 1
  };
  for (const auto& k : cases) {
    VerifyCostModel m(4);
    feed(m, k.cost, 1);
    DraftDepthController c(4);
    train(c, k.a, 4, 400);
    const double a = c.optimistic_acceptance();
    EXPECT_GT(a, c.acceptance());
    EXPECT_LT(a, c.acceptance() + 0.08);  // 400 verify steps of evidence: a small margin
    int want = 0;
    double best = 1.0;
    for (int d = 1; d <= 4; ++d)
      if (expected(a, d) / k.cost[d] > best) {
        best = expected(a, d) / k.cost[d];
        want = d;
      }
    if (best < DraftDepthController::kMinGain) want = 0;
    EXPECT_EQ(c.choose(m, 1), want) << "a " << k.a << " (estimated " << a << "), cost[1] " << k.cost[1];
    EXPECT_GT(want, 0);
    EXPECT_NEAR(c.acceptance(), k.a, 0.12);
  }
}

TEST(DraftDepthController, ExploresDepthOneFirstThenDeeperDepthsOptimistically) {
  VerifyCostModel m(4);
  DraftDepthController c(4);
  EXPECT_EQ(c.choose(m, 1), 0);  // no baseline: decode plainly
  m.record(0, 1, 1.0);
  EXPECT_EQ(c.choose(m, 1), 1);  // depth 1 unmeasured, costed as plain decoding; deeper ones wait for it
  EXPECT_TRUE(std::isinf(m.relative_cost(2, 1)));
  // A MoE verify step: the first draft costs a whole plain step more (its token's experts), so depth 1
  // does not pay (1.67 tokens for 2.0), but depth 4, costed as depth 1 until measured, might.
  m.record(1, 1, 2.0);
  c.observe(1, 1);
  EXPECT_EQ(c.choose(m, 1), 4);
  m.record(4, 1, 2.2);  // the union of experts fills up: depth 4 costs little more than depth 1
  c.observe(4, 4);
  EXPECT_EQ(c.choose(m, 1), 4);
  // Had depth 4 been expensive, depth 3 (still costed as depth 1) is tried next, top down.
  VerifyCostModel m2(4);
  feed(m2, {1.0, 2.0}, 1);
  m2.record(4, 1, 9.0);
  DraftDepthController c2(4);
  c2.observe(1, 1);
  c2.observe(4, 4);
  EXPECT_EQ(c2.choose(m2, 1), 3);
}

TEST(DraftDepthController, ReprobesAfterChoosingZeroWithBackoff) {
  VerifyCostModel m(4);
  feed(m, {1.0, 2.0, 2.4, 2.8, 3.2}, 1);  // a MoE's verify step: the first draft costs a plain step more
  DraftDepthController c(4);
  train(c, 0.0, 4, 50);
  std::vector<int> probes;
  for (int step = 0; step < 200; ++step) {
    const int32_t d = c.choose(m, 1);
    ASSERT_LE(d, 1);
    if (d == 1) {
      probes.push_back(step);
      c.observe(1, 0);  // the probe: still nothing accepted
    }
  }
  ASSERT_GE(probes.size(), 3u);
  EXPECT_EQ(probes[0], DraftDepthController::kReprobeSteps);
  // Each failed probe doubles the wait.
  EXPECT_EQ(probes[1] - probes[0], 2 * DraftDepthController::kReprobeSteps + 1);
  EXPECT_EQ(probes[2] - probes[1], 4 * DraftDepthController::kReprobeSteps + 1);

  // Acceptance comes back: accepted probes make speculation pay again, up to the deepest depth.
  int32_t d = 0;
  int first = -1, step = 0;
  for (; step < 4000 && d < 4; ++step) {
    d = c.choose(m, 1);
    if (d > 0 && first < 0) first = step;
    c.observe(d, d);
  }
  ASSERT_GE(first, 0);
  EXPECT_EQ(d, 4);
  // Within a few probes: the wait doubled to 128 steps above, and each probe's success halves the doubt.
  EXPECT_LT(step - first, 4 * DraftDepthController::kMaxReprobeSteps) << "first probe at " << first;
}

TEST(DraftDepthController, StepsWithNoDraftsChangeNothing) {
  VerifyCostModel m(4);
  feed(m, {1.0, 1.1, 1.2, 1.3, 1.4}, 1);
  DraftDepthController c(4), same(4);
  train(c, 0.8, 4, 30);
  train(same, 0.8, 4, 30);
  for (int i = 0; i < 1000; ++i) c.observe(0, 0);  // ngram found no match: nothing drafted
  EXPECT_DOUBLE_EQ(c.acceptance(), same.acceptance());
  EXPECT_EQ(c.choose(m, 1), same.choose(m, 1));
  EXPECT_GT(c.choose(m, 1), 0);
  EXPECT_THROW(c.observe(2, 3), std::invalid_argument);
  EXPECT_THROW(c.observe(-1, 0), std::invalid_argument);
  EXPECT_DOUBLE_EQ(c.acceptance(), same.acceptance());
  EXPECT_THROW(DraftDepthController(-1), std::invalid_argument);
}

TEST(DraftDepthController, DeterministicForTheSameObservationsAndTimings) {
  auto run = [] {
    VerifyCostModel m(4);
    DraftDepthController c(4);
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<int32_t> out;
    for (int step = 0; step < 500; ++step) {
      const double a = step < 250 ? 0.85 : 0.1;  // acceptance changes half way
      const int32_t d = c.choose(m, 1);
      out.push_back(d);
      m.record(d, 1, 1.0 + 0.35 * d + 0.05 * u(rng));
      int32_t k = 0;
      while (k < d && u(rng) < a) ++k;
      c.observe(d, k);
    }
    return out;
  };
  const auto first = run();
  EXPECT_EQ(first, run());
  int deep_early = 0, deep_late = 0;
  for (int i = 150; i < 250; ++i) deep_early += first[i] > 0;
  for (int i = 400; i < 500; ++i) deep_late += first[i] > 0;
  EXPECT_GT(deep_early, 90);  // speculation pays at 0.85
  EXPECT_LT(deep_late, 10);   // and not at 0.1: only the re-probes
}

}  // namespace
}  // namespace kda::serving
