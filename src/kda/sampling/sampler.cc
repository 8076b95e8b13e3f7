// RequestSampler: the math of sampler.h in passes over the row, partial selection instead of sorting the
// vocabulary, and scratch kept between calls.
#include "kda/sampling/sampler.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "kda/sampling/argmax.h"
#include "kda/sampling/sampler_math.h"

namespace kda::sampling {

using detail::before;
using detail::Mass;
using detail::mass;
using detail::weight;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Weight buckets for top-p's histogram: a weight in [0, 1] by its float bits' exponent and top three
// mantissa bits (eight buckets per octave).
constexpr size_t kBuckets = (0x3F800000u >> 20) + 1;
inline size_t bucket(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof bits);
  return bits >> 20;
}

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
    for (int32_t id : prompt) {
      if (seen_set_.insert(id).second) seen_.push_back(id);
      max_id_ = std::max(max_id_, id);
    }
}

void RequestSampler::accept(int32_t token) {
  if (token < 0) throw std::invalid_argument("accept: negative token id " + std::to_string(token));
  if (repetition_ && seen_set_.insert(token).second) seen_.push_back(token);
  if (additive_) ++counts_[token];
  if (repetition_ || additive_) max_id_ = std::max(max_id_, token);
  ++generated_;
}

void RequestSampler::penalize(float* l) const {
  if (repetition_)
    for (int32_t id : seen_) l[id] = detail::repetition(l[id], params_.repetition_penalty);
  if (additive_)
    for (const auto& [id, c] : counts_)
      l[id] = detail::presence_frequency(l[id], c, params_.presence_penalty, params_.frequency_penalty);
}

int32_t RequestSampler::sample(std::span<float> logits, const uint8_t* allowed, TokenLogprob* lp) {
  const int64_t V = static_cast<int64_t>(logits.size());
  if (V == 0) throw std::invalid_argument("logits: empty row");
  // A refused call (here, or a NaN logit or no allowed id in pick) leaves the sampler as it was.
  if (max_id_ >= V)
    throw std::invalid_argument("prompt/generated: id " + std::to_string(max_id_) + " is outside the row's " +
                                std::to_string(V) + " logits");
  float* l = logits.data();
  if (lp != nullptr) raw_.assign(l, l + V);  // the raw row, for the log-probabilities after the draw
  penalize(l);
  const int32_t chosen = pick(logits, allowed);
  if (lp != nullptr) fill_logprob(V, allowed, chosen, lp);
  return chosen;
}

void RequestSampler::distribution(std::span<float> logits, const uint8_t* allowed, std::vector<double>& p) {
  const int64_t V = static_cast<int64_t>(logits.size());
  if (V == 0) throw std::invalid_argument("logits: empty row");
  if (max_id_ >= V)
    throw std::invalid_argument("prompt/generated: id " + std::to_string(max_id_) + " is outside the row's " +
                                std::to_string(V) + " logits");
  penalize(logits.data());
  pick(logits, allowed, &p);
}

void RequestSampler::logprob(std::span<const float> raw, const uint8_t* allowed, int32_t token,
                             TokenLogprob* lp) {
  const int64_t V = static_cast<int64_t>(raw.size());
  if (token < 0 || token >= V)
    throw std::invalid_argument("token: id " + std::to_string(token) + " is outside the row's " +
                                std::to_string(V) + " logits");
  raw_.assign(raw.begin(), raw.end());
  fill_logprob(V, allowed, token, lp);
}

void RequestSampler::fill_logprob(int64_t V, const uint8_t* allowed, int32_t chosen, TokenLogprob* lp) {
  float* r = raw_.data();
  float m = kNegInf;
  for (int64_t i = 0; i < V; ++i)
    if (ok(allowed, i)) m = std::max(m, r[i]);
  lp->token = chosen;
  lp->top.clear();
  if (params_.logprobs > 0) {
    select_top(r, allowed, V, static_cast<size_t>(params_.logprobs), ids_);
    std::sort(ids_.begin(), ids_.end(), [r](int32_t a, int32_t b) { return before(r[a], a, r[b], b); });
    for (int32_t id : ids_) lp->top.emplace_back(id, r[id]);  // raw logits for now
  }
  const float chosen_logit = r[chosen];
  // The weights over the raw row in place (a loop without the mask vectorizes), then their sum.
  if (std::isfinite(m)) {
    for (int64_t i = 0; i < V; ++i) r[i] = detail::exp_nonpositive(r[i] - m);
  } else {
    for (int64_t i = 0; i < V; ++i) r[i] = weight(r[i], m);
  }
  double z = 0.0;
  for (int64_t i = 0; i < V; ++i)
    if (ok(allowed, i)) z += r[i];
  lp->logprob = detail::log_prob(chosen_logit, m, z);
  for (auto& [id, v] : lp->top) v = detail::log_prob(v, m, z);
}

int32_t RequestSampler::pick(std::span<float> logits, const uint8_t* allowed, std::vector<double>* probs) {
  const int64_t V = static_cast<int64_t>(logits.size());
  float* l = logits.data();
  // The NaN checks ride on the first pass: penalties and temperature make no NaN of a number (inf / T and
  // inf - c stay inf), so a NaN here is one of the row as it came.
  if (params_.greedy()) {
    bool nan = false;
    const int32_t best = argmax_allowed(l, V, allowed, &nan);
    if (nan)  // the first allowed NaN's id, as the other passes name it
      for (int64_t i = 0; i < V; ++i)
        if (ok(allowed, i) && std::isnan(l[i])) detail::nan_logit(i);
    if (best < 0) throw std::invalid_argument("allowed: every id is disallowed");
    if (probs != nullptr) {
      probs->assign(static_cast<size_t>(V), 0.0);
      (*probs)[static_cast<size_t>(best)] = 1.0;
      return -1;
    }
    return best;
  }

  // s = l / T in place; m = max s; n = how many ids are allowed.
  const float T = params_.temperature;
  float m = kNegInf;
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!ok(allowed, i)) continue;
    if (std::isnan(l[i])) detail::nan_logit(i);
    if (T != 1.0f) l[i] /= T;
    m = std::max(m, l[i]);
    ++n;
  }
  if (n == 0) throw std::invalid_argument("allowed: every id is disallowed");
  const bool top_k = params_.top_k > 0 && params_.top_k < n;
  const bool top_p = params_.top_p < 1.0f;
  const double min_p = params_.min_p;  // the largest kept weight is always 1: the top id's exp(0)

  const uint64_t u = detail::draw53(seed_, generated_);
  if (top_k) {
    // A small set: gather it, then the reference's steps on it alone.
    const size_t cap = std::max<size_t>(2 * static_cast<size_t>(params_.top_k), 256);
    if (ids_.capacity() < cap) ids_.reserve(cap);
    if (ids2_.capacity() < cap) ids2_.reserve(cap);
    select_top(l, allowed, V, static_cast<size_t>(params_.top_k), ids_);
    for (int32_t id : ids_) l[id] = weight(l[id], m);  // w from here on
    std::vector<int32_t>& kept = ids_;
    std::vector<int32_t>& by_id = ids2_;
    if (top_p) {
      Mass z = 0;
      for (int32_t id : kept) z += mass(l[id]);
      std::sort(kept.begin(), kept.end(), [l](int32_t a, int32_t b) { return before(l[a], a, l[b], b); });
      const Mass target = detail::scale(z, detail::frac53(params_.top_p));
      Mass cum = 0;
      for (size_t i = 0; i < kept.size(); ++i) {
        cum += mass(l[kept[i]]);
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
    Mass z = 0;
    for (int32_t id : by_id) z += mass(l[id]);
    if (probs != nullptr) {
      probs->assign(static_cast<size_t>(V), 0.0);
      for (int32_t id : by_id)
        (*probs)[static_cast<size_t>(id)] = static_cast<double>(mass(l[id])) / static_cast<double>(z);
      return -1;
    }
    const Mass target = detail::scale(z, u);
    Mass cum = 0;
    for (int32_t id : by_id) {
      cum += mass(l[id]);
      if (cum > target) return id;
    }
    throw std::logic_error("sampler: the draw passed every kept id");  // z > target: unreachable
  }

  // The whole row: w in place, its total mass.
  // (Over every id: a loop without the mask vectorizes; the disallowed ids' values are never read.)
  if (std::isfinite(m)) {
    for (int64_t i = 0; i < V; ++i) l[i] = detail::exp_nonpositive(l[i] - m);
  } else {
    for (int64_t i = 0; i < V; ++i) l[i] = weight(l[i], m);
  }
  // top-p as a boundary (wb, ib): the kept ids are those ordered no later than it. Masses add exactly, so
  // a histogram over weight buckets (a weight's float bits, monotone in it) tells which bucket the sum
  // crosses p * Z in; only that bucket's ids are sorted and walked.
  float wb = 0.0f;
  int32_t ib = std::numeric_limits<int32_t>::max();
  if (top_p) {
    hist_.assign(kBuckets, 0);
    Mass z = 0;
    for (int64_t i = 0; i < V; ++i)
      if (ok(allowed, i)) {
        const uint64_t q = mass(l[i]);
        hist_[bucket(l[i])] += q;
        z += q;
      }
    const Mass target = detail::scale(z, detail::frac53(params_.top_p));
    Mass cum = 0;
    size_t b = kBuckets - 1;
    while (cum + hist_[b] < target) cum += hist_[b--];  // target <= z: some bucket reaches it
    std::vector<int32_t>& band = ids_;
    if (band.capacity() < static_cast<size_t>(V)) band.reserve(static_cast<size_t>(V));  // any bucket fits
    band.clear();
    for (int64_t i = 0; i < V; ++i)
      if (ok(allowed, i) && bucket(l[i]) == b) band.push_back(static_cast<int32_t>(i));
    std::sort(band.begin(), band.end(), [l](int32_t x, int32_t y) { return before(l[x], x, l[y], y); });
    for (int32_t id : band) {
      cum += mass(l[id]);
      if (cum >= target) {
        wb = l[id];
        ib = id;
        break;
      }
    }
  }
  auto kept = [&](int64_t i) {
    const int32_t id = static_cast<int32_t>(i);
    return ok(allowed, i) && (!top_p || id == ib || before(l[i], id, wb, ib)) &&
           !(static_cast<double>(l[i]) < min_p);
  };
  Mass zs = 0;
  for (int64_t i = 0; i < V; ++i)
    if (kept(i)) zs += mass(l[i]);
  if (probs != nullptr) {
    probs->assign(static_cast<size_t>(V), 0.0);
    const double z = static_cast<double>(zs);
    for (int64_t i = 0; i < V; ++i)
      if (kept(i)) (*probs)[static_cast<size_t>(i)] = static_cast<double>(mass(l[i])) / z;
    return -1;
  }
  const Mass target = detail::scale(zs, u);
  Mass cum = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!kept(i)) continue;
    cum += mass(l[i]);
    if (cum > target) return static_cast<int32_t>(i);
  }
  throw std::logic_error("sampler: the draw passed every kept id");  // zs > target: unreachable
}

}  // namespace kda::sampling
