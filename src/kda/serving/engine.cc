#include "kda/serving/engine.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kda/serving/inputs.h"

namespace kda::serving {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

ServeResult serve(ModelRunner& runner, const std::vector<RequestSpec>& requests, const ServeOptions& opt) {
  KdaStack& stack = runner.stack();
  const int64_t D = stack.hidden_size(), V = stack.vocab_size();
  Scheduler sched(requests, opt.scheduler, runner.pools().req_to_token_pool);
  const int32_t n = sched.parallel_samples();
  const auto& seqs = sched.sequences();
  const int64_t S = static_cast<int64_t>(seqs.size());
  const int64_t R = static_cast<int64_t>(requests.size());

  ServeResult res;
  res.hidden = D;
  res.outputs.resize(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    const RequestSpec& r = requests[seqs[s].request];
    res.outputs[s].request_id = r.id;
    res.outputs[s].sample = r.sample_base + seqs[s].sample;
    res.outputs[s].prompt_len = r.prompt_len;
  }
  auto kept = [&](int64_t s) { return !opt.keep.empty() && opt.keep[seqs[s].request]; };

  // Prompt tokens per request: a first turn's now, a next turn's when its previous turn finishes.
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
    sched.set_prompt(r, p);  // the prefix cache matches and keys snapshots by it
  };
  for (int64_t r = 0; r < R; ++r) {
    if (requests[r].after >= 0)
      next_turn[requests[r].after] = r;
    else
      add_own_tokens(r);
  }
  // Per sequence: its greedy picks (output_len + 1 when finished), and the token decode step k feeds.
  std::vector<std::vector<int32_t>> gen(static_cast<size_t>(S));
  auto fed = [&](int64_t s, int32_t k) {
    const auto& forced = requests[seqs[s].request].forced;
    const auto& src = forced.empty() ? gen[s] : forced[seqs[s].sample];
    if (k >= static_cast<int32_t>(src.size())) throw std::logic_error("decode input before its token");
    return src[k];
  };
  std::vector<Clock::time_point> arrived_at(static_cast<size_t>(R));

  ProgressInfo prog;
  prog.requests_total = R;
  for (const auto& r : requests) prog.tokens_total += r.prompt_len + int64_t{n} * r.output_len;

  std::vector<float> x, y, head;
  std::vector<int32_t> toks, picks;
  std::vector<size_t> pick_rows;
  const auto t_start = Clock::now();
  while (!sched.done()) {
    bool stop = opt.stop && opt.stop->load();
    if (opt.agree_stop) stop = opt.agree_stop(stop);
    if (stop) {
      res.interrupted = true;
      break;
    }
    const ScheduledBatch b = sched.schedule();
    const auto now = Clock::now();
    for (const int64_t r : b.arrived) arrived_at[r] = now;
    if (b.empty()) {
      // Nothing can run before the next arrival (the pool cannot be what blocks: a request never
      // needs more slots than the pool has, and with nothing running every slot is free).
      if (!sched.skip_to_next_arrival())
        throw std::logic_error("scheduler: requests left but nothing to run and nothing to arrive");
      continue;
    }
    const int64_t T = b.num_tokens();
    x.resize(static_cast<size_t>(T * D));
    y.resize(static_cast<size_t>(T * D));
    toks.resize(static_cast<size_t>(T));
    int64_t t = 0;
    for (const auto& row : b.rows) {
      const Sequence& q = seqs[row.seq];
      for (int32_t i = 0; i < row.len; ++i, ++t) {
        const int32_t pos = row.start + i;
        toks[t] = pos < q.prompt_len ? prompts[q.request][pos] : fed(row.seq, pos - q.prompt_len);
        if (pos >= q.prompt_len) sched.add_fed_token(row.seq, toks[t]);
      }
    }
    stack.embed(toks.data(), T, x.data());
    auto fb = sched.forward_batch(b);
    const auto t0 = Clock::now();
    runner.forward(fb, x.data(), y.data());
    // The next token of every row that reached the prompt's last position (a finished prompt or a
    // decode): final norm, LM head and argmax on its last output row.
    pick_rows.clear();
    head.clear();
    t = 0;
    for (size_t i = 0; i < b.rows.size(); ++i) {
      const auto& row = b.rows[i];
      t += row.len;
      if (row.start + row.len < seqs[row.seq].prompt_len) continue;
      pick_rows.push_back(i);
      head.insert(head.end(), y.data() + (t - 1) * D, y.data() + t * D);
    }
    picks.resize(pick_rows.size());
    stack.next_tokens(head.data(), static_cast<int64_t>(pick_rows.size()), picks.data());
    if (opt.agree_tokens) opt.agree_tokens(picks);
    const auto t_picked = Clock::now();
    res.step_ms.push_back(std::chrono::duration<double, std::milli>(t_picked - t0).count());
    for (size_t k = 0; k < pick_rows.size(); ++k) {
      const auto& row = b.rows[pick_rows[k]];
      gen[row.seq].push_back(picks[k]);
      if (!row.decode)  // the prompt's last position: the request's first token
        res.ttft_ms.push_back(
            std::chrono::duration<double, std::milli>(t_picked - arrived_at[seqs[row.seq].request]).count());
    }

    t = 0;
    for (const auto& row : b.rows) {
      const float* out = y.data() + t * D;
      // A prefix-cache hit's first row is at its prefix_len: the rows before were never computed.
      if (kept(row.seq) && res.outputs[row.seq].rows.empty()) res.outputs[row.seq].rows_from = row.start;
      if (kept(row.seq))
        res.outputs[row.seq].rows.insert(res.outputs[row.seq].rows.end(), out, out + row.len * D);
      t += row.len;
    }
    const StepEvents ev = sched.complete(b);
    for (const auto& [parent, child] : ev.forks) {  // a fork starts from its parent's prompt
      gen[child] = gen[parent];
      if (kept(child)) {
        res.outputs[child].rows = res.outputs[parent].rows;
        res.outputs[child].rows_from = res.outputs[parent].rows_from;
      }
    }
    for (const int64_t r : ev.finished_requests) {  // a finished turn: its next turn's prompt
      const int64_t nt = next_turn[r];
      if (nt < 0) continue;
      prompts[nt] = prompts[r];
      const auto& g = gen[sched.seq_index(r, 0)];
      prompts[nt].insert(prompts[nt].end(), g.begin(), g.end());
      add_own_tokens(nt);
    }

    ++res.steps;
    if (b.mode == model_executor::ForwardMode::DECODE)
      ++res.decode_steps;
    else if (b.decode_tokens > 0)
      ++res.mixed_steps;
    else
      ++res.extend_steps;
    res.prefill_tokens += b.prefill_tokens + b.cached_tokens;
    res.prefill_tokens_computed += b.prefill_tokens;
    res.decode_tokens += b.decode_tokens;
    if (opt.progress) {
      prog.tokens_done += T + b.cached_tokens;  // restored prompt tokens are done too (prefix cache)
      prog.requests_done = sched.finished_requests();
      prog.steps = res.steps;
      prog.elapsed_s = seconds_since(t_start);
      opt.progress(prog);
    }
  }
  res.wall_s = seconds_since(t_start);
  res.requests_completed = sched.finished_requests();
  res.peak_slots = sched.peak_slots();
  res.slot_reuses = sched.slot_reuses();
  res.prefix_cache_hit_tokens = sched.cache_hit_tokens();
  if (const auto* c = opt.scheduler.cache) {
    res.prefix_cache_bytes = static_cast<int64_t>(c->bytes());
    res.prefix_cache_snapshots = c->snapshots();
    res.prefix_cache_evictions = c->evictions();
  }
  for (int64_t s = 0; s < S; ++s) {
    res.outputs[s].prompt = prompts[seqs[s].request];
    res.outputs[s].tokens = std::move(gen[s]);
  }
  return res;
}

}  // namespace kda::serving
