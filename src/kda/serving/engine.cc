// The serving engine (engine.h): the scheduler over requests submitted while it runs.
#include "kda/serving/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

#include "kda/sampling/argmax.h"
#include "kda/sampling/spec_accept.h"
#include "kda/serving/spec_step.h"

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

// The scheduler's options for `opt`: each request brings its n; speculative decoding's verify rows hold
// drafts beyond the committed tokens (promised at admission: at least the caller's verify_extra_tokens, so
// that a driver's run without speculation can admit as its speculative run does) and are capped by the
// runner's verify buffer. Checks the speculative options and hooks against the runner first.
SchedulerOptions scheduler_options(const EngineOptions& opt, ModelRunner& runner) {
  SchedulerOptions so = opt.scheduler;
  so.parallel_samples = 1;
  const int32_t caller_extra = so.verify_extra_tokens;
  so.verify_extra_tokens = 0;
  if (caller_extra < 0)
    throw std::invalid_argument("scheduler.verify_extra_tokens: must be >= 0, got " +
                                std::to_string(caller_extra));
  const SpeculativeOptions& spec = opt.spec;
  spec.validate();
  const bool probe = opt.hooks.probe_decode;
  if (probe && spec.enabled())
    throw std::invalid_argument(
        "hooks.probe_decode: not with speculative decoding (it verifies placeholders)");
  if (opt.hooks.drafter && spec.algorithm != SpecAlgorithm::kReplay)
    throw std::invalid_argument("hooks.drafter: drafts replay's continuations; spec.algorithm is " +
                                std::string(to_string(spec.algorithm)));
  if (!spec.enabled() && !probe) return so;
  if (spec.algorithm == SpecAlgorithm::kReplay && !opt.hooks.drafter)
    throw std::invalid_argument(std::string("spec: ") + to_string(spec.algorithm) +
                                " drafting needs a known continuation, which online requests do not have; "
                                "use ngram");
  if (spec.enabled() && spec.algorithm != SpecAlgorithm::kNgram && spec.algorithm != SpecAlgorithm::kReplay)
    throw std::invalid_argument(std::string("spec: ") + to_string(spec.algorithm) +
                                " drafting is not one the engine runs; use ngram");
  const int32_t tokens = probe ? 2 : spec.max_verify_tokens();
  const auto& cfg = runner.pools().recurrent_state_pool.config();
  if (cfg.max_verify_tokens < tokens)
    throw std::invalid_argument("spec: verify rows of " + std::to_string(tokens) +
                                " tokens need a runner built with max_verify_tokens >= that (it has " +
                                std::to_string(cfg.max_verify_tokens) + ")");
  const int64_t rows = cfg.verify_rows > 0 ? cfg.verify_rows : cfg.size;
  so.max_batch = std::min(so.max_batch, rows);
  so.verify_extra_tokens = std::max(caller_extra, tokens - 1);
  return so;
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
      sched_({}, scheduler_options(opt_, runner), runner.pools().req_to_token_pool),
      cost_(opt_.spec.enabled() ? opt_.spec.draft_tokens : 0),
      seeds_(std::random_device{}()) {
  if (!opt_.producible.empty() && static_cast<int64_t>(opt_.producible.size()) != V_)
    throw std::invalid_argument("producible: " + std::to_string(opt_.producible.size()) +
                                " entries for a vocabulary of " + std::to_string(V_));
  if (!opt_.producible.empty() &&
      std::none_of(opt_.producible.begin(), opt_.producible.end(), [](uint8_t v) { return v != 0; }))
    throw std::invalid_argument("producible: no id is producible");
  if (!(opt_.admission_window_ms >= 0.0 && opt_.admission_window_ms <= 1000.0))  // NaN fails too
    throw std::invalid_argument("admission_window_ms: must be in [0, 1000] ms, got " +
                                std::to_string(opt_.admission_window_ms));
  if (opt_.max_context < 0)
    throw std::invalid_argument("max_context: must be >= 0, got " + std::to_string(opt_.max_context));
  verify_extra_ = scheduler_options(opt_, runner).verify_extra_tokens;
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
  const int32_t extra = verify_extra_;
  if (kv_tokens_ > 0 && kv_tokens_for(spec, req.n, extra) > kv_tokens_)
    throw std::invalid_argument("max_tokens: the prompt's " + std::to_string(spec.prompt_len) +
                                " tokens + max_tokens " + std::to_string(req.params.max_tokens) +
                                " per sample (n = " + std::to_string(req.n) + ") need " +
                                std::to_string(kv_tokens_for(spec, req.n, extra)) +
                                " MLA KV token slots but the pool holds " + std::to_string(kv_tokens_));
  if (!req.forced.empty()) {
    if (opt_.spec.enabled())
      throw std::invalid_argument("forced: teacher forcing is not for speculative decoding");
    if (static_cast<int32_t>(req.forced.size()) != req.n)
      throw std::invalid_argument("forced: " + std::to_string(req.forced.size()) +
                                  " lists for n = " + std::to_string(req.n));
    for (const auto& f : req.forced) {
      if (static_cast<int64_t>(f.size()) < int64_t{req.params.max_tokens} - 1)
        throw std::invalid_argument("forced: " + std::to_string(f.size()) + " ids for max_tokens " +
                                    std::to_string(req.params.max_tokens) + " (it needs max_tokens - 1)");
      for (const int32_t id : f)
        if (id < 0 || id >= V_)
          throw std::invalid_argument("forced: token id " + std::to_string(id) +
                                      " is outside the vocabulary of " + std::to_string(V_));
    }
  }
  if (req.keep_rows && !opt_.hooks.rows)
    throw std::invalid_argument("keep_rows: the engine has no hooks.rows to hand them to");
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
  const bool adaptive = opt_.spec.enabled() && opt_.spec.depth_mode == DraftDepthMode::kAdaptive &&
                        (s.req.params.greedy() || !s.req.params.seed);
  if (adaptive)
    for (auto& c : L.cont) c.depth.emplace(opt_.spec.draft_tokens);
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
    s.kv_tokens_used -= c->kv_tokens_held_alone();  // slots no request holds
  }
  std::lock_guard<std::mutex> lk(mu_);
  s.waiting += static_cast<int64_t>(inbox_.size());
  stats_ = s;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

FinishReason Engine::finish_of(const Live& L, int32_t token, int32_t generated) const {
  const auto& sp = L.req.params;
  const bool stop =
      (!sp.ignore_eos && is_stop_[token]) ||
      std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), token) != sp.stop_token_ids.end();
  return stop                         ? FinishReason::kStop
         : generated >= sp.max_tokens ? FinishReason::kLength
                                      : FinishReason::kNone;
}

void Engine::commit_picks(std::vector<Pick>& picks, const std::vector<int64_t>& failed, StepEvents& ev) {
  auto has_failed = [&](int64_t r) { return std::find(failed.begin(), failed.end(), r) != failed.end(); };
  for (auto& p : picks) {
    if (has_failed(p.r)) continue;
    Live& L = live_.at(p.r);
    Continuation& c = L.cont[p.j];
    c.last = p.token;
    ++c.generated;
    if (opt_.spec.enabled()) c.tokens.push_back(p.token);
    ++totals_.generation_tokens;
    const FinishReason f = finish_of(L, p.token, c.generated);
    emit(p.r, p.j, p.token, std::move(p.lp), f);
    if (f != FinishReason::kNone) {
      sched_.finish_now(sched_.seq_index(p.r, p.j), ev);  // no-op when the scheduler finished it (length)
      finish_continuation(p.r, p.j, f);
    }
  }
  for (const int64_t r : failed)
    if (live_.count(r)) abort_live(r);
}

void Engine::count_step(const ScheduledBatch& b, StepInfo info) {
  ++totals_.steps;
  totals_.prompt_tokens += b.prefill_tokens + b.cached_tokens;
  totals_.prompt_tokens_computed += b.prefill_tokens;
  totals_.cached_tokens += b.cached_tokens;
  info.prefill_tokens = b.prefill_tokens;
  info.cached_tokens = b.cached_tokens;
  info.decode_tokens = b.decode_tokens;
  if (opt_.hooks.step) opt_.hooks.step(info);
  publish_stats();
  deliver();
}

// Another rank's picks (hooks.agree_tokens) come from its own model: ranks built with different
// vocabularies are a launch error, caught here before the id reaches a stop-id table or the embedding.
void Engine::check_agreed() const {
  for (const int32_t t : agreed_)
    if (t < 0 || t >= V_)
      throw std::runtime_error("token id " + std::to_string(t) +
                               " agreed across ranks is outside the vocabulary [0, " + std::to_string(V_) +
                               ")");
}

int32_t Engine::next_input(const Live& L, int32_t j) const {
  const Continuation& c = L.cont[j];
  return L.req.forced.empty() ? c.last : L.req.forced[j][c.generated - 1];
}

void Engine::keep_rows(const ScheduledBatch& b, const float* y) const {
  if (!opt_.hooks.rows) return;
  const auto& seqs = sched_.sequences();
  int64_t t = 0;
  for (const auto& row : b.rows) {
    const Sequence& q = seqs[row.seq];
    const Live& L = live_.at(q.request);
    if (L.req.keep_rows) opt_.hooks.rows(L.id, row.decode ? q.sample : -1, row.start, y + t * D_, row.len);
    t += row.len;
  }
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
  StepInfo info;
  info.mode = b.mode;
  drafting_ = {};
  if ((opt_.spec.enabled() || opt_.hooks.probe_decode) && b.mode == model_executor::ForwardMode::DECODE &&
      draft(b)) {
    verify_step(b);
    return true;
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
      toks_[t++] = next_input(L, q.sample);
      sched_.add_fed_token(row.seq, toks_[t - 1]);
      continue;
    }
    std::memcpy(toks_.data() + t, L.req.prompt.data() + row.start, sizeof(int32_t) * row.len);
    t += row.len;
  }
  auto fb = sched_.forward_batch(b);
  const auto t0 = std::chrono::steady_clock::now();
  runner_.forward(fb, toks_.data(), y_.data());
  keep_rows(b, y_.data());

  // The logits of every row that reached its prompt's last position (a finished prompt: the first token
  // of each continuation) or decoded.
  const std::vector<size_t> pick_rows = gather_pick_rows(b, seqs, y_.data(), D_, head_);
  const int64_t M = static_cast<int64_t>(pick_rows.size());
  logits_.resize(static_cast<size_t>(M * V_));
  runner_.logits(head_.data(), M, logits_.data());
  const uint8_t* allowed = opt_.producible.empty() ? nullptr : opt_.producible.data();
  std::vector<Pick> picks;
  // Requests whose logits row was refused (a NaN from the model: by the sampler, or by the plain greedy
  // pick as the sampler would): they are aborted after the step, alone; everyone else in the batch goes
  // on.
  std::vector<int64_t> failed;
  auto has_failed = [&](int64_t r) { return std::find(failed.begin(), failed.end(), r) != failed.end(); };
  // The plain-greedy rows' picks first, the rows shared out over the threads.
  std::vector<const float*> greedy_rows;
  std::vector<int64_t> greedy_at(static_cast<size_t>(M), -1);
  for (int64_t k = 0; k < M; ++k)
    if (live_.at(seqs[b.rows[pick_rows[k]].seq].request).plain_greedy) {
      greedy_at[k] = static_cast<int64_t>(greedy_rows.size());
      greedy_rows.push_back(logits_.data() + k * V_);
    }
  std::vector<int32_t> greedy_ids(greedy_rows.size());
  std::vector<uint8_t> greedy_nan(greedy_rows.size());
  sampling::argmax_allowed_rows(greedy_rows.data(), static_cast<int64_t>(greedy_rows.size()), V_, allowed,
                                greedy_ids.data(), greedy_nan.data());
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
        p.token = greedy_ids[static_cast<size_t>(greedy_at[k])];
        if (greedy_nan[static_cast<size_t>(greedy_at[k])]) {  // a NaN row, refused as the sampler refuses it
          failed.push_back(q.request);
          break;
        }
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
      }
      if (p.token < 0) throw std::logic_error("engine: no producible id to pick");
      picks.push_back(std::move(p));
    }
  }
  std::erase_if(picks, [&](const Pick& p) { return has_failed(p.r); });
  if (opt_.hooks.agree_tokens) {  // every rank feeds rank 0's picks
    agreed_.clear();
    for (const Pick& p : picks) agreed_.push_back(p.token);
    opt_.hooks.agree_tokens(agreed_);
    check_agreed();
    for (size_t k = 0; k < picks.size(); ++k) picks[k].token = agreed_[k];
  }
  for (const Pick& p : picks)  // the next draw's penalties see the token
    if (auto& c = live_.at(p.r).cont[p.j]; c.sampler) c.sampler->accept(p.token);
  info.num_tokens = T;
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // A plain decode step (no drafts, or every depth 0): the cost model's baseline.
  if (opt_.spec.enabled() && b.mode == model_executor::ForwardMode::DECODE)
    cost_.record(0, static_cast<int64_t>(b.rows.size()), info.seconds);
  info.depth_rows = drafting_.rows;
  info.depth_sum = drafting_.depth_sum;
  info.draft_tokens = drafting_.drafted;
  StepEvents ev = sched_.complete(b);
  commit_picks(picks, failed, ev);
  count_step(b, info);
  return true;
}

bool Engine::draft(ScheduledBatch& b) {
  const auto& seqs = sched_.sequences();
  drafts_.clear();
  begin_verify(b);
  const bool probe = opt_.hooks.probe_decode;
  const auto rows = static_cast<int64_t>(b.rows.size());
  // Each row's depth first: under tensor parallelism every rank drafts rank 0's (an adaptive choice follows
  // the rank's own step times).
  agreed_.clear();
  for (const auto& row : b.rows) {
    const Sequence& q = seqs[row.seq];
    Continuation& c = live_.at(q.request).cont[q.sample];
    agreed_.push_back(probe ? 1 : c.depth ? c.depth->choose(cost_, rows) : opt_.spec.draft_tokens);
  }
  if (opt_.hooks.agree_tokens && !probe) opt_.hooks.agree_tokens(agreed_);
  for (size_t i = 0; i < b.rows.size(); ++i) {
    auto& row = b.rows[i];
    const Sequence& q = seqs[row.seq];
    Live& L = live_.at(q.request);
    Continuation& c = L.cont[q.sample];
    const int32_t depth = verify_depth(q, agreed_[i]);
    ++drafting_.rows;
    drafting_.depth_sum += depth;
    if (depth < 1) {
      drafts_.emplace_back();
    } else if (probe) {  // a placeholder the target's pick may or may not match
      drafts_.push_back(Draft{{static_cast<int32_t>((next_input(L, q.sample) + 1) % V_)}, {-1}});
    } else if (opt_.hooks.drafter) {
      drafts_.push_back(opt_.hooks.drafter(L.id, q.sample, c.tokens, depth));
    } else {
      history_.assign(L.req.prompt.begin(), L.req.prompt.end());
      history_.insert(history_.end(), c.tokens.begin(), c.tokens.end());
      drafts_.push_back(ngram_draft(history_, depth, opt_.spec.topk));
    }
    add_verify_row(b, row, drafts_.back());
    drafting_.drafted += drafts_.back().size();
  }
  if (!end_drafting(b, probe)) return false;
  totals_.spec_draft_tokens += probe ? 0 : drafting_.drafted;
  return true;
}

void Engine::verify_step(ScheduledBatch& b) {
  const auto& seqs = sched_.sequences();
  const int64_t T = b.num_tokens();
  y_.resize(static_cast<size_t>(T * D_));
  toks_.resize(static_cast<size_t>(T));
  verify_inputs(
      b, drafts_,
      [&](size_t i) {
        const Sequence& q = seqs[b.rows[i].seq];
        return next_input(live_.at(q.request), q.sample);
      },
      toks_.data());
  auto fb = sched_.forward_batch(b);
  const auto t0 = std::chrono::steady_clock::now();
  runner_.forward(fb, toks_.data(), y_.data());
  // Every row position's logits: a position is verified against its own distribution.
  logits_.resize(static_cast<size_t>(T * V_));
  runner_.logits(y_.data(), T, logits_.data());
  const uint8_t* allowed = opt_.producible.empty() ? nullptr : opt_.producible.data();
  // Under tensor parallelism, the greedy pick of every position is rank 0's.
  const bool agree = static_cast<bool>(opt_.hooks.agree_tokens);
  if (agree) {
    agreed_.resize(static_cast<size_t>(T));
    std::vector<const float*> rows(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) rows[t] = logits_.data() + t * V_;
    agreed_nan_.resize(static_cast<size_t>(T));
    sampling::argmax_allowed_rows(rows.data(), T, V_, allowed, agreed_.data(), agreed_nan_.data());
    opt_.hooks.agree_tokens(agreed_);
    check_agreed();
  }

  std::vector<Pick> picks;
  std::vector<int64_t> failed;
  std::vector<int32_t> accepted(b.rows.size(), 0), emitted(b.rows.size(), 1);
  std::vector<int32_t> children, child_pos, visited;
  int64_t t = 0, hits_total = 0;
  for (size_t i = 0; i < b.rows.size(); ++i) {
    const BatchRow& row = b.rows[i];
    const Sequence& q = seqs[row.seq];
    const Draft& d = drafts_[i];
    const int64_t row_t = t;
    t += row.len;
    Live& L = live_.at(q.request);
    Continuation& c = L.cont[q.sample];
    const bool logprobs = L.req.params.logprobs >= 0;
    const size_t first_pick = picks.size();
    // Walk the draft tree from the row's first position: each position emits one token; a token that
    // is one of the position's drafts moves on to that draft's position, any other ends the row.
    int32_t pos = 0, generated = c.generated, hits = 0;
    visited.clear();
    try {
      for (;;) {
        const float* lg = logits_.data() + (row_t + pos) * V_;
        children.clear();
        child_pos.clear();
        for (int32_t j = 0; j < d.size(); ++j)
          if (d.parents[j] == pos - 1) {
            children.push_back(d.tokens[j]);
            child_pos.push_back(j + 1);
          }
        Pick p{q.request, q.sample, -1, std::nullopt};
        int32_t next = -1;
        if (L.plain_greedy || L.req.params.greedy()) {  // greedy verification: the target's own pick
          if (L.plain_greedy) {
            bool nan = false;
            p.token = agree ? agreed_[row_t + pos] : sampling::argmax_allowed(lg, V_, allowed, &nan);
            if (agree ? agreed_nan_[row_t + pos] != 0 : nan)  // refused as the sampler refuses it
              throw std::invalid_argument("logits: NaN in a greedy row");
          } else {
            scratch_.assign(lg, lg + V_);
            sampling::TokenLogprob lp;
            p.token = c.sampler->sample(scratch_, allowed, logprobs ? &lp : nullptr);
            if (logprobs) p.lp = std::move(lp);
          }
          for (size_t k = 0; k < children.size(); ++k)
            if (children[k] == p.token) next = child_pos[k];
        } else {  // speculative sampling at the request's draw index for this position
          scratch_.assign(lg, lg + V_);
          c.sampler->distribution(scratch_, allowed, probs_);
          const auto res =
              sampling::spec_accept(probs_, children, {}, c.sampler->seed(), c.sampler->generated());
          p.token = res.token;
          if (res.sibling >= 0) next = child_pos[static_cast<size_t>(res.sibling)];
          if (logprobs) {
            sampling::TokenLogprob lp;
            c.sampler->logprob(std::span<const float>(lg, static_cast<size_t>(V_)), allowed, p.token, &lp);
            p.lp = std::move(lp);
          }
        }
        if (p.token < 0) throw std::logic_error("engine: no producible id to pick");
        if (c.sampler) c.sampler->accept(p.token);  // the next position's penalties and draw index see it
        ++generated;
        accepted[i] = pos;
        emitted[i] = static_cast<int32_t>(picks.size() - first_pick) + 1;
        visited.push_back(pos);
        hits += next >= 0;
        const bool ends = finish_of(L, p.token, generated) != FinishReason::kNone;
        picks.push_back(std::move(p));
        if (ends || next < 0) break;  // a stop or max_tokens cuts the accepted path here
        pos = next;
      }
    } catch (const std::invalid_argument&) {  // a NaN row: the request is aborted after the step, alone
      picks.resize(first_pick);
      accepted[i] = 0;
      emitted[i] = 1;
      hits = 0;
      visited.clear();
      failed.push_back(q.request);
    }
    // The rows of the inputs the row committed: its first token's, then each accepted draft's.
    if (L.req.keep_rows && opt_.hooks.rows)
      for (size_t k = 0; k < visited.size(); ++k)
        opt_.hooks.rows(L.id, q.sample, row.start + static_cast<int32_t>(k),
                        y_.data() + (row_t + visited[k]) * D_, 1);
    hits_total += hits;
    if (c.depth) c.depth->observe(draft_depth(d), hits);
  }
  // Each slot moves to the state after its last emitted token's input; the rest of the row leaves no
  // trace (KDA states, MLA token slots).
  runner_.accept(fb, accepted);
  int32_t step_depth = 0;
  for (const Draft& d : drafts_) step_depth = std::max(step_depth, draft_depth(d));
  StepInfo info;
  info.mode = model_executor::ForwardMode::TARGET_VERIFY;
  info.num_tokens = T;
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  info.verify_rows = static_cast<int64_t>(b.rows.size());
  info.depth_rows = drafting_.rows;
  info.depth_sum = drafting_.depth_sum;
  const bool probe = opt_.hooks.probe_decode;
  info.draft_tokens = probe ? 0 : drafting_.drafted;
  info.accepted_tokens = probe ? 0 : hits_total;
  if (!probe) totals_.spec_accepted_tokens += hits_total;
  if (opt_.spec.enabled()) cost_.record(step_depth, static_cast<int64_t>(b.rows.size()), info.seconds);
  for (size_t i = 0, k = 0; i < b.rows.size(); ++i) {  // the committed inputs (the prefix cache's key)
    const Sequence& q = seqs[b.rows[i].seq];
    sched_.add_fed_token(b.rows[i].seq, next_input(live_.at(q.request), q.sample));
    for (; k < picks.size() && picks[k].r == q.request && picks[k].j == q.sample; ++k)
      if (k + 1 < picks.size() && picks[k + 1].r == q.request && picks[k + 1].j == q.sample)
        sched_.add_fed_token(b.rows[i].seq, picks[k].token);
  }
  commit_verify_rows(b, emitted);
  StepEvents ev = sched_.complete(b);
  commit_picks(picks, failed, ev);
  count_step(b, info);
}

bool Engine::first_step_full() const {
  int64_t seqs = 0, tokens = 0;
  for (const auto& s : inbox_) {
    seqs += s.req.n;
    tokens += static_cast<int64_t>(s.req.prompt.size());
  }
  return seqs >= std::min(opt_.scheduler.max_batch, slots_) || tokens >= opt_.scheduler.token_budget;
}

void Engine::await_burst(std::unique_lock<std::mutex>& lk, const std::atomic<bool>& stop) {
  if (opt_.admission_window_ms <= 0.0 || first_step_full() || !aborts_.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const auto window = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double, std::milli>(opt_.admission_window_ms));
  // The window restarts at every arrival, up to kAdmissionWindows windows in all: a burst whose requests
  // come less than a window apart (a loaded host parses and tokenizes 16 of them over more than one
  // window) starts as one step, and a lone request still waits one window.
  const auto last = t0 + kAdmissionWindows * window;
  auto deadline = t0 + window;
  // submit() and abort() notify; the stop flag is seen by the deadline at the latest.
  while (!first_step_full() && aborts_.empty() && !stop.load()) {
    const size_t n = inbox_.size();
    if (!cv_.wait_until(lk, deadline, [&] { return inbox_.size() != n || !aborts_.empty() || stop.load(); }))
      break;
    deadline = std::min(last, std::chrono::steady_clock::now() + window);
  }
  ++totals_.admission_waits;  // totals_ is the engine thread's; the next step publishes it
  totals_.admission_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::reserve_workspaces() {
  const int64_t T = opt_.scheduler.token_budget;
  runner_.reserve(T);
  if (y_.size() < static_cast<size_t>(T * D_)) y_.resize(static_cast<size_t>(T * D_));
  if (toks_.size() < static_cast<size_t>(T)) toks_.resize(static_cast<size_t>(T));
}

void Engine::run(const std::atomic<bool>& stop) {
  while (!stop.load()) {
    if (live_.empty()) {
      // Idle: nothing runs or waits, and only an arrival (or an abort, or stop) can change that. The wait
      // comes before the step, so that the first arrival always meets the admission window, the first
      // after run() starts included.
      std::unique_lock<std::mutex> lk(mu_);
      while (inbox_.empty() && aborts_.empty() && !stop.load())
        cv_.wait_for(lk, std::chrono::milliseconds(20));  // the stop flag is not under the lock: seen by then
      if (!inbox_.empty()) await_burst(lk, stop);
      if (stop.load()) break;
    }
    step();
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
