// The serving engine: the scheduler over requests submitted while it runs, tokens streamed back as they
// are made. `kda serve` drives it from its HTTP threads (submit, abort, run on a thread of its own); `kda
// simulate` drives it step by step (workload_driver.h: a workload's arrivals, sessions, replay drafts,
// teacher forcing and kept output rows through EngineHooks).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

#include "kda/sampling/sampler.h"
#include "kda/sampling/sampling_params.h"
#include "kda/serving/draft_depth.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/request.h"
#include "kda/serving/scheduler.h"
#include "kda/serving/speculative.h"

namespace kda::serving {

enum class FinishReason { kNone, kStop, kLength, kAbort };
const char* finish_reason_name(FinishReason r);  // "stop" | "length" | "abort" ("" for kNone)

struct GenerateRequest {
  std::vector<int32_t> prompt;      // token ids (non-empty, each < vocab)
  sampling::SamplingParams params;  // max_tokens, stop ids, seed, logprobs, ...
  int32_t n = 1;                    // parallel samples (continuation j's seed: seed + j)
  // Teacher forcing (kda simulate's self-check): when non-empty, continuation j's decode inputs are
  // forced[j][0..max_tokens - 2] instead of the tokens it generates (which are still picked and streamed).
  // Needs n lists of at least max_tokens - 1 ids each, and no speculative decoding.
  std::vector<std::vector<int32_t>> forced;
  // Hand the last layer's output rows of every position the request processes to EngineHooks::rows.
  bool keep_rows = false;
};

// What one step ran, for EngineHooks::step.
struct StepInfo {
  model_executor::ForwardMode mode = model_executor::ForwardMode::EXTEND;  // TARGET_VERIFY for verify steps
  int64_t prefill_tokens = 0;  // prompt tokens that went through the layers
  int64_t cached_tokens = 0;   // prompt tokens of admitted requests a prefix-cache hit restored
  int64_t decode_tokens = 0;   // tokens decode (and verify) rows emitted
  int64_t num_tokens = 0;      // tokens through the layers (verify rows: their drafts too)
  // Speculative decoding's DECODE batches: the rows given a draft depth and the sum of their depths
  // (verify_depth; 0 where speculation does not pay), and the drafts they held (a batch without any runs
  // as a plain DECODE step). Verify steps: their rows and the drafts accepted. Zero with hooks.probe_decode
  // but depth_rows, depth_sum and verify_rows.
  int64_t depth_rows = 0, depth_sum = 0, draft_tokens = 0;
  int64_t verify_rows = 0, accepted_tokens = 0;
  double seconds = 0.0;  // the forward pass to the picks (and accept), as the draft-depth cost model sees it
};

// What a driver other than the server plugs in (kda simulate, workload_driver.h). All optional; called on
// the engine's thread.
struct EngineHooks {
  // Drafts in place of ngram's (replay: a known continuation) for spec.algorithm kReplay: continuation j of
  // request `id`, the tokens it generated so far, the depth it may draft (>= 1).
  std::function<Draft(int64_t id, int32_t j, std::span<const int32_t> generated, int32_t depth)> drafter;
  // Without speculative decoding: every DECODE step runs as a TARGET_VERIFY step of one placeholder draft
  // per row, so that a run's steps have a verify step's shapes and kernels (workload_driver.h says why).
  bool probe_decode = false;
  // Tensor parallelism: each step's greedy picks and draft depths go through this (rank 0's on every rank),
  // so that every rank feeds the same tokens.
  std::function<void(std::vector<int32_t>&)> agree_tokens;
  // The last layer's output rows [count, D] of positions [pos, pos + count) of a request that asked
  // (GenerateRequest::keep_rows), for the inputs a step committed: j = -1 for prompt positions (every
  // continuation's), else continuation j's decode positions (a verify row: its accepted path).
  std::function<void(int64_t id, int32_t j, int32_t pos, const float* rows, int32_t count)> rows;
  // After every step that ran a batch, before its events are delivered.
  std::function<void(const StepInfo&)> step;
};

struct TokenEvent {
  int64_t request = 0;                            // the id submit() returned
  int32_t index = 0;                              // continuation 0..n-1
  int32_t token = -1;                             // -1 on a finish event that carries no token (abort)
  std::optional<sampling::TokenLogprob> logprob;  // when params.logprobs >= 0
  FinishReason finish = FinishReason::kNone;      // set on the continuation's last event
  int32_t prompt_tokens = 0;                      // every event: the prompt's length
  int32_t cached_tokens = 0;                      // every event: prompt tokens a prefix-cache hit restored
};

// Called on the engine's thread after each step: must not block; may call Engine::abort only.
using EventSink = std::function<void(const TokenEvent&)>;

// The most admission windows (EngineOptions::admission_window_ms) one wait from idle may span.
inline constexpr int kAdmissionWindows = 8;

struct EngineOptions {
  SchedulerOptions scheduler;       // parallel_samples is not used: each request brings its n
  std::vector<int32_t> stop_ids;    // the model's (tokenizer's) stop ids
  std::vector<uint8_t> producible;  // [vocab] or empty (all producible)
  int64_t max_context = 0;          // prompt + max_tokens limit (0: the pools' limit only)
  // Speculative decoding: ngram drafts, or replay with hooks.drafter (replay needs a true continuation,
  // which online requests do not have). The runner must have a verify buffer of spec.max_verify_tokens()
  // tokens per row (2 for hooks.probe_decode); decode batches are capped at its verify rows.
  SpeculativeOptions spec;
  EngineHooks hooks;
  // Admission window, run() only: when the engine wakes from idle to a request, it waits up to this
  // long for more before its first step, so that a burst of clients whose requests reach it a little
  // apart (each parsed and tokenized on its own HTTP thread) starts as one prefill step rather than
  // several, each of which would delay every request in the batch by a step. Each arrival restarts the
  // window, up to kAdmissionWindows windows from the first. The wait ends as soon as the first step is
  // full (max_batch sequences, or token_budget prompt tokens, waiting), or on an abort or stop. It is
  // never taken while requests run: an arrival then joins at the next step. 0: no wait. Must lie in
  // [0, 1000].
  double admission_window_ms = 2.0;
};

struct EngineStats {
  int64_t running = 0, waiting = 0;
  int64_t requests_finished = 0, requests_aborted = 0;
  int64_t prompt_tokens = 0, prompt_tokens_computed = 0, generation_tokens = 0;  // totals
  int64_t slots_total = 0, slots_used = 0;  // request slots (KDA state pool)
  // MLA token slots (0 without MLA layers); used: held by requests and not by the prefix cache too.
  int64_t kv_tokens_total = 0, kv_tokens_used = 0;
  int64_t cached_tokens = 0, prefix_cache_bytes = 0;  // prefix cache (0 without one)
  int64_t prefix_cache_evictions = 0, prefix_cache_snapshots = 0, prefix_cache_kv_tokens = 0;
  int64_t steps = 0;
  // The admission window (EngineOptions::admission_window_ms): how often the engine, woken from idle,
  // held its first step for more arrivals, and the seconds it held them in all.
  int64_t admission_waits = 0;
  double admission_wait_s = 0.0;
  // Speculative decoding (0 without it): drafted tokens verified, and those accepted and emitted.
  int64_t spec_draft_tokens = 0, spec_accepted_tokens = 0;
};

// The serving loop: the scheduler over requests that arrive while it runs (`kda serve`), or that a driver
// submits at its steps (`kda simulate`, workload_driver.h).
// Each step: the inbox (submits, aborts) is applied, the scheduler's batch runs, each finished position's
// logits give its continuations their next tokens (argmax for a plain greedy request, else the
// continuation's RequestSampler; ids not producible are never picked), a stop id or max_tokens ends a
// continuation (its slot freed at once), and the step's events go to the requests' sinks.
// With speculative decoding (EngineOptions::spec), a DECODE batch becomes a TARGET_VERIFY step of each
// continuation's ngram drafts over its prompt + generated tokens. Each row is verified position by
// position: greedy requests accept a draft when it is the target's pick there (the tokens of plain
// decoding), sampled ones by speculative sampling (spec_accept.h) against the distribution the request's
// sampler draws from, its penalties seeing the tokens emitted before. Every emitted token gets its event
// (logprobs from its own position's row); a stop id or max_tokens cuts the path there, and the states keep
// exactly the tokens emitted.
class Engine {
 public:
  // `runner` must outlive the engine. std::invalid_argument for options it cannot serve.
  Engine(ModelRunner& runner, EngineOptions opt);
  ~Engine();

  // Thread safe. Checks everything first (empty prompt, ids >= vocab, params.validate, n > the pool's slots,
  // prompt + max_tokens beyond max_context or beyond what the pools can ever hold) -> std::invalid_argument
  // "<field>: <what is wrong>", nothing queued. Returns the request's id (increasing from 1).
  int64_t submit(GenerateRequest req, EventSink sink);
  // Thread safe. The request finishes with kAbort before the engine's next step: every continuation gets a
  // finish event, its slots and MLA token slots are freed. Unknown or finished id: no-op.
  void abort(int64_t id);
  // The serving loop on the caller's thread: steps while there is work, waits (condition variable) when idle,
  // and on waking from idle to a request, waits out the admission window (EngineOptions::
  // admission_window_ms); returns once `stop` is set (after the step in flight), aborting what is left.
  void run(const std::atomic<bool>& stop);
  // Sizes and touches the workspaces of a step of the scheduler's token budget (the model's, on the
  // calling thread: ModelRunner::reserve; the step's hidden rows), so the first long prompt costs what
  // later ones do. On the thread that steps the engine (run's), before it starts: requests that arrive
  // meanwhile would meet a loop that is not yet running.
  void reserve_workspaces();
  // One step when there is work (false when idle). Not concurrently with run().
  bool step();
  EngineStats stats() const;  // thread safe
  int64_t vocab_size() const { return V_; }
  // The scheduler (its peak slots, slot reuses, prefix-cache hits): on the engine's thread, between steps.
  const Scheduler& scheduler() const { return sched_; }

 private:
  struct Continuation {
    std::unique_ptr<sampling::RequestSampler> sampler;  // null on the plain greedy path
    int32_t last = -1;                                  // its last generated token (the next decode input)
    int32_t generated = 0;
    bool finished = false;
    std::vector<int32_t> tokens;  // generated so far (kept with speculative decoding: ngram drafts)
    // Adaptive draft depth (draft_depth.h): its acceptance; none at a fixed depth. A seeded sampled
    // continuation drafts at the fixed depth: which tokens speculative sampling draws depends on the
    // drafts, and the depth a controller picks depends on measured step times, so an adaptive depth
    // would make a seeded request's tokens depend on timing.
    std::optional<DraftDepthController> depth;
  };
  struct Live {
    int64_t id = 0;
    GenerateRequest req;
    std::shared_ptr<EventSink> sink;
    std::vector<Continuation> cont;
    int32_t unfinished = 0;
    bool plain_greedy = false;  // argmax, no penalties, no logprobs: no sampler
  };
  struct Submitted {
    int64_t id = 0;
    GenerateRequest req;
    EventSink sink;
    uint64_t seed = 0;
  };
  struct Pending {  // one event, delivered after the step
    std::shared_ptr<EventSink> sink;
    TokenEvent ev;
  };
  struct Pick {  // a token a step gave continuation j of request r
    int64_t r = 0;
    int32_t j = 0;
    int32_t token = -1;
    std::optional<sampling::TokenLogprob> lp;
  };

  void apply_inbox();
  // run()'s admission window: with mu_ held (by lk), the engine idle and the inbox not empty.
  void await_burst(std::unique_lock<std::mutex>& lk, const std::atomic<bool>& stop);
  bool first_step_full() const;  // with mu_ held: the inbox fills a step (admission_window_ms)
  void admit(Submitted s);
  void abort_live(int64_t r);  // scheduler request index
  void emit(int64_t r, int32_t j, int32_t token, std::optional<sampling::TokenLogprob> lp, FinishReason f);
  void finish_continuation(int64_t r, int32_t j, FinishReason f);
  void deliver();
  void publish_stats();
  // How a continuation that has generated `generated` tokens, the last one `token`, finishes (kNone: not).
  FinishReason finish_of(const Live& L, int32_t token, int32_t generated) const;
  // After the step's forward: the picks (in order per continuation) become the continuations' tokens and
  // events; failed requests are aborted.
  void commit_picks(std::vector<Pick>& picks, const std::vector<int64_t>& failed, StepEvents& ev);
  // Speculative decoding: drafts for a DECODE batch (false: no row has one, the batch stays DECODE), and
  // the verify step that runs them.
  bool draft(ScheduledBatch& b);
  void verify_step(ScheduledBatch& b);
  // After a step's forward: its stats, hooks.step, then its events.
  void count_step(const ScheduledBatch& b, StepInfo info);
  void check_agreed() const;  // agreed_'s ids against the vocabulary (std::runtime_error)
  // The decode input after continuation j's picks so far: its last pick, or the forced one.
  int32_t next_input(const Live& L, int32_t j) const;
  // hooks.rows for the rows of a step's batch that took prompt tokens or one decode token.
  void keep_rows(const ScheduledBatch& b, const float* y) const;

  ModelRunner& runner_;
  EngineOptions opt_;
  int64_t V_ = 0, D_ = 0, slots_ = 0, kv_tokens_ = 0;
  int32_t verify_extra_ = 0;  // MLA KV token slots a verify row may hold beyond its committed tokens
  Scheduler sched_;
  std::vector<uint8_t> is_stop_;  // [V]: the model's stop ids

  // Engine thread only.
  std::unordered_map<int64_t, Live> live_;      // by scheduler request index
  std::unordered_map<int64_t, int64_t> by_id_;  // submit id -> scheduler request index
  std::vector<Pending> out_;
  std::vector<float> y_, head_, logits_, scratch_;
  std::vector<int32_t> toks_;
  std::vector<Draft> drafts_;        // the verify step's, per row
  std::vector<int32_t> history_;     // a continuation's prompt + generated tokens (ngram's input)
  std::vector<double> probs_;        // a position's target distribution (speculative sampling)
  std::vector<int32_t> agreed_;      // a step's draft depths, then its greedy picks (hooks.agree_tokens)
  std::vector<uint8_t> agreed_nan_;  // whether each of those picks' rows held a NaN (verify steps)
  struct Drafting {                  // the step's draft(): rows, their depths' sum, the drafts they hold
    int64_t rows = 0, depth_sum = 0, drafted = 0;
  } drafting_;
  VerifyCostModel cost_;  // adaptive depth: decode and verify steps' measured times
  EngineStats totals_;

  // Shared with submitters.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Submitted> inbox_;
  std::vector<int64_t> aborts_;
  int64_t next_id_ = 1;
  std::mt19937_64 seeds_;
  EngineStats stats_;
};

}  // namespace kda::serving
