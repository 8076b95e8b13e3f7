// RequestSampler: the math of sampler.h in passes over the row, partial selection instead of sorting the
// vocabulary, and scratch kept between calls.
#include "kda/sampling/sampler.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "kda/sampling/sampler_math.h"

namespace kda::sampling {

using detail::before;
using detail::weight;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline bool ok(const uint8_t* allowed, int64_t i) { return allowed == nullptr || allowed[i] != 0; }

// The k first allowed ids by (v descending, id ascending), unordered, in `buf`. One pass: ids enter a
// buffer only when they beat the k-th best so far; a full buffer is cut back to its k best.
void select_top(const float* v, const uint8_t* allowed, int64_t V, size_t k, std::vector<int32_t>& buf) {
  const size_t cap = std::max<size_t>(2 * k, 256);
  auto cmp = [v](int32_t a, int32_t b) { return before(v[a], a, v[b], b); };
  buf.clear();
  bool have_thr = false;
  float tv = 0.0f;
  int32_t ti = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!ok(allowed, i)) continue;
    const int32_t id = static_cast<int32_t>(i);
    if (have_thr && !before(v[i], id, tv, ti)) continue;
    buf.push_back(id);
    if (buf.size() == cap) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), cmp);
      buf.resize(k);
      have_thr = true;
      tv = v[buf[k - 1]];
      ti = buf[k - 1];
    }
  }
  if (buf.size() > k) {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), cmp);
    buf.resize(k);
  }
}

}  // namespace

RequestSampler::RequestSampler(const SamplingParams& params, std::span<const int32_t> prompt, uint64_t seed)
    : params_(params), seed_(seed) {
  params_.validate(std::numeric_limits<int64_t>::max());
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0)
      throw std::invalid_argument("prompt: negative id " + std::to_string(prompt[i]) + " at index " +
                                  std::to_string(i));
  repetition_ = params_.repetition_penalty != 1.0f;
  additive_ = params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f;
  if (repetition_)
    for (int32_t id : prompt)
      if (seen_set_.insert(id).second) seen_.push_back(id);
}

void RequestSampler::accept(int32_t token) {
  if (token < 0) throw std::invalid_argument("accept: negative token id " + std::to_string(token));
  if (repetition_ && seen_set_.insert(token).second) seen_.push_back(token);
  if (additive_) ++counts_[token];
  ++generated_;
}

int32_t RequestSampler::sample(std::span<float> logits, const uint8_t* allowed, TokenLogprob* lp) {
  const int64_t V = static_cast<int64_t>(logits.size());
  if (V == 0) throw std::invalid_argument("logits: empty row");
  // Every check before the row changes, so that a refused call leaves it (and the sampler) as it was.
  for (int32_t id : seen_)
    if (id >= V) throw std::invalid_argument("prompt/generated: id " + std::to_string(id) + " outside vocab");
  for (const auto& [id, c] : counts_)
    if (id >= V) throw std::invalid_argument("generated: id " + std::to_string(id) + " outside vocab");
  float* l = logits.data();
  bool any = false;
  for (int64_t i = 0; i < V; ++i) {
    if (!ok(allowed, i)) continue;
    any = true;
    if (std::isnan(l[i])) detail::nan_logit(i);
  }
  if (!any) throw std::invalid_argument("allowed: every id is disallowed");

  if (lp != nullptr) raw_.assign(l, l + V);  // the raw row, for the log-probabilities after the draw
  if (repetition_)
    for (int32_t id : seen_) l[id] = detail::repetition(l[id], params_.repetition_penalty);
  if (additive_)
    for (const auto& [id, c] : counts_)
      l[id] = detail::presence_frequency(l[id], c, params_.presence_penalty, params_.frequency_penalty);
  const int32_t chosen = pick(logits, allowed);

  if (lp != nullptr) {
    const float* r = raw_.data();
    float m = kNegInf;
    for (int64_t i = 0; i < V; ++i)
      if (ok(allowed, i)) m = std::max(m, r[i]);
    double z = 0.0;
    for (int64_t i = 0; i < V; ++i)
      if (ok(allowed, i)) z += weight(r[i], m);
    lp->token = chosen;
    lp->logprob = detail::log_prob(r[chosen], m, z);
    lp->top.clear();
    if (params_.logprobs > 0) {
      select_top(r, allowed, V, static_cast<size_t>(params_.logprobs), ids_);
      std::sort(ids_.begin(), ids_.end(), [r](int32_t a, int32_t b) { return before(r[a], a, r[b], b); });
      for (int32_t id : ids_) lp->top.emplace_back(id, detail::log_prob(r[id], m, z));
    }
  }
  return chosen;
}

int32_t RequestSampler::pick(std::span<float> logits, const uint8_t* allowed) {
  const int64_t V = static_cast<int64_t>(logits.size());
  float* l = logits.data();
  if (params_.greedy()) {
    int64_t best = -1;
    for (int64_t i = 0; i < V; ++i)
      if (ok(allowed, i) && (best < 0 || l[i] > l[best])) best = i;
    return static_cast<int32_t>(best);
  }

  // s = l / T in place; m = max s; n = how many ids are allowed.
  const float T = params_.temperature;
  float m = kNegInf;
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!ok(allowed, i)) continue;
    if (T != 1.0f) l[i] /= T;
    m = std::max(m, l[i]);
    ++n;
  }
  const bool top_k = params_.top_k > 0 && params_.top_k < n;
  const bool top_p = params_.top_p < 1.0f;
  const double min_p = params_.min_p;  // the largest kept weight is always 1: the top id's exp(0)

  if (top_k) {
    // A small set: gather it, then the reference's steps on it alone.
    ids_.reserve(std::max<size_t>(2 * params_.top_k, 256));
    select_top(l, allowed, V, static_cast<size_t>(params_.top_k), ids_);
    for (int32_t id : ids_) l[id] = weight(l[id], m);  // w from here on
    std::vector<int32_t>& kept = ids_;
    std::vector<int32_t>& by_id = ids2_;
    if (top_p) {
      by_id.assign(kept.begin(), kept.end());
      std::sort(by_id.begin(), by_id.end());
      double z = 0.0;
      for (int32_t id : by_id) z += l[id];
      std::sort(kept.begin(), kept.end(), [l](int32_t a, int32_t b) { return before(l[a], a, l[b], b); });
      const double target = static_cast<double>(params_.top_p) * z;
      double cum = 0.0;
      for (size_t i = 0; i < kept.size(); ++i) {
        cum += l[kept[i]];
        if (cum >= target) {
          kept.resize(i + 1);
          break;
        }
      }
    }
    by_id.clear();
    for (int32_t id : kept)
      if (!(static_cast<double>(l[id]) < min_p)) by_id.push_back(id);
    std::sort(by_id.begin(), by_id.end());
    double z = 0.0;
    for (int32_t id : by_id) z += l[id];
    const double target = draw_uniform(seed_, generated_) * z;
    double cum = 0.0;
    int32_t last = -1;
    for (int32_t id : by_id) {
      cum += l[id];
      if (cum > target) return id;
      if (l[id] > 0.0f) last = id;
    }
    return last;
  }

  // The whole row: w in place, Z over every allowed id in id order.
  double z = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    if (!ok(allowed, i)) continue;
    l[i] = weight(l[i], m);
    z += l[i];
  }
  // top-p as a boundary (wb, ib): the kept ids are those ordered no later than it. Found by bands of
  // weight, each gathered and sorted in turn and walked until the sum reaches p * Z; a peaked distribution
  // needs the first band only.
  float wb = 0.0f;
  int32_t ib = std::numeric_limits<int32_t>::max();
  if (top_p) {
    const double target = static_cast<double>(params_.top_p) * z;
    double cum = 0.0;
    float hi = std::numeric_limits<float>::infinity(), lo = 0x1.0p-6f;
    std::vector<int32_t>& band = ids_;
    band.reserve(static_cast<size_t>(V));
    bool found = false;
    int32_t last = -1;
    while (!found) {
      band.clear();
      for (int64_t i = 0; i < V; ++i)
        if (ok(allowed, i) && l[i] < hi && l[i] >= lo) band.push_back(static_cast<int32_t>(i));
      std::sort(band.begin(), band.end(), [l](int32_t a, int32_t b) { return before(l[a], a, l[b], b); });
      for (int32_t id : band) {
        cum += l[id];
        last = id;
        if (cum >= target) {
          found = true;
          break;
        }
      }
      if (lo < 0.0f) break;  // every band walked: rounding kept the sum below p * Z, keep them all
      hi = lo;
      lo = lo > 1e-37f ? lo * 0x1.0p-6f : -1.0f;
    }
    wb = l[last];
    ib = last;
  }
  auto kept = [&](int64_t i) {
    const int32_t id = static_cast<int32_t>(i);
    return ok(allowed, i) && (!top_p || id == ib || before(l[i], id, wb, ib)) &&
           !(static_cast<double>(l[i]) < min_p);
  };
  double zs = 0.0;
  for (int64_t i = 0; i < V; ++i)
    if (kept(i)) zs += l[i];
  const double target = draw_uniform(seed_, generated_) * zs;
  double cum = 0.0;
  int32_t last = -1;
  for (int64_t i = 0; i < V; ++i) {
    if (!kept(i)) continue;
    cum += l[i];
    if (cum > target) return static_cast<int32_t>(i);
    if (l[i] > 0.0f) last = static_cast<int32_t>(i);
  }
  return last;
}

}  // namespace kda::sampling
