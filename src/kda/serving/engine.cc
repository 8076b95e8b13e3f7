#include "kda/serving/engine.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kda/common/seeded.h"
#include "kda/serving/draft_depth.h"
#include "kda/serving/spec_step.h"

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
  Scheduler sched(requests, opt.scheduler, runner.pools().req_to_token_pool);
  const int32_t n = sched.parallel_samples();
  const auto& seqs = sched.sequences();
  const int64_t S = static_cast<int64_t>(seqs.size());
  const int64_t R = static_cast<int64_t>(requests.size());

  ServeResult res;
  res.hidden = D;
  res.outputs.resize(static_cast<size_t>(S));
  auto kept = [&](int64_t s) { return !opt.keep.empty() && opt.keep[seqs[s].request]; };
  for (int64_t s = 0; s < S; ++s) {
    const RequestSpec& r = requests[seqs[s].request];
    res.outputs[s].request_id = r.id;
    res.outputs[s].sample = r.sample_base + seqs[s].sample;
    res.outputs[s].prompt_len = r.prompt_len;
    // A kept sequence's rows, sized once for their most (a row per position) and written through before
    // the first step, so that the loop appends into memory already resident: appended with vector growth
    // as its steps came, each kept request (a self-check sample, ~0.8 MB of rows each at the soak's sizes)
    // raised resident memory when it happened to run, late in a long run as early (scripts/soak.sh).
    if (kept(s)) {
      auto& rows = res.outputs[s].rows;
      rows.assign(static_cast<size_t>((int64_t{r.prompt_len} + r.output_len) * D), 0.0f);
      rows.clear();  // keeps the capacity
    }
  }

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

  std::vector<float> y, head;
  std::vector<int32_t> toks, picks, accepted, emitted;
  std::vector<size_t> pick_rows;
  // Speculative decoding: each verify row's drafts and verdict.
  opt.spec.validate();
  if (opt.spec.enabled())
    for (const auto& r : requests)
      if (!r.forced.empty() || opt.probe_decode)
        throw std::logic_error("speculative decoding with teacher-forced inputs or probe_decode");
  if (opt.spec.algorithm == SpecAlgorithm::kReplay &&
      (!opt.replay_truth || static_cast<int64_t>(opt.replay_truth->size()) != S))
    throw std::logic_error("replay drafting needs every sequence's tokens from a run without speculation");
  std::vector<Draft> drafts;
  std::vector<Verdict> verdicts;
  std::vector<int32_t> history, depths;
  // Adaptive depth: one cost model for the loop (its decode and verify steps' times), one controller per
  // sequence (its acceptance).
  const bool adaptive = opt.spec.enabled() && opt.spec.depth_mode == DraftDepthMode::kAdaptive;
  VerifyCostModel cost(opt.spec.enabled() ? opt.spec.draft_tokens : 0);
  std::vector<DraftDepthController> depth_ctl;
  if (adaptive) depth_ctl.assign(static_cast<size_t>(S), DraftDepthController(opt.spec.draft_tokens));
  int32_t step_depth = 0;  // the step's deepest draft (0: a plain decode step)
  auto propose = [&](int64_t s, int32_t depth) {
    if (depth < 1) return Draft{};
    const auto& g = gen[s];
    if (!opt.spec.enabled())  // probe_decode: one placeholder draft
      return Draft{{static_cast<int32_t>((g.back() + 1) % V)}, {-1}};
    if (opt.spec.algorithm == SpecAlgorithm::kNgram) {
      const auto& p = prompts[seqs[s].request];
      history.assign(p.begin(), p.end());
      history.insert(history.end(), g.begin(), g.end());
      return ngram_draft(history, depth, opt.spec.topk);
    }
    const auto& truth = (*opt.replay_truth)[s];  // truth[k]: the token generated k-th
    const size_t from = std::min(g.size(), truth.size());
    // Keyed by the request's id and sample, not the sequence index: the same draws under --dp.
    const RequestSpec& r = requests[seqs[s].request];
    return replay_draft(std::span<const int32_t>(truth).subspan(from), depth, opt.spec.topk,
                        opt.spec.accept_rate, V, opt.seed, r.id * 4096 + r.sample_base + seqs[s].sample,
                        static_cast<int64_t>(g.size()));
  };
  const auto t_start = Clock::now();
  while (!sched.done()) {
    bool stop = opt.stop && opt.stop->load();
    if (opt.agree_stop) stop = opt.agree_stop(stop);
    if (stop) {
      res.interrupted = true;
      break;
    }
    ScheduledBatch b = sched.schedule();
    const auto now = Clock::now();
    for (const int64_t r : b.arrived) arrived_at[r] = now;
    if (b.empty()) {
      // Nothing can run before the next arrival (the pool cannot be what blocks: a request never
      // needs more slots than the pool has, and with nothing running every slot is free).
      if (!sched.skip_to_next_arrival())
        throw std::logic_error("scheduler: requests left but nothing to run and nothing to arrive");
      continue;
    }
    // Speculative decoding: each decode row becomes its token + drafts (never past the sequence's end).
    bool verify = (opt.spec.enabled() || opt.probe_decode) && b.mode == model_executor::ForwardMode::DECODE;
    drafts.clear();
    step_depth = 0;
    if (verify) {
      begin_verify(b);
      depths.assign(b.rows.size(), opt.spec.draft_tokens);
      if (adaptive) {
        const auto rows = static_cast<int64_t>(b.rows.size());
        for (size_t i = 0; i < b.rows.size(); ++i) depths[i] = depth_ctl[b.rows[i].seq].choose(cost, rows);
        // The choices follow each rank's own step times: under TP every rank drafts rank 0's depths.
        if (opt.agree_tokens) opt.agree_tokens(depths);
      }
      for (size_t i = 0; i < b.rows.size(); ++i) {
        auto& row = b.rows[i];
        const Sequence& q = seqs[row.seq];
        const int32_t depth = verify_depth(q, depths[i]);
        res.spec_depth_sum += depth;
        ++res.spec_depth_rows;
        drafts.push_back(propose(row.seq, depth));
        const Draft& d = drafts.back();
        step_depth = std::max(step_depth, draft_depth(d));
        add_verify_row(b, row, d);
        res.spec_draft_tokens += d.size();
      }
      // No row has a draft (ngram found no match): a plain DECODE step, without the verify path's
      // kept inputs and accept replay.
      verify = end_drafting(b, opt.probe_decode);
    }
    const int64_t T = b.num_tokens();
    y.resize(static_cast<size_t>(T * D));
    toks.resize(static_cast<size_t>(T));
    int64_t t = 0;
    if (verify) {  // the last generated token, then the drafts (fed tokens are noted once accepted)
      verify_inputs(
          b, drafts,
          [&](size_t i) { return fed(b.rows[i].seq, b.rows[i].start - seqs[b.rows[i].seq].prompt_len); },
          toks.data());
    } else {
      for (const auto& row : b.rows) {
        const Sequence& q = seqs[row.seq];
        for (int32_t k = 0; k < row.len; ++k, ++t) {
          const int32_t pos = row.start + k;
          toks[t] = pos < q.prompt_len ? prompts[q.request][pos] : fed(row.seq, pos - q.prompt_len);
          if (pos >= q.prompt_len) sched.add_fed_token(row.seq, toks[t]);
        }
      }
    }
    auto fb = sched.forward_batch(b);
    const auto t0 = Clock::now();
    runner.forward(fb, toks.data(), y.data());
    if (verify) {
      // The target's argmax at every row position, greedy verification, then each slot moves to the
      // state after its accepted tokens (no layer pass). Under TP the picks are rank 0's, so every rank
      // accepts the same.
      picks.resize(static_cast<size_t>(T));
      runner.next_tokens(y.data(), T, picks.data());
      if (opt.agree_tokens) opt.agree_tokens(picks);
      accepted.clear();
      verdicts.clear();
      t = 0;
      for (size_t i = 0; i < b.rows.size(); ++i) {
        verdicts.push_back(greedy_verify(
            drafts[i], std::span<const int32_t>(picks.data() + t, static_cast<size_t>(b.rows[i].len))));
        accepted.push_back(verdicts.back().last);
        if (adaptive)
          depth_ctl[b.rows[i].seq].observe(draft_depth(drafts[i]),
                                           static_cast<int32_t>(verdicts.back().path.size()));
        t += b.rows[i].len;
      }
      runner.accept(fb, accepted);
      const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
      res.step_ms.push_back(step_s * 1e3);
      if (adaptive) cost.record(step_depth, static_cast<int64_t>(b.rows.size()), step_s);
      emitted.clear();
      t = 0;
      for (size_t i = 0; i < b.rows.size(); ++i) {
        auto& row = b.rows[i];
        const Verdict& v = verdicts[i];
        const Draft& d = drafts[i];
        sched.add_fed_token(row.seq, toks[t]);  // the committed inputs: the row's token, accepted drafts
        for (const int32_t p : v.path) {
          gen[row.seq].push_back(d.tokens[p - 1]);
          sched.add_fed_token(row.seq, d.tokens[p - 1]);
        }
        gen[row.seq].push_back(v.next_token);
        if (kept(row.seq)) {  // the accepted path's rows: position 0, then each accepted draft's
          auto& rows = res.outputs[row.seq].rows;
          const float* out = y.data() + t * D;
          rows.insert(rows.end(), out, out + D);
          for (const int32_t p : v.path) rows.insert(rows.end(), out + p * D, out + (p + 1) * D);
        }
        t += row.len;
        emitted.push_back(1 + static_cast<int32_t>(v.path.size()));
        res.spec_accepted_tokens += static_cast<int64_t>(v.path.size());
      }
      // From here on row lengths and decode_tokens count the tokens the step emitted (what complete()
      // advances the sequences by, and what plain decode steps count).
      commit_verify_rows(b, emitted);
      res.spec_emitted_tokens += b.decode_tokens;
      ++res.spec_verify_steps;
      res.spec_verify_rows += static_cast<int64_t>(b.rows.size());
    } else {
      // The next token of every row that reached the prompt's last position (a finished prompt or a
      // decode): final norm, LM head and argmax on its last output row.
      pick_rows = gather_pick_rows(b, seqs, y.data(), D, head);
      picks.resize(pick_rows.size());
      runner.next_tokens(head.data(), static_cast<int64_t>(pick_rows.size()), picks.data());
      if (opt.agree_tokens) opt.agree_tokens(picks);
      const auto t_picked = Clock::now();
      const double step_s = std::chrono::duration<double>(t_picked - t0).count();
      res.step_ms.push_back(step_s * 1e3);
      // A plain decode step (speculation chose depth 0 or found no drafts): the cost model's baseline.
      if (adaptive && b.mode == model_executor::ForwardMode::DECODE)
        cost.record(0, static_cast<int64_t>(b.rows.size()), step_s);
      for (size_t k = 0; k < pick_rows.size(); ++k) {
        const auto& row = b.rows[pick_rows[k]];
        gen[row.seq].push_back(picks[k]);
        if (!row.decode) {  // the prompt's last position: the request's first token
          const int64_t r = seqs[row.seq].request;
          const double ms = std::chrono::duration<double, std::milli>(t_picked - arrived_at[r]).count();
          res.ttft_ms.push_back(ms);
          if (requests[r].after >= 0) res.ttft_later_turns_ms.push_back(ms);
        }
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
    }
    const StepEvents ev = sched.complete(b);
    for (const auto& [parent, child] : ev.forks) {  // a fork starts from its parent's prompt
      gen[child] = gen[parent];
      if (adaptive) depth_ctl[child] = depth_ctl[parent];
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
    if (b.mode == model_executor::ForwardMode::DECODE || verify)
      ++res.decode_steps;
    else if (b.decode_tokens > 0)
      ++res.mixed_steps;
    else
      ++res.extend_steps;
    res.prefill_tokens += b.prefill_tokens + b.cached_tokens;
    res.prefill_tokens_computed += b.prefill_tokens;
    res.decode_tokens += b.decode_tokens;
    if (opt.progress) {
      prog.tokens_done +=
          b.num_tokens() + b.cached_tokens;  // restored prompt tokens are done too (prefix cache)
      prog.requests_done = sched.finished_requests();
      prog.steps = res.steps;
      prog.elapsed_s = seconds_since(t_start);
      opt.progress(prog);
    }
  }
  res.wall_s = seconds_since(t_start);
  res.spec_state_bytes = static_cast<int64_t>(runner.pools().recurrent_state_pool.spec_state_bytes());
  res.requests_completed = sched.finished_requests();
  res.peak_slots = sched.peak_slots();
  res.slot_reuses = sched.slot_reuses();
  res.peak_kv_tokens = sched.peak_kv_tokens();
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
