// The scheduler of the serving simulation: which sequences run in each step, and the slot lifecycle
// (admission, fork, free). It does no compute; the driver runs the batches it hands out.
//
// Policy (sglang-like):
//   - Requests are admitted in arrival order (FIFO, no overtaking) when the pool has a slot for them:
//     a request with n parallel samples needs n free slots, one taken at admission and n - 1 reserved
//     for its forks. So a fork never waits on a pool full of parents waiting to fork (which could
//     deadlock); the request waits at admission instead. A full pool makes requests wait; it evicts only
//     prefix-cache snapshots, never a request's state.
//   - Chunked prefill: each step's prompt tokens fit the token budget; requests already in prefill
//     continue first, then new ones are admitted while budget and slots remain.
//   - Decodes are batched (at most max_batch rows), round-robin when more sequences decode than fit.
//   - Without mixed batches a step is either EXTEND (prefill chunks) or DECODE. Prefill goes first, as
//     in sglang, but after max_prefill_streak EXTEND steps in a row with decodes waiting, one DECODE
//     step runs, so decodes never starve behind a long stream of prompts.
//   - With mixed batches, decodes (as 1-token EXTEND segments with prefix > 0, counted in the token
//     budget) and prefill chunks share one EXTEND step; a step with no prefill work is a DECODE step.
//   - Parallel samples: continuation 0 is the request itself; when its prompt is done, continuations
//     1..n-1 are forked from it (HybridReqToTokenPool::fork, i.e. copy_slot) and all n decode.
//   - Sessions: a request with RequestSpec::after >= 0 (the next turn of a conversation) arrives only
//     when its previous turn has finished (every continuation), arrival_step steps later; then it is
//     queued like any other arrival, in (arrival step, workload index) order.
//   - Prefix cache (optional RadixCache, see mem_cache/radix_cache.h): at admission the request matches
//     its prompt minus the last token (that one must run for the first token's logits). When a deeper
//     snapshot of that path is still being written by another request's prefill (Pending), the request
//     waits at the queue head (FIFO) until it is Ready (then it hits) or gone; on a hit the snapshot is
//     copied into the request's slot and its prefill starts at prefix_len = the hit's length. Its own
//     prefill writes snapshots (ForwardBatch::state_snapshots, committed after the step) at: the prompt
//     minus its last token (prompt_len - 1: what an identical later prompt matches), every
//     cache_interval tokens, and the branch point where it leaves a cached path. A finished sequence's
//     state after all its processed tokens is inserted before its slot is freed (a session's next turn
//     starts with exactly those tokens). Snapshots and requests share the pool: admission counts
//     evictable snapshots as free slots and evicts (LRU) what it needs, so a full cache costs speed only.
//     On a model with MLA layers the cache must be attached to the KV pool: a hit also shares the KV
//     slots of the prefix's tokens into the request (HybridReqToTokenPool::share_tokens), snapshot
//     commits and the finished insert pass the request's token slots, which the tree then references.
//   - MLA KV token slots (models with MLA layers): the model allocates a step's token slots as it runs
//     it and HybridReqToTokenPool::free drops a request's references with it. Admission promises a
//     request the fresh slots it can come to hold (prompt + output tokens per continuation, less a hit's
//     shared prefix and, for forks, the parent's prompt they share) and keeps every promise not yet
//     taken backed by free slots, evicting cached KV for it; a request waits while neither free slots
//     nor evictable cached KV cover it. A request that could never fit is an error at construction.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kda/mem_cache/memory_pool.h"
#include "kda/mem_cache/radix_cache.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/serving/request.h"

namespace kda::serving {

struct SchedulerOptions {
  int64_t token_budget = 4096;  // tokens per step (prefill; in mixed steps decodes count too)
  int64_t max_batch = 64;       // decode rows per step
  bool mixed = false;
  int32_t parallel_samples = 1;
  int max_prefill_streak = 4;
  mem_cache::RadixCache* cache = nullptr;  // prefix cache over the same recurrent pool; null: off
  int64_t cache_interval = 256;            // a snapshot every this many prompt tokens (> 0)
  // Speculative decoding: the MLA KV token slots a continuation may hold beyond its committed tokens
  // during a TARGET_VERIFY step (max_verify_tokens - 1: a tree row's drafts need not lie on one path),
  // promised at admission with the rest. 0 without speculative decoding.
  int32_t verify_extra_tokens = 0;
};

struct BatchRow {
  int64_t seq = 0;      // index into Scheduler::sequences()
  int32_t start = 0;    // first position this step runs (= tokens processed before)
  int32_t len = 0;      // tokens this step runs
  bool decode = false;  // a decode token (else prompt tokens)
};

struct ScheduledBatch {
  model_executor::ForwardMode mode = model_executor::ForwardMode::EXTEND;
  std::vector<BatchRow> rows;
  int64_t prefill_tokens = 0, decode_tokens = 0;  // tokens through the layers in this step
  // Prompt tokens of the requests admitted in this step that their slot already held (prefix_len).
  int64_t cached_tokens = 0;
  std::vector<int64_t> arrived;  // requests that became visible to the scheduler in this schedule() call
  // Speculative decoding: the driver turns a DECODE batch into a TARGET_VERIFY one (each row's len =
  // 1 + its drafts, draft_parents every row's drafts' parents, as ForwardBatch::target_verify takes them),
  // and before complete() sets each row's len to the tokens it accepted (1 + accepted drafts).
  std::vector<int32_t> draft_parents;
  bool empty() const { return rows.empty(); }
  int64_t num_tokens() const { return prefill_tokens + decode_tokens; }
};

struct StepEvents {
  std::vector<std::pair<int64_t, int64_t>> forks;  // (parent seq, child seq): child starts as a copy
  std::vector<int64_t> finished;                   // sequences that finished in this step
  std::vector<int64_t> finished_requests;          // requests whose last continuation finished
};

// The rows of a batch that give a next token (a prompt's last position reached, or a decode): their
// indices into b.rows, and each one's last output row of y [T, D] gathered into head [M, D]. What both
// Engine's steps pick from.
std::vector<size_t> gather_pick_rows(const ScheduledBatch& b, const std::vector<Sequence>& seqs,
                                     const float* y, int64_t D, std::vector<float>& head);

class Scheduler {
 public:
  // `pool` must outlive the scheduler. Throws std::invalid_argument for options it cannot serve
  // (a request needing more slots than the pool has, budget or batch < 1).
  Scheduler(const std::vector<RequestSpec>& requests, const SchedulerOptions& options,
            mem_cache::HybridReqToTokenPool& pool);

  bool done() const { return finished_requests_ == added_requests_; }
  // Nothing admitted and unfinished, nothing waiting (online serving: the engine sleeps).
  bool idle() const { return prefilling_.empty() && decode_queue_.empty() && waiting_requests() == 0; }
  int64_t step() const { return step_; }

  // The next step's batch (admitting requests, which takes slots). Empty when nothing can run before
  // a later arrival: call skip_to_next_arrival() then. A session's next turn must have its prompt
  // tokens ready when its previous turn finishes (complete() reports it in finished_requests).
  ScheduledBatch schedule();
  // The ForwardBatch of a scheduled batch (request pool indices, lengths, prefixes).
  model_executor::ForwardBatch forward_batch(const ScheduledBatch& b) const;
  // After the batch ran: advances positions, forks finished prompts, frees finished sequences.
  StepEvents complete(const ScheduledBatch& b);
  // Idle until the next arrival; false when no request is left to arrive.
  bool skip_to_next_arrival();

  const std::vector<Sequence>& sequences() const { return seqs_; }
  // A workload's sequences are [request * n + sample]; an online request's follow those before it.
  int64_t seq_index(int64_t request, int32_t sample) const { return seq_base_[request] + sample; }
  int32_t parallel_samples() const { return n_; }                       // the workload's
  int32_t samples_of(int64_t request) const { return n_of_[request]; }  // any request's

  // Online serving (the engine), between steps only:
  // Why a request could never be admitted (a slot per continuation beyond the pool, more MLA KV token
  // slots than the pool has), as std::invalid_argument naming the field; nothing changes.
  void check_request(const RequestSpec& spec, int32_t n, const std::string& name = "request") const;
  // A request arriving now with n continuations (seen by the next schedule()), its prompt's token ids
  // (prompt_len of them; kept only with a prefix cache). spec.after must be -1. Checked first
  // (check_request). Returns its request index: a finished online request's index may be reused (with its
  // sequences' indices), so a request index names a request only until it finished.
  int64_t add_request(RequestSpec spec, int32_t n, std::vector<int32_t> prompt);
  // Sequence `seq` ends now, whatever its phase (a stop token, an abort): its slot and MLA token slots go
  // back to the pool, its pending snapshots are dropped, a continuation still to be forked gives back its
  // reserved slot. No-op for a finished sequence. Events: the sequence, and its request when it was the
  // last continuation.
  void finish_now(int64_t seq, StepEvents& ev);
  // Every unfinished continuation of `request` ends now (finish_now).
  void abort_request(int64_t request, StepEvents& ev);
  int64_t waiting_requests() const { return static_cast<int64_t>(waiting_.size() + online_.size()); }
  int64_t running_requests() const { return admitted_unfinished_; }

  int64_t finished_requests() const { return finished_requests_; }
  int64_t peak_slots() const { return peak_slots_; }
  int64_t slot_reuses() const { return slot_reuses_; }
  int64_t slots_in_use() const;
  int64_t cache_hit_tokens() const { return cache_hit_tokens_; }
  // MLA KV token slots promised to the admitted, unfinished requests (0 without a KV pool); its peak.
  int64_t kv_tokens_promised() const { return kv_promised_; }
  int64_t peak_kv_tokens() const { return peak_kv_tokens_; }

  // Prefix cache only (no-ops without one): a request's whole prompt, before it can be admitted (a
  // session's next turn: when its previous turn finished), and the token each decode step of a sequence
  // feeds, as it is fed (the finished state is inserted under prompt + fed tokens).
  void set_prompt(int64_t request, std::vector<int32_t> tokens);
  void add_fed_token(int64_t seq, int32_t token);

 private:
  int32_t slots_needed(int64_t request) const;
  int64_t kv_tokens_needed(int64_t request) const;
  static int32_t slots_needed(const RequestSpec& r, int32_t n) { return r.output_len > 0 ? n : 1; }
  int64_t kv_tokens_needed(const RequestSpec& r, int32_t n) const {
    return kv_tokens_for(r, n, opt_.verify_extra_tokens);
  }
  int64_t kv_outstanding() const;
  void note_kv_use();  // the KV pool's use after a step ran, before its finished requests free theirs
  bool can_admit(int64_t request) const;
  bool waits_for_snapshot(int64_t request);  // a deeper snapshot of its prompt is being written
  bool admissible(int64_t request) { return can_admit(request) && !waits_for_snapshot(request); }
  std::span<const int32_t> match_key(int64_t request) const;  // prompt minus its last token
  void plan_snapshots(int64_t seq, const mem_cache::MatchResult& m);
  void commit_snapshots(int64_t seq);
  int32_t take_slot(int32_t req_pool_index);  // bookkeeping after an alloc / fork; returns the slot
  void fill_prefill(ScheduledBatch& b, int64_t budget);
  void take_decodes(ScheduledBatch& b, int64_t limit);
  void check_fork_slots(const ScheduledBatch& b) const;
  void finish(int64_t seq, StepEvents& ev);
  void add_sequences(int64_t request);  // seqs_ entries of a request appended to requests_
  Sequence fresh_sequence(int64_t request, int32_t sample) const;  // continuation `sample` before it runs

  std::vector<RequestSpec> requests_;
  SchedulerOptions opt_;
  int32_t n_;
  mem_cache::HybridReqToTokenPool* pool_;
  mem_cache::MLATokenToKVPool* kv_;  // the pool's MLA token KV pool; null for a model without MLA layers
  std::vector<int64_t> kv_share_;    // per sequence: the fresh KV token slots promised to it while it runs
  std::vector<int64_t> shared_len_;  // per sequence: leading token slots it holds by reference (not fresh)
  int64_t kv_promised_ = 0, peak_kv_tokens_ = 0;
  std::vector<Sequence> seqs_;     // [seq_base_[request] + sample]
  std::vector<int64_t> seq_base_;  // per request: its first sequence
  std::vector<int32_t> n_of_;      // per request: its continuations
  std::deque<int64_t> online_;     // requests added online, not yet seen by schedule()
  int64_t admitted_unfinished_ = 0;
  int64_t added_requests_ = 0;                        // the workload's + every add_request
  std::vector<uint8_t> recyclable_;                   // per request: added online (its index is reused)
  std::map<int32_t, std::vector<int64_t>> recycled_;  // by n: finished online requests' indices
  std::vector<int64_t> arrival_order_;  // requests without a previous turn, by (arrival_step, index)
  size_t next_arrival_ = 0;             // into arrival_order_
  std::vector<int64_t> next_turn_;      // per request: the request of its session's next turn, or -1
  std::set<std::pair<int64_t, int64_t>> turn_arrivals_;  // (arrival step, request): next turns due
  std::deque<int64_t> waiting_;                          // arrived, not admitted (requests)
  std::vector<int64_t> prefilling_;                      // sequences in prefill, in admission order
  std::deque<int64_t> decode_queue_;                     // sequences ready to decode, round-robin
  std::vector<int32_t> unfinished_;                      // per request: continuations not finished
  std::vector<uint8_t> slot_used_;                       // per slot: handed out before (slot reuse count)
  int64_t reserved_ = 0;                                 // slots promised to forks of admitted requests
  int64_t step_ = 0;
  int prefill_streak_ = 0;
  int64_t finished_requests_ = 0, peak_slots_ = 0, slot_reuses_ = 0;
  // Prefix cache.
  struct PendingSnapshot {
    int32_t pos = 0;  // prompt tokens before the state
    mem_cache::NodeId node = mem_cache::kNoNode;
    int32_t slot = -1;
  };
  mem_cache::RadixCache* cache_ = nullptr;
  std::vector<std::vector<int32_t>> prompts_;          // per request (cache only)
  std::vector<std::vector<int32_t>> fed_;              // per sequence: decode inputs fed (cache only)
  std::vector<std::vector<PendingSnapshot>> pending_;  // per sequence: snapshots its prefill writes
  int64_t cache_hit_tokens_ = 0;
};

}  // namespace kda::serving
