// What the serving simulation serves: a request (a prompt of hidden states, then decode steps, possibly
// forked into parallel samples) and the scheduler's view of one running sequence.
#pragma once

#include <cstdint>

namespace kda::serving {

// One request of the workload. `id` seeds its inputs (it is the index in the workload, so a request
// re-run alone gets the same inputs); `sample_base` offsets the sample indices that seed its decode
// noise (0 in a workload; the self-check and the tests use it to replay one continuation alone).
struct RequestSpec {
  int64_t id = 0;
  int32_t prompt_len = 1;    // >= 1: tokens of the prompt (EXTEND, possibly in chunks)
  int32_t output_len = 0;    // >= 0: decode steps after the prompt, per continuation
  int64_t arrival_step = 0;  // the scheduler sees the request from this step on
  int32_t sample_base = 0;
};

// One continuation of a request: continuation 0 is the request itself (it runs the prompt and keeps
// its slot); continuations 1..n-1 are forked from it with copy_slot once the prompt is done.
enum class SeqPhase { kWaiting, kPrefill, kForkPending, kDecode, kFinished };

struct Sequence {
  int64_t request = 0;  // index into the workload
  int32_t sample = 0;   // continuation index j (0..n-1)
  int32_t prompt_len = 0;
  int32_t output_len = 0;
  int32_t processed = 0;  // tokens done: prompt tokens, then decode tokens
  int32_t req_pool_index = -1;
  SeqPhase phase = SeqPhase::kWaiting;

  int32_t total_len() const { return prompt_len + output_len; }
  int32_t remaining_prompt() const { return processed < prompt_len ? prompt_len - processed : 0; }
};

}  // namespace kda::serving
