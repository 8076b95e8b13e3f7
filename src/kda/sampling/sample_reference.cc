// The plainest code of the sampler's math (sampler.h): full sorts, every id visited, double sums.
#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/sampling/sampler.h"
#include "kda/sampling/sampler_math.h"

namespace kda::sampling {

using detail::before;
using detail::weight;

int32_t sample_reference(std::span<const float> logits, const uint8_t* allowed, const SamplingParams& p,
                         std::span<const int32_t> prompt, std::span<const int32_t> generated, uint64_t seed,
                         TokenLogprob* lp) {
  const int64_t V = static_cast<int64_t>(logits.size());
  p.validate(V);
  auto ok = [&](int64_t i) { return allowed == nullptr || allowed[i] != 0; };
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < V; ++i)
    if (ok(i)) {
      if (std::isnan(logits[i])) detail::nan_logit(i);
      ids.push_back(static_cast<int32_t>(i));
    }
  if (ids.empty()) throw std::invalid_argument("allowed: every id is disallowed");

  std::vector<float> l(logits.begin(), logits.end());
  std::set<int32_t> seen(prompt.begin(), prompt.end());
  seen.insert(generated.begin(), generated.end());
  for (int32_t id : seen)
    if (id < 0 || id >= V)
      throw std::invalid_argument("prompt/generated: id " + std::to_string(id) + " outside vocab");
  if (p.repetition_penalty != 1.0f)
    for (int32_t id : seen) l[id] = detail::repetition(l[id], p.repetition_penalty);
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::map<int32_t, int32_t> count;
    for (int32_t id : generated) ++count[id];
    for (auto [id, c] : count)
      l[id] = detail::presence_frequency(l[id], c, p.presence_penalty, p.frequency_penalty);
  }

  int32_t chosen = -1;
  if (p.greedy()) {
    for (int32_t id : ids)
      if (chosen < 0 || l[id] > l[chosen]) chosen = id;
  } else {
    std::vector<float> s(V);
    for (int32_t id : ids) s[id] = l[id] / p.temperature;
    float m = -std::numeric_limits<float>::infinity();
    for (int32_t id : ids) m = std::max(m, s[id]);
    // top-k
    std::vector<int32_t> kept = ids;
    std::sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) { return before(s[a], a, s[b], b); });
    if (p.top_k > 0 && static_cast<size_t>(p.top_k) < kept.size()) kept.resize(p.top_k);
    std::vector<float> w(V);
    for (int32_t id : kept) w[id] = weight(s[id], m);
    // top-p
    if (p.top_p < 1.0f) {
      std::vector<int32_t> by_id = kept;
      std::sort(by_id.begin(), by_id.end());
      double z = 0.0;
      for (int32_t id : by_id) z += w[id];
      std::sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) { return before(w[a], a, w[b], b); });
      const double target = static_cast<double>(p.top_p) * z;
      double cum = 0.0;
      size_t n = kept.size();
      for (size_t i = 0; i < kept.size(); ++i) {
        cum += w[kept[i]];
        if (cum >= target) {
          n = i + 1;
          break;
        }
      }
      kept.resize(n);
    }
    // min-p
    if (p.min_p > 0.0f) {
      float w_max = 0.0f;
      for (int32_t id : kept) w_max = std::max(w_max, w[id]);
      const double floor = static_cast<double>(p.min_p) * static_cast<double>(w_max);
      std::vector<int32_t> rest;
      for (int32_t id : kept)
        if (!(static_cast<double>(w[id]) < floor)) rest.push_back(id);
      kept = rest;
    }
    // the draw
    std::sort(kept.begin(), kept.end());
    double z = 0.0;
    for (int32_t id : kept) z += w[id];
    const double target = draw_uniform(seed, static_cast<int64_t>(generated.size())) * z;
    double cum = 0.0;
    for (int32_t id : kept) {
      cum += w[id];
      if (cum > target) {
        chosen = id;
        break;
      }
    }
    if (chosen < 0)  // u * z rounded up to z: the last id that carries weight
      for (int32_t id : kept)
        if (w[id] > 0.0f) chosen = id;
  }

  if (lp != nullptr) {
    float m = -std::numeric_limits<float>::infinity();
    for (int32_t id : ids) m = std::max(m, logits[id]);
    double z = 0.0;
    for (int32_t id : ids) z += weight(logits[id], m);
    std::vector<int32_t> order = ids;
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return before(logits[a], a, logits[b], b); });
    lp->token = chosen;
    lp->logprob = detail::log_prob(logits[chosen], m, z);
    lp->top.clear();
    const size_t n = std::min(order.size(), static_cast<size_t>(std::max(p.logprobs, 0)));
    for (size_t i = 0; i < n; ++i) lp->top.emplace_back(order[i], detail::log_prob(logits[order[i]], m, z));
  }
  return chosen;
}

double draw_uniform(uint64_t seed, int64_t k) {
  const uint64_t h = detail::splitmix64(detail::splitmix64(seed) + static_cast<uint64_t>(k));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

}  // namespace kda::sampling
