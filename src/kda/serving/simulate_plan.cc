#include "kda/serving/simulate_plan.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

#include "kda/io/kimi_linear_48b.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kda_stack.h"
#include "kda/models/kimi_linear.h"
#include "kda/serving/trace.h"

namespace kda::serving {

int32_t slots_for(const RequestSpec& r, int32_t n) { return r.output_len > 0 ? n : 1; }

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
    p.cfg = o.synthetic_config.value_or(io::kimi_linear_48b_config());
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

}  // namespace kda::serving
