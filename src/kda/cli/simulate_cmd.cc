// kda simulate: options -> serving::SimulateOptions (through ServerArgs), SIGINT handling, the
// progress display, and the summary (text or JSON).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <string>

#include "kda/cli/commands.h"
#include "kda/distributed/parallel.h"
#include "kda/io/config.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/layers/onednn_isa.h"
#include "kda/serving/progress.h"
#include "kda/serving/simulate.h"
#include "kda/serving/trace.h"

namespace kda::cli {

namespace {

std::atomic<bool> g_stop{false};  // lock-free: a store from a signal handler is safe
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_sigint(int) { g_stop.store(true); }

// Ctrl-C asks for a stop after the current step; SA_RESETHAND makes a second Ctrl-C end the process.
void install_sigint() {
  struct sigaction sa = {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  sigaction(SIGINT, &sa, nullptr);
}

std::string mib(double bytes) {
  char buf[32];
  if (bytes >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024));
  return buf;
}

// 3.02e9 -> "3.02 B", 2.09e6 -> "2.09 M".
std::string count(double n) {
  char buf[32];
  if (n >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2f B", n / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.2f M", n / 1e6);
  return buf;
}

void print_summary(const serving::SimulateResult& r) {
  const auto& s = r.serve;
  const double wall = s.wall_s > 0 ? s.wall_s : 1e-9;
  std::printf(
      "\nkda simulate: %d decoder layer%s, %d KDA + %d MLA (%s, %s, hidden %lld, vocab %lld), built in %.1f "
      "s%s\n",
      r.layers, r.layers == 1 ? "" : "s", r.kda_layers, r.mla_layers, r.model.c_str(), to_string(r.precision),
      static_cast<long long>(r.hidden), static_cast<long long>(r.vocab), r.build_s,
      s.interrupted ? "  [INTERRUPTED]" : "");
  if (r.moe_layers > 0)
    std::printf(
        "  MoE           %d layers of top-%d of %d routed experts + shared; %s active parameters per token "
        "(the real model's whenever top-k and the expert size are, whatever --experts)\n",
        r.moe_layers, r.experts_per_token, r.num_experts,
        count(static_cast<double>(r.active_params)).c_str());
  std::printf(
      "  weights       %s%s, %.2f GB resident (%.1f MB per decoder layer), %.2f GB read per decoded "
      "token\n",
      to_string(r.weights), r.quantize_lm_head ? " (the LM head too)" : "",
      static_cast<double>(r.model_weight_bytes) / 1e9, static_cast<double>(r.weight_bytes) / 1e6,
      static_cast<double>(r.active_weight_bytes) / 1e9);
  std::printf(
      "  requests      %lld of %lld completed (%s, parallel samples %d); %lld steps: %lld extend, %lld "
      "decode, %lld mixed\n",
      static_cast<long long>(s.requests_completed), static_cast<long long>(r.requests), r.workload.c_str(),
      r.parallel_samples, static_cast<long long>(s.steps), static_cast<long long>(s.extend_steps),
      static_cast<long long>(s.decode_steps), static_cast<long long>(s.mixed_steps));
  std::printf("  prefill       %lld tokens (%lld computed), %.1f tok/s\n",
              static_cast<long long>(s.prefill_tokens), static_cast<long long>(s.prefill_tokens_computed),
              static_cast<double>(s.prefill_tokens_computed) / wall);
  std::printf("  decode        %lld tokens, %.1f tok/s\n", static_cast<long long>(s.decode_tokens),
              static_cast<double>(s.decode_tokens) / wall);
  std::printf("  wall          %.1f s serving\n", s.wall_s);
  std::printf("  step latency  p50 %.1f ms, p99 %.1f ms\n", r.step_ms_p50, r.step_ms_p99);
  std::printf("  TTFT          p50 %.1f ms, p99 %.1f ms (arrival to first generated token)\n", r.ttft_ms_p50,
              r.ttft_ms_p99);
  if (!s.ttft_later_turns_ms.empty())
    std::printf("  TTFT turns 2+ p50 %.1f ms, p99 %.1f ms (%zu later turns of sessions)\n",
                r.ttft_ms_p50_later_turns, r.ttft_ms_p99_later_turns, s.ttft_later_turns_ms.size());
  std::printf("  state pool    %lld slots x %s = %s; peak %lld slots in use, %lld slot reuses\n",
              static_cast<long long>(r.pool_slots), mib(static_cast<double>(r.slot_bytes)).c_str(),
              mib(static_cast<double>(r.pool_bytes)).c_str(), static_cast<long long>(s.peak_slots),
              static_cast<long long>(s.slot_reuses));
  if (r.mla_layers > 0)
    std::printf("  MLA KV pool   %lld token slots x %lld bytes = %s; peak %lld in use\n",
                static_cast<long long>(r.kv_tokens), static_cast<long long>(r.kv_token_bytes),
                mib(static_cast<double>(r.kv_bytes)).c_str(), static_cast<long long>(s.peak_kv_tokens));
  std::printf("  scheduler     token budget %lld, max batch %lld, mixed %s, radix cache %s\n",
              static_cast<long long>(r.token_budget), static_cast<long long>(r.max_batch),
              r.mixed ? "on" : "off", !r.radix_cache_disabled ? "on" : "off");
  if (!r.radix_cache_disabled) {
    const double rate = s.prefill_tokens > 0 ? static_cast<double>(s.prefix_cache_hit_tokens) /
                                                   static_cast<double>(s.prefill_tokens)
                                             : 0.0;
    std::printf(
        "  prefix cache  %s budget, a snapshot every %lld tokens; %lld hit tokens (%.1f%% of the prompts), "
        "%lld snapshots (%s) held at the end, %lld evicted\n",
        mib(static_cast<double>(r.prefix_cache_memory)).c_str(), static_cast<long long>(r.cache_interval),
        static_cast<long long>(s.prefix_cache_hit_tokens), 100.0 * rate,
        static_cast<long long>(s.prefix_cache_snapshots),
        mib(static_cast<double>(s.prefix_cache_bytes)).c_str(),
        static_cast<long long>(s.prefix_cache_evictions));
  }
  if (r.spec.enabled()) {
    const double rate = s.spec_draft_tokens > 0 ? static_cast<double>(s.spec_accepted_tokens) /
                                                      static_cast<double>(s.spec_draft_tokens)
                                                : 0.0;
    const double per_step = s.spec_verify_rows > 0 ? static_cast<double>(s.spec_emitted_tokens) /
                                                         static_cast<double>(s.spec_verify_rows)
                                                   : 0.0;
    const double mean_depth =
        s.spec_depth_rows > 0 ? static_cast<double>(s.spec_depth_sum) / static_cast<double>(s.spec_depth_rows)
                              : 0.0;
    char depth_buf[64];
    std::snprintf(depth_buf, sizeof depth_buf, " (%s depth, mean %.2f)", to_string(r.spec.depth_mode),
                  mean_depth);
    std::string how = std::string(to_string(r.spec.algorithm)) + ", " + std::to_string(r.spec.draft_tokens) +
                      " draft tokens" +
                      (r.spec.topk > 1 ? " x " + std::to_string(r.spec.topk) + " branches" : std::string()) +
                      depth_buf;
    if (r.spec.algorithm == serving::SpecAlgorithm::kReplay) {
      char buf[48];
      std::snprintf(buf, sizeof buf, ", accept rate %.2f", r.spec.accept_rate);
      how += buf;
    }
    std::printf(
        "  speculative   %s: %lld drafted, %lld accepted (%.1f%%), %.2f tokens per request per verify step; "
        "verify buffer %s\n",
        how.c_str(), static_cast<long long>(s.spec_draft_tokens),
        static_cast<long long>(s.spec_accepted_tokens), 100.0 * rate, per_step,
        mib(static_cast<double>(s.spec_state_bytes)).c_str());
  }
  if (!s.interrupted) {
    if (r.accounting_ok())
      std::printf(
          "  accounting    every state slot, request index and KV token slot accounted for; RSS %s at the "
          "end "
          "(%+.1f%% "
          "since the first tenth of the steps)\n",
          mib(r.rss_bytes.empty() ? 0.0 : static_cast<double>(r.rss_bytes.back())).c_str(),
          100.0 * r.rss_growth());
    else
      std::printf("  accounting    FAIL: %s\n", r.accounting_error.c_str());
  }
  if (r.check) {
    std::string ids;
    for (const auto id : r.check->request_ids) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    std::printf(
        "  self-check    %zu request(s) alone, teacher-forced [%s]: worst %s = %.3g (bound %.3g)  %s\n",
        r.check->request_ids.size(), ids.c_str(), r.check->metric.c_str(), r.check->worst, r.check->bound,
        r.check->ok ? "PASS" : "FAIL");
    std::printf("                argmax tokens matched: %s (%lld of %lld)\n",
                r.check->tokens_all_matched() ? "yes" : "no", static_cast<long long>(r.check->tokens_matched),
                static_cast<long long>(r.check->tokens_total));
  } else {
    std::printf("  self-check    %s\n", s.interrupted ? "skipped (interrupted)" : "off (--check 0)");
  }
}

}  // namespace

int run_simulate(const SimulateCliOptions& o) {
  // Before any oneDNN kernel exists. A bf16 self-check compares batched and alone, which only bf16 rows
  // independent of their batch make a sharp test (on AMX a corrupted restore hid under the loose bound).
  const bool bf16_checked = o.check > 0 && o.precision == "bf16" && o.weights == "bf16";
  if (o.batch_invariant || bf16_checked) layers::make_bf16_batch_invariant();
  serving::SimulateOptions so;
  so.model_dir = o.model;
  so.layers = o.layers;
  so.num_experts = o.experts;
  so.precision = parse_precision(o.precision);
  so.weights = parse_weights(o.weights);
  so.quantize_lm_head = o.quantize_lm_head;
  so.kernel = o.kernel;
  so.seed = o.seed;
  so.vocab = serving::resolve_vocab(o.model, o.vocab);  // the workload's token ids need it first
  if (!o.trace.empty()) {
    so.requests = serving::load_trace(o.trace, so.vocab);
    so.workload = "trace";
  } else {
    if (o.output_len < 0 || o.output_len > INT32_MAX)
      throw std::invalid_argument("--output-len must be in 0..2^31-1, got " + std::to_string(o.output_len));
    serving::WorkloadOptions w;
    w.kind = serving::parse_workload_kind(o.workload);
    w.requests = o.requests;
    w.prompt = serving::parse_len_range(o.prompt_len, "--prompt-len");
    w.output_len = static_cast<int32_t>(o.output_len);
    w.prefix_groups = o.prefix_groups;
    const int64_t spl = o.shared_prefix_len >= 0                         ? o.shared_prefix_len
                        : w.kind == serving::WorkloadKind::kSharedPrefix ? 64
                                                                         : 0;
    if (spl > INT32_MAX)
      throw std::invalid_argument("--shared-prefix-len is too large: " + std::to_string(spl));
    w.shared_prefix_len = static_cast<int32_t>(spl);
    if (w.kind != serving::WorkloadKind::kMultiTurn && o.turns >= 0)
      throw std::invalid_argument("--turns needs --workload multi-turn");
    w.turns = w.kind != serving::WorkloadKind::kMultiTurn ? 1 : o.turns < 0 ? 2 : o.turns;
    w.vocab = so.vocab;
    w.seed = o.seed;
    so.requests = serving::make_workload(w);
    so.workload = serving::to_string(w.kind);
    if (w.kind == serving::WorkloadKind::kMultiTurn)
      so.workload += " (" + std::to_string(w.requests) + " x " + std::to_string(w.turns) + " turns)";
  }
  so.server_args.chunked_prefill_size = o.token_budget;
  so.server_args.enable_mixed_chunk = o.mixed;
  so.max_batch = o.max_batch;
  so.state_memory = serving::parse_byte_size(o.state_memory, "--state-memory");
  so.kv_memory = serving::parse_byte_size(o.kv_memory, "--kv-memory");
  so.server_args.disable_radix_cache = o.no_prefix_cache;  // the CLI serves with the cache by default
  so.prefix_cache_memory = o.prefix_cache_memory == "0"
                               ? 0
                               : serving::parse_byte_size(o.prefix_cache_memory, "--prefix-cache-memory");
  so.cache_interval = o.cache_interval;
  if (o.parallel_samples < 1 || o.parallel_samples > 4096)
    throw std::invalid_argument("--parallel-samples must be in 1..4096, got " +
                                std::to_string(o.parallel_samples));
  so.parallel_samples = static_cast<int32_t>(o.parallel_samples);
  so.check = o.check;
  so.server_args.speculative_algorithm = o.speculative;
  so.spec.algorithm = serving::parse_spec_algorithm(o.speculative);
  if (o.draft_tokens < 1 || o.draft_tokens > 64)
    throw std::invalid_argument("--draft-tokens must be in 1..64, got " + std::to_string(o.draft_tokens));
  if (o.draft_topk < 1 || o.draft_topk > 16)
    throw std::invalid_argument("--draft-topk must be in 1..16, got " + std::to_string(o.draft_topk));
  so.spec.draft_tokens = static_cast<int32_t>(o.draft_tokens);
  so.spec.topk = static_cast<int32_t>(o.draft_topk);
  if (o.accept_rate != -1.0 && so.spec.algorithm != serving::SpecAlgorithm::kReplay)
    throw std::invalid_argument("--accept-rate is for --speculative replay only");
  so.spec.accept_rate = o.accept_rate == -1.0 ? 0.7 : o.accept_rate;
  so.spec.depth_mode = serving::parse_draft_depth_mode(o.draft_depth);
  so.outputs_path = o.outputs;
  // Under --tp every rank of a group runs the same schedule on its shard; under --dp the groups serve
  // disjoint requests. World rank 0 alone reports and writes.
  auto par = distributed::make_parallel_context(o.tp, o.dp);
  so.tp = par.tensor_parallel();
  so.dp = par.dp;
  so.dp_rank = par.dp_rank;
  so.world = par.world.get();
  const bool root = par.is_root();
  if (!root && !std::freopen("/dev/null", "w", stdout)) throw std::runtime_error("cannot silence stdout");

  // With --json, stdout carries only the JSON: progress and phase lines go to stderr.
  std::FILE* info = o.json ? stderr : stdout;
  serving::Progress progress(info, isatty(fileno(info)) != 0);
  if (root) so.progress = [&](const serving::ProgressInfo& p) { progress.update(p); };
  if (root)
    so.log = [&](const std::string& line) {
      progress.finish();  // a bar in flight ends its line first
      std::fprintf(info, "kda simulate: %s\n", line.c_str());
      std::fflush(info);
    };
  g_stop.store(false);
  so.stop = &g_stop;
  install_sigint();

  const auto r = serving::run_simulation(so);
  progress.finish();
  if (o.json)
    std::printf("%s\n", serving::to_json(r).dump(2).c_str());
  else
    print_summary(r);
  if (!o.outputs.empty() && !o.json) std::printf("  outputs       %s\n", o.outputs.c_str());
  if (r.serve.interrupted) return 130;
  return r.ok() ? 0 : 1;
}

}  // namespace kda::cli
