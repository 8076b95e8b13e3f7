// A workload through the serving engine (engine.h), as `kda simulate` serves it: requests arrive at their
// steps (a session's next turn when its previous turn finished, its prompt built from that turn's), the
// engine schedules and runs them, greedy, and the driver collects each continuation's tokens, the output
// rows it was asked to keep and the run's statistics. Used for the simulation itself, replay's run
// without speculation and the self-check's runs of single requests.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "kda/distributed/communicator.h"
#include "kda/serving/engine.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/request.h"
#include "kda/serving/scheduler.h"
#include "kda/serving/speculative.h"

namespace kda::serving {

struct ProgressInfo {
  int64_t tokens_done = 0, tokens_total = 0;
  int64_t requests_done = 0, requests_total = 0;
  int64_t steps = 0;
  double elapsed_s = 0.0;
};

struct ServeOptions {
  SchedulerOptions scheduler;
  uint64_t seed = 0;  // the requests' random prompt tokens
  // Under tensor parallelism every rank must feed the same tokens: each step's greedy picks go through
  // this (rank 0's picks, on every rank). Null: the local picks.
  std::function<void(std::vector<int32_t>&)> agree_tokens;
  // Per request (workload index): keep its sequences' outputs. Empty: keep none.
  std::vector<uint8_t> keep;
  // Checked before every step: when set, the loop stops after the step in flight (SIGINT).
  const std::atomic<bool>* stop = nullptr;
  // Under tensor parallelism every rank must stop at the same step: the local stop request goes
  // through this (an OR over the ranks) before each step. Null: the local request alone.
  std::function<bool(bool)> agree_stop;
  std::function<void(const ProgressInfo&)> progress;  // after every step
  // Speculative decoding (speculative.h): every DECODE step becomes a TARGET_VERIFY step of each row's
  // drafts (a mixed EXTEND step keeps its decodes as plain 1-token rows). Not with teacher forcing.
  SpeculativeOptions spec;
  // replay: per sequence ([request * n + sample], as ServeResult::outputs), the tokens a run without
  // speculation generated; replay drafts the continuation of position k from its entries k + 1.. .
  const std::vector<std::vector<int32_t>>* replay_truth = nullptr;
  // replay's run without speculation: every decode row still runs as a TARGET_VERIFY row, with one
  // placeholder draft, so that the true continuation is what the target computes in a verify step. Greedy
  // verification keeps the tokens the target's own picks whatever the draft; what this adds is the verify
  // step's shapes and kernels (its rows' GEMM row counts, the recurrent replay), so that nothing but the
  // drafts differs from the speculative pass: a synthetic model's flat logits have near-ties that any
  // rounding difference flips (self_check.cc says which differences bf16 shows).
  bool probe_decode = false;
};

// One continuation: its last-layer outputs for every token it processed ([prompt_len + decoded, D],
// kept only when asked), its prompt and the tokens it generated (greedy, output_len + 1 when finished).
struct SequenceOutput {
  int64_t request_id = 0;
  int32_t sample = 0;  // continuation index (request's sample_base + j)
  int32_t prompt_len = 0;
  // rows: [rows_from, prompt_len + decoded) -- rows_from is the prefix a prefix-cache hit restored
  // (those positions were never computed; 0 without a hit).
  int32_t rows_from = 0;
  std::vector<float> rows;
  std::vector<int32_t> prompt;  // the whole prompt's token ids (a session's turn: with the history)
  std::vector<int32_t> tokens;  // generated: its own argmax picks, even when teacher-forced
  // The prompt tokens its prefix-cache hit restored, whether or not its rows are kept (rows_from is that
  // only for a request whose rows are).
  int32_t cached_tokens = 0;
};

struct ServeResult {
  int64_t hidden = 0;
  int64_t steps = 0, extend_steps = 0, decode_steps = 0, mixed_steps = 0;
  int64_t prefill_tokens = 0;           // prompt tokens of the admitted requests (cached ones included)
  int64_t prefill_tokens_computed = 0;  // prompt tokens that went through the layers
  int64_t decode_tokens = 0;
  int64_t requests_completed = 0;
  int64_t peak_slots = 0, slot_reuses = 0;
  int64_t peak_kv_tokens = 0;  // MLA KV token slots in use at the busiest step (0 without MLA layers)
  // Prefix cache (zero without one): prompt tokens restored from snapshots; at the end, the snapshots
  // held and their bytes; snapshots evicted.
  int64_t prefix_cache_hit_tokens = 0, prefix_cache_bytes = 0, prefix_cache_snapshots = 0,
          prefix_cache_evictions = 0;
  // Speculative decoding (zero without it): verify steps and rows, drafted tokens, accepted drafts, tokens
  // emitted by verify rows (accepted + 1 each), and the backend's verify buffer in bytes.
  int64_t spec_verify_steps = 0, spec_verify_rows = 0, spec_draft_tokens = 0, spec_accepted_tokens = 0,
          spec_emitted_tokens = 0, spec_state_bytes = 0;
  // The draft depth each speculative decode row was given (adaptive: its controller's choice, 0 where
  // speculation did not pay), capped at the tokens the sequence has left: their sum and count.
  int64_t spec_depth_sum = 0, spec_depth_rows = 0;
  int64_t replay_diverged =
      0;  // replay: sequences whose tokens left their true continuation (set by the driver)
  double wall_s = 0.0;
  std::vector<double> step_ms;
  std::vector<double> ttft_ms;  // per request that got its first token: arrival to first token
  // The same for the requests that are a session's later turn (`after` >= 0), apart: a first turn cannot
  // hit the prefix cache on its history, so mixed in it would hide what the cache does for the others.
  std::vector<double> ttft_later_turns_ms;
  bool interrupted = false;
  // Per sequence: [request * n + sample] (n: scheduler.parallel_samples); rows empty unless kept.
  std::vector<SequenceOutput> outputs;
};

ServeResult serve(ModelRunner& runner, const std::vector<RequestSpec>& requests, const ServeOptions& opt);

// Sets `so`'s agree_stop and agree_tokens for a tensor-parallel group (tp.size > 1; nothing otherwise):
// every rank stops at the same step and feeds rank 0's greedy picks. The ranks compute the same logits
// from the same allreduced hidden states, but an allreduce need not give every rank the same bits, and
// one differing pick would give the ranks different inputs. `tp`'s communicator must outlive the pass.
void agree_across_ranks(const distributed::TensorParallel& tp, ServeOptions& so);

}  // namespace kda::serving
