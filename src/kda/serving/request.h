// What the serving simulation serves: a request (a prompt of token ids, then greedy decode steps,
// possibly forked into parallel samples, possibly one turn of a multi-turn session) and the
// scheduler's view of one running sequence.
#pragma once

#include <cstdint>
#include <vector>

namespace kda::serving {

// One request of the workload. `id` seeds its random prompt tokens and names its outputs (it is the
// index in the workload, so a request re-run alone gets the same tokens).
//
// Tokens: a request runs prompt_len prompt tokens (EXTEND, possibly in chunks), then output_len
// DECODE steps per continuation. It generates output_len + 1 tokens greedily: the first from the
// prompt's last position, then one per decode step; each decode step's input is the token generated
// just before it, so the last generated token is never fed back (in a session it opens the next turn).
//
// Sessions: a request with `after` >= 0 is the next turn of the request at workload index `after`
// (which comes before it in the workload; a request has at most one next turn). Its prompt is the
// previous turn's whole prompt + that turn's output_len + 1 generated tokens (continuation 0's) +
// `turn_len` tokens of its own, so prompt_len = prev.prompt_len + prev.output_len + 1 + turn_len. It
// arrives `arrival_step` steps after the previous turn finished (0: the next step).
// Without `after`, turn_len is not used: the whole prompt is the request's own (own_len()).
//
// The request's own tokens (the last turn_len of the prompt): `prompt` when given (turn_len ids, each
// < the vocabulary size), else seeded random ids drawn from (seed, id, position) (serve time).
struct RequestSpec {
  int64_t id = 0;
  int32_t prompt_len = 1;    // >= 1: tokens of the whole prompt
  int32_t output_len = 0;    // >= 0: decode steps after the prompt, per continuation
  int64_t arrival_step = 0;  // the scheduler sees the request from this step on (a next turn: after)
  // Offsets the sample index of its outputs (0 in a workload; the self-check replays continuations).
  int32_t sample_base = 0;
  int32_t turn_len = 0;         // with `after`: tokens the request adds to the prompt itself (>= 0)
  std::vector<int32_t> prompt;  // its own token ids (turn_len of them), or empty: seeded random ids
  int64_t after = -1;           // workload index of the previous turn of its session, or -1
  // Teacher forcing (the self-check): when non-empty, continuation j's decode inputs are
  // forced[j][0..output_len-1] instead of its own greedy tokens (which are still recorded).
  std::vector<std::vector<int32_t>> forced;

  int32_t own_len() const { return after >= 0 ? turn_len : prompt_len; }
  int32_t own_start() const { return prompt_len - own_len(); }  // position of its first own token
};

// MLA KV token slots a request can hold at once with n continuations: each holds a row per token it
// processes (the prompt's, copied into each fork, then its decode inputs) and, during a speculative verify
// step, up to verify_extra drafted tokens beyond them; a prefill-only request holds its prompt. What the
// scheduler's admission promises, and what the plan sizes the KV pool by.
inline int64_t kv_tokens_for(const RequestSpec& r, int32_t n, int32_t verify_extra = 0) {
  return r.output_len > 0 ? int64_t{n} * (int64_t{r.prompt_len} + r.output_len + verify_extra) : r.prompt_len;
}

// One continuation of a request: continuation 0 is the request itself (it runs the prompt and keeps
// its slot); continuations 1..n-1 are forked from it with copy_slot once the prompt is done.
enum class SeqPhase { kWaiting, kPrefill, kForkPending, kDecode, kFinished };

struct Sequence {
  int64_t request = 0;  // index into the workload
  int32_t sample = 0;   // continuation index j (0..n-1)
  int32_t prompt_len = 0;
  int32_t output_len = 0;
  // Prompt tokens whose state the request's slot already holds when it is admitted (the prefix-cache
  // hook): its prefill starts at this position. 0 without a hit; the prefix cache sets it (at most
  // prompt_len - 1, so that the prompt's last position runs and gives the first token's logits) and
  // restores that state into the slot at admission (Scheduler::fill_prefill).
  int32_t prefix_len = 0;
  int32_t processed = 0;  // tokens done: prompt tokens, then decode tokens
  int32_t req_pool_index = -1;
  SeqPhase phase = SeqPhase::kWaiting;

  int32_t total_len() const { return prompt_len + output_len; }
  int32_t remaining_prompt() const { return processed < prompt_len ? prompt_len - processed : 0; }
};

}  // namespace kda::serving
