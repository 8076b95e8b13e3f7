#include "kda/serving/engine.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "kda/serving/inputs.h"

namespace kda::serving {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
}  // namespace

ServeResult serve(ModelRunner& runner, const std::vector<RequestSpec>& requests, const ServeOptions& opt) {
  const int64_t D = runner.stack().hidden_size();
  Scheduler sched(requests, opt.scheduler, runner.pools().req_to_token_pool);
  const int32_t n = sched.parallel_samples();
  const auto& seqs = sched.sequences();
  const int64_t S = static_cast<int64_t>(seqs.size());

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
  // Each sequence's latest output row: the next decode input is derived from it.
  std::vector<float> last(static_cast<size_t>(S * D), 0.0f);

  ProgressInfo prog;
  prog.requests_total = static_cast<int64_t>(requests.size());
  for (const auto& r : requests) prog.tokens_total += r.prompt_len + int64_t{n} * r.output_len;

  std::vector<float> x, y;
  const auto t_start = Clock::now();
  while (!sched.done()) {
    bool stop = opt.stop && opt.stop->load();
    if (opt.agree_stop) stop = opt.agree_stop(stop);
    if (stop) {
      res.interrupted = true;
      break;
    }
    const ScheduledBatch b = sched.schedule();
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
    int64_t t = 0;
    for (const auto& row : b.rows) {
      const Sequence& q = seqs[row.seq];
      const RequestSpec& r = requests[q.request];
      for (int32_t i = 0; i < row.len; ++i, ++t) {
        const int64_t pos = row.start + i;
        float* xp = x.data() + t * D;
        if (pos < q.prompt_len)
          prompt_input(opt.seed, r.id, pos, D, xp);
        else
          decode_input(opt.seed, r.id, pos, r.sample_base + q.sample, last.data() + row.seq * D, D, xp);
      }
    }
    auto fb = sched.forward_batch(b);
    const auto t0 = Clock::now();
    runner.forward(fb, x.data(), y.data());
    res.step_ms.push_back(seconds_since(t0) * 1e3);

    t = 0;
    for (const auto& row : b.rows) {
      const float* out = y.data() + t * D;
      std::memcpy(last.data() + row.seq * D, out + (row.len - 1) * D, sizeof(float) * D);
      if (kept(row.seq))
        res.outputs[row.seq].rows.insert(res.outputs[row.seq].rows.end(), out, out + row.len * D);
      t += row.len;
    }
    const StepEvents ev = sched.complete(b);
    for (const auto& [parent, child] : ev.forks) {  // a fork starts from its parent's prompt
      std::memcpy(last.data() + child * D, last.data() + parent * D, sizeof(float) * D);
      if (kept(child)) res.outputs[child].rows = res.outputs[parent].rows;
    }

    ++res.steps;
    if (b.mode == model_executor::ForwardMode::DECODE)
      ++res.decode_steps;
    else if (b.decode_tokens > 0)
      ++res.mixed_steps;
    else
      ++res.extend_steps;
    res.prefill_tokens += b.prefill_tokens;
    res.decode_tokens += b.decode_tokens;
    if (opt.progress) {
      prog.tokens_done += T;
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
  return res;
}

}  // namespace kda::serving
