// Speculative sampling (sampling/spec_accept.h): the tokens it emits follow the target's distribution
// whatever the drafter proposes (chi-square at fixed seeds, one position and two in a chain, one-hot and
// general proposals, tree siblings), the residual's edge cases, the optimized path against the reference,
// and RequestSampler::distribution against what sample() draws.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "kda/sampling/sampler.h"
#include "kda/sampling/spec_accept.h"

namespace kda::sampling {
namespace {

std::vector<double> random_distribution(size_t V, std::mt19937_64& rng, double spread = 1.5) {
  std::normal_distribution<double> nd(0.0, spread);
  std::vector<double> p(V);
  double z = 0.0;
  for (auto& x : p) z += (x = std::exp(nd(rng)));  // softmax of random logits, temperature 1
  for (auto& x : p) x /= z;
  return p;
}

int32_t draw_from(const std::vector<double>& q, std::mt19937_64& rng) {
  return static_cast<int32_t>(std::discrete_distribution<int32_t>(q.begin(), q.end())(rng));
}

// Pearson's statistic of observed counts against expected probabilities (cells with expectation > 0).
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& expected, int64_t n) {
  double s = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = expected[i] * static_cast<double>(n);
    if (e <= 0.0) {
      if (counts[i] != 0) return 1e300;  // a token the target never gives
      continue;
    }
    s += (static_cast<double>(counts[i]) - e) * (static_cast<double>(counts[i]) - e) / e;
  }
  return s;
}

// The chi-square quantile at 1 - 1e-4 for `dof` degrees of freedom (Wilson-Hilferty), a fixed bound for
// fixed seeds: a correct sampler passes, a biased one (see the checks against q) does not.
double chi_square_bound(int dof) {
  const double z = 3.719;  // the normal's 1 - 1e-4 quantile
  const double k = dof;
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

using Accept = SpecAcceptResult (*)(std::span<double>, std::span<const int32_t>, std::span<const double>,
                                    uint64_t, int64_t);

class SpecAcceptBoth : public ::testing::TestWithParam<Accept> {};

TEST_P(SpecAcceptBoth, OneHotDraftsEmitTheTargetDistribution) {
  const Accept accept = GetParam();
  std::mt19937_64 rng(7);
  const size_t V = 12;
  const auto p = random_distribution(V, rng);
  const auto q = random_distribution(V, rng, 2.5);  // the drafter's, far from p
  const int64_t N = 40000;
  std::vector<int64_t> counts(V, 0), drafted(V, 0);
  int64_t accepted = 0;
  for (int64_t t = 0; t < N; ++t) {
    const int32_t x = draw_from(q, rng);
    ++drafted[x];
    std::vector<double> scratch = p;
    const std::vector<int32_t> d = {x};
    const auto r = accept(scratch, d, {}, /*seed=*/1000 + t, /*k=*/t % 5);
    accepted += r.sibling == 0;
    ASSERT_EQ(r.sibling == 0, r.token == x);
    ++counts[r.token];
  }
  EXPECT_LT(chi_square(counts, p, N), chi_square_bound(static_cast<int>(V) - 1));
  // The test has the power to see a wrong rule: the drafts themselves (q) are far from p.
  EXPECT_GT(chi_square(drafted, p, N), 50 * chi_square_bound(static_cast<int>(V) - 1));
  // Acceptance of a one-hot draft x ~ q is sum_x q(x) p(x).
  double expect = 0.0;
  for (size_t i = 0; i < V; ++i) expect += q[i] * p[i];
  EXPECT_NEAR(static_cast<double>(accepted) / N, expect, 5 * std::sqrt(expect / N));
}

TEST_P(SpecAcceptBoth, GeneralProposalEmitsTheTargetDistributionAtBothPositionsOfAChain) {
  const Accept accept = GetParam();
  std::mt19937_64 rng(11);
  const size_t V = 6;
  const auto p0 = random_distribution(V, rng);
  const auto q0 = random_distribution(V, rng, 2.0);
  std::vector<std::vector<double>> p1, q1;  // the second position's, given the first token
  for (size_t a = 0; a < V; ++a) {
    p1.push_back(random_distribution(V, rng));
    q1.push_back(random_distribution(V, rng, 2.0));
  }
  std::vector<double> joint(V * V);
  for (size_t a = 0; a < V; ++a)
    for (size_t b = 0; b < V; ++b) joint[a * V + b] = p0[a] * p1[a][b];
  const int64_t N = 60000;
  std::vector<int64_t> counts(V * V, 0);
  for (int64_t t = 0; t < N; ++t) {
    const uint64_t seed = 5000 + t;
    // A drafter with known q: two chained draws.
    const int32_t d0 = draw_from(q0, rng), d1 = draw_from(q1[d0], rng);
    std::vector<double> s = p0;
    const std::vector<int32_t> x0 = {d0};
    const auto r0 = accept(s, x0, q0, seed, 0);
    int32_t t1;
    s = p1[r0.token];
    if (r0.sibling == 0) {  // on to the second draft, against the target given the first
      const std::vector<int32_t> x1 = {d1};
      t1 = accept(s, x1, q1[d0], seed, 1).token;
    } else {  // the step ends at the resampled token: the next step samples from the target (no drafts)
      t1 = accept(s, {}, {}, seed, 1).token;
    }
    ++counts[r0.token * V + t1];
  }
  EXPECT_LT(chi_square(counts, joint, N), chi_square_bound(static_cast<int>(V * V) - 1));
}

TEST_P(SpecAcceptBoth, TreeSiblingsByRecursiveRejectionEmitTheTargetDistribution) {
  const Accept accept = GetParam();
  std::mt19937_64 rng(13);
  const size_t V = 10;
  const auto p = random_distribution(V, rng);
  const auto q = random_distribution(V, rng, 2.0);
  const int64_t N = 40000;
  // Deterministic siblings (one-hot, distinct, as a trie's): three different tokens from the drafter.
  std::vector<int64_t> counts(V, 0);
  std::vector<int64_t> by_sibling(4, 0);
  for (int64_t t = 0; t < N; ++t) {
    std::vector<int32_t> d;
    while (d.size() < 3) {
      const int32_t x = draw_from(q, rng);
      if (std::find(d.begin(), d.end(), x) == d.end()) d.push_back(x);
    }
    std::vector<double> s = p;
    const auto r = accept(s, d, {}, 90000 + t, 3);
    ++counts[r.token];
    ++by_sibling[r.sibling + 1];
  }
  EXPECT_LT(chi_square(counts, p, N), chi_square_bound(static_cast<int>(V) - 1));
  EXPECT_GT(by_sibling[2], 0);  // later siblings are reached and accepted
  EXPECT_GT(by_sibling[3], 0);
  // General proposals: three independent draws, each sibling with its own q.
  std::vector<std::vector<double>> qs = {q, random_distribution(V, rng, 1.0),
                                         random_distribution(V, rng, 3.0)};
  std::vector<double> flat;
  for (const auto& x : qs) flat.insert(flat.end(), x.begin(), x.end());
  std::fill(counts.begin(), counts.end(), 0);
  for (int64_t t = 0; t < N; ++t) {
    const std::vector<int32_t> d = {draw_from(qs[0], rng), draw_from(qs[1], rng), draw_from(qs[2], rng)};
    std::vector<double> s = p;
    ++counts[accept(s, d, flat, 190000 + t, 0).token];
  }
  EXPECT_LT(chi_square(counts, p, N), chi_square_bound(static_cast<int>(V) - 1));
}

TEST_P(SpecAcceptBoth, ResidualEdgeCases) {
  const Accept accept = GetParam();
  // p(x) = 0: never accepted, and the draw is p's.
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    std::vector<double> p = {0.5, 0.0, 0.25, 0.25};
    const std::vector<int32_t> d = {1};
    const auto r = accept(p, d, {}, seed, 0);
    ASSERT_EQ(r.sibling, -1);
    ASSERT_NE(r.token, 1);
  }
  // q = p: always accepted (u < 1 = p(x) / q(x)); p exact in binary so no rounding enters the ratio.
  const std::vector<double> exact = {0.5, 0.25, 0.125, 0.125};
  std::mt19937_64 rng(3);
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    std::vector<double> p = exact;
    const std::vector<int32_t> d = {draw_from(exact, rng)};
    const auto r = accept(p, d, exact, seed, 2);
    ASSERT_EQ(r.sibling, 0);
    ASSERT_EQ(r.token, d[0]);
  }
  // A one-hot draft of a certain token: always accepted.
  for (uint64_t seed = 0; seed < 500; ++seed) {
    std::vector<double> p = {0.0, 1.0, 0.0};
    const std::vector<int32_t> d = {1};
    ASSERT_EQ(accept(p, d, {}, seed, 0).sibling, 0);
  }
  // Every sibling rejected: the draw is from what is left (only id 3); with uniform p, each of the four
  // outcomes has probability 1/4 (1/4, then 1/3 of 3/4, then 1/2 of 2/4).
  std::vector<int64_t> outcome(4, 0);
  const int64_t N = 20000;
  for (int64_t seed = 0; seed < N; ++seed) {
    std::vector<double> p = {0.25, 0.25, 0.25, 0.25};
    const std::vector<int32_t> d = {0, 1, 2};
    const auto r = accept(p, d, {}, static_cast<uint64_t>(seed), 0);
    if (r.sibling < 0) {
      ASSERT_EQ(r.token, 3);
    }
    ++outcome[r.sibling + 1];
  }
  EXPECT_LT(chi_square(outcome, {0.25, 0.25, 0.25, 0.25}, N), chi_square_bound(3));
  // No drafts: a plain draw from p with the sampler's uniform of draw k.
  std::vector<double> p = {0.5, 0.5};
  EXPECT_EQ(accept(p, {}, {}, 42, 9).token, spec_uniform(42, 9, 0) < 0.5 ? 0 : 1);
  EXPECT_EQ(spec_uniform(42, 9, 0), draw_uniform(42, 9));
}

TEST_P(SpecAcceptBoth, BadInputThrowsAndLeavesPUntouched) {
  const Accept accept = GetParam();
  const std::vector<double> p0 = {0.5, 0.5};
  std::vector<double> p = p0;
  const std::vector<int32_t> out_of_range = {2};
  EXPECT_THROW(accept(p, out_of_range, {}, 0, 0), std::invalid_argument);
  const std::vector<int32_t> ok = {0};
  const std::vector<double> short_q = {1.0};
  EXPECT_THROW(accept(p, ok, short_q, 0, 0), std::invalid_argument);
  const std::vector<double> zero_q = {0.0, 1.0};
  EXPECT_THROW(accept(p, ok, zero_q, 0, 0), std::invalid_argument);
  EXPECT_EQ(p, p0);
  std::vector<double> neg = {-0.5, 1.5};
  EXPECT_THROW(accept(neg, ok, {}, 0, 0), std::invalid_argument);
  std::vector<double> none = {0.0, 0.0};
  EXPECT_THROW(accept(none, ok, {}, 0, 0), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(OptimizedAndReference, SpecAcceptBoth,
                         ::testing::Values(&spec_accept, &spec_accept_reference));

TEST(SpecAccept, OptimizedEqualsReference) {
  std::mt19937_64 rng(21);
  int64_t rejected_all = 0, accepted_later = 0;
  for (int64_t c = 0; c < 20000; ++c) {
    const size_t V = 2 + rng() % 40;
    auto p = random_distribution(V, rng, 0.5 + static_cast<double>(rng() % 4));
    if (c % 3 == 0) p[rng() % V] = 0.0;  // an id the target never gives
    std::vector<int32_t> d;
    const size_t n = rng() % std::min<size_t>(V, 5);
    while (d.size() < n) {
      const int32_t x = static_cast<int32_t>(rng() % V);
      if (std::find(d.begin(), d.end(), x) == d.end()) d.push_back(x);
    }
    std::vector<double> a = p, b = p;
    const uint64_t seed = rng();
    const auto ra = spec_accept(a, d, {}, seed, c);
    const auto rb = spec_accept_reference(b, d, {}, seed, c);
    ASSERT_EQ(ra.sibling, rb.sibling) << "case " << c;
    ASSERT_EQ(ra.token, rb.token) << "case " << c;
    rejected_all += !d.empty() && ra.sibling < 0;
    accepted_later += ra.sibling > 0;
  }
  EXPECT_GT(rejected_all, 100);  // both branches compared
  EXPECT_GT(accepted_later, 100);
}

// distribution() is what sample() draws from: penalties, temperature, top-k, top-p, min-p alike.
TEST(SpecAccept, SamplerDistributionIsWhatSampleDraws) {
  std::mt19937_64 rng(5);
  const int64_t V = 40;
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> logits(V);
  for (auto& x : logits) x = nd(rng);
  SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 20;
  sp.top_p = 0.9f;
  sp.min_p = 0.02f;
  sp.repetition_penalty = 1.3f;
  sp.presence_penalty = 0.5f;
  const std::vector<int32_t> prompt = {1, 2, 3, 4};
  std::vector<uint8_t> allowed(V, 1);
  allowed[7] = 0;
  auto make = [&](uint64_t seed) {
    RequestSampler s(sp, prompt, seed);
    s.accept(5);
    s.accept(6);
    return s;
  };
  std::vector<double> p;
  {
    auto s = make(0);
    std::vector<float> row = logits;
    s.distribution(row, allowed.data(), p);
    EXPECT_EQ(s.generated(), 2);  // nothing committed
  }
  ASSERT_EQ(static_cast<int64_t>(p.size()), V);
  EXPECT_EQ(p[7], 0.0);
  double z = 0.0;
  int kept = 0;
  for (double x : p) {
    z += x;
    kept += x > 0.0;
  }
  EXPECT_NEAR(z, 1.0, 1e-12);
  EXPECT_LE(kept, 20);
  EXPECT_GT(kept, 2);
  const int64_t N = 30000;
  std::vector<int64_t> counts(V, 0);
  for (int64_t t = 0; t < N; ++t) {
    auto s = make(static_cast<uint64_t>(t) * 7919);
    std::vector<float> row = logits;
    ++counts[s.sample(row, allowed.data(), nullptr)];
  }
  EXPECT_LT(chi_square(counts, p, N), chi_square_bound(kept - 1));
  // Greedy: one-hot at sample()'s pick.
  sp.temperature = 0.0f;
  RequestSampler g(sp, prompt, 1);
  std::vector<float> row = logits;
  g.distribution(row, allowed.data(), p);
  row = logits;
  const int32_t pick = g.sample(row, allowed.data(), nullptr);
  EXPECT_EQ(p[pick], 1.0);
  EXPECT_EQ(std::count(p.begin(), p.end(), 0.0), V - 1);
  // logprob() reports what sample() does for the same token.
  sp.temperature = 1.0f;
  sp.logprobs = 3;
  RequestSampler a(sp, prompt, 9), b(sp, prompt, 9);
  row = logits;
  TokenLogprob la, lb;
  const int32_t tok = a.sample(row, allowed.data(), &la);
  b.logprob(logits, allowed.data(), tok, &lb);
  EXPECT_EQ(la.token, lb.token);
  EXPECT_EQ(la.logprob, lb.logprob);
  EXPECT_EQ(la.top, lb.top);
}

}  // namespace
}  // namespace kda::sampling
