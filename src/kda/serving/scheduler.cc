#include "kda/serving/scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kda::serving {

using model_executor::ForwardBatch;
using model_executor::ForwardMode;

Scheduler::Scheduler(const std::vector<RequestSpec>& requests, const SchedulerOptions& options,
                     mem_cache::HybridReqToTokenPool& pool)
    : requests_(requests), opt_(options), n_(options.parallel_samples), pool_(&pool) {
  if (opt_.token_budget < 1)
    throw std::invalid_argument("--token-budget must be >= 1, got " + std::to_string(opt_.token_budget));
  if (opt_.max_batch < 1)
    throw std::invalid_argument("--max-batch must be >= 1, got " + std::to_string(opt_.max_batch));
  if (n_ < 1) throw std::invalid_argument("--parallel-samples must be >= 1, got " + std::to_string(n_));
  if (opt_.max_prefill_streak < 1) throw std::invalid_argument("max_prefill_streak must be >= 1");
  const int64_t R = static_cast<int64_t>(requests_.size());
  seqs_.resize(static_cast<size_t>(R * n_));
  next_turn_.assign(static_cast<size_t>(R), -1);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t prev = requests_[r].after;
    if (prev >= 0) {
      if (prev >= r || next_turn_[prev] >= 0)
        throw std::invalid_argument("request " + std::to_string(r) + ": previous turn " +
                                    std::to_string(prev) +
                                    " must come before it and have no other next turn");
      next_turn_[prev] = r;
    }
    if (slots_needed(r) > pool.size())
      throw std::invalid_argument("request " + std::to_string(r) + " needs " +
                                  std::to_string(slots_needed(r)) +
                                  " state slots (--parallel-samples) but the pool holds " +
                                  std::to_string(pool.size()) + " (raise --state-memory)");
    for (int32_t j = 0; j < n_; ++j) {
      Sequence& s = seqs_[seq_index(r, j)];
      s.request = r;
      s.sample = j;
      s.prompt_len = requests_[r].prompt_len;
      s.output_len = requests_[r].output_len;
    }
    if (prev < 0) arrival_order_.push_back(r);  // a next turn arrives when its previous one finishes
  }
  std::stable_sort(arrival_order_.begin(), arrival_order_.end(), [&](int64_t a, int64_t b) {
    return requests_[a].arrival_step < requests_[b].arrival_step;
  });
  unfinished_.assign(static_cast<size_t>(R), n_);
  slot_used_.assign(static_cast<size_t>(pool.recurrent_pool().size() + 1), 0);
}

int64_t Scheduler::slots_in_use() const { return pool_->size() - pool_->available(); }

// A request that decodes needs a slot per continuation; a prefill-only one (output_len 0) needs one:
// its continuations would all equal the prompt, so nothing is forked.
int32_t Scheduler::slots_needed(int64_t request) const { return requests_[request].output_len > 0 ? n_ : 1; }

bool Scheduler::can_admit(int64_t request) const {
  return pool_->available() - reserved_ >= slots_needed(request);
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
  while (budget > 0 && !waiting_.empty() && can_admit(waiting_.front())) {
    const int64_t r = waiting_.front();
    waiting_.pop_front();
    const int64_t s = seq_index(r, 0);
    Sequence& q = seqs_[s];
    q.req_pool_index = pool_->alloc(1)[0];
    take_slot(q.req_pool_index);
    // Prefix-cache hook: a cache that holds the state of the prompt's first k tokens sets
    // q.prefix_len = k here (k <= prompt_len - 1) and restores that state into the slot; the prefill
    // then runs only the rest (the row's start is k, its ForwardBatch prefix k > 0).
    q.prefix_len = 0;
    q.processed = q.prefix_len;
    b.cached_tokens += q.prefix_len;
    reserved_ += slots_needed(r) - 1;
    q.phase = SeqPhase::kPrefill;
    for (int32_t j = 1; j < n_; ++j) seqs_[seq_index(r, j)].phase = SeqPhase::kForkPending;
    prefilling_.push_back(s);
    const int32_t take = static_cast<int32_t>(std::min<int64_t>(q.remaining_prompt(), budget));
    b.rows.push_back({s, q.processed, take, false});
    b.prefill_tokens += take;
    budget -= take;
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

  const bool has_prefill = !prefilling_.empty() || (!waiting_.empty() && can_admit(waiting_.front()));
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
  return ForwardBatch::extend(std::move(reqs), std::move(lens), std::move(prefix));
}

void Scheduler::finish(int64_t seq, StepEvents& ev) {
  Sequence& q = seqs_[seq];
  if (q.req_pool_index >= 0) {
    const int32_t idx = q.req_pool_index;
    pool_->free(std::span<const int32_t>(&idx, 1));
  }
  q.req_pool_index = -1;
  q.phase = SeqPhase::kFinished;
  ev.finished.push_back(seq);
  if (--unfinished_[q.request] == 0) {
    ++finished_requests_;
    ev.finished_requests.push_back(q.request);
  }
}

StepEvents Scheduler::complete(const ScheduledBatch& b) {
  StepEvents ev;
  std::vector<int64_t> requeue, ready;
  for (const auto& row : b.rows) {
    Sequence& q = seqs_[row.seq];
    q.processed += row.len;
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
    for (int32_t j = 1; j < n_; ++j) {
      seqs_[seq_index(r, j)].processed = q.processed;
      ev.forks.emplace_back(row.seq, seq_index(r, j));
    }
    if (q.output_len == 0) {  // nothing to decode: every continuation is the prompt, no slot forked
      for (int32_t j = 0; j < n_; ++j) finish(seq_index(r, j), ev);
      continue;
    }
    q.phase = SeqPhase::kDecode;
    ready.push_back(row.seq);
    for (int32_t j = 1; j < n_; ++j) {
      Sequence& child = seqs_[seq_index(r, j)];
      child.req_pool_index = pool_->fork(q.req_pool_index);  // copy_slot of every layer's state
      --reserved_;
      take_slot(child.req_pool_index);
      child.phase = SeqPhase::kDecode;
      ready.push_back(seq_index(r, j));
    }
  }
  // Sequences that waited go first; those that just ran, then new ones, queue behind them.
  decode_queue_.insert(decode_queue_.end(), requeue.begin(), requeue.end());
  decode_queue_.insert(decode_queue_.end(), ready.begin(), ready.end());
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
