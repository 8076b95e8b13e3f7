#include "kda/serving/simulate.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>

#include "kda/io/npy.h"
#include "kda/kernels/kda/kda.h"
#include "kda/mem_cache/radix_cache.h"
#include "kda/models/kda_stack.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/trace.h"

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

// What the options resolve to, all of it computed (and checked) before any work.
struct Plan {
  io::KimiLinearConfig cfg;
  int layers = 0;
  kernels::KernelImpl kernel = kernels::KernelImpl::Auto;
  ServerArgs server_args;
  SchedulerOptions sched;
  int64_t vocab = 0;
  int64_t slot_bytes = 0, slots = 0;
  bool cache = false;
  int64_t cache_slots = 0;  // snapshot slots on top of `slots` (the pool holds slots + cache_slots)
  int verify_tokens = 0;    // speculative decoding: the verify buffer's tokens per row, and its rows
  int64_t verify_rows = 0;
  std::vector<int64_t> check_requests;  // workload indices
};

int32_t slots_for(const RequestSpec& r, int32_t n) { return r.output_len > 0 ? n : 1; }

// Every rank of a tensor-parallel group feeds rank 0's greedy picks. The ranks compute the same logits
// from the same allreduced hidden states, but an allreduce need not give every rank the same bits, and
// one differing pick would give the ranks different inputs. Token ids (< 2^24) are exact in fp32, so a
// sum with zeros from every other rank is a broadcast.
void agree_tokens(const distributed::TensorParallel& tp, std::vector<int32_t>& t) {
  std::vector<float> f(t.size(), 0.0f);
  if (tp.rank == 0)
    for (size_t i = 0; i < t.size(); ++i) f[i] = static_cast<float>(t[i]);
  tp.comm->allreduce_sum(f.data(), f.size());
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(f[i]);
}

Plan make_plan(const SimulateOptions& o) {
  validate_workload(o.requests);
  Plan p;
  if (!o.model_dir.empty() && !std::filesystem::is_directory(o.model_dir))
    throw std::invalid_argument("--model " + o.model_dir + ": not a directory");
  p.vocab = resolve_vocab(o.model_dir, o.vocab);
  validate_workload(o.requests, p.vocab);
  p.server_args = o.server_args;
  if (p.server_args.chunked_prefill_size < 1)
    throw std::invalid_argument("--token-budget must be >= 1, got " +
                                std::to_string(p.server_args.chunked_prefill_size));
  p.server_args.check_server_args(/*model_has_recurrent_state=*/true);
  if (o.max_batch < 1)
    throw std::invalid_argument("--max-batch must be >= 1, got " + std::to_string(o.max_batch));
  if (o.parallel_samples < 1)
    throw std::invalid_argument("--parallel-samples must be >= 1, got " + std::to_string(o.parallel_samples));
  const int64_t R = static_cast<int64_t>(o.requests.size());
  if (o.check < 0 || o.check > R)
    throw std::invalid_argument("--check " + std::to_string(o.check) + ": must be in 0.." +
                                std::to_string(R) + " (the number of requests)");
  if (o.state_memory < 1)
    throw std::invalid_argument("--state-memory must be positive, got " + std::to_string(o.state_memory));
  p.kernel = kernels::parse_kernel_impl(o.kernel);
  if (!o.model_dir.empty()) {
    if (!std::filesystem::is_directory(o.model_dir))
      throw std::invalid_argument("--model " + o.model_dir + ": not a directory");
    p.cfg = io::load_config(o.model_dir);
  } else {
    p.cfg = o.synthetic_config.value_or(models::kimi_linear_48b_config());
  }
  p.layers = static_cast<int>(models::KdaStack::select_layers(p.cfg, o.layers).size());
  models::check_tensor_parallel(p.cfg, o.tp.size);
  p.slot_bytes = models::KdaStack::slot_bytes(p.cfg, p.layers, o.precision);
  // Speculative decoding: the verify buffer holds a row per decode row of a step (at most max_batch and
  // at most the request slots), so the first max_batch slots each cost a verify row too.
  o.spec.validate();
  if (o.spec.enabled()) {
    std::string named = p.server_args.speculative_algorithm;
    for (char& c : named) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (named != to_string(o.spec.algorithm))
      throw std::invalid_argument(
          std::string("speculative decoding: SimulateOptions::spec is ") + to_string(o.spec.algorithm) +
          " but server_args.speculative_algorithm is '" + p.server_args.speculative_algorithm + "'");
    p.verify_tokens = o.spec.max_verify_tokens();
  } else if (!p.server_args.speculative_algorithm.empty()) {
    throw std::invalid_argument("server_args.speculative_algorithm '" + p.server_args.speculative_algorithm +
                                "' without SimulateOptions::spec");
  }
  const int64_t row_bytes = int64_t{p.verify_tokens} * p.layers * static_cast<int64_t>(sizeof(float)) *
                            mem_cache::RecurrentStatePool::verify_token_elems(
                                3 * int64_t{p.cfg.projection_size()}, p.cfg.num_heads, p.cfg.head_dim);
  int64_t budget_slots = o.state_memory / (p.slot_bytes + row_bytes);
  if (budget_slots > o.max_batch)  // past max_batch, slots cost no verify row
    budget_slots = o.max_batch + (o.state_memory - o.max_batch * (p.slot_bytes + row_bytes)) / p.slot_bytes;
  if (budget_slots < 1)
    throw std::invalid_argument(
        "--state-memory " + std::to_string(o.state_memory) +
        " bytes is too small for one state slot: a slot needs " + std::to_string(p.slot_bytes) + " bytes (" +
        std::to_string(p.layers) + " layers x (recurrent + conv state))" +
        (row_bytes > 0 ? " + " + std::to_string(row_bytes) + " bytes of verify buffer (--draft-tokens)"
                       : ""));
  int64_t need = 0, total = 0;
  for (const auto& r : o.requests) {
    need = std::max<int64_t>(need, slots_for(r, o.parallel_samples));
    total += slots_for(r, o.parallel_samples);
  }
  if (budget_slots < need)
    throw std::invalid_argument("--state-memory " + std::to_string(o.state_memory) + " bytes holds " +
                                std::to_string(budget_slots) + " state slots, but a request with " +
                                std::to_string(o.parallel_samples) + " parallel samples needs " +
                                std::to_string(need));
  // More slots than the workload has sequences could never be used: do not allocate them.
  p.slots = std::min(budget_slots, total);
  if (p.verify_tokens > 0) p.verify_rows = std::min(o.max_batch, p.slots);
  p.cache = !p.server_args.disable_radix_cache;
  if (p.cache) {
    if (o.cache_interval < 64 || o.cache_interval % 64 != 0)
      throw std::invalid_argument("--cache-interval must be a positive multiple of 64, got " +
                                  std::to_string(o.cache_interval));
    if (o.prefix_cache_memory < 0)
      throw std::invalid_argument("--prefix-cache-memory must be >= 0, got " +
                                  std::to_string(o.prefix_cache_memory));
    if (o.prefix_cache_memory > 0 && o.prefix_cache_memory < p.slot_bytes)
      throw std::invalid_argument("--prefix-cache-memory " + std::to_string(o.prefix_cache_memory) +
                                  " bytes is too small for one state snapshot: a slot needs " +
                                  std::to_string(p.slot_bytes) + " bytes (0 turns the cache's storage off)");
    // At most the snapshots the workload could ever create: per request its interval points, its end
    // and branch point, and one insert per continuation at finish.
    int64_t most = 0;
    for (const auto& r : o.requests) most += r.prompt_len / o.cache_interval + 2 + o.parallel_samples;
    p.cache_slots = std::min(o.prefix_cache_memory / p.slot_bytes, most);
  }
  if (!o.outputs_path.empty()) {
    if (std::filesystem::is_directory(o.outputs_path))
      throw std::invalid_argument("--outputs " + o.outputs_path + ": is a directory");
    const auto parent = std::filesystem::absolute(o.outputs_path).parent_path();
    if (!std::filesystem::is_directory(parent))
      throw std::invalid_argument("--outputs " + o.outputs_path + ": folder " + parent.string() +
                                  " does not exist");
  }
  p.sched.token_budget = p.server_args.chunked_prefill_size;
  // With speculation a decode step's rows are verify rows: at most the verify buffer's (requests that
  // borrowed evicted snapshots' slots wait their turn, round-robin).
  p.sched.max_batch = p.verify_rows > 0 ? p.verify_rows : o.max_batch;
  p.sched.mixed = p.server_args.enable_mixed_chunk;
  p.sched.parallel_samples = o.parallel_samples;
  p.sched.cache_interval = o.cache_interval;

  // The requests to re-run alone: a seeded draw (Fisher-Yates on the raw stream, portable).
  std::vector<int64_t> idx(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) idx[i] = i;
  std::mt19937_64 rng(o.seed ^ 0xc4ec4ULL);
  for (int64_t i = R - 1; i > 0; --i) std::swap(idx[i], idx[rng() % static_cast<uint64_t>(i + 1)]);
  p.check_requests.assign(idx.begin(), idx.begin() + o.check);
  std::sort(p.check_requests.begin(), p.check_requests.end());
  return p;
}

// The bf16 bound of a stack of L layers: the spec's 5e-3 relative L2 per layer, times L. One layer's
// output is rounded at the spec's points whatever the batch, but the fp32 sums before a rounding point
// may be ordered differently for different row counts: on CPUs without AVX512_BF16, oneDNN's bf16 GEMM
// for one row (a lone decode step) reduces in another order than for several (a batched step), which
// flips bf16 ulps, and the residual stream carries each layer's flips into the next (measured on an
// Ice Lake Xeon, synthetic stack, batched vs alone: 4.6e-5 at 1 layer, 1.3e-3 at 4, 5-12e-3 at 20).
// A scheduling bug (a wrong slot, a lost state) moves the output by O(1), far above this bound.
double bf16_limit(int layers) { return 5e-3 * std::max(layers, 1); }

double ratio_of(const std::vector<float>& a, const std::vector<float>& b, Precision p, double limit) {
  if (a.size() != b.size() || a.empty()) return std::numeric_limits<double>::infinity();
  if (p == Precision::FP32) {  // spec: elementwise |a - b| <= 1e-5 + 1e-5 |b|
    double worst = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
      if (!std::isfinite(d)) return std::numeric_limits<double>::infinity();
      worst = std::max(worst, d / (1e-5 + 1e-5 * std::fabs(static_cast<double>(b[i]))));
    }
    return worst;
  }
  double num = 0.0, den = 0.0;  // relative L2 <= limit
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  const double rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  return std::isfinite(rel) ? rel / limit : std::numeric_limits<double>::infinity();
}

// Each sampled request alone on a fresh pool, teacher-forced on the batched run's tokens: its whole
// prompt in one EXTEND, then DECODE steps of its own continuations only, each fed the token the batched
// run generated there. Every position's last-layer output must match the batched run at the spec's
// tolerance; its own argmax picks are compared with the batched run's tokens and counted.
CheckReport self_check(const SimulateOptions& o, const Plan& p, models::KdaStack& stack,
                       const ServeResult& batched, bool* interrupted) {
  CheckReport rep;
  const double limit = bf16_limit(stack.num_layers());
  char metric[48];
  std::snprintf(metric, sizeof(metric), "rel_l2/%.3g (5e-3 x %d layers)", limit, stack.num_layers());
  rep.metric = o.precision == Precision::FP32 ? "max_err_ratio" : metric;
  const auto t0 = Clock::now();
  const int32_t n = o.parallel_samples;
  for (const int64_t r : p.check_requests) {
    const SequenceOutput& first = batched.outputs[r * n];
    RequestSpec spec;
    spec.id = o.requests[r].id;
    spec.output_len = o.requests[r].output_len;
    spec.sample_base = o.requests[r].sample_base;
    spec.prompt = first.prompt;  // a session's turn: with its history, as the batched run built it
    spec.prompt_len = static_cast<int32_t>(spec.prompt.size());
    for (int32_t j = 0; j < n; ++j) spec.forced.push_back(batched.outputs[r * n + j].tokens);
    rep.request_ids.push_back(spec.id);
    ModelRunner alone(stack, slots_for(spec, n), p.kernel);
    ServeOptions so;
    so.scheduler.token_budget = spec.prompt_len;
    so.scheduler.max_batch = n;
    so.scheduler.parallel_samples = n;
    so.seed = o.seed;
    so.keep = {1};
    so.stop = o.stop;
    if (o.tp.size > 1) {
      so.agree_stop = [&o](bool v) { return o.tp.comm->allreduce_or(v); };
      so.agree_tokens = [&o](std::vector<int32_t>& t) { agree_tokens(o.tp, t); };
    }
    const ServeResult ar = serve(alone, {spec}, so);
    if (ar.interrupted) {
      *interrupted = true;
      break;
    }
    for (int32_t j = 0; j < n; ++j) {
      const auto& b = batched.outputs[r * n + j];
      // A prefix-cache hit's rows start at rows_from: compare the positions both runs computed.
      const auto& full = ar.outputs[j].rows;
      const size_t skip = static_cast<size_t>(b.rows_from) * static_cast<size_t>(stack.hidden_size());
      const std::vector<float> tail(full.begin() + static_cast<std::ptrdiff_t>(std::min(skip, full.size())),
                                    full.end());
      const double ratio = ratio_of(b.rows, tail, o.precision, limit);
      rep.worst_ratio = std::max(rep.worst_ratio, ratio);
      const auto& mine = ar.outputs[j].tokens;
      rep.tokens_total += static_cast<int64_t>(std::max(b.tokens.size(), mine.size()));
      for (size_t k = 0; k < std::min(b.tokens.size(), mine.size()); ++k)
        rep.tokens_matched += b.tokens[k] == mine[k];
    }
  }
  rep.ok = rep.worst_ratio <= 1.0;
  rep.wall_s = seconds_since(t0);
  return rep;
}

void write_outputs(const std::string& path, const ServeResult& s, int32_t n) {
  io::NpzArchive npz;
  for (const auto& q : s.outputs) {
    if (!q.tokens.empty())
      npz[tokens_key(q, n)] =
          io::NpyArray::from_i32({static_cast<int64_t>(q.tokens.size())}, q.tokens.data());
    if (q.rows.empty()) continue;
    const int64_t tokens = static_cast<int64_t>(q.rows.size()) / s.hidden;
    npz[output_key(q, n)] = io::NpyArray::from_f32({tokens, s.hidden}, q.rows.data());
  }
  io::write_npz(path, npz);
}

}  // namespace

std::string output_key(const SequenceOutput& s, int32_t parallel_samples) {
  std::string k = "req_" + std::to_string(s.request_id);
  if (parallel_samples > 1) k += "_s" + std::to_string(s.sample);
  return k;
}

std::string tokens_key(const SequenceOutput& s, int32_t parallel_samples) {
  std::string k = "tokens_" + std::to_string(s.request_id);
  if (parallel_samples > 1) k += "_s" + std::to_string(s.sample);
  return k;
}

int64_t resolve_vocab(const std::string& model_dir, int64_t vocab) {
  if (vocab < 0 || vocab > (int64_t{1} << 24))
    throw std::invalid_argument("--vocab must be in 1..2^24, got " + std::to_string(vocab));
  const int64_t ckpt = model_dir.empty() ? 0 : models::KdaStack::checkpoint_vocab(model_dir);
  if (ckpt > 0 && vocab > 0 && vocab != ckpt)
    throw std::invalid_argument("--vocab " + std::to_string(vocab) + ": the checkpoint " + model_dir +
                                " has a vocabulary of " + std::to_string(ckpt));
  if (ckpt > (int64_t{1} << 24))
    throw std::invalid_argument(model_dir + ": a vocabulary of " + std::to_string(ckpt) +
                                " is more than 2^24");
  return ckpt > 0 ? ckpt : vocab > 0 ? vocab : models::KdaStack::kDefaultVocab;
}

int64_t parse_byte_size(const std::string& text, const std::string& option) {
  size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0)
    throw std::invalid_argument(option + " '" + text + "': not a size (e.g. 2GiB, 512MiB, 1073741824)");
  std::string unit = text.substr(used);
  double mult = 0.0;
  if (unit.empty() || unit == "B")
    mult = 1.0;
  else if (unit == "K" || unit == "KiB")
    mult = 1024.0;
  else if (unit == "M" || unit == "MiB")
    mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TiB")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    throw std::invalid_argument(option + " '" + text + "': unknown unit '" + unit +
                                "' (B, K/KiB, M/MiB, G/GiB, T/TiB)");
  const double bytes = v * mult;
  if (!(bytes >= 1.0) || bytes > 9.0e18)
    throw std::invalid_argument(option + " '" + text + "': must be between 1 byte and 8 EiB");
  return static_cast<int64_t>(bytes);
}

double SimulateResult::rss_growth() const {
  if (rss_bytes.size() < 2) return 0.0;
  const size_t tenth = std::max<size_t>(rss_bytes.size() / 10, 1) - 1;
  const double base = static_cast<double>(rss_bytes[tenth]);
  return base > 0 ? static_cast<double>(rss_bytes.back()) / base - 1.0 : 0.0;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(v.size()))) - 1;
  return v[i];
}

namespace {

// The summed counters of a ServeResult, by the names pack() and unpack_into() use.
constexpr std::pair<const char*, int64_t ServeResult::*> kCounters[] = {
    {"steps", &ServeResult::steps},
    {"extend_steps", &ServeResult::extend_steps},
    {"decode_steps", &ServeResult::decode_steps},
    {"mixed_steps", &ServeResult::mixed_steps},
    {"prefill_tokens", &ServeResult::prefill_tokens},
    {"prefill_tokens_computed", &ServeResult::prefill_tokens_computed},
    {"decode_tokens", &ServeResult::decode_tokens},
    {"requests_completed", &ServeResult::requests_completed},
    {"peak_slots", &ServeResult::peak_slots},
    {"slot_reuses", &ServeResult::slot_reuses},
    {"prefix_cache_hit_tokens", &ServeResult::prefix_cache_hit_tokens},
    {"prefix_cache_bytes", &ServeResult::prefix_cache_bytes},
    {"prefix_cache_snapshots", &ServeResult::prefix_cache_snapshots},
    {"prefix_cache_evictions", &ServeResult::prefix_cache_evictions},
    {"spec_verify_steps", &ServeResult::spec_verify_steps},
    {"spec_verify_rows", &ServeResult::spec_verify_rows},
    {"spec_draft_tokens", &ServeResult::spec_draft_tokens},
    {"spec_accepted_tokens", &ServeResult::spec_accepted_tokens},
    {"spec_emitted_tokens", &ServeResult::spec_emitted_tokens},
    {"spec_state_bytes", &ServeResult::spec_state_bytes},
    {"replay_diverged", &ServeResult::replay_diverged},
};

// One group's result as bytes (statistics and kept outputs), for the gather to world rank 0.
std::vector<uint8_t> pack(const SimulateResult& r) {
  const auto& s = r.serve;
  nlohmann::json j = {{"wall_s", s.wall_s},
                      {"step_ms", s.step_ms},
                      {"ttft_ms", s.ttft_ms},
                      {"interrupted", s.interrupted},
                      {"has_check", r.check.has_value()},
                      {"leaked_slots", r.leaked_slots},
                      {"leaked_request_indices", r.leaked_request_indices},
                      {"cache_consistent", r.cache_consistent},
                      {"accounting_error", r.accounting_error}};
  for (const auto& [name, field] : kCounters) j[name] = s.*field;
  if (r.check)
    j["check"] = {{"ids", r.check->request_ids},
                  {"metric", r.check->metric},
                  {"worst", r.check->worst_ratio},
                  {"ok", r.check->ok},
                  {"wall_s", r.check->wall_s},
                  {"tokens_matched", r.check->tokens_matched},
                  {"tokens_total", r.check->tokens_total}};
  nlohmann::json outs = nlohmann::json::array();
  for (const auto& q : s.outputs)
    outs.push_back({{"id", q.request_id},
                    {"sample", q.sample},
                    {"prompt_len", q.prompt_len},
                    {"rows_from", q.rows_from},
                    {"rows", q.rows},
                    {"prompt", q.prompt},
                    {"tokens", q.tokens}});
  j["outputs"] = outs;
  return nlohmann::json::to_cbor(j);
}

// Adds one group's packed result into `m`.
void unpack_into(const std::vector<uint8_t>& bytes, SimulateResult& m) {
  const auto j = nlohmann::json::from_cbor(bytes);
  auto& s = m.serve;
  for (const auto& [name, field] : kCounters) s.*field += j.at(name).get<int64_t>();
  s.wall_s = std::max(s.wall_s, j.at("wall_s").get<double>());  // the groups run side by side
  const auto ms = j.at("step_ms").get<std::vector<double>>();
  s.step_ms.insert(s.step_ms.end(), ms.begin(), ms.end());
  const auto tt = j.at("ttft_ms").get<std::vector<double>>();
  s.ttft_ms.insert(s.ttft_ms.end(), tt.begin(), tt.end());
  s.interrupted = s.interrupted || j.at("interrupted").get<bool>();
  m.leaked_slots += j.at("leaked_slots").get<int64_t>();
  m.leaked_request_indices += j.at("leaked_request_indices").get<int64_t>();
  m.cache_consistent = m.cache_consistent && j.at("cache_consistent").get<bool>();
  if (m.accounting_error.empty()) m.accounting_error = j.at("accounting_error").get<std::string>();
  if (j.at("has_check").get<bool>()) {
    const auto& c = j.at("check");
    if (!m.check) {
      m.check = CheckReport{};
      m.check->metric = c.at("metric").get<std::string>();
    }
    const auto ids = c.at("ids").get<std::vector<int64_t>>();
    m.check->request_ids.insert(m.check->request_ids.end(), ids.begin(), ids.end());
    m.check->worst_ratio = std::max(m.check->worst_ratio, c.at("worst").get<double>());
    m.check->ok = m.check->ok && c.at("ok").get<bool>();
    m.check->wall_s = std::max(m.check->wall_s, c.at("wall_s").get<double>());
    m.check->tokens_matched += c.at("tokens_matched").get<int64_t>();
    m.check->tokens_total += c.at("tokens_total").get<int64_t>();
  }
  for (const auto& q : j.at("outputs"))
    s.outputs.push_back({q.at("id").get<int64_t>(), q.at("sample").get<int32_t>(),
                         q.at("prompt_len").get<int32_t>(), q.at("rows_from").get<int32_t>(),
                         q.at("rows").get<std::vector<float>>(), q.at("prompt").get<std::vector<int32_t>>(),
                         q.at("tokens").get<std::vector<int32_t>>()});
}

SimulateResult run_group(const SimulateOptions& o);

// Each group serves its share of the workload; world rank 0 merges what the groups report.
SimulateResult run_data_parallel(const SimulateOptions& o) {
  make_plan(o);  // the whole workload and every option, checked before any work
  const int64_t R = static_cast<int64_t>(o.requests.size());
  if (o.dp > R)
    throw std::invalid_argument("--dp " + std::to_string(o.dp) + " needs at least as many requests (" +
                                std::to_string(R) + ")");
  if (!o.world) throw std::invalid_argument("data parallelism needs a world communicator");
  SimulateOptions g = o;
  g.dp = 1;
  g.requests.clear();
  // Request i goes to group c(i) % dp, c(i) the number of first turns before its session's first
  // turn (i itself when no request has a previous turn): a conversation stays in one group, and the
  // conversations are dealt round-robin. Previous turns are renumbered.
  std::vector<int64_t> conv(static_cast<size_t>(R)), local(static_cast<size_t>(R), -1);
  int64_t firsts = 0;
  for (int64_t i = 0; i < R; ++i) {
    conv[i] = o.requests[i].after >= 0 ? conv[o.requests[i].after] : firsts++;
    if (conv[i] % o.dp != o.dp_rank) continue;
    local[i] = static_cast<int64_t>(g.requests.size());
    g.requests.push_back(o.requests[i]);
    if (o.requests[i].after >= 0) g.requests.back().after = local[o.requests[i].after];
  }
  if (g.requests.empty())
    throw std::invalid_argument("--dp " + std::to_string(o.dp) + ": data-parallel group " +
                                std::to_string(o.dp_rank) + " gets no request (fewer sessions than groups)");
  const int64_t share = static_cast<int64_t>(g.requests.size());
  g.check = std::min<int64_t>(share, (o.check + o.dp - 1 - o.dp_rank) / o.dp);  // the checks split too
  g.outputs_path.clear();
  g.keep_outputs = o.keep_outputs || !o.outputs_path.empty();
  SimulateResult mine = run_group(g);

  // Only a group's first tensor-parallel rank reports (its ranks hold the same results).
  const auto all = o.world->allgather_bytes(o.tp.rank == 0 ? pack(mine) : std::vector<uint8_t>{});
  SimulateResult m = mine;
  m.requests = R;
  m.serve = ServeResult{};
  m.serve.hidden = mine.serve.hidden;
  m.check.reset();
  m.leaked_slots = m.leaked_request_indices = 0;  // summed over the groups below
  m.cache_consistent = true;
  m.accounting_error.clear();
  for (const auto& b : all)
    if (!b.empty()) unpack_into(b, m);
  std::sort(m.serve.outputs.begin(), m.serve.outputs.end(),
            [](const SequenceOutput& a, const SequenceOutput& b) {
              return a.request_id != b.request_id ? a.request_id < b.request_id : a.sample < b.sample;
            });
  if (m.check) std::sort(m.check->request_ids.begin(), m.check->request_ids.end());
  m.step_ms_p50 = percentile(m.serve.step_ms, 50);
  m.step_ms_p99 = percentile(m.serve.step_ms, 99);
  m.ttft_ms_p50 = percentile(m.serve.ttft_ms, 50);
  m.ttft_ms_p99 = percentile(m.serve.ttft_ms, 99);
  if (!o.outputs_path.empty() && o.world->rank() == 0)
    write_outputs(o.outputs_path, m.serve, o.parallel_samples);
  if (!o.keep_outputs)
    for (auto& q : m.serve.outputs) std::vector<float>().swap(q.rows);
  return m;
}

}  // namespace

SimulateResult run_simulation(const SimulateOptions& o) {
  return o.dp > 1 ? run_data_parallel(o) : run_group(o);
}

namespace {

// The prefix cache of one serving pass over `runner`'s pool (none when the plan has it off); `cache`
// must outlive the pass and go before the runner. The snapshots' budget is their slots' bytes.
void attach_cache(const Plan& p, ModelRunner& runner, ServeOptions& so,
                  std::optional<mem_cache::RadixCache>& cache) {
  if (!p.cache) return;
  cache.emplace(runner.pools().recurrent_state_pool, static_cast<size_t>(p.cache_slots * p.slot_bytes));
  so.scheduler.cache = &*cache;
}

// After a completed pass: every state slot is a request's or a snapshot's, every request index is back,
// and the cache's tree is consistent with nothing pending or locked. The first inconsistency is named.
void account(ModelRunner& runner, const mem_cache::RadixCache* cache, SimulateResult& res) {
  auto& pools = runner.pools();
  const int64_t snapshots = cache ? cache->snapshots() : 0;
  res.leaked_slots = pools.recurrent_state_pool.size() - pools.recurrent_state_pool.available() - snapshots;
  res.leaked_request_indices = pools.req_to_token_pool.size() - pools.req_to_token_pool.available();
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
    res.prefix_cache_memory = p.cache_slots * p.slot_bytes;
    res.cache_interval = o.cache_interval;
  }

  log("building " + std::to_string(p.layers) + (p.layers == 1 ? " KDA layer (" : " KDA layers (") +
      res.model + ", " + to_string(o.precision) + ", hidden " + std::to_string(p.cfg.hidden_size) + ", " +
      std::to_string(p.cfg.num_heads) + " heads x " + std::to_string(p.cfg.head_dim) + ")");
  const auto t0 = Clock::now();
  auto stack = o.model_dir.empty() ? models::KdaStack::synthetic(p.cfg, p.layers, o.precision, o.seed, o.tp,
                                                                 p.vocab, o.weights)
                                   : models::KdaStack::from_checkpoint(o.model_dir, p.layers, o.precision,
                                                                       o.tp, p.vocab, o.seed, o.weights);
  res.build_s = seconds_since(t0);
  res.weight_bytes = stack->layer_weight_bytes();

  ServeOptions so;
  so.scheduler = p.sched;
  so.seed = o.seed;
  so.stop = o.stop;
  if (o.tp.size > 1) {
    so.agree_stop = [&o](bool v) { return o.tp.comm->allreduce_or(v); };
    so.agree_tokens = [&o](std::vector<int32_t>& t) { agree_tokens(o.tp, t); };
  }
  const bool keep_all = o.keep_outputs || !o.outputs_path.empty();
  so.keep.assign(o.requests.size(), keep_all ? 1 : 0);
  for (const int64_t r : p.check_requests) so.keep[r] = 1;
  // replay: the true continuations first, from the same workload served without speculation.
  std::vector<std::vector<int32_t>> truth;
  if (o.spec.algorithm == SpecAlgorithm::kReplay) {
    log("replay: serving the workload without speculation first, for the true continuations");
    // The same pool and prefix cache as the speculative pass: the cache's snapshot positions end
    // chunk_kda's chunks, which moves the prompt's states by fp32 rounding, and bf16 near-ties would
    // carry such a difference into other tokens.
    ServeOptions pre = so;
    pre.progress = nullptr;
    pre.keep.assign(o.requests.size(), 0);
    pre.probe_decode = true;
    const auto tp0 = Clock::now();
    ModelRunner runner(*stack, p.slots + p.cache_slots, p.kernel, 2, p.verify_rows);
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
    ModelRunner runner(*stack, p.slots + p.cache_slots, p.kernel, p.verify_tokens, p.verify_rows);
    res.pool_bytes = static_cast<int64_t>(runner.pools().recurrent_state_pool.total_bytes());
    log("state pool: " + std::to_string(p.slots) + " request + " + std::to_string(p.cache_slots) +
        " snapshot slots x " + std::to_string(p.slot_bytes) + " bytes; " + std::to_string(res.requests) +
        " requests");
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
  res.step_ms_p50 = percentile(res.serve.step_ms, 50);
  res.step_ms_p99 = percentile(res.serve.step_ms, 99);
  res.ttft_ms_p50 = percentile(res.serve.ttft_ms, 50);
  res.ttft_ms_p99 = percentile(res.serve.ttft_ms, 99);
  if (!o.outputs_path.empty() && o.tp.rank == 0) write_outputs(o.outputs_path, res.serve, o.parallel_samples);
  if (o.check > 0 && !res.serve.interrupted) {
    log("self-check: re-running " + std::to_string(o.check) + " request(s) alone on a fresh pool");
    bool interrupted = false;
    CheckReport rep = self_check(o, p, *stack, res.serve, &interrupted);
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

nlohmann::json to_json(const SimulateResult& r) {
  const auto& s = r.serve;
  const double wall = s.wall_s > 0 ? s.wall_s : 1e-9;
  nlohmann::json j = {
      {"requests_completed", s.requests_completed},
      {"prefill_tokens", s.prefill_tokens},
      {"prefill_tokens_computed", s.prefill_tokens_computed},
      {"decode_tokens", s.decode_tokens},
      {"prefill_tok_s", static_cast<double>(s.prefill_tokens_computed) / wall},
      {"decode_tok_s", static_cast<double>(s.decode_tokens) / wall},
      {"step_ms_p50", r.step_ms_p50},
      {"step_ms_p99", r.step_ms_p99},
      {"ttft_ms_p50", r.ttft_ms_p50},
      {"ttft_ms_p99", r.ttft_ms_p99},
      {"pool_bytes", r.pool_bytes},
      {"peak_slots", s.peak_slots},
      {"slot_reuses", s.slot_reuses},
      {"requests", r.requests},
      {"pool_slots", r.pool_slots},
      {"slot_bytes", r.slot_bytes},
      {"steps", s.steps},
      {"extend_steps", s.extend_steps},
      {"decode_steps", s.decode_steps},
      {"mixed_steps", s.mixed_steps},
      {"wall_s", s.wall_s},
      {"build_s", r.build_s},
      {"interrupted", s.interrupted},
      {"model", r.model},
      {"precision", to_string(r.precision)},
      {"weights", to_string(r.weights)},
      {"weight_bytes", r.weight_bytes},
      {"layers", r.layers},
      {"hidden", r.hidden},
      {"vocab", r.vocab},
      {"workload", r.workload},
      {"mixed", r.mixed},
      {"token_budget", r.token_budget},
      {"max_batch", r.max_batch},
      {"parallel_samples", r.parallel_samples},
      {"radix_cache_disabled", r.radix_cache_disabled},
      {"prefix_cache_hit_tokens", s.prefix_cache_hit_tokens},
      {"prefix_cache_hit_rate", s.prefill_tokens > 0 ? static_cast<double>(s.prefix_cache_hit_tokens) /
                                                           static_cast<double>(s.prefill_tokens)
                                                     : 0.0},
      {"prefix_cache_bytes", s.prefix_cache_bytes},
      {"prefix_cache_snapshots", s.prefix_cache_snapshots},
      {"prefix_cache_evictions", s.prefix_cache_evictions},
      {"prefix_cache_memory", r.prefix_cache_memory},
      {"cache_interval", r.cache_interval},
      {"speculative", to_string(r.spec.algorithm)},
      {"spec_draft_tokens", s.spec_draft_tokens},
      {"spec_accepted_tokens", s.spec_accepted_tokens},
      {"spec_accept_rate", s.spec_draft_tokens > 0 ? static_cast<double>(s.spec_accepted_tokens) /
                                                         static_cast<double>(s.spec_draft_tokens)
                                                   : 0.0},
      {"spec_tokens_per_step", s.spec_verify_rows > 0 ? static_cast<double>(s.spec_emitted_tokens) /
                                                            static_cast<double>(s.spec_verify_rows)
                                                      : 0.0},
      {"spec_verify_steps", s.spec_verify_steps},
      {"spec_state_bytes", s.spec_state_bytes},
      {"leaked_slots", r.leaked_slots},
      {"leaked_request_indices", r.leaked_request_indices},
      {"cache_consistent", r.cache_consistent},
      {"accounting_ok", r.accounting_ok()},
      {"rss_bytes_end", r.rss_bytes.empty() ? 0 : r.rss_bytes.back()},
      {"rss_bytes_peak", r.rss_bytes.empty() ? 0 : *std::max_element(r.rss_bytes.begin(), r.rss_bytes.end())},
      {"rss_growth", r.rss_growth()},
      {"ok", r.ok()},
  };
  if (!r.accounting_error.empty()) j["accounting_error"] = r.accounting_error;
  {  // the RSS curve, at most 100 points
    nlohmann::json curve = nlohmann::json::array();
    const size_t n = r.rss_bytes.size(), stride = std::max<size_t>(1, (n + 99) / 100);
    for (size_t i = 0; i < n; i += stride) curve.push_back(r.rss_bytes[i]);
    if (n > 0 && (n - 1) % stride != 0) curve.push_back(r.rss_bytes.back());
    j["rss_samples"] = curve;
  }
  if (r.spec.enabled()) {
    j["draft_tokens"] = r.spec.draft_tokens;
    j["draft_topk"] = r.spec.topk;
    if (r.spec.algorithm == SpecAlgorithm::kReplay) {
      j["accept_rate"] = r.spec.accept_rate;
      j["replay_prerun_s"] = r.replay_prerun_s;
      j["replay_diverged"] = s.replay_diverged;
    }
  }
  if (r.check) {
    j["check_worst_error_ratio"] = r.check->worst_ratio;
    j["check_metric"] = r.check->metric;
    j["check_requests"] = r.check->request_ids;
    j["check_ok"] = r.check->ok;
    j["check_s"] = r.check->wall_s;
    j["check_tokens_matched"] = r.check->tokens_matched;
    j["check_tokens_total"] = r.check->tokens_total;
    j["check_argmax_matched"] = r.check->tokens_all_matched();
  } else {
    j["check_worst_error_ratio"] = nullptr;
  }
  return j;
}

}  // namespace kda::serving
