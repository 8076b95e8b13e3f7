#include "kda/serving/draft_depth.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace kda::serving {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

void check_max_depth(const char* who, int32_t max_depth) {
  if (max_depth < 0 || max_depth > 64)
    throw std::invalid_argument(std::string(who) + ": max_depth must be in 0..64, got " +
                                std::to_string(max_depth));
}

// Expected tokens a chain step emits at per-token acceptance a with d drafts: the accepted prefix plus
// the bonus token, sum_{i=0..d} a^i.
double expected_tokens(double a, int32_t d) {
  double sum = 0.0, p = 1.0;
  for (int32_t i = 0; i <= d; ++i, p *= a) sum += p;
  return sum;
}
}  // namespace

VerifyCostModel::VerifyCostModel(int32_t max_depth) : max_depth_(max_depth) {
  check_max_depth("VerifyCostModel", max_depth);
  cells_.resize(static_cast<size_t>(max_depth + 1) * kBuckets);
}

int32_t VerifyCostModel::bucket(int64_t rows) {
  int32_t b = 0;
  while (rows > 1 && b + 1 < kBuckets) {
    rows >>= 1;
    ++b;
  }
  return b;
}

double VerifyCostModel::Cell::estimate() const {
  const int64_t n = std::min<int64_t>(count, kWindow);
  std::array<double, kWindow> v = recent;
  std::sort(v.begin(), v.begin() + n);
  // Under 3 samples one slow step (a page fault, another process) would rule a depth out for good: the
  // optimistic minimum lets it be chosen again until the median has enough samples to mean something.
  return n < 3 ? v[0] : v[static_cast<size_t>(n / 2)];
}

void VerifyCostModel::record(int32_t depth, int64_t rows, double seconds) {
  if (depth < 0 || depth > max_depth_)
    throw std::invalid_argument("VerifyCostModel::record: depth " + std::to_string(depth) + " outside 0.." +
                                std::to_string(max_depth_));
  if (rows < 1) throw std::invalid_argument("VerifyCostModel::record: rows must be >= 1");
  if (!std::isfinite(seconds) || seconds < 0.0)
    throw std::invalid_argument("VerifyCostModel::record: seconds must be finite and >= 0");
  Cell& c = cells_[static_cast<size_t>(depth) * kBuckets + bucket(rows)];
  c.recent[static_cast<size_t>(c.count % kWindow)] = seconds;
  ++c.count;
}

int64_t VerifyCostModel::samples(int32_t depth, int64_t rows) const {
  if (depth < 0 || depth > max_depth_ || rows < 1) return 0;
  return cell(depth, bucket(rows)).count;
}

double VerifyCostModel::measured_ratio(int32_t depth, int32_t b) const {
  // Nearest bucket first, the smaller row count on a tie: the same answer for the same cells.
  for (int32_t dist = 0; dist < kBuckets; ++dist)
    for (const int32_t x : {b - dist, b + dist}) {
      if (x < 0 || x >= kBuckets) continue;
      const Cell& base = cell(0, x);
      const Cell& c = cell(depth, x);
      if (base.count == 0 || c.count == 0) continue;
      const double b0 = base.estimate();
      return b0 > 0.0 ? c.estimate() / b0 : 1.0;
    }
  return -1.0;
}

double VerifyCostModel::relative_cost(int32_t depth, int64_t rows) const {
  if (depth < 0 || depth > max_depth_)
    throw std::invalid_argument("VerifyCostModel::relative_cost: depth " + std::to_string(depth) +
                                " outside 0.." + std::to_string(max_depth_));
  if (rows < 1) throw std::invalid_argument("VerifyCostModel::relative_cost: rows must be >= 1");
  const int32_t b = bucket(rows);
  if (measured_ratio(0, b) < 0.0) return kInf;  // no plain decode step measured at any row count
  if (depth == 0) return 1.0;
  const double r = measured_ratio(depth, b);
  if (r >= 0.0) return r;
  // Unmeasured: optimistic, the cost of the deepest measured depth below it. Depth 1 comes first (costed
  // as a plain step); deeper ones are candidates once a verify step has been measured, each costed as
  // the deepest measured depth below it until it is measured itself. Not one depth at a time: a verify
  // step's cost is far from linear in its depth (a fixed part, the verify path and the experts a second
  // token adds, then less per token as the union of experts fills up), so depth 1's cost can rule depth 2
  // out while depth 4 pays.
  for (int32_t d = depth - 1; d >= 1; --d) {
    const double below = measured_ratio(d, b);
    if (below >= 0.0) return below;
  }
  return depth == 1 ? 1.0 : kInf;
}

DraftDepthController::DraftDepthController(int32_t max_depth) : max_depth_(max_depth) {
  check_max_depth("DraftDepthController", max_depth);
}

double DraftDepthController::acceptance() const {
  constexpr double kPriorHits = 1.0, kPriorMisses = 1.0;  // 0.5, worth two tokens of evidence
  return (hits_ + kPriorHits) / (hits_ + misses_ + kPriorHits + kPriorMisses);
}

double DraftDepthController::optimistic_acceptance() const {
  const double a = acceptance(), n = hits_ + misses_ + 2.0;  // the prior's two tokens included
  return std::min(0.99, a + std::sqrt(a * (1.0 - a) / n));
}

void DraftDepthController::observe(int32_t drafted, int32_t accepted) {
  if (drafted < 0 || accepted < 0 || accepted > drafted)
    throw std::invalid_argument("DraftDepthController::observe: accepted " + std::to_string(accepted) +
                                " of " + std::to_string(drafted) + " drafted");
  if (drafted == 0) return;
  // A chain's accepted prefix: `accepted` successes, then one rejection unless every draft was accepted
  // (the maximum-likelihood estimate of a per-token rate from a truncated geometric count).
  hits_ = hits_ * kDecay + accepted;
  misses_ = misses_ * kDecay + (accepted < drafted ? 1.0 : 0.0);
}

int32_t DraftDepthController::best_depth(const VerifyCostModel& cost, int64_t rows, double a) const {
  int32_t best = 0;
  double best_score = 1.0;  // plain decoding: one token per unit cost
  for (int32_t d = 1; d <= std::min(max_depth_, cost.max_depth()); ++d) {
    const double c = cost.relative_cost(d, rows);
    if (!std::isfinite(c) || c <= 0.0) continue;
    const double score = expected_tokens(a, d) / c;
    if (score > best_score) {
      best = d;
      best_score = score;
    }
  }
  return best_score >= kMinGain ? best : 0;
}

int32_t DraftDepthController::choose(const VerifyCostModel& cost, int64_t rows) {
  int32_t d = best_depth(cost, rows, optimistic_acceptance());
  if (probing_) {  // the probe's observation is in: did it make a depth pay on the estimate itself?
    reprobe_after_ = best_depth(cost, rows, acceptance()) > 0
                         ? kReprobeSteps
                         : std::min(reprobe_after_ * 2, kMaxReprobeSteps);
    probing_ = false;
  }
  if (d > 0) {
    zero_run_ = 0;
  } else if (++zero_run_ > reprobe_after_ && max_depth_ > 0 && std::isfinite(cost.relative_cost(1, rows))) {
    d = 1;
    zero_run_ = 0;
    probing_ = true;
    const double weight = hits_ + misses_;
    if (weight > kProbeMemory) {
      hits_ *= kProbeMemory / weight;
      misses_ *= kProbeMemory / weight;
    }
  }
  last_ = d;
  return d;
}

}  // namespace kda::serving
