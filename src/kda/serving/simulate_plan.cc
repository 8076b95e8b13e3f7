#include "kda/serving/simulate_plan.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>

#include "kda/io/kimi_linear_48b.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kimi_linear.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/serving/trace.h"

namespace kda::serving {

int32_t slots_for(const RequestSpec& r, int32_t n) { return r.output_len > 0 ? n : 1; }

namespace {

// One request slot's bytes over `kda_layers` KDA layers: recurrent state fp32 and conv state (fp32, or
// bf16 in the bf16 precision), as the RecurrentStatePool lays them out.
int64_t kda_slot_bytes(const io::KimiLinearConfig& cfg, int kda_layers, Precision precision) {
  const int64_t H = cfg.num_heads, K = cfg.head_dim, W = cfg.short_conv_kernel_size;
  const int64_t rec = H * K * K * static_cast<int64_t>(sizeof(float));
  const int64_t conv = (W - 1) * 3 * H * K * (precision == Precision::BF16 ? 2 : 4);
  return kda_layers * (rec + conv);
}

// Whatever --tp splits besides the KDA heads (models::check_tensor_parallel): the MLA heads and every
// MLP's intermediate rows.
void check_model_tensor_parallel(const io::KimiLinearConfig& cfg, int layers, int tp) {
  if (tp <= 1) return;
  auto need = [&](int64_t what, const char* name) {
    if (what % tp != 0)
      throw std::invalid_argument("--tp " + std::to_string(tp) + ": " + name + " " + std::to_string(what) +
                                  " is not divisible by the ranks");
  };
  bool dense = false, moe = false, mla = false;
  for (int i = 0; i < layers; ++i) {
    mla = mla || cfg.is_mla_layer(i);
    (cfg.is_moe_layer(i) ? moe : dense) = true;
  }
  if (mla) need(cfg.num_attention_heads, "num_attention_heads (MLA heads)");
  if (dense) need(cfg.intermediate_size, "intermediate_size (dense MLP)");
  if (moe) need(cfg.moe_intermediate_size, "moe_intermediate_size (experts)");
}

}  // namespace

Plan make_plan(const SimulateOptions& o) {
  validate_workload(o.requests);
  Plan p;
  if (!o.model_dir.empty() && !std::filesystem::is_directory(o.model_dir))
    throw std::invalid_argument("--model " + o.model_dir + ": not a directory");
  p.vocab = resolve_vocab(o.model_dir, o.vocab, o.synthetic_config);
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
    p.cfg = io::load_model_config(o.model_dir);
    if (o.num_experts != 0)
      throw std::invalid_argument("--experts is for synthetic weights: the checkpoint " + o.model_dir +
                                  " has its own " + std::to_string(p.cfg.num_experts));
  } else {
    p.cfg = o.synthetic_config.value_or(io::kimi_linear_48b_config());
    if (!p.cfg.has_model_fields)
      throw std::invalid_argument(
          "synthetic config: the whole model's fields (MLA, MoE, vocab) are missing (has_model_fields)");
  }
  if (o.layers < 0 || o.layers > p.cfg.num_hidden_layers)
    throw std::invalid_argument("--layers " + std::to_string(o.layers) + ": must be in 0.." +
                                std::to_string(p.cfg.num_hidden_layers) + " (0: all decoder layers)");
  p.layers = o.layers == 0 ? p.cfg.num_hidden_layers : o.layers;
  for (int i = 0; i < p.layers; ++i) {
    (p.cfg.is_mla_layer(i) ? p.mla_layers : p.kda_layers) += 1;
    p.moe_layers += p.cfg.is_moe_layer(i) ? 1 : 0;
  }
  if (o.num_experts < 0 || o.num_experts > io::kMaxExperts)
    throw std::invalid_argument("--experts must be in 1.." + std::to_string(io::kMaxExperts) + ", got " +
                                std::to_string(o.num_experts));
  if (o.num_experts > 0 && p.cfg.num_experts == 0)
    throw std::invalid_argument("--experts " + std::to_string(o.num_experts) +
                                ": the config has no MoE layers");
  p.num_experts = o.num_experts > 0                                        ? o.num_experts
                  : o.model_dir.empty() && !o.synthetic_config.has_value() ? kDefaultExperts
                                                                           : p.cfg.num_experts;
  if (p.moe_layers == 0) p.num_experts = 0;
  if (o.num_experts > p.cfg.num_experts)
    throw std::invalid_argument("--experts " + std::to_string(o.num_experts) + ": the config has " +
                                std::to_string(p.cfg.num_experts) + " routed experts per MoE layer");
  // The routed experts' weights alone, against the machine's memory: a model that cannot be resident is
  // refused before it is drawn (at 256 experts the real model's experts are ~90 GB in bf16).
  {
    const double per_weight = o.weights == Weights::Int4       ? 0.56
                              : o.weights == Weights::Int8     ? 1.0
                              : o.precision == Precision::BF16 ? 2.0
                                                               : 4.0;
    const double experts_bytes = double(p.moe_layers) * p.num_experts * 3.0 * double(p.cfg.hidden_size) *
                                 double(p.cfg.moe_intermediate_size) * per_weight / std::max(o.tp.size, 1);
    const double phys = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
    if (phys > 0 && experts_bytes > phys)
      throw std::invalid_argument("--experts " + std::to_string(p.num_experts) +
                                  ": the routed experts alone "
                                  "would take " +
                                  std::to_string(static_cast<int64_t>(experts_bytes / 1e9)) +
                                  " GB, more than this machine's " +
                                  std::to_string(static_cast<int64_t>(phys / 1e9)) + " GB of memory");
  }
  models::check_tensor_parallel(p.cfg, o.tp.size);
  check_model_tensor_parallel(p.cfg, p.layers, o.tp.size);
  p.slot_bytes = kda_slot_bytes(p.cfg, p.kda_layers, o.precision);
  if (p.slot_bytes == 0)
    throw std::invalid_argument("--layers " + std::to_string(p.layers) +
                                ": no KDA layer among them (the serving pool's request slots are KDA slots)");
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
  const int64_t row_bytes = int64_t{p.verify_tokens} * p.kda_layers * static_cast<int64_t>(sizeof(float)) *
                            mem_cache::RecurrentStatePool::verify_token_elems(
                                3 * int64_t{p.cfg.projection_size()}, p.cfg.num_heads, p.cfg.head_dim);
  int64_t budget_slots = o.state_memory / (p.slot_bytes + row_bytes);
  if (budget_slots > o.max_batch)  // past max_batch, slots cost no verify row
    budget_slots = o.max_batch + (o.state_memory - o.max_batch * (p.slot_bytes + row_bytes)) / p.slot_bytes;
  if (budget_slots < 1)
    throw std::invalid_argument(
        "--state-memory " + std::to_string(o.state_memory) +
        " bytes is too small for one state slot: a slot needs " + std::to_string(p.slot_bytes) + " bytes (" +
        std::to_string(p.kda_layers) + " KDA layers x (recurrent + conv state))" +
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
  // MLA token KV pool: as many token slots as the budget holds, at most what the workload could hold.
  if (p.mla_layers > 0) {
    p.kv_token_bytes =
        int64_t{p.mla_layers} * p.cfg.kv_cache_dim() * (o.precision == Precision::BF16 ? 2 : 4);
    if (o.kv_memory < 1)
      throw std::invalid_argument("--kv-memory must be positive, got " + std::to_string(o.kv_memory));
    const int64_t budget = o.kv_memory / p.kv_token_bytes;
    int64_t kv_need = 0, kv_total = 0;
    for (const auto& r : o.requests) {
      const int32_t extra = o.spec.enabled() ? o.spec.max_verify_tokens() - 1 : 0;
      kv_need = std::max(kv_need, kv_tokens_for(r, o.parallel_samples, extra));
      kv_total += kv_tokens_for(r, o.parallel_samples, extra);
    }
    if (budget < kv_need)
      throw std::invalid_argument("--kv-memory " + std::to_string(o.kv_memory) + " bytes holds " +
                                  std::to_string(budget) + " MLA KV token slots (" +
                                  std::to_string(p.kv_token_bytes) + " bytes each over " +
                                  std::to_string(p.mla_layers) + " MLA layers), but a request needs " +
                                  std::to_string(kv_need) + " (prompt + output tokens per continuation)");
    p.kv_tokens = std::min(budget, kv_total);
  }
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
    // The cached tokens' KV rows (models with MLA layers) count in the same budget: at most the KV pool.
    p.cache_budget =
        std::min(o.prefix_cache_memory, p.cache_slots * p.slot_bytes + p.kv_tokens * p.kv_token_bytes);
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
  p.sched.verify_extra_tokens = o.spec.enabled() ? o.spec.max_verify_tokens() - 1 : 0;

  // The requests to re-run alone: a seeded draw (Fisher-Yates on the raw stream, portable).
  std::vector<int64_t> idx(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) idx[i] = i;
  std::mt19937_64 rng(o.seed ^ 0xc4ec4ULL);
  for (int64_t i = R - 1; i > 0; --i) std::swap(idx[i], idx[rng() % static_cast<uint64_t>(i + 1)]);
  p.check_requests.assign(idx.begin(), idx.begin() + o.check);
  std::sort(p.check_requests.begin(), p.check_requests.end());
  return p;
}

int64_t resolve_vocab(const std::string& model_dir, int64_t vocab,
                      const std::optional<io::KimiLinearConfig>& synthetic_config) {
  if (vocab < 0 || vocab > (int64_t{1} << 24))
    throw std::invalid_argument("--vocab must be in 1..2^24, got " + std::to_string(vocab));
  const int64_t ckpt = model_dir.empty() ? 0 : io::load_model_config(model_dir).vocab_size;
  if (ckpt > 0 && vocab > 0 && vocab != ckpt)
    throw std::invalid_argument("--vocab " + std::to_string(vocab) + ": the checkpoint " + model_dir +
                                " has a vocabulary of " + std::to_string(ckpt));
  if (ckpt > (int64_t{1} << 24))
    throw std::invalid_argument(model_dir + ": a vocabulary of " + std::to_string(ckpt) +
                                " is more than 2^24");
  if (ckpt > 0) return ckpt;
  if (vocab > 0) return vocab;
  const int64_t v = synthetic_config.value_or(io::kimi_linear_48b_config()).vocab_size;
  if (v < 1) throw std::invalid_argument("synthetic config: no vocab_size (and no --vocab)");
  return v;
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

models::ModelOptions model_options(const Plan& p, const SimulateOptions& o) {
  models::ModelOptions mo;
  mo.precision = o.precision;
  mo.weights = o.weights;
  mo.quantize_lm_head = o.quantize_lm_head;
  mo.tp = o.tp;
  mo.num_layers = p.layers;
  mo.kernel = p.kernel;
  if (o.model_dir.empty()) {
    mo.num_experts = p.num_experts;
    mo.vocab = p.vocab;
  }
  return mo;
}

}  // namespace kda::serving
