// spec_accept (one-hot proposals: one pass over p, the residual kept unnormalized) and its reference.
#include "kda/sampling/spec_accept.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/sampling/sampler.h"
#include "kda/sampling/sampler_math.h"

namespace kda::sampling {

namespace {

void check(std::span<const double> p, std::span<const int32_t> drafts, std::span<const double> q) {
  const int64_t V = static_cast<int64_t>(p.size());
  if (V == 0) throw std::invalid_argument("p: empty distribution");
  if (!q.empty() && q.size() != drafts.size() * p.size())
    throw std::invalid_argument("q: " + std::to_string(q.size()) + " entries for " +
                                std::to_string(drafts.size()) + " drafts over " + std::to_string(V) + " ids");
  double z = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    if (!(p[i] >= 0.0)) throw std::invalid_argument("p: id " + std::to_string(i) + " is negative or NaN");
    z += p[i];
  }
  if (!(z > 0.0)) throw std::invalid_argument("p: no mass");
  for (size_t i = 0; i < drafts.size(); ++i) {
    if (drafts[i] < 0 || drafts[i] >= V)
      throw std::invalid_argument("drafts: id " + std::to_string(drafts[i]) +
                                  " is outside the vocabulary of " + std::to_string(V));
    if (q.empty()) continue;
    for (int64_t t = 0; t < V; ++t)
      if (!(q[i * V + t] >= 0.0)) throw std::invalid_argument("q: a negative or NaN probability");
    if (!(q[i * V + drafts[i]] > 0.0))
      throw std::invalid_argument("q: draft " + std::to_string(i) +
                                  " has probability 0 under its own proposal");
  }
}

// The first id whose running mass exceeds u * z (ascending ids); the last id with mass on rounding.
int32_t draw(std::span<const double> r, double z, double u) {
  const double target = u * z;
  double cum = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < r.size(); ++i) {
    if (!(r[i] > 0.0)) continue;
    cum += r[i];
    last = static_cast<int32_t>(i);
    if (cum > target) return last;
  }
  return last;
}

}  // namespace

double spec_uniform(uint64_t seed, int64_t k, int32_t j) {
  const uint64_t d = detail::draw53(seed, k);
  if (j == 0) return static_cast<double>(d) * 0x1.0p-53;
  return static_cast<double>(detail::splitmix64(d ^ detail::splitmix64(static_cast<uint64_t>(j))) >> 11) *
         0x1.0p-53;
}

SpecAcceptResult spec_accept(std::span<double> p, std::span<const int32_t> drafts, std::span<const double> q,
                             uint64_t seed, int64_t k) {
  if (!q.empty()) return spec_accept_reference(p, drafts, q, seed, k);  // general q: the dense steps
  check(p, drafts, q);
  // One-hot proposals: the residual after rejecting x_1..x_i is p without them, so it stays p with those
  // ids zeroed, and its total is tracked instead of renormalizing V entries per sibling.
  double z = 0.0;
  for (const double v : p) z += v;
  for (size_t i = 0; i < drafts.size(); ++i) {
    const double px = p[drafts[i]];
    const double u = spec_uniform(seed, k, static_cast<int32_t>(i) + 1);
    if (u * z < px) return {static_cast<int32_t>(i), drafts[i]};
    if (z - px > 0.0) {  // a residual without mass (z == px: acceptance was certain) keeps the previous one
      z -= px;
      p[drafts[i]] = 0.0;
    }
  }
  return {-1, draw(p, z, spec_uniform(seed, k, 0))};
}

SpecAcceptResult spec_accept_reference(std::span<double> p, std::span<const int32_t> drafts,
                                       std::span<const double> q, uint64_t seed, int64_t k) {
  check(p, drafts, q);
  const size_t V = p.size();
  std::vector<double> r(p.begin(), p.end()), next(V);
  auto normalize = [](std::vector<double>& v) {
    double s = 0.0;
    for (const double x : v) s += x;
    for (double& x : v) x /= s;
  };
  normalize(r);
  for (size_t i = 0; i < drafts.size(); ++i) {
    const size_t x = static_cast<size_t>(drafts[i]);
    const double qx = q.empty() ? 1.0 : q[i * V + x];
    const double u = spec_uniform(seed, k, static_cast<int32_t>(i) + 1);
    if (u < r[x] / qx) return {static_cast<int32_t>(i), drafts[i]};
    double s = 0.0;
    for (size_t t = 0; t < V; ++t) {
      const double qt = q.empty() ? (t == x ? 1.0 : 0.0) : q[i * V + t];
      next[t] = std::max(0.0, r[t] - qt);
      s += next[t];
    }
    if (s > 0.0) {
      r.swap(next);
      normalize(r);
    }
  }
  std::copy(r.begin(), r.end(), p.begin());
  return {-1, draw(p, 1.0, spec_uniform(seed, k, 0))};
}

}  // namespace kda::sampling
