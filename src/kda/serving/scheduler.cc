#include "kda/serving/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kda::serving {

using model_executor::ForwardBatch;
using model_executor::ForwardMode;

std::vector<size_t> gather_pick_rows(const ScheduledBatch& b, const std::vector<Sequence>& seqs,
                                     const float* y, int64_t D, std::vector<float>& head) {
  std::vector<size_t> pick;
  head.clear();
  int64_t t = 0;
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const auto& row = b.rows[i];
    t += row.len;
    if (row.start + row.len < seqs[row.seq].prompt_len) continue;
    pick.push_back(i);
    head.insert(head.end(), y + (t - 1) * D, y + t * D);
  }
  return pick;
}

Scheduler::Scheduler(const std::vector<RequestSpec>& requests, const SchedulerOptions& options,
                     mem_cache::HybridReqToTokenPool& pool)
    : requests_(requests),
      opt_(options),
      n_(options.parallel_samples),
      pool_(&pool),
      kv_(pool.token_to_kv_pool()) {
  if (opt_.token_budget < 1)
    throw std::invalid_argument("--token-budget must be >= 1, got " + std::to_string(opt_.token_budget));
  if (opt_.max_batch < 1)
    throw std::invalid_argument("--max-batch must be >= 1, got " + std::to_string(opt_.max_batch));
  if (n_ < 1) throw std::invalid_argument("--parallel-samples must be >= 1, got " + std::to_string(n_));
  if (opt_.max_prefill_streak < 1) throw std::invalid_argument("max_prefill_streak must be >= 1");
  const int64_t R = static_cast<int64_t>(requests_.size());
  added_requests_ = R;
  next_turn_.assign(static_cast<size_t>(R), -1);
  n_of_.assign(static_cast<size_t>(R), n_);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t prev = requests_[r].after;
    if (prev >= 0) {
      if (prev >= r || next_turn_[prev] >= 0)
        throw std::invalid_argument("request " + std::to_string(r) + ": previous turn " +
                                    std::to_string(prev) +
                                    " must come before it and have no other next turn");
      next_turn_[prev] = r;
    }
    check_request(requests_[r], n_, "request " + std::to_string(r));
    add_sequences(r);
    if (prev < 0) arrival_order_.push_back(r);  // a next turn arrives when its previous one finishes
  }
  std::stable_sort(arrival_order_.begin(), arrival_order_.end(), [&](int64_t a, int64_t b) {
    return requests_[a].arrival_step < requests_[b].arrival_step;
  });
  slot_used_.assign(static_cast<size_t>(pool.recurrent_pool().size() + 1), 0);
  cache_ = opt_.cache && opt_.cache->enabled() ? opt_.cache : nullptr;
  // On a model with MLA layers a hit restores the prefix's KV rows too, which only a cache attached to
  // this KV pool holds.
  if (opt_.cache && kv_ && !opt_.cache->attached_to(kv_))
    throw std::invalid_argument(
        "prefix cache: the model has MLA layers but the cache is not attached to its MLA KV pool "
        "(construct the RadixCache with the pool's token_to_kv_pool)");
  if (opt_.cache && !kv_ && opt_.cache->attached_to_kv())
    throw std::invalid_argument("prefix cache: attached to an MLA KV pool, but the model has no MLA layers");
  if (opt_.cache && opt_.cache_interval < 1)
    throw std::invalid_argument("--cache-interval must be >= 1, got " + std::to_string(opt_.cache_interval));
  if (cache_) {
    prompts_.resize(static_cast<size_t>(R));
    fed_.resize(seqs_.size());
  }
}

void Scheduler::check_request(const RequestSpec& spec, int32_t n, const std::string& name) const {
  if (slots_needed(spec, n) > pool_->size())
    throw std::invalid_argument(name + " needs " + std::to_string(slots_needed(spec, n)) +
                                " state slots (--parallel-samples) but the pool holds " +
                                std::to_string(pool_->size()) + " (raise --state-memory)");
  if (kv_ && kv_tokens_needed(spec, n) > kv_->size())
    throw std::invalid_argument(name + " needs " + std::to_string(kv_tokens_needed(spec, n)) +
                                " MLA KV token slots (prompt + output tokens per continuation) but the "
                                "pool holds " +
                                std::to_string(kv_->size()) + " (raise --kv-memory)");
}

Sequence Scheduler::fresh_sequence(int64_t r, int32_t j) const {
  Sequence s;
  s.request = r;
  s.sample = j;
  s.prompt_len = requests_[r].prompt_len;
  s.output_len = requests_[r].output_len;
  return s;
}

void Scheduler::add_sequences(int64_t r) {
  const int32_t n = n_of_[r];
  seq_base_.push_back(static_cast<int64_t>(seqs_.size()));
  for (int32_t j = 0; j < n; ++j) seqs_.push_back(fresh_sequence(r, j));
  unfinished_.push_back(n);
  kv_share_.resize(seqs_.size(), 0);
  shared_len_.resize(seqs_.size(), 0);
  pending_.resize(seqs_.size());
}

int64_t Scheduler::add_request(RequestSpec spec, int32_t n, std::vector<int32_t> prompt) {
  if (n < 1) throw std::invalid_argument("n: must be >= 1, got " + std::to_string(n));
  if (spec.after >= 0)
    throw std::invalid_argument("scheduler: an online request cannot be a session's next turn");
  if (spec.prompt_len < 1 || spec.output_len < 0)
    throw std::invalid_argument("scheduler: a request needs prompt_len >= 1 and output_len >= 0");
  if (cache_ && static_cast<int64_t>(prompt.size()) != spec.prompt_len)
    throw std::invalid_argument("scheduler: a prompt of " + std::to_string(prompt.size()) +
                                " tokens, prompt_len says " + std::to_string(spec.prompt_len));
  check_request(spec, n);
  spec.arrival_step = step_;
  spec.prompt.clear();  // the scheduler needs only its lengths (and the cache its tokens, below)
  spec.forced.clear();
  ++added_requests_;
  // A finished online request's index (and its n sequences) is taken again, so that a server's
  // bookkeeping stays as large as its busiest moment, not as its number of requests so far.
  auto& free = recycled_[n];
  if (!free.empty()) {
    const int64_t r = free.back();
    free.pop_back();
    requests_[r] = std::move(spec);
    unfinished_[r] = n;
    for (int32_t j = 0; j < n; ++j) seqs_[seq_index(r, j)] = fresh_sequence(r, j);
    if (cache_) prompts_[r] = std::move(prompt);
    online_.push_back(r);
    return r;
  }
  const int64_t r = static_cast<int64_t>(requests_.size());
  requests_.push_back(std::move(spec));
  n_of_.push_back(n);
  next_turn_.push_back(-1);
  recyclable_.resize(requests_.size(), 0);
  recyclable_[r] = 1;
  add_sequences(r);
  if (cache_) {
    prompts_.push_back(std::move(prompt));
    fed_.resize(seqs_.size());
  }
  online_.push_back(r);
  return r;
}

void Scheduler::set_prompt(int64_t request, std::vector<int32_t> tokens) {
  if (!cache_) return;
  if (static_cast<int64_t>(tokens.size()) != requests_[request].prompt_len)
    throw std::logic_error("scheduler: request " + std::to_string(request) + ": a prompt of " +
                           std::to_string(tokens.size()) + " tokens, prompt_len says " +
                           std::to_string(requests_[request].prompt_len));
  prompts_[request] = std::move(tokens);
}

void Scheduler::add_fed_token(int64_t seq, int32_t token) {
  if (cache_) fed_[seq].push_back(token);
}

std::span<const int32_t> Scheduler::match_key(int64_t request) const {
  const auto& p = prompts_[request];
  if (static_cast<int64_t>(p.size()) != requests_[request].prompt_len)
    throw std::logic_error("scheduler: request " + std::to_string(request) + " admitted before its prompt");
  return std::span<const int32_t>(p.data(), p.size() - 1);
}

// Another request's prefill is writing a snapshot deeper on this prompt's path than any Ready one: waiting
// for it (a few steps at most: snapshots commit after the step that writes them) saves recomputing it.
bool Scheduler::waits_for_snapshot(int64_t request) {
  if (!cache_ || requests_[request].prompt_len < 2) return false;
  const auto m = cache_->match_prefix(match_key(request));
  return m.pending && m.pending.len > m.hit.len;
}

int64_t Scheduler::slots_in_use() const { return pool_->size() - pool_->available(); }

// A request that decodes needs a slot per continuation; a prefill-only one (output_len 0) needs one:
// its continuations would all equal the prompt, so nothing is forked.
int32_t Scheduler::slots_needed(int64_t request) const {
  return slots_needed(requests_[request], n_of_[request]);
}

// MLA KV token slots a request can hold at once (request.h, kv_tokens_for).
int64_t Scheduler::kv_tokens_needed(int64_t request) const {
  return kv_tokens_needed(requests_[request], n_of_[request]);
}

// With a prefix cache, evictable snapshots count as free: admission evicts what it needs.
bool Scheduler::can_admit(int64_t request) const {
  int64_t free = pool_->available();
  if (cache_) free = std::min(free, pool_->recurrent_pool().available() + cache_->evictable_snapshots());
  if (free - reserved_ < slots_needed(request)) return false;
  // Admission promises a request every KV token slot it can come to hold, so that no step's
  // alloc_tokens ever finds the KV pool short: a request waits here instead. Free slots back every
  // promise not yet taken (admission evicts cached KV to keep it so); the check counts what the cache
  // could give up, and the request's whole need (a hit's shared tokens need less).
  if (!kv_) return true;
  const int64_t want = kv_outstanding() + kv_tokens_needed(request);
  if (want <= kv_->available()) return true;
  return cache_ && want <= kv_->available() + cache_->evictable_kv_tokens();
}

// KV token slots promised to running sequences and not allocated by them yet: at most what is free.
int64_t Scheduler::kv_outstanding() const {
  int64_t out = 0;
  for (size_t s = 0; s < seqs_.size(); ++s) {
    if (kv_share_[s] == 0) continue;
    const int32_t idx = seqs_[s].req_pool_index;
    const int64_t own = idx >= 0 ? pool_->seq_len(idx) - shared_len_[s] : 0;
    out += std::max<int64_t>(0, kv_share_[s] - own);
  }
  return out;
}

int32_t Scheduler::take_slot(int32_t req_pool_index) {
  const int32_t slot = pool_->slot_of(req_pool_index);
  if (slot_used_[slot]) ++slot_reuses_;
  slot_used_[slot] = 1;
  peak_slots_ = std::max(peak_slots_, slots_in_use());
  return slot;
}

void Scheduler::fill_prefill(ScheduledBatch& b, int64_t budget) {
  for (const int64_t s : prefilling_) {
    if (budget <= 0) return;
    const Sequence& q = seqs_[s];
    const int32_t take = static_cast<int32_t>(std::min<int64_t>(q.remaining_prompt(), budget));
    b.rows.push_back({s, q.processed, take, false});
    b.prefill_tokens += take;
    budget -= take;
  }
  while (budget > 0 && !waiting_.empty() && admissible(waiting_.front())) {
    const int64_t r = waiting_.front();
    if (cache_ && !cache_->ensure_free_slots(reserved_ + slots_needed(r)))
      throw std::logic_error("scheduler: admitted a request the pool and the cache cannot give slots");
    waiting_.pop_front();
    const int64_t s = seq_index(r, 0);
    Sequence& q = seqs_[s];
    q.req_pool_index = pool_->alloc(1)[0];
    // The forks' slots are promised before the request's own snapshots are planned: a snapshot must not
    // take the slot its own request forks into.
    reserved_ += slots_needed(r) - 1;
    if (kv_) {
      const int32_t holders = q.output_len > 0 ? n_of_[r] : 1;
      const int64_t per_seq = kv_tokens_needed(r) / holders;
      for (int32_t j = 0; j < holders; ++j) kv_share_[seq_index(r, j)] = per_seq;
      kv_promised_ += kv_tokens_needed(r);
    }
    const int32_t slot = take_slot(q.req_pool_index);
    // Prefix cache: the deepest Ready snapshot of the prompt minus its last token is copied into the
    // slot; the prefill then runs only the rest (the row's start is k, its ForwardBatch prefix k > 0).
    q.prefix_len = 0;
    shared_len_[s] = 0;
    if (cache_ && q.prompt_len >= 2) {
      const auto m = cache_->match_prefix(match_key(r));
      if (m.hit) {
        cache_->inc_lock_ref(m.hit.node);
        pool_->recurrent_pool().copy_slot(m.hit.slot, slot);
        q.prefix_len = static_cast<int32_t>(m.hit.len);
        cache_hit_tokens_ += q.prefix_len;
        const int32_t idx = q.req_pool_index, len = q.prefix_len;
        if (kv_) {
          // The prefix's MLA KV rows by reference: the request never writes them (its new tokens get
          // fresh slots), and they need no slot of its promise.
          pool_->share_tokens(idx, m.kv_slots);
          shared_len_[s] = len;
          kv_share_[s] -= len;
          kv_promised_ -= len;
        } else {
          pool_->alloc_tokens(std::span<const int32_t>(&idx, 1), std::span<const int32_t>(&len, 1));
        }
        cache_->dec_lock_ref(m.hit.node);
      }
      // Every promise backed by a free slot before the request's own snapshots pin its path's KV.
      if (kv_ && !cache_->ensure_free_kv_tokens(kv_outstanding()))
        throw std::logic_error("scheduler: admitted a request the KV pool and the cache cannot give slots");
      plan_snapshots(s, m);
    } else if (cache_ && kv_ && !cache_->ensure_free_kv_tokens(kv_outstanding())) {
      throw std::logic_error("scheduler: admitted a request the KV pool and the cache cannot give slots");
    }
    q.processed = q.prefix_len;
    b.cached_tokens += q.prefix_len;
    q.phase = SeqPhase::kPrefill;
    for (int32_t j = 1; j < n_of_[r]; ++j) seqs_[seq_index(r, j)].phase = SeqPhase::kForkPending;
    ++admitted_unfinished_;
    prefilling_.push_back(s);
    const int32_t take = static_cast<int32_t>(std::min<int64_t>(q.remaining_prompt(), budget));
    b.rows.push_back({s, q.processed, take, false});
    b.prefill_tokens += take;
    budget -= take;
  }
}

// The snapshots a prefill writes (positions after prefix_len, before prompt_len): the prompt minus its
// last token, every cache_interval tokens, and the branch point off a cached path. Each gets a Pending
// node now; a snapshot never takes a slot promised to a fork (reserved_), and one the cache cannot give
// (budget of locked / pending snapshots, or a full pool) is skipped.
void Scheduler::plan_snapshots(int64_t seq, const mem_cache::MatchResult& m) {
  const Sequence& q = seqs_[seq];
  std::set<int32_t> pos;
  pos.insert(q.prompt_len - 1);
  for (int64_t p = opt_.cache_interval; p < q.prompt_len; p += opt_.cache_interval)
    pos.insert(static_cast<int32_t>(p));
  if (m.matched_len > m.hit.len && m.matched_len < q.prompt_len)
    pos.insert(static_cast<int32_t>(m.matched_len));
  const auto& tokens = prompts_[q.request];
  for (const int32_t p : pos) {
    if (p <= q.prefix_len) continue;
    auto& rec = pool_->recurrent_pool();
    if (rec.available() - reserved_ < 1 && !cache_->ensure_free_slots(reserved_ + 1)) continue;
    const auto snap = cache_->reserve(std::span<const int32_t>(tokens.data(), tokens.size()), p);
    if (!snap || !snap.created) continue;  // none to be had, or one is there already
    pending_[seq].push_back({p, snap.node, snap.slot});
  }
}

void Scheduler::commit_snapshots(int64_t seq) {
  auto& v = pending_[seq];
  const int32_t done = seqs_[seq].processed;
  const auto kv_slots = pool_->req_to_token(seqs_[seq].req_pool_index);  // empty without a KV pool
  for (auto it = v.begin(); it != v.end();) {
    if (it->pos <= done) {
      cache_->commit(it->node, kv_slots);
      it = v.erase(it);
    } else {
      ++it;
    }
  }
}

void Scheduler::take_decodes(ScheduledBatch& b, int64_t limit) {
  while (limit-- > 0 && !decode_queue_.empty()) {
    const int64_t s = decode_queue_.front();
    decode_queue_.pop_front();
    b.rows.push_back({s, seqs_[s].processed, 1, true});
    ++b.decode_tokens;
  }
}

ScheduledBatch Scheduler::schedule() {
  ScheduledBatch b;
  // Arrivals of both kinds (first requests, next turns due), in (arrival step, index) order.
  std::vector<std::pair<int64_t, int64_t>> due;
  while (next_arrival_ < arrival_order_.size() &&
         requests_[arrival_order_[next_arrival_]].arrival_step <= step_) {
    const int64_t r = arrival_order_[next_arrival_++];
    due.emplace_back(requests_[r].arrival_step, r);
  }
  while (!turn_arrivals_.empty() && turn_arrivals_.begin()->first <= step_) {
    due.push_back(*turn_arrivals_.begin());
    turn_arrivals_.erase(turn_arrivals_.begin());
  }
  std::sort(due.begin(), due.end());
  for (const auto& [when, r] : due) {
    waiting_.push_back(r);
    b.arrived.push_back(r);
  }
  for (; !online_.empty(); online_.pop_front()) {  // added between steps: they arrive now
    waiting_.push_back(online_.front());
    b.arrived.push_back(online_.front());
  }

  const bool has_prefill = !prefilling_.empty() || (!waiting_.empty() && admissible(waiting_.front()));
  const bool has_decode = !decode_queue_.empty();
  if (!has_prefill && !has_decode) return b;
  if (opt_.mixed) {
    if (!has_prefill) {
      b.mode = ForwardMode::DECODE;
      take_decodes(b, opt_.max_batch);
      return b;
    }
    b.mode = ForwardMode::EXTEND;
    take_decodes(b, std::min(opt_.max_batch, opt_.token_budget));
    fill_prefill(b, opt_.token_budget - b.decode_tokens);
    return b;
  }
  if (has_prefill && (!has_decode || prefill_streak_ < opt_.max_prefill_streak)) {
    b.mode = ForwardMode::EXTEND;
    prefill_streak_ = has_decode ? prefill_streak_ + 1 : 0;
    fill_prefill(b, opt_.token_budget);
    return b;
  }
  b.mode = ForwardMode::DECODE;
  prefill_streak_ = 0;
  take_decodes(b, opt_.max_batch);
  return b;
}

ForwardBatch Scheduler::forward_batch(const ScheduledBatch& b) const {
  std::vector<int32_t> reqs, lens, prefix;
  for (const auto& row : b.rows) {
    reqs.push_back(seqs_[row.seq].req_pool_index);
    lens.push_back(row.len);
    prefix.push_back(row.start);  // > 0: the slot holds the state of the tokens before
  }
  if (b.mode == ForwardMode::DECODE) return ForwardBatch::decode(std::move(reqs));
  if (b.mode == ForwardMode::TARGET_VERIFY) {
    for (auto& l : lens) --l;  // drafts after the row's first token
    return ForwardBatch::target_verify(std::move(reqs), lens, b.draft_parents);
  }
  auto fb = ForwardBatch::extend(std::move(reqs), std::move(lens), std::move(prefix));
  for (size_t i = 0; i < b.rows.size(); ++i) {  // snapshots whose position this chunk reaches
    const auto& row = b.rows[i];
    if (row.decode) continue;
    for (const auto& ps : pending_[row.seq])
      if (ps.pos > row.start && ps.pos <= row.start + row.len)
        fb.state_snapshots.push_back({static_cast<int32_t>(i), ps.pos - row.start, ps.slot});
  }
  return fb;
}

void Scheduler::finish(int64_t seq, StepEvents& ev) {
  Sequence& q = seqs_[seq];
  for (const auto& ps : pending_[seq]) cache_->abort(ps.node);  // unwritten: commits follow each step
  pending_[seq].clear();
  if (cache_ && q.req_pool_index >= 0 && q.processed > 0) {
    // The state after every processed token (prompt + fed decode inputs): a session's next turn
    // continues from it. A full cache makes this insert give nothing, which only costs speed.
    std::vector<int32_t> tokens = prompts_[q.request];
    tokens.insert(tokens.end(), fed_[seq].begin(), fed_[seq].end());
    const auto kv_slots = pool_->req_to_token(q.req_pool_index);
    if (static_cast<int64_t>(tokens.size()) == q.processed &&
        (!kv_ || static_cast<int64_t>(kv_slots.size()) >= q.processed))
      cache_->insert(tokens, q.processed, pool_->slot_of(q.req_pool_index), kv_slots);
  }
  if (q.req_pool_index >= 0) {
    const int32_t idx = q.req_pool_index;
    pool_->free(std::span<const int32_t>(&idx, 1));  // its MLA token slots too
  }
  kv_promised_ -= kv_share_[seq];
  kv_share_[seq] = 0;
  const bool admitted = q.phase != SeqPhase::kWaiting;
  q.req_pool_index = -1;
  q.phase = SeqPhase::kFinished;
  ev.finished.push_back(seq);
  // What a finished sequence held goes back now, so that memory stays flat over a long online run.
  std::vector<PendingSnapshot>().swap(pending_[seq]);
  if (cache_) std::vector<int32_t>().swap(fed_[seq]);
  if (--unfinished_[q.request] == 0) {
    ++finished_requests_;
    if (admitted) --admitted_unfinished_;
    ev.finished_requests.push_back(q.request);
    if (cache_) std::vector<int32_t>().swap(prompts_[q.request]);
    if (static_cast<size_t>(q.request) < recyclable_.size() && recyclable_[q.request])
      recycled_[n_of_[q.request]].push_back(q.request);
  }
}

void Scheduler::finish_now(int64_t seq, StepEvents& ev) {
  Sequence& q = seqs_[seq];
  const int64_t r = q.request;
  switch (q.phase) {
    case SeqPhase::kFinished:
      return;
    case SeqPhase::kWaiting:  // queued: none of its continuations holds anything
      if (auto it = std::find(waiting_.begin(), waiting_.end(), r); it != waiting_.end()) waiting_.erase(it);
      if (auto it = std::find(online_.begin(), online_.end(), r); it != online_.end()) online_.erase(it);
      break;
    case SeqPhase::kPrefill:
      prefilling_.erase(std::find(prefilling_.begin(), prefilling_.end(), seq));
      break;
    case SeqPhase::kForkPending:  // its slot was promised at admission (a request that decodes)
      if (q.output_len > 0) --reserved_;
      break;
    case SeqPhase::kDecode:
      if (auto it = std::find(decode_queue_.begin(), decode_queue_.end(), seq); it != decode_queue_.end())
        decode_queue_.erase(it);
      break;
  }
  finish(seq, ev);
}

void Scheduler::abort_request(int64_t request, StepEvents& ev) {
  const int32_t n = n_of_[request];
  // A waiting request's continuations are all kWaiting: finish_now takes it out of the queue once.
  for (int32_t j = 0; j < n; ++j) finish_now(seq_index(request, j), ev);
}

// The slots this step's forks take, had from the pool (free, or a snapshot evicted) before complete()
// changes anything. Admission reserved them, so a shortfall means someone took slots behind the
// scheduler's back.
void Scheduler::check_fork_slots(const ScheduledBatch& b) const {
  int64_t forks = 0;
  for (const auto& row : b.rows) {
    const Sequence& q = seqs_[row.seq];
    if (!row.decode && q.output_len > 0 && q.processed < q.prompt_len &&
        int64_t{q.processed} + row.len >= q.prompt_len)
      forks += n_of_[q.request] - 1;
  }
  if (forks == 0) return;
  auto& rec = pool_->recurrent_pool();
  const int64_t slots = rec.available() + (cache_ ? cache_->evictable_snapshots() : 0);
  if (pool_->available() < forks || slots < forks)
    throw std::logic_error("scheduler: this step forks " + std::to_string(forks) +
                           " sequence(s) but the pool has " +
                           std::to_string(std::min(pool_->available(), slots)) +
                           " slot(s) to give (slots reserved for forks were taken outside the scheduler)");
}

void Scheduler::note_kv_use() {
  if (kv_) peak_kv_tokens_ = std::max(peak_kv_tokens_, kv_->size() - kv_->available());
}

StepEvents Scheduler::complete(const ScheduledBatch& b) {
  check_fork_slots(b);
  note_kv_use();
  StepEvents ev;
  std::vector<int64_t> requeue, ready;
  for (const auto& row : b.rows) {
    Sequence& q = seqs_[row.seq];
    q.processed += row.len;
    if (cache_ && !row.decode) commit_snapshots(row.seq);
    if (row.decode) {
      if (q.processed == q.total_len())
        finish(row.seq, ev);
      else
        requeue.push_back(row.seq);
      continue;
    }
    if (q.processed < q.prompt_len) continue;
    // The prompt is done: fork the other continuations from its state, then decode all of them.
    prefilling_.erase(std::find(prefilling_.begin(), prefilling_.end(), row.seq));
    const int64_t r = q.request;
    const int32_t n = n_of_[r];
    for (int32_t j = 1; j < n; ++j) {
      seqs_[seq_index(r, j)].processed = q.processed;
      ev.forks.emplace_back(row.seq, seq_index(r, j));
    }
    if (q.output_len == 0) {  // nothing to decode: every continuation is the prompt, no slot forked
      for (int32_t j = 0; j < n; ++j) finish(seq_index(r, j), ev);
      continue;
    }
    q.phase = SeqPhase::kDecode;
    ready.push_back(row.seq);
    for (int32_t j = 1; j < n; ++j) {
      Sequence& child = seqs_[seq_index(r, j)];
      // check_fork_slots made sure of the slot; this evicts a snapshot only when none is free.
      if (cache_ && !cache_->ensure_free_slots(1))
        throw std::logic_error("scheduler: no slot for a fork although one was reserved");
      child.req_pool_index = pool_->fork(q.req_pool_index);  // copy_slot; the KV rows by reference
      if (kv_) {  // the shared prompt rows need no slot of the child's promise
        const int64_t shared = pool_->seq_len(child.req_pool_index);
        shared_len_[seq_index(r, j)] = shared;
        kv_share_[seq_index(r, j)] -= shared;
        kv_promised_ -= shared;
      }
      if (cache_) fed_[seq_index(r, j)] = fed_[row.seq];
      --reserved_;
      take_slot(child.req_pool_index);
      child.phase = SeqPhase::kDecode;
      ready.push_back(seq_index(r, j));
    }
  }
  // Sequences that waited go first; those that just ran, then new ones, queue behind them.
  decode_queue_.insert(decode_queue_.end(), requeue.begin(), requeue.end());
  decode_queue_.insert(decode_queue_.end(), ready.begin(), ready.end());
  note_kv_use();  // the forks' copied rows
  ++step_;
  // A finished turn's next turn arrives arrival_step steps from the next step on.
  for (const int64_t r : ev.finished_requests)
    if (next_turn_[r] >= 0)
      turn_arrivals_.emplace(step_ + requests_[next_turn_[r]].arrival_step, next_turn_[r]);
  return ev;
}

bool Scheduler::skip_to_next_arrival() {
  int64_t next = -1;
  if (next_arrival_ < arrival_order_.size()) next = requests_[arrival_order_[next_arrival_]].arrival_step;
  if (!turn_arrivals_.empty() && (next < 0 || turn_arrivals_.begin()->first < next))
    next = turn_arrivals_.begin()->first;
  if (next < 0) return false;
  step_ = std::max(step_, next);
  return true;
}

}  // namespace kda::serving
