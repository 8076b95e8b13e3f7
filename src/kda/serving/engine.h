// The serving loop: the scheduler picks each step's batch, the engine builds its inputs (the prompt
// tokens, or the token each sequence generated last), runs the model step, picks each
// finished position's next token greedily (final norm, LM head, argmax) and hands it back as the next
// decode input. When a session's turn finishes, the engine builds its next turn's prompt. Used for the
// simulation itself and for the self-check's runs of single requests.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_map>
#include <vector>

#include "kda/distributed/communicator.h"
#include "kda/sampling/sampler.h"
#include "kda/sampling/sampling_params.h"
#include "kda/serving/draft_depth.h"
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
  // replay: per sequence (indexed like Scheduler::sequences()), the tokens a run without speculation
  // generated; replay drafts the continuation of position k from its entries k + 1.. .
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
  // Indexed like Scheduler::sequences() ([request * n + sample]); rows empty unless kept.
  std::vector<SequenceOutput> outputs;
};

ServeResult serve(ModelRunner& runner, const std::vector<RequestSpec>& requests, const ServeOptions& opt);

// Sets `so`'s agree_stop and agree_tokens for a tensor-parallel group (tp.size > 1; nothing otherwise):
// every rank stops at the same step and feeds rank 0's greedy picks. The ranks compute the same logits
// from the same allreduced hidden states, but an allreduce need not give every rank the same bits, and
// one differing pick would give the ranks different inputs. `tp`'s communicator must outlive the pass.
void agree_across_ranks(const distributed::TensorParallel& tp, ServeOptions& so);

// --- The online engine: requests submitted while it runs, tokens streamed back as they are made. ---

enum class FinishReason { kNone, kStop, kLength, kAbort };
const char* finish_reason_name(FinishReason r);  // "stop" | "length" | "abort" ("" for kNone)

struct GenerateRequest {
  std::vector<int32_t> prompt;      // token ids (non-empty, each < vocab)
  sampling::SamplingParams params;  // max_tokens, stop ids, seed, logprobs, ...
  int32_t n = 1;                    // parallel samples (continuation j's seed: seed + j)
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

struct EngineOptions {
  SchedulerOptions scheduler;       // parallel_samples is not used: each request brings its n
  std::vector<int32_t> stop_ids;    // the model's (tokenizer's) stop ids
  std::vector<uint8_t> producible;  // [vocab] or empty (all producible)
  int64_t max_context = 0;          // prompt + max_tokens limit (0: the pools' limit only)
  // Speculative decoding: ngram drafts only (replay needs a true continuation, which online requests do
  // not have). The runner must have a verify buffer of spec.max_verify_tokens() tokens per row; decode
  // batches are capped at its verify rows.
  SpeculativeOptions spec;
  // Admission window, run() only: when the engine wakes from idle to a request, it waits up to this
  // long for more before its first step, so that a burst of clients whose requests reach it a little
  // apart (each parsed and tokenized on its own HTTP thread) starts as one prefill step rather than
  // several, each of which would delay every request in the batch by a step. The wait ends as soon as
  // the first step is full (max_batch sequences, or token_budget prompt tokens, waiting), or on an abort
  // or stop. It is never taken while requests run: an arrival then joins at the next step. 0: no wait.
  // Must lie in [0, 1000].
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

// The serving loop of `kda serve`: the scheduler of serve() over requests that arrive while it runs.
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
  // One step when there is work (false when idle). Not concurrently with run().
  bool step();
  EngineStats stats() const;  // thread safe
  int64_t vocab_size() const { return V_; }

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
  void count_step(const ScheduledBatch& b);

  ModelRunner& runner_;
  EngineOptions opt_;
  int64_t V_ = 0, D_ = 0, slots_ = 0, kv_tokens_ = 0;
  Scheduler sched_;
  std::vector<uint8_t> is_stop_;  // [V]: the model's stop ids

  // Engine thread only.
  std::unordered_map<int64_t, Live> live_;      // by scheduler request index
  std::unordered_map<int64_t, int64_t> by_id_;  // submit id -> scheduler request index
  std::vector<Pending> out_;
  std::vector<float> y_, head_, logits_, scratch_;
  std::vector<int32_t> toks_;
  std::vector<Draft> drafts_;     // the verify step's, per row
  std::vector<int32_t> history_;  // a continuation's prompt + generated tokens (ngram's input)
  std::vector<double> probs_;     // a position's target distribution (speculative sampling)
  VerifyCostModel cost_;          // adaptive depth: decode and verify steps' measured times
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
