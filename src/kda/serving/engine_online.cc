// The online engine (engine.h): the scheduler over requests submitted while it runs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

#include "kda/serving/engine.h"

namespace kda::serving {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kNone:
      break;
  }
  return "";
}

namespace {

bool plain_greedy(const sampling::SamplingParams& p) {
  return p.greedy() && p.logprobs < 0 && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
         p.frequency_penalty == 0.0f;
}

// What the scheduler needs of a request: its lengths. Generating max_tokens tokens takes max_tokens - 1
// decode steps after the prompt (the first token comes from the prompt's last position).
RequestSpec spec_of(const GenerateRequest& req) {
  RequestSpec s;
  s.prompt_len = static_cast<int32_t>(req.prompt.size());
  s.output_len = req.params.max_tokens - 1;
  return s;
}

}  // namespace

Engine::Engine(ModelRunner& runner, EngineOptions opt)
    : runner_(runner),
      opt_(std::move(opt)),
      V_(runner.model().vocab_size()),
      D_(runner.model().hidden_size()),
      slots_(runner.pools().req_to_token_pool.size()),
      kv_tokens_(runner.pools().req_to_token_pool.token_to_kv_pool()
                     ? runner.pools().req_to_token_pool.token_to_kv_pool()->size()
                     : 0),
      sched_(
          {},
          [&] {
            SchedulerOptions so = opt_.scheduler;
            so.parallel_samples = 1;     // each request brings its own n
            so.verify_extra_tokens = 0;  // no speculative decoding here
            return so;
          }(),
          runner.pools().req_to_token_pool),
      seeds_(std::random_device{}()) {
  if (!opt_.producible.empty() && static_cast<int64_t>(opt_.producible.size()) != V_)
    throw std::invalid_argument("producible: " + std::to_string(opt_.producible.size()) +
                                " entries for a vocabulary of " + std::to_string(V_));
  if (!opt_.producible.empty() &&
      std::none_of(opt_.producible.begin(), opt_.producible.end(), [](uint8_t v) { return v != 0; }))
    throw std::invalid_argument("producible: no id is producible");
  if (opt_.max_context < 0)
    throw std::invalid_argument("max_context: must be >= 0, got " + std::to_string(opt_.max_context));
  is_stop_.assign(static_cast<size_t>(V_), 0);
  for (const int32_t id : opt_.stop_ids) {
    if (id < 0 || id >= V_)
      throw std::invalid_argument("stop_ids: id " + std::to_string(id) + " is outside the vocabulary of " +
                                  std::to_string(V_));
    is_stop_[id] = 1;
  }
  publish_stats();
}

Engine::~Engine() = default;

int64_t Engine::submit(GenerateRequest req, EventSink sink) {
  if (req.prompt.empty()) throw std::invalid_argument("prompt: must not be empty");
  if (req.prompt.size() > static_cast<size_t>(INT32_MAX / 2))
    throw std::invalid_argument("prompt: " + std::to_string(req.prompt.size()) + " tokens is too long");
  for (size_t i = 0; i < req.prompt.size(); ++i)
    if (req.prompt[i] < 0 || req.prompt[i] >= V_)
      throw std::invalid_argument("prompt: token id " + std::to_string(req.prompt[i]) + " at position " +
                                  std::to_string(i) + " is outside the vocabulary of " + std::to_string(V_));
  req.params.validate(V_);
  if (req.n < 1) throw std::invalid_argument("n: must be >= 1, got " + std::to_string(req.n));
  const RequestSpec spec = spec_of(req);
  if (req.n > slots_ && spec.output_len > 0)
    throw std::invalid_argument("n: " + std::to_string(req.n) +
                                " parallel samples need as many state slots but the pool holds " +
                                std::to_string(slots_));
  const int64_t context = int64_t{spec.prompt_len} + req.params.max_tokens;
  if (opt_.max_context > 0 && context > opt_.max_context)
    throw std::invalid_argument("max_tokens: the prompt's " + std::to_string(spec.prompt_len) +
                                " tokens + max_tokens " + std::to_string(req.params.max_tokens) +
                                " exceed the context limit of " + std::to_string(opt_.max_context));
  if (kv_tokens_ > 0 && kv_tokens_for(spec, req.n) > kv_tokens_)
    throw std::invalid_argument("max_tokens: the prompt's " + std::to_string(spec.prompt_len) +
                                " tokens + max_tokens " + std::to_string(req.params.max_tokens) +
                                " per sample (n = " + std::to_string(req.n) + ") need " +
                                std::to_string(kv_tokens_for(spec, req.n)) +
                                " MLA KV token slots but the pool holds " + std::to_string(kv_tokens_));
  if (!sink) throw std::invalid_argument("sink: must not be empty");
  std::lock_guard<std::mutex> lk(mu_);
  Submitted s;
  s.id = next_id_++;
  s.seed = req.params.seed ? *req.params.seed : seeds_();
  s.req = std::move(req);
  s.sink = std::move(sink);
  const int64_t id = s.id;
  inbox_.push_back(std::move(s));
  ++stats_.waiting;
  cv_.notify_all();
  return id;
}

void Engine::abort(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  aborts_.push_back(id);
  cv_.notify_all();
}

void Engine::admit(Submitted s) {
  const RequestSpec spec = spec_of(s.req);
  const int64_t r = sched_.add_request(spec, s.req.n, s.req.prompt);
  Live& L = live_[r];
  L.id = s.id;
  L.sink = std::make_shared<EventSink>(std::move(s.sink));
  L.plain_greedy = plain_greedy(s.req.params);
  L.cont.resize(static_cast<size_t>(s.req.n));
  if (!L.plain_greedy)
    for (int32_t j = 0; j < s.req.n; ++j)
      L.cont[j].sampler = std::make_unique<sampling::RequestSampler>(s.req.params, s.req.prompt, s.seed + j);
  L.unfinished = s.req.n;
  L.req = std::move(s.req);
  by_id_[L.id] = r;
}

void Engine::apply_inbox() {
  std::vector<Submitted> in;
  std::vector<int64_t> ab;
  {
    std::lock_guard<std::mutex> lk(mu_);
    in.swap(inbox_);
    ab.swap(aborts_);
  }
  // Submits first: an abort of a request submitted just before it finds it.
  for (auto& s : in) admit(std::move(s));
  for (const int64_t id : ab) {
    const auto it = by_id_.find(id);
    if (it != by_id_.end()) abort_live(it->second);
  }
}

void Engine::emit(int64_t r, int32_t j, int32_t token, std::optional<sampling::TokenLogprob> lp,
                  FinishReason f) {
  const Live& L = live_.at(r);
  TokenEvent ev;
  ev.request = L.id;
  ev.index = j;
  ev.token = token;
  ev.logprob = std::move(lp);
  ev.finish = f;
  ev.prompt_tokens = static_cast<int32_t>(L.req.prompt.size());
  ev.cached_tokens = sched_.sequences()[sched_.seq_index(r, 0)].prefix_len;
  out_.push_back({L.sink, std::move(ev)});
}

// Bookkeeping once a continuation's finish event is out; the request goes when its last one finished.
void Engine::finish_continuation(int64_t r, int32_t j, FinishReason f) {
  Live& L = live_.at(r);
  L.cont[j].finished = true;
  L.cont[j].sampler.reset();
  if (--L.unfinished > 0) return;
  if (f == FinishReason::kAbort)
    ++totals_.requests_aborted;
  else
    ++totals_.requests_finished;
  by_id_.erase(L.id);
  live_.erase(r);
}

void Engine::abort_live(int64_t r) {
  StepEvents ev;
  sched_.abort_request(r, ev);  // every slot and token slot back before anything else runs
  Live& L = live_.at(r);
  const int32_t n = static_cast<int32_t>(L.cont.size());
  for (int32_t j = 0; j < n; ++j) {
    if (live_.at(r).cont[j].finished) continue;
    emit(r, j, -1, std::nullopt, FinishReason::kAbort);
    finish_continuation(r, j, FinishReason::kAbort);  // may erase the request: look it up each time
    if (!live_.count(r)) break;
  }
}

void Engine::deliver() {
  for (auto& p : out_) {
    try {
      (*p.sink)(p.ev);
    } catch (...) {
      // A sink must not throw; one that does loses its event, never the engine the other requests.
    }
  }
  out_.clear();
}

void Engine::publish_stats() {
  EngineStats s = totals_;
  s.running = sched_.running_requests();
  s.waiting = sched_.waiting_requests();
  auto& pool = runner_.pools().req_to_token_pool;
  s.slots_total = pool.size();
  s.slots_used = pool.size() - pool.available();
  if (const auto* kv = pool.token_to_kv_pool()) {
    s.kv_tokens_total = kv->size();
    s.kv_tokens_used = kv->size() - kv->available();
  }
  if (const auto* c = opt_.scheduler.cache) {
    s.prefix_cache_bytes = static_cast<int64_t>(c->bytes());
    s.prefix_cache_evictions = c->evictions();
    s.prefix_cache_snapshots = c->snapshots();
    s.prefix_cache_kv_tokens = c->kv_tokens();
    s.kv_tokens_used -= s.prefix_cache_kv_tokens;  // the tree's slots are all in use, each held once
  }
  std::lock_guard<std::mutex> lk(mu_);
  s.waiting += static_cast<int64_t>(inbox_.size());
  stats_ = s;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

bool Engine::step() {
  apply_inbox();
  ScheduledBatch b = sched_.schedule();
  if (b.empty()) {
    if (!sched_.idle())
      throw std::logic_error("engine: requests waiting but the scheduler has nothing to run");
    const bool any = !out_.empty();
    publish_stats();
    deliver();
    return any;
  }
  const auto& seqs = sched_.sequences();
  const int64_t T = b.num_tokens();
  y_.resize(static_cast<size_t>(T * D_));
  toks_.resize(static_cast<size_t>(T));
  int64_t t = 0;
  for (const auto& row : b.rows) {
    const Sequence& q = seqs[row.seq];
    const Live& L = live_.at(q.request);
    if (row.decode) {
      toks_[t++] = L.cont[q.sample].last;
      sched_.add_fed_token(row.seq, toks_[t - 1]);
      continue;
    }
    std::memcpy(toks_.data() + t, L.req.prompt.data() + row.start, sizeof(int32_t) * row.len);
    t += row.len;
  }
  auto fb = sched_.forward_batch(b);
  runner_.forward(fb, toks_.data(), y_.data());

  // The logits of every row that reached its prompt's last position (a finished prompt: the first token
  // of each continuation) or decoded.
  const std::vector<size_t> pick_rows = gather_pick_rows(b, seqs, y_.data(), D_, head_);
  const int64_t M = static_cast<int64_t>(pick_rows.size());
  logits_.resize(static_cast<size_t>(M * V_));
  runner_.logits(head_.data(), M, logits_.data());
  const uint8_t* allowed = opt_.producible.empty() ? nullptr : opt_.producible.data();
  struct Pick {
    int64_t r;
    int32_t j;
    int32_t token;
    std::optional<sampling::TokenLogprob> lp;
  };
  std::vector<Pick> picks;
  // Requests whose sampler refused their logits row (a NaN from the model): they are aborted after the
  // step, alone; everyone else in the batch goes on.
  std::vector<int64_t> failed;
  auto has_failed = [&](int64_t r) { return std::find(failed.begin(), failed.end(), r) != failed.end(); };
  for (int64_t k = 0; k < M; ++k) {
    const auto& row = b.rows[pick_rows[k]];
    const Sequence& q = seqs[row.seq];
    if (has_failed(q.request)) continue;
    Live& L = live_.at(q.request);
    const float* lg = logits_.data() + k * V_;
    // A finished prompt gives every continuation its first token from the same row.
    const int32_t j0 = row.decode ? q.sample : 0;
    const int32_t j1 = row.decode ? q.sample + 1 : static_cast<int32_t>(L.cont.size());
    for (int32_t j = j0; j < j1; ++j) {
      Continuation& c = L.cont[j];
      Pick p{q.request, j, -1, std::nullopt};
      if (L.plain_greedy) {
        p.token = argmax_allowed(lg, V_, allowed);
      } else {
        scratch_.assign(lg, lg + V_);
        sampling::TokenLogprob lp;
        try {
          p.token = c.sampler->sample(scratch_, allowed, L.req.params.logprobs >= 0 ? &lp : nullptr);
        } catch (const std::invalid_argument&) {
          failed.push_back(q.request);
          break;
        }
        if (L.req.params.logprobs >= 0) p.lp = std::move(lp);
        c.sampler->accept(p.token);
      }
      if (p.token < 0) throw std::logic_error("engine: no producible id to pick");
      picks.push_back(std::move(p));
    }
  }

  StepEvents ev = sched_.complete(b);
  for (auto& p : picks) {
    if (has_failed(p.r)) continue;
    Live& L = live_.at(p.r);
    Continuation& c = L.cont[p.j];
    c.last = p.token;
    ++c.generated;
    ++totals_.generation_tokens;
    const auto& sp = L.req.params;
    const bool stop =
        (!sp.ignore_eos && is_stop_[p.token]) ||
        std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), p.token) != sp.stop_token_ids.end();
    const FinishReason f = stop                           ? FinishReason::kStop
                           : c.generated >= sp.max_tokens ? FinishReason::kLength
                                                          : FinishReason::kNone;
    emit(p.r, p.j, p.token, std::move(p.lp), f);
    if (f != FinishReason::kNone) {
      sched_.finish_now(sched_.seq_index(p.r, p.j), ev);  // no-op when the scheduler finished it (length)
      finish_continuation(p.r, p.j, f);
    }
  }
  for (const int64_t r : failed)
    if (live_.count(r)) abort_live(r);
  ++totals_.steps;
  totals_.prompt_tokens += b.prefill_tokens + b.cached_tokens;
  totals_.prompt_tokens_computed += b.prefill_tokens;
  totals_.cached_tokens += b.cached_tokens;
  publish_stats();
  deliver();
  return true;
}

void Engine::run(const std::atomic<bool>& stop) {
  while (!stop.load()) {
    if (step()) continue;
    std::unique_lock<std::mutex> lk(mu_);
    // The stop flag is not under the lock: the timeout bounds how late it is seen when idle.
    cv_.wait_for(lk, std::chrono::milliseconds(20),
                 [&] { return !inbox_.empty() || !aborts_.empty() || stop.load(); });
  }
  apply_inbox();
  std::vector<int64_t> left;
  for (const auto& [r, L] : live_) left.push_back(r);
  std::sort(left.begin(), left.end());
  for (const int64_t r : left) abort_live(r);
  publish_stats();
  deliver();
}

}  // namespace kda::serving
