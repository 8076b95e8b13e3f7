// Per-request token sampling: penalties -> temperature -> top-k -> top-p -> min-p -> a seeded draw.
//
// The math, shared bit for bit by RequestSampler (the optimized path) and sample_reference:
//  - logits l (fp32). Repetition penalty r over the distinct ids of prompt + generated: l > 0 ? l / r : l *
//  r.
//    Then over the generated ids with count c > 0: l -= presence + frequency * c.
//  - Greedy (temperature 0): the lowest allowed id with the largest penalized logit.
//  - Else s = l / T (fp32) over the allowed ids, m = max s. Weights w = exp(s - m) (fp32 std::exp); when m is
//    infinite (a logit of +inf, or every allowed one -inf), w = 1 where s == m and 0 elsewhere.
//  - top-k keeps the k first allowed ids by (s descending, id ascending).
//  - top-p: Z = the double sum of w over the kept ids in ascending id order; walking the kept ids by
//    (w descending, id ascending) and adding w in double, keep up to and including the first id where the
//    sum reaches p * Z (all of them if rounding never lets it).
//  - min-p drops w < min_p * w_max (w_max = the largest kept w).
//  - The draw: u in [0, 1) from (seed, k) only, k = the number of tokens generated so far (splitmix64);
//    over the kept ids in ascending id order, the first whose running double sum of w exceeds u * (their
//    sum).
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

 private:
  int32_t pick(std::span<float> logits, const uint8_t* allowed);

  SamplingParams params_;
  uint64_t seed_;
  int32_t generated_ = 0;
  bool repetition_ = false, additive_ = false;  // which penalties are on
  std::vector<int32_t> seen_;                   // distinct ids of prompt + generated (repetition penalty)
  std::unordered_set<int32_t> seen_set_;
  std::unordered_map<int32_t, int32_t> counts_;  // generated id -> count (presence / frequency)
  // Scratch, grown on the first call and kept: sample() allocates nothing after it.
  std::vector<float> raw_;
  std::vector<int32_t> ids_, ids2_;
};

// The reference beside it, same math by the plainest code (full sort, double sums): tests compare.
int32_t sample_reference(std::span<const float> logits, const uint8_t* allowed, const SamplingParams& p,
                         std::span<const int32_t> prompt, std::span<const int32_t> generated, uint64_t seed,
                         TokenLogprob* lp);

// The uniform in [0, 1) of the k-th generated token's draw.
double draw_uniform(uint64_t seed, int64_t k);

}  // namespace kda::sampling
