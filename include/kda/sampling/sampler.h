// Per-request token sampling: penalties -> temperature -> top-k -> top-p -> min-p -> a seeded draw.
//
// The math, shared bit for bit by RequestSampler (the optimized path) and sample_reference:
//  - logits l (fp32). Repetition penalty r over the distinct ids of prompt + generated:
//    l > 0 ? l / r : l * r. Then over the generated ids with count c > 0: l -= presence + frequency * c.
//  - Greedy (temperature 0): the lowest allowed id with the largest penalized logit.
//  - Else s = l / T (fp32) over the allowed ids, m = max s. Weights w = exp(s - m) (fp32 std::exp); when m is
//    infinite (a logit of +inf, or every allowed one -inf), w = 1 where s == m and 0 elsewhere.
//  - top-k keeps the k first allowed ids by (s descending, id ascending).
//  - Sums of weights are exact: each w as an integer mass, w * 2^62 truncated (a w below 2^-62 of the top
//    one weighs nothing), added in 128 bits, so that any order of adding gives the same sum.
//  - top-p: Z = the kept ids' total mass; walking them by (w descending, id ascending), keep up to and
//    including the first id where the running mass reaches floor(p * Z) (p as a 53-bit fraction).
//  - min-p drops w < min_p * w_max (w_max = the largest kept w).
//  - The draw: 53 bits d from (seed, k) only, k = the number of tokens generated so far (splitmix64);
//    over the kept ids in ascending id order, the first whose running mass exceeds floor(d * Z_kept / 2^53).
//  - Logprobs: log_softmax of the raw logits over the allowed ids (fp32 exp, double sum in id order).
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kda/sampling/sampling_params.h"

namespace kda::sampling {

// One request's sampler (one per continuation): the penalties' token counts, its seeded generator.
class RequestSampler {
 public:
  // seed: resolved (params.seed or drawn by the engine); prompt: for the repetition penalty.
  // Invalid params or a negative prompt id -> std::invalid_argument.
  RequestSampler(const SamplingParams& params, std::span<const int32_t> prompt, uint64_t seed);
  // logits: one fp32 row [V] (used as scratch: its contents are undefined afterwards). allowed: null or [V]
  // (0: never produce that id). The draw of the k-th generated token is a function of (seed, k) only, so
  // the same request gives the same tokens whatever else is batched. Fills *lp when non-null.
  // A NaN logit at an allowed id, no allowed id, or a penalized id >= V -> std::invalid_argument, the
  // sampler's state untouched.
  int32_t sample(std::span<float> logits, const uint8_t* allowed, TokenLogprob* lp);
  void accept(int32_t token);  // a generated token committed (penalty counts, k += 1)
  int32_t generated() const { return generated_; }
  uint64_t seed() const { return seed_; }
  // What sample() would draw from, as probabilities: p[i] = id i's kept mass / the kept ids' total (after
  // the penalties, temperature, top-k, top-p and min-p; greedy: one-hot at the pick), 0 for the ids
  // dropped. Speculative sampling verifies drafts against it. logits as sample() takes them (scratch);
  // the same errors, the sampler's state untouched either way.
  void distribution(std::span<float> logits, const uint8_t* allowed, std::vector<double>& p);
  // The log-probabilities sample() reports for `token` (the raw row's log_softmax, top-n alternatives).
  // raw: the row as the model gave it (copied, not changed).
  void logprob(std::span<const float> raw, const uint8_t* allowed, int32_t token, TokenLogprob* lp);

 private:
  void penalize(float* l) const;
  // probs null: the draw. Else the kept distribution goes to *probs and the result is -1.
  int32_t pick(std::span<float> logits, const uint8_t* allowed, std::vector<double>* probs = nullptr);
  // raw_ holds the raw row [V]: *lp for `chosen` (raw_ is scratch afterwards).
  void fill_logprob(int64_t V, const uint8_t* allowed, int32_t chosen, TokenLogprob* lp);

  SamplingParams params_;
  uint64_t seed_;
  int32_t generated_ = 0;
  bool repetition_ = false, additive_ = false;  // which penalties are on
  std::vector<int32_t> seen_;                   // distinct ids of prompt + generated (repetition penalty)
  std::unordered_set<int32_t> seen_set_;
  std::unordered_map<int32_t, int32_t> counts_;  // generated id -> count (presence / frequency)
  int32_t max_id_ = -1;                          // the largest id the penalties touch
  // Scratch, grown on the first call and kept: sample() allocates nothing after it.
  std::vector<float> raw_;
  std::vector<int32_t> ids_, ids2_;
  std::vector<unsigned __int128> hist_;  // top-p's masses per weight bucket
};

// The reference beside it, same math by the plainest code (full sort, double sums): tests compare.
int32_t sample_reference(std::span<const float> logits, const uint8_t* allowed, const SamplingParams& p,
                         std::span<const int32_t> prompt, std::span<const int32_t> generated, uint64_t seed,
                         TokenLogprob* lp);

// The uniform in [0, 1) of the k-th generated token's draw.
double draw_uniform(uint64_t seed, int64_t k);

}  // namespace kda::sampling
