// The sampler: the optimized RequestSampler against sample_reference on random rows (every parameter alone
// and combined, ties, -inf, huge values, masks, penalties' histories), the seeded generator, the empirical
// distributions against the exact targets, logprobs, and the parameters' validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <new>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/sampling/sampler.h"
#include "kda/sampling/sampling_params.h"

// GCC flags free() in the replaced operator delete once inlined beside operator new's malloc: a false
// positive of the replacement itself.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

// Counts this thread's heap allocations, to check that sample() allocates nothing after its first call.
namespace {
thread_local int64_t g_allocations = 0;
}
void* operator new(std::size_t n) {
  ++g_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  ++g_allocations;
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace kda::sampling {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

enum class Row { kNormal, kTies, kNegInf, kHuge, kPeaked, kEqual, kHalves };

std::vector<float> make_row(int64_t V, Row kind, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> l(V);
  for (auto& x : l) x = nd(rng);
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  switch (kind) {
    case Row::kNormal:
      break;
    case Row::kTies:  // few distinct values: every boundary falls inside a run of equal logits
      for (auto& x : l) x = std::round(x);
      break;
    case Row::kNegInf:
      for (int64_t i = 0; i < V; ++i)
        if (i % 3 == 0) l[i] = -kInf;
      break;
    case Row::kHuge:
      for (int64_t i = 0; i < std::max<int64_t>(2, V / 50); ++i) l[pick(rng)] = (i % 2 ? -1 : 1) * 3e38f;
      if (V > 100) l[pick(rng)] = kInf;
      break;
    case Row::kEqual:  // every weight 1: top-p's sums are exact, p * Z lands on one of them
      std::fill(l.begin(), l.end(), 0.5f);
      break;
    case Row::kHalves:  // weights 1 (a ids) and 0.5 (2a ids), the rest 0: top-p 0.5 ends exactly at the 1s
      std::fill(l.begin(), l.end(), -kInf);
      for (int64_t i = 0, a = std::max<int64_t>(1, V / 50); i < 3 * a && i < V; ++i)
        l[(i * 37) % V] = i < a ? 0.0f : std::log(0.5f);
      break;
    case Row::kPeaked:  // an LLM-like row: a few ids carry almost all the mass
      for (auto& x : l) x *= 3.0f;
      for (int i = 0; i < 5; ++i) l[pick(rng)] = 25.0f + i;
      break;
  }
  return l;
}

std::vector<SamplingParams> param_cases() {
  std::vector<SamplingParams> out;
  auto add = [&](auto f) {
    SamplingParams p;
    f(p);
    out.push_back(p);
  };
  add([](SamplingParams&) {});
  add([](SamplingParams& p) { p.temperature = 0.0f; });
  add([](SamplingParams& p) { p.temperature = 0.7f; });
  add([](SamplingParams& p) { p.temperature = 1e-3f; });
  add([](SamplingParams& p) { p.temperature = 3.0f; });
  add([](SamplingParams& p) { p.top_k = 1; });
  add([](SamplingParams& p) { p.top_k = 5; });
  add([](SamplingParams& p) { p.top_k = 6; });  // at V = 7: all but one
  add([](SamplingParams& p) { p.top_k = 300; });
  add([](SamplingParams& p) { p.top_p = 0.9f; });
  add([](SamplingParams& p) { p.top_p = 0.3f; });
  add([](SamplingParams& p) { p.top_p = 0.5f; });
  add([](SamplingParams& p) { p.top_p = 1e-6f; });
  add([](SamplingParams& p) { p.min_p = 0.05f; });
  add([](SamplingParams& p) { p.min_p = 1.0f; });
  add([](SamplingParams& p) { p.repetition_penalty = 1.3f; });
  add([](SamplingParams& p) { p.repetition_penalty = 0.8f; });
  add([](SamplingParams& p) { p.presence_penalty = 1.5f; });
  add([](SamplingParams& p) { p.frequency_penalty = -0.7f; });
  add([](SamplingParams& p) {
    p.temperature = 0.8f;
    p.top_k = 50;
    p.top_p = 0.9f;
  });
  add([](SamplingParams& p) {
    p.temperature = 1.2f;
    p.top_p = 0.95f;
    p.min_p = 0.02f;
    p.repetition_penalty = 1.1f;
    p.presence_penalty = 0.4f;
    p.frequency_penalty = 0.3f;
  });
  add([](SamplingParams& p) {
    p.top_k = 40;
    p.min_p = 0.1f;
    p.frequency_penalty = 1.0f;
  });
  add([](SamplingParams& p) {
    p.temperature = 0.0f;
    p.repetition_penalty = 1.5f;
    p.presence_penalty = 2.0f;
  });
  for (auto& p : out) p.logprobs = 5;
  return out;
}

// Runs `steps` draws of one request through RequestSampler and sample_reference side by side (each step's
// row drawn afresh), checking the tokens and the logprobs are the same.
void compare(int64_t V, Row kind, const SamplingParams& p, bool masked, uint64_t seed, int steps) {
  std::mt19937_64 rng(seed * 7919 + V);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 8; ++i) prompt.push_back(static_cast<int32_t>(rng() % V));
  std::vector<uint8_t> allowed;
  if (masked) {
    allowed.assign(V, 1);
    for (int64_t i = 0; i < V; ++i)
      if (rng() % 4 == 0) allowed[i] = 0;
    allowed[rng() % V] = 1;
  }
  const uint8_t* a = masked ? allowed.data() : nullptr;
  RequestSampler s(p, prompt, seed);
  std::vector<int32_t> generated;
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> row = make_row(V, kind, rng);
    std::vector<float> scratch = row;
    TokenLogprob lo, lr;
    const int32_t got = s.sample(scratch, a, &lo);
    const int32_t want = sample_reference(row, a, p, prompt, generated, seed, &lr);
    SCOPED_TRACE("V=" + std::to_string(V) + " kind=" + std::to_string(static_cast<int>(kind)) +
                 " step=" + std::to_string(step) + " T=" + std::to_string(p.temperature) +
                 " k=" + std::to_string(p.top_k) + " p=" + std::to_string(p.top_p) +
                 " min_p=" + std::to_string(p.min_p));
    ASSERT_EQ(got, want);
    ASSERT_TRUE(a == nullptr || a[got] != 0);
    EXPECT_EQ(lo.token, got);
    EXPECT_EQ(lo.logprob, lr.logprob);
    EXPECT_EQ(lo.top, lr.top);
    s.accept(got);
    generated.push_back(got);
  }
}

TEST(Sampling, OptimizedMatchesReference) {
  const std::vector<SamplingParams> cases = param_cases();
  for (int64_t V : {7, 512}) {
    for (Row kind :
         {Row::kNormal, Row::kTies, Row::kNegInf, Row::kHuge, Row::kPeaked, Row::kEqual, Row::kHalves})
      for (size_t c = 0; c < cases.size(); ++c)
        for (bool masked : {false, true}) compare(V, kind, cases[c], masked, 100 + c, 6);
  }
}

TEST(Sampling, OptimizedMatchesReferenceFullVocab) {
  const std::vector<SamplingParams> cases = param_cases();
  const int64_t V = 163840;
  const Row kinds[] = {Row::kNormal, Row::kTies,  Row::kNegInf, Row::kHuge,
                       Row::kPeaked, Row::kEqual, Row::kHalves};
  const size_t n = std::size(kinds);
  for (size_t c = 0; c < cases.size(); ++c)  // two kinds of row per case, every kind with every few cases
    for (size_t r : {c % n, (c + 3) % n}) compare(V, kinds[r], cases[c], c % 3 == 0, 500 + c, 1);
}

TEST(Sampling, DisallowedIdsNeverComeOut) {
  const int64_t V = 64;
  std::vector<float> row(V, 0.0f);
  std::vector<uint8_t> allowed(V, 1);
  for (int64_t i = 0; i < V; i += 2) {
    allowed[i] = 0;
    row[i] = i == 0 ? kInf : 1e30f;  // the disallowed ids hold the largest logits
  }
  for (SamplingParams p : param_cases()) {
    RequestSampler s(p, {}, 9);
    for (int i = 0; i < 50; ++i) {
      std::vector<float> scratch = row;
      const int32_t t = s.sample(scratch, allowed.data(), nullptr);
      ASSERT_EQ(allowed[t], 1) << t;
      s.accept(t);
    }
  }
}

TEST(Sampling, SeedsReproduceAndTheKthDrawDependsOnSeedAndKOnly) {
  const int64_t V = 1000;
  std::mt19937_64 rng(3);
  SamplingParams p;
  p.temperature = 1.5f;
  std::vector<std::vector<float>> rows;
  for (int i = 0; i < 20; ++i) rows.push_back(make_row(V, Row::kNormal, rng));
  auto run = [&](uint64_t seed, int perturb_before) {
    RequestSampler s(p, {}, seed);
    std::vector<int32_t> out;
    for (int i = 0; i < 20; ++i) {
      std::vector<float> scratch = rows[i];
      if (i < perturb_before)  // other logits (another batch's numbers) at the earlier steps
        for (auto& x : scratch) x = -x;
      out.push_back(s.sample(scratch, nullptr, nullptr));
      s.accept(out.back());
    }
    return out;
  };
  const auto a = run(11, 0), b = run(11, 0), c = run(12, 0), d = run(11, 10);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(std::vector<int32_t>(a.begin(), a.begin() + 10), std::vector<int32_t>(d.begin(), d.begin() + 10));
  EXPECT_EQ(std::vector<int32_t>(a.begin() + 10, a.end()), std::vector<int32_t>(d.begin() + 10, d.end()));
  // The uniforms themselves: in [0, 1), different over k and over seeds.
  for (int64_t k = 0; k < 1000; ++k) {
    const double u = draw_uniform(5, k);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ASSERT_NE(u, draw_uniform(5, k + 1));
    ASSERT_NE(u, draw_uniform(6, k));
  }
}

// The exact target distribution of the semantics (sampler.h), in double, by the definition.
std::vector<double> target(const std::vector<float>& l, const SamplingParams& p) {
  const size_t V = l.size();
  std::vector<double> q(V);
  double m = -1e300;
  for (float x : l) m = std::max(m, static_cast<double>(x) / p.temperature);
  for (size_t i = 0; i < V; ++i) q[i] = std::exp(static_cast<double>(l[i]) / p.temperature - m);
  std::vector<size_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return q[a] > q[b]; });
  std::vector<bool> keep(V, true);
  if (p.top_k > 0)
    for (size_t r = p.top_k; r < V; ++r) keep[order[r]] = false;
  double z = 0;
  for (size_t i = 0; i < V; ++i)
    if (keep[i]) z += q[i];
  if (p.top_p < 1.0f) {
    double cum = 0;
    bool reached = false;
    for (size_t i : order) {
      if (!keep[i]) continue;
      if (reached) keep[i] = false;
      cum += q[i];
      if (cum >= p.top_p * z) reached = true;
    }
  }
  for (size_t i = 0; i < V; ++i)
    if (keep[i] && q[i] < p.min_p * q[order[0]]) keep[i] = false;
  z = 0;
  for (size_t i = 0; i < V; ++i) z += keep[i] ? q[i] : 0.0;
  for (size_t i = 0; i < V; ++i) q[i] = keep[i] ? q[i] / z : 0.0;
  return q;
}

std::vector<int64_t> draw_counts(const std::vector<float>& l, const SamplingParams& p, int n, uint64_t seed) {
  RequestSampler s(p, {}, seed);
  std::vector<int64_t> counts(l.size());
  std::vector<float> scratch;
  for (int i = 0; i < n; ++i) {
    scratch = l;
    const int32_t t = s.sample(scratch, nullptr, nullptr);
    ++counts[t];
    s.accept(t);
  }
  return counts;
}

// Pearson's statistic over the ids the target gives mass; an id drawn that the target excludes: infinity.
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& q, int n) {
  double x = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    if (q[i] == 0.0) {
      if (counts[i] != 0) return std::numeric_limits<double>::infinity();
      continue;
    }
    const double e = n * q[i];
    x += (counts[i] - e) * (counts[i] - e) / e;
  }
  return x;
}

// 99.9% quantile of chi-square with 11 degrees of freedom (at most 12 ids carry mass below): a correct
// sampler exceeds it once in a thousand seeds, and the seed is fixed.
constexpr double kChi2Bound = 31.26;

TEST(Sampling, EmpiricalDistributionsMatchTheTargets) {
  // Probabilities 0.30 0.20 0.15 0.10 ... : every cut below lands between distinct values.
  const std::vector<double> probs = {0.30, 0.20, 0.15, 0.10, 0.08,  0.06,
                                     0.04, 0.03, 0.02, 0.01, 0.007, 0.003};
  std::vector<float> l;
  for (double pr : probs) l.push_back(static_cast<float>(std::log(pr)));
  const int n = 40000;
  struct Case {
    const char* name;
    SamplingParams p;
    SamplingParams wrong;  // a plausible mistake the test must reject
  };
  std::vector<Case> cases;
  {
    Case c{"temperature", {}, {}};
    c.p.temperature = 0.6f;
    c.wrong.temperature = 1.0f / 0.6f;  // T applied the wrong way round
    cases.push_back(c);
  }
  {
    Case c{"top_k", {}, {}};
    c.p.top_k = 4;
    c.wrong.top_k = 5;
    cases.push_back(c);
  }
  {
    Case c{"top_p", {}, {}};
    c.p.top_p = 0.70f;  // 0.30 + 0.20 + 0.15 = 0.65 < 0.70: the fourth id (0.10) is the boundary, kept
    c.wrong.top_k = 3;  // the set of mass < p only, the boundary id dropped
    cases.push_back(c);
  }
  {
    Case c{"min_p", {}, {}};
    c.p.min_p = 0.25f;              // keep p_i >= 0.075: the first five
    c.wrong.min_p = 0.25f / 0.30f;  // p_i >= min_p alone, not scaled by p_max: keeps the first id only
    cases.push_back(c);
  }
  {
    Case c{"combined", {}, {}};
    c.p.temperature = 1.3f;
    c.p.top_k = 8;
    c.p.top_p = 0.8f;
    c.p.min_p = 0.1f;
    c.wrong = c.p;
    c.wrong.top_p = 1.0f;
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<int64_t> counts = draw_counts(l, c.p, n, 1234);
    const double good = chi_square(counts, target(l, c.p), n);
    const double bad = chi_square(counts, target(l, c.wrong), n);
    EXPECT_LT(good, kChi2Bound);
    EXPECT_GT(bad, 10 * kChi2Bound);
  }
}

TEST(Sampling, Penalties) {
  // Repetition: positive logits divided, negative multiplied, over prompt + generated ids, once per id.
  SamplingParams p;
  p.temperature = 0.0f;
  p.repetition_penalty = 1.25f;
  std::vector<float> row = {2.0f, 1.9f, -1.0f, -1.1f};
  {
    RequestSampler s(p, std::vector<int32_t>{0, 0, 0}, 0);
    std::vector<float> r = row;
    EXPECT_EQ(s.sample(r, nullptr, nullptr), 1);  // 2.0 / 1.25 = 1.6 < 1.9
  }
  {
    std::vector<float> r = {-1.0f, -1.1f};
    RequestSampler s(p, std::vector<int32_t>{0}, 0);
    EXPECT_EQ(s.sample(r, nullptr, nullptr), 1);  // -1.0 * 1.25 = -1.25 < -1.1
  }
  // Presence + frequency over generated ids only: l -= presence + frequency * count.
  SamplingParams q;
  q.temperature = 0.0f;
  q.presence_penalty = 0.5f;
  q.frequency_penalty = 0.2f;
  RequestSampler s(q, std::vector<int32_t>{1, 1, 1}, 0);  // the prompt does not count
  std::vector<float> r = {1.0f, 1.5f, 0.0f};
  EXPECT_EQ(s.sample(r, nullptr, nullptr), 1);
  s.accept(1);  // 1.5 - 0.7 = 0.8 < 1.0
  r = {1.0f, 1.5f, 0.0f};
  EXPECT_EQ(s.sample(r, nullptr, nullptr), 0);
  s.accept(0);  // 1.0 - 0.7 = 0.3, 0.8: back to 1
  r = {1.0f, 1.5f, 0.0f};
  EXPECT_EQ(s.sample(r, nullptr, nullptr), 1);
  s.accept(1);  // 1.5 - 0.5 - 0.4 = 0.6 > 0.3
  s.accept(1);  // 1.5 - 0.5 - 0.6 = 0.4 > 0.3
  s.accept(1);  // 1.5 - 0.5 - 0.8 = 0.2 < 0.3
  r = {1.0f, 1.5f, 0.0f};
  EXPECT_EQ(s.sample(r, nullptr, nullptr), 0);
  EXPECT_EQ(s.generated(), 5);
}

TEST(Sampling, Logprobs) {
  std::mt19937_64 rng(8);
  for (int64_t V : {7, 20, 163840}) {
    std::vector<float> row = make_row(V, Row::kTies, rng);
    SamplingParams p;
    p.temperature = 0.5f;  // logprobs are of the raw logits: neither temperature nor penalties show
    p.repetition_penalty = 2.0f;
    p.logprobs = kMaxLogprobs;
    RequestSampler s(p, std::vector<int32_t>{0, 1, 2}, 77);
    std::vector<float> scratch = row;
    TokenLogprob lp;
    const int32_t t = s.sample(scratch, nullptr, &lp);
    EXPECT_EQ(lp.token, t);
    ASSERT_EQ(lp.top.size(), std::min<size_t>(V, kMaxLogprobs));
    double lse = 0, mx = *std::max_element(row.begin(), row.end());
    for (float x : row) lse += std::exp(static_cast<double>(x) - mx);
    lse = mx + std::log(lse);
    EXPECT_NEAR(lp.logprob, row[t] - lse, 1e-5);
    for (size_t i = 0; i < lp.top.size(); ++i) {
      const auto [id, v] = lp.top[i];
      EXPECT_NEAR(v, row[id] - lse, 1e-5);
      if (i > 0) {  // descending, ties by lower id
        const auto [pid, pv] = lp.top[i - 1];
        EXPECT_TRUE(pv > v || (pv == v && pid < id)) << i;
      }
      if (id == t) {
        EXPECT_EQ(v, lp.logprob);
      }
    }
    if (V <= kMaxLogprobs) {  // every id listed: the probabilities sum to 1
      double sum = 0;
      for (auto [id, v] : lp.top) sum += std::exp(static_cast<double>(v));
      EXPECT_NEAR(sum, 1.0, 1e-6);
    }
  }
  // Over the allowed ids only; logprobs = 0: the chosen token alone.
  std::vector<float> row = {0.0f, 0.0f, 0.0f, 5.0f};
  std::vector<uint8_t> allowed = {1, 1, 1, 0};
  SamplingParams p;
  p.logprobs = 0;
  RequestSampler s(p, {}, 1);
  TokenLogprob lp;
  s.sample(row, allowed.data(), &lp);
  EXPECT_TRUE(lp.top.empty());
  EXPECT_NEAR(lp.logprob, -std::log(3.0), 1e-6);
}

TEST(Sampling, BadRowsAreRefused) {
  SamplingParams p;
  RequestSampler s(p, {}, 1);
  std::vector<float> row = {0.0f, std::nanf(""), 1.0f};
  try {
    s.sample(row, nullptr, nullptr);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "logits: NaN at id 1");
  }
  SamplingParams g;  // greedy: the same refusal, naming the same id
  g.temperature = 0.0f;
  RequestSampler sg(g, {}, 1);
  for (const int64_t V : {3, 300}) {
    std::vector<float> wide(static_cast<size_t>(V), 0.5f);
    wide[1] = std::nanf("");
    wide[V - 1] = std::nanf("");
    try {
      sg.sample(wide, nullptr, nullptr);
      FAIL() << V;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "logits: NaN at id 1") << V;
    }
  }
  std::vector<uint8_t> allowed = {1, 0, 1};
  EXPECT_NE(s.sample(row, allowed.data(), nullptr), 1);  // a NaN where nothing may come out is ignored
  row = {0.0f, std::nanf(""), 1.0f};
  EXPECT_EQ(sg.sample(row, allowed.data(), nullptr), 2);
  allowed = {0, 0, 0};
  row = {0.0f, 1.0f, 2.0f};
  EXPECT_THROW(s.sample(row, allowed.data(), nullptr), std::invalid_argument);
  EXPECT_EQ(s.generated(), 0);
  SamplingParams r;
  r.repetition_penalty = 1.1f;
  RequestSampler big(r, std::vector<int32_t>{5}, 1);  // a prompt id beyond the row
  row = {0.0f, 1.0f, 2.0f};
  EXPECT_THROW(big.sample(row, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(RequestSampler(r, std::vector<int32_t>{-1}, 1), std::invalid_argument);
  r.top_p = 0.0f;
  EXPECT_THROW(RequestSampler(r, {}, 1), std::invalid_argument);
}

TEST(Sampling, SampleAllocatesNothingAfterItsFirstCall) {
  const int64_t V = 163840;
  std::mt19937_64 rng(4);
  const std::vector<float> row = make_row(V, Row::kNormal, rng);
  for (const SamplingParams& p : param_cases()) {  // logprobs 5 included: lp's vectors are reused
    RequestSampler s(p, std::vector<int32_t>{1, 2, 3}, 5);
    TokenLogprob lp;
    std::vector<float> scratch = row;
    s.accept(s.sample(scratch, nullptr, &lp));
    scratch = row;
    const int64_t before = g_allocations;
    const int32_t t = s.sample(scratch, nullptr, &lp);
    EXPECT_EQ(g_allocations, before) << "T=" << p.temperature << " k=" << p.top_k << " p=" << p.top_p;
    EXPECT_GE(t, 0);
    EXPECT_EQ(lp.token, t);
  }
}

void expect_invalid(const SamplingParams& p, int64_t vocab, const std::string& message) {
  try {
    p.validate(vocab);
    ADD_FAILURE() << "accepted; expected: " << message;
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).substr(0, message.size()), message);
  }
}

TEST(SamplingParams, ValidateNamesTheField) {
  SamplingParams ok;
  ok.top_k = -1;
  ok.top_p = 1.0f;
  ok.min_p = 1.0f;
  ok.presence_penalty = -2.0f;
  ok.frequency_penalty = 2.0f;
  ok.logprobs = 20;
  ok.stop_token_ids = {0, 99};
  EXPECT_NO_THROW(ok.validate(100));
  auto with = [](auto f) {
    SamplingParams p;
    f(p);
    return p;
  };
  const float nan = std::nanf("");
  expect_invalid(with([&](auto& p) { p.temperature = nan; }), 10,
                 "temperature: must be a finite number >= 0, got nan");
  expect_invalid(with([](auto& p) { p.temperature = -0.5f; }), 10,
                 "temperature: must be a finite number >= 0, got -0.5");
  expect_invalid(with([](auto& p) { p.temperature = kInf; }), 10,
                 "temperature: must be a finite number >= 0, got inf");
  expect_invalid(with([](auto& p) { p.top_p = 0.0f; }), 10,
                 "top_p: must be a finite number in (0, 1], got 0");
  expect_invalid(with([](auto& p) { p.top_p = 1.5f; }), 10, "top_p: ");
  expect_invalid(with([&](auto& p) { p.top_p = nan; }), 10, "top_p: ");
  expect_invalid(with([](auto& p) { p.min_p = -0.1f; }), 10,
                 "min_p: must be a finite number in [0, 1], got -0.1");
  expect_invalid(with([](auto& p) { p.min_p = 1.01f; }), 10, "min_p: ");
  expect_invalid(with([](auto& p) { p.repetition_penalty = 0.0f; }), 10,
                 "repetition_penalty: must be a finite number > 0");
  expect_invalid(with([&](auto& p) { p.repetition_penalty = nan; }), 10, "repetition_penalty: ");
  expect_invalid(with([](auto& p) { p.presence_penalty = 2.5f; }), 10,
                 "presence_penalty: must be a finite number in [-2, 2], got 2.5");
  expect_invalid(with([](auto& p) { p.frequency_penalty = -kInf; }), 10, "frequency_penalty: ");
  expect_invalid(with([](auto& p) { p.max_tokens = 0; }), 10, "max_tokens: must be >= 1, got 0");
  expect_invalid(with([](auto& p) {
                   p.stop_token_ids = {3, 10};
                 }),
                 10, "stop_token_ids: id 10 at index 1 is outside [0, 10)");
  expect_invalid(with([](auto& p) { p.stop_token_ids = {-1}; }), 10, "stop_token_ids: ");
  expect_invalid(with([](auto& p) { p.logprobs = 21; }), 10, "logprobs: ");
  expect_invalid(with([](auto& p) { p.logprobs = -2; }), 10, "logprobs: ");
  expect_invalid(SamplingParams{}, 0, "vocab: ");
}

}  // namespace
}  // namespace kda::sampling
