#include "kda/serving/workload_driver.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "kda/common/seeded.h"

namespace kda::serving {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

ServeResult serve(ModelRunner& runner, const std::vector<RequestSpec>& requests, const ServeOptions& opt) {
  models::KimiLinearForCausalLM& model = runner.model();
  const int64_t D = model.hidden_size(), V = model.vocab_size();
  const int32_t n = opt.scheduler.parallel_samples;
  const int64_t R = static_cast<int64_t>(requests.size());
  // The workload as a scheduler would hold it (sessions, every request against the pools), checked before
  // any step; the engine's own scheduler then takes the requests as they arrive.
  Scheduler(requests, opt.scheduler, runner.pools().req_to_token_pool);
  opt.spec.validate();
  if (opt.spec.enabled())
    for (const auto& r : requests)
      if (!r.forced.empty() || opt.probe_decode)
        throw std::logic_error("speculative decoding with teacher-forced inputs or probe_decode");
  if (opt.spec.algorithm == SpecAlgorithm::kReplay &&
      (!opt.replay_truth || static_cast<int64_t>(opt.replay_truth->size()) != R * n))
    throw std::logic_error("replay drafting needs every sequence's tokens from a run without speculation");

  ServeResult res;
  res.hidden = D;
  res.outputs.resize(static_cast<size_t>(R * n));
  auto kept = [&](int64_t r) { return !opt.keep.empty() && opt.keep[r] != 0; };
  for (int64_t r = 0; r < R; ++r)
    for (int32_t j = 0; j < n; ++j) {
      SequenceOutput& out = res.outputs[static_cast<size_t>(r * n + j)];
      out.request_id = requests[r].id;
      out.sample = requests[r].sample_base + j;
      out.prompt_len = requests[r].prompt_len;
      // A kept sequence's rows, sized once for their most (a row per position) and written through before
      // the first step, so that the run appends into memory already resident: appended with vector growth
      // as its steps came, each kept request (a self-check sample, ~0.8 MB of rows each at the soak's
      // sizes) raised resident memory when it happened to run, late in a long run as early
      // (scripts/soak.sh).
      if (kept(r)) {
        out.rows.assign(static_cast<size_t>((int64_t{requests[r].prompt_len} + requests[r].output_len) * D),
                        0.0f);
        out.rows.clear();  // keeps the capacity
      }
    }

  // Prompt tokens per request: a first turn's when it arrives, a next turn's when its previous turn
  // finishes (the previous prompt, continuation 0's tokens, its own).
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(R));
  std::vector<int64_t> next_turn(static_cast<size_t>(R), -1);
  auto add_own_tokens = [&](int64_t r) {
    const RequestSpec& q = requests[r];
    auto& p = prompts[r];
    if (!q.prompt.empty()) {
      p.insert(p.end(), q.prompt.begin(), q.prompt.end());
    } else {
      for (int32_t pos = q.own_start(); pos < q.prompt_len; ++pos)
        p.push_back(seeded_token(opt.seed, TokenStream::kPrompt, q.id, pos, V));
    }
    if (static_cast<int64_t>(p.size()) != q.prompt_len)
      throw std::logic_error("request " + std::to_string(r) + ": its prompt has " + std::to_string(p.size()) +
                             " tokens, prompt_len says " + std::to_string(q.prompt_len));
  };
  // Arrivals in (step, workload index) order, as the scheduler orders a workload's: first turns now, a
  // next turn once its previous turn finished.
  std::set<std::pair<int64_t, int64_t>> due;
  for (int64_t r = 0; r < R; ++r) {
    if (requests[r].after >= 0)
      next_turn[requests[r].after] = r;
    else
      due.emplace(requests[r].arrival_step, r);
  }

  std::vector<std::vector<int32_t>> gen(static_cast<size_t>(R * n));
  std::unordered_map<int64_t, int64_t> by_id;  // engine request id -> workload index
  std::vector<int32_t> unfinished(static_cast<size_t>(R), n);
  std::vector<Clock::time_point> arrived_at(static_cast<size_t>(R));
  std::vector<uint8_t> got_first(static_cast<size_t>(R), 0);
  int64_t vstep = 0;  // the workload's clock: steps run, and the idle steps skipped to the next arrival
  int64_t completed = 0;

  ProgressInfo prog;
  prog.requests_total = R;
  for (const auto& r : requests) prog.tokens_total += r.prompt_len + int64_t{n} * r.output_len;

  EngineOptions eo;
  eo.scheduler = opt.scheduler;
  eo.spec = opt.spec;
  eo.admission_window_ms = 0.0;  // run() only; the driver steps the engine itself
  eo.hooks.probe_decode = opt.probe_decode;
  eo.hooks.agree_tokens = opt.agree_tokens;
  if (opt.spec.algorithm == SpecAlgorithm::kReplay)
    eo.hooks.drafter = [&](int64_t id, int32_t j, std::span<const int32_t> generated, int32_t depth) {
      const int64_t r = by_id.at(id);
      const auto& truth = (*opt.replay_truth)[static_cast<size_t>(r * n + j)];  // truth[k]: the k-th token
      const size_t from = std::min(generated.size(), truth.size());
      // Keyed by the request's id and sample, not its index: the same draws under --dp.
      const RequestSpec& q = requests[r];
      return replay_draft(std::span<const int32_t>(truth).subspan(from), depth, opt.spec.topk,
                          opt.spec.accept_rate, V, opt.seed, q.id * 4096 + q.sample_base + j,
                          static_cast<int64_t>(generated.size()));
    };
  eo.hooks.rows = [&](int64_t id, int32_t j, int32_t pos, const float* rows, int32_t count) {
    const int64_t r = by_id.at(id);
    // Prompt rows are every continuation's (the forks start from them); a prefix-cache hit's first row is
    // at its prefix length: the rows before were never computed.
    for (int32_t k = j < 0 ? 0 : j; k < (j < 0 ? n : j + 1); ++k) {
      SequenceOutput& out = res.outputs[static_cast<size_t>(r * n + k)];
      if (out.rows.empty()) out.rows_from = pos;
      out.rows.insert(out.rows.end(), rows, rows + int64_t{count} * D);
    }
  };
  eo.hooks.step = [&](const StepInfo& s) {
    ++vstep;
    ++res.steps;
    res.step_ms.push_back(s.seconds * 1e3);
    const bool decode =
        s.mode == model_executor::ForwardMode::DECODE || s.mode == model_executor::ForwardMode::TARGET_VERIFY;
    if (decode)
      ++res.decode_steps;
    else if (s.decode_tokens > 0)
      ++res.mixed_steps;
    else
      ++res.extend_steps;
    res.prefill_tokens += s.prefill_tokens + s.cached_tokens;
    res.prefill_tokens_computed += s.prefill_tokens;
    res.decode_tokens += s.decode_tokens;
    // Restored prompt tokens are done too; a verify row counts the tokens it emitted, not its drafts.
    prog.tokens_done += s.prefill_tokens + s.cached_tokens + s.decode_tokens;
    if (!opt.spec.enabled()) return;
    res.spec_depth_sum += s.depth_sum;
    res.spec_depth_rows += s.depth_rows;
    res.spec_draft_tokens += s.draft_tokens;
    if (s.mode != model_executor::ForwardMode::TARGET_VERIFY) return;
    ++res.spec_verify_steps;
    res.spec_verify_rows += s.verify_rows;
    res.spec_accepted_tokens += s.accepted_tokens;
    res.spec_emitted_tokens += s.decode_tokens;
  };
  Engine engine(runner, std::move(eo));
  engine.reserve_workspaces();

  auto on_finished = [&](int64_t r) {  // a finished turn: its next turn's prompt, due arrival_step steps on
    ++completed;
    const int64_t nt = next_turn[r];
    if (nt < 0) return;
    prompts[nt] = prompts[r];
    const auto& g = gen[static_cast<size_t>(r * n)];
    prompts[nt].insert(prompts[nt].end(), g.begin(), g.end());
    add_own_tokens(nt);
    due.emplace(vstep + requests[nt].arrival_step, nt);
  };
  const EventSink sink = [&](const TokenEvent& ev) {
    const int64_t r = by_id.at(ev.request);
    if (ev.token >= 0) gen[static_cast<size_t>(r * n + ev.index)].push_back(ev.token);
    res.outputs[static_cast<size_t>(r * n + ev.index)].cached_tokens = ev.cached_tokens;
    if (ev.token >= 0 && !got_first[r]) {  // the prompt's last position: the request's first token
      got_first[r] = 1;
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - arrived_at[r]).count();
      res.ttft_ms.push_back(ms);
      if (requests[r].after >= 0) res.ttft_later_turns_ms.push_back(ms);
    }
    if (ev.finish != FinishReason::kNone && --unfinished[r] == 0) on_finished(r);
  };
  auto submit = [&](int64_t r) {
    if (requests[r].after < 0) add_own_tokens(r);
    GenerateRequest g;
    g.prompt = prompts[r];
    g.params.temperature = 0.0f;
    g.params.max_tokens = requests[r].output_len + 1;
    g.n = n;
    g.forced = requests[r].forced;
    g.keep_rows = kept(r);
    arrived_at[r] = Clock::now();
    by_id[engine.submit(std::move(g), sink)] = r;
  };

  const auto t_start = Clock::now();
  for (;;) {
    bool stop = opt.stop && opt.stop->load();
    if (opt.agree_stop) stop = opt.agree_stop(stop);
    if (stop) {
      res.interrupted = true;
      break;
    }
    while (!due.empty() && due.begin()->first <= vstep) {
      const int64_t r = due.begin()->second;
      due.erase(due.begin());
      submit(r);
    }
    const int64_t steps_before = res.steps;
    if (!engine.step()) {
      // Idle: nothing runs before the next arrival (never the pool: a request needs no more slots than the
      // pool has, and with nothing running every slot is free).
      if (due.empty()) break;
      vstep = std::max(vstep, due.begin()->first);
      continue;
    }
    if (opt.progress && res.steps != steps_before) {
      prog.requests_done = completed;
      prog.steps = res.steps;
      prog.elapsed_s = seconds_since(t_start);
      opt.progress(prog);
    }
  }
  if (!res.interrupted && completed != R)
    throw std::logic_error("workload driver: " + std::to_string(R - completed) + " requests never finished");
  res.wall_s = seconds_since(t_start);
  res.spec_state_bytes = static_cast<int64_t>(runner.pools().recurrent_state_pool.spec_state_bytes());
  res.requests_completed = completed;
  const Scheduler& sched = engine.scheduler();
  res.peak_slots = sched.peak_slots();
  res.slot_reuses = sched.slot_reuses();
  res.peak_kv_tokens = sched.peak_kv_tokens();
  res.prefix_cache_hit_tokens = sched.cache_hit_tokens();
  if (const auto* c = opt.scheduler.cache) {
    res.prefix_cache_bytes = static_cast<int64_t>(c->bytes());
    res.prefix_cache_snapshots = c->snapshots();
    res.prefix_cache_evictions = c->evictions();
  }
  for (int64_t r = 0; r < R; ++r)
    for (int32_t j = 0; j < n; ++j) {
      SequenceOutput& out = res.outputs[static_cast<size_t>(r * n + j)];
      out.prompt = prompts[r];
      out.tokens = std::move(gen[static_cast<size_t>(r * n + j)]);
    }
  return res;
}

void agree_across_ranks(const distributed::TensorParallel& tp, ServeOptions& so) {
  if (tp.size <= 1) return;
  so.agree_stop = [comm = tp.comm](bool v) { return comm->allreduce_or(v); };
  // Token ids (< 2^24) are exact in fp32, so a sum with zeros from every other rank is a broadcast.
  so.agree_tokens = [comm = tp.comm, rank = tp.rank](std::vector<int32_t>& t) {
    std::vector<float> f(t.size(), 0.0f);
    if (rank == 0)
      for (size_t i = 0; i < t.size(); ++i) f[i] = static_cast<float>(t[i]);
    comm->allreduce_sum(f.data(), f.size());
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(f[i]);
  };
}

}  // namespace kda::serving
