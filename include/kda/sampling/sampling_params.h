// A request's sampling parameters, with the ranges OpenAI's and vLLM's APIs accept.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace kda::sampling {

struct SamplingParams {
  float temperature = 1.0f;             // >= 0; 0: greedy (argmax, ties to the lowest id)
  int32_t top_k = 0;                    // <= 0 (vLLM's -1 included): off
  float top_p = 1.0f;                   // (0, 1]
  float min_p = 0.0f;                   // [0, 1]
  float repetition_penalty = 1.0f;      // > 0 (over the prompt + generated tokens, as vLLM)
  float presence_penalty = 0.0f;        // [-2, 2] (over generated tokens, as OpenAI/vLLM)
  float frequency_penalty = 0.0f;       // [-2, 2]
  std::optional<uint64_t> seed;         // none: the engine draws one at submit
  int32_t max_tokens = 16;              // >= 1
  std::vector<int32_t> stop_token_ids;  // extra stop ids (each < vocab)
  bool ignore_eos = false;              // do not stop on the model's stop ids
  int32_t logprobs = -1;  // -1: off; 0..20: the chosen token's logprob and this many top alternatives

  // std::invalid_argument "<field>: <what is wrong>" for NaN/inf/out-of-range values, ids >= vocab.
  void validate(int64_t vocab) const;
  bool greedy() const { return temperature == 0.0f; }
};

inline constexpr int32_t kMaxLogprobs = 20;

// The chosen token's log-probability and the most likely alternatives, from the raw logits.
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;  // log_softmax of the raw logits (before penalties/temperature)
  std::vector<std::pair<int32_t, float>>
      top;  // the `logprobs` most likely ids, descending, ties: lower id first
};

}  // namespace kda::sampling
