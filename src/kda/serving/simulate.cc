#include "kda/serving/simulate.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kda/mem_cache/radix_cache.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/serving/data_parallel.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/self_check.h"
#include "kda/serving/simulate_plan.h"
#include "kda/serving/simulate_report.h"

namespace kda::serving {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Resident set size from /proc/self/statm (0 where there is none).
int64_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long long total = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &total, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

// The prefix cache of one serving pass over `runner`'s pool (none when the plan has it off); `cache`
// must outlive the pass and go before the runner. On a model with MLA layers it holds the cached tokens'
// KV rows of the runner's KV pool too.
void attach_cache(const Plan& p, ModelRunner& runner, ServeOptions& so,
                  std::optional<mem_cache::RadixCache>& cache) {
  if (!p.cache) return;
  cache.emplace(runner.pools().recurrent_state_pool, static_cast<size_t>(p.cache_budget),
                runner.pools().token_to_kv_pool.get());
  so.scheduler.cache = &*cache;
}

// After a completed pass: every state slot is a request's or a snapshot's, every request index and MLA
// KV token slot is back, and the cache's tree is consistent with nothing pending or locked. The first
// inconsistency is named.
void account(ModelRunner& runner, const mem_cache::RadixCache* cache, SimulateResult& res) {
  auto& pools = runner.pools();
  const int64_t snapshots = cache ? cache->snapshots() : 0;
  res.leaked_slots = pools.recurrent_state_pool.size() - pools.recurrent_state_pool.available() - snapshots;
  res.leaked_request_indices = pools.req_to_token_pool.size() - pools.req_to_token_pool.available();
  // The cache's tree holds the KV slots of its tokens (one reference each); every other one must be back.
  if (const auto* kv = pools.token_to_kv_pool.get())
    res.leaked_kv_tokens = kv->size() - kv->available() - (cache ? cache->kv_tokens() : 0);
  if (cache) {
    try {
      cache->check_invariants();
    } catch (const std::exception& e) {
      res.cache_consistent = false;
      res.accounting_error = std::string("prefix cache: ") + e.what();
    }
    if (res.cache_consistent &&
        (cache->pending_snapshots() != 0 || cache->evictable_snapshots() != snapshots)) {
      res.cache_consistent = false;
      res.accounting_error =
          "prefix cache: " + std::to_string(cache->pending_snapshots()) + " snapshots pending and " +
          std::to_string(snapshots - cache->evictable_snapshots()) + " not evictable after the run";
    }
  }
  if (res.leaked_slots != 0 && res.accounting_error.empty())
    res.accounting_error = std::to_string(res.leaked_slots) + " state slots held by no request or snapshot";
  if (res.leaked_request_indices != 0 && res.accounting_error.empty())
    res.accounting_error = std::to_string(res.leaked_request_indices) + " request indices never freed";
  if (res.leaked_kv_tokens != 0 && res.accounting_error.empty())
    res.accounting_error = std::to_string(res.leaked_kv_tokens) + " MLA KV token slots never freed";
}

SimulateResult run_group(const SimulateOptions& o) {
  const Plan p = make_plan(o);  // every option checked before any work
  auto log = [&](const std::string& s) {
    if (o.log) o.log(s);
  };
  SimulateResult res;
  res.model = o.model_dir.empty() ? "synthetic" : o.model_dir;
  res.precision = o.precision;
  res.weights = o.weights;
  res.quantize_lm_head = o.quantize_lm_head;
  res.layers = p.layers;
  res.hidden = p.cfg.hidden_size;
  res.mixed = p.sched.mixed;
  res.radix_cache_disabled = p.server_args.disable_radix_cache;
  res.token_budget = p.sched.token_budget;
  res.max_batch = p.sched.max_batch;
  res.parallel_samples = o.parallel_samples;
  res.requests = static_cast<int64_t>(o.requests.size());
  res.vocab = p.vocab;
  res.workload = o.workload;
  res.slot_bytes = p.slot_bytes;
  res.pool_slots = p.slots + p.cache_slots;
  res.spec = o.spec;
  if (p.cache) {
    res.prefix_cache_memory = p.cache_budget;
    res.cache_interval = o.cache_interval;
  }

  res.kda_layers = p.kda_layers;
  res.mla_layers = p.mla_layers;
  res.moe_layers = p.moe_layers;
  res.num_experts = p.num_experts;
  res.experts_per_token = p.num_experts > 0 ? std::min(p.cfg.num_experts_per_token, p.num_experts) : 0;
  res.kv_tokens = p.kv_tokens;
  res.kv_token_bytes = p.kv_token_bytes;

  std::string what = std::to_string(p.layers) + (p.layers == 1 ? " decoder layer (" : " decoder layers (") +
                     std::to_string(p.kda_layers) + " KDA + " + std::to_string(p.mla_layers) + " MLA";
  if (p.moe_layers > 0)
    what += "; " + std::to_string(p.moe_layers) + " MoE of top-" + std::to_string(res.experts_per_token) +
            " of " + std::to_string(p.num_experts) + " experts";
  log("building " + what + "; " + res.model + ", " + to_string(o.precision) + ", " + to_string(o.weights) +
      " weights, hidden " + std::to_string(p.cfg.hidden_size) + ", vocab " + std::to_string(p.vocab) + ")");
  const auto t0 = Clock::now();
  const models::ModelOptions mo = model_options(p, o);
  const std::unique_ptr<models::KimiLinearForCausalLM> model =
      o.model_dir.empty() ? models::KimiLinearForCausalLM::synthetic(p.cfg, mo, o.seed)
                          : models::KimiLinearForCausalLM::from_pretrained(o.model_dir, mo);
  res.build_s = seconds_since(t0);
  res.model_weight_bytes = model->weight_bytes();
  res.active_weight_bytes = model->active_weight_bytes();
  res.active_params = model->active_params();
  int64_t layer_bytes = 0;
  for (int i = 0; i < model->num_layers(); ++i) layer_bytes += model->model().layer(i).weight_bytes();
  res.weight_bytes = model->num_layers() > 0 ? layer_bytes / model->num_layers() : 0;

  ServeOptions so;
  so.scheduler = p.sched;
  so.seed = o.seed;
  so.stop = o.stop;
  agree_across_ranks(o.tp, so);
  const bool keep_all = o.keep_outputs || !o.outputs_path.empty();
  so.keep.assign(o.requests.size(), keep_all ? 1 : 0);
  for (const int64_t r : p.check_requests) so.keep[r] = 1;
  // replay: the true continuations first, from the same workload served without speculation.
  std::vector<std::vector<int32_t>> truth;
  if (o.spec.algorithm == SpecAlgorithm::kReplay) {
    log("replay: serving the workload without speculation first, for the true continuations");
    // The same pool and prefix cache as the speculative pass: the cache's hits start chunk_kda's chunks
    // at other points, which moves the prompt's states by fp32 rounding, and bf16 near-ties would carry
    // such a difference into other tokens.
    ServeOptions pre = so;
    pre.progress = nullptr;
    pre.keep.assign(o.requests.size(), 0);
    pre.probe_decode = true;
    const auto tp0 = Clock::now();
    ModelRunner runner(*model, p.slots + p.cache_slots, p.kv_tokens, p.kernel, 2, p.verify_rows);
    std::optional<mem_cache::RadixCache> cache;
    attach_cache(p, runner, pre, cache);
    ServeResult r0 = serve(runner, o.requests, pre);
    res.replay_prerun_s = seconds_since(tp0);
    if (r0.interrupted) {
      res.serve = std::move(r0);
      return res;
    }
    for (auto& q : r0.outputs) truth.push_back(std::move(q.tokens));
  }
  so.spec = o.spec;
  so.replay_truth = &truth;
  {
    // Freed before the check's pools.
    ModelRunner runner(*model, p.slots + p.cache_slots, p.kv_tokens, p.kernel, p.verify_tokens,
                       p.verify_rows);
    res.pool_bytes = static_cast<int64_t>(runner.pools().recurrent_state_pool.total_bytes());
    if (const auto* kv = runner.pools().token_to_kv_pool.get())
      res.kv_bytes = static_cast<int64_t>(kv->bytes());
    log("state pool: " + std::to_string(p.slots) + " request + " + std::to_string(p.cache_slots) +
        " snapshot slots x " + std::to_string(p.slot_bytes) + " bytes; " + std::to_string(res.requests) +
        " requests" +
        (p.mla_layers > 0 ? "; MLA KV pool: " + std::to_string(p.kv_tokens) + " token slots x " +
                                std::to_string(p.kv_token_bytes) + " bytes"
                          : std::string()));
    std::optional<mem_cache::RadixCache> cache;
    attach_cache(p, runner, so, cache);
    so.progress = [&](const ProgressInfo& pi) {
      res.rss_bytes.push_back(resident_bytes());
      if (o.progress) o.progress(pi);
    };
    res.serve = serve(runner, o.requests, so);
    if (!res.serve.interrupted) account(runner, cache ? &*cache : nullptr, res);
    // replay: sequences whose tokens left the true continuation (a near-tie argmax flipped by a rounding
    // difference between the two passes' batches; their later drafts are then mostly rejected).
    for (size_t i = 0; i < truth.size(); ++i)
      res.serve.replay_diverged += res.serve.outputs[i].tokens != truth[i];
  }
  set_percentiles(res);
  if (!o.outputs_path.empty() && o.tp.rank == 0) write_outputs(o.outputs_path, res.serve, o.parallel_samples);
  if (o.check > 0 && !res.serve.interrupted) {
    log("self-check: re-running " + std::to_string(o.check) + " request(s) alone on a fresh pool");
    bool interrupted = false;
    CheckReport rep = self_check(o, p, *model, res.serve, &interrupted);
    if (interrupted)
      res.serve.interrupted = true;
    else
      res.check = rep;
  }
  if (!keep_all)  // the check's rows were only kept for the comparison
    for (auto& q : res.serve.outputs) std::vector<float>().swap(q.rows);
  return res;
}

}  // namespace

SimulateResult run_simulation(const SimulateOptions& o) {
  return o.dp > 1 ? run_data_parallel(o, run_group) : run_group(o);
}

}  // namespace kda::serving
