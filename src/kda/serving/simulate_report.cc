#include "kda/serving/simulate_report.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "kda/io/npy.h"

namespace kda::serving {

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

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t i = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(v.size()))) - 1;
  return v[i];
}

void set_percentiles(SimulateResult& r) {
  r.step_ms_p50 = percentile(r.serve.step_ms, 50);
  r.step_ms_p99 = percentile(r.serve.step_ms, 99);
  r.ttft_ms_p50 = percentile(r.serve.ttft_ms, 50);
  r.ttft_ms_p99 = percentile(r.serve.ttft_ms, 99);
  r.ttft_ms_p50_later_turns = percentile(r.serve.ttft_later_turns_ms, 50);
  r.ttft_ms_p99_later_turns = percentile(r.serve.ttft_later_turns_ms, 99);
}

double SimulateResult::rss_growth() const {
  if (rss_bytes.size() < 2) return 0.0;
  const size_t tenth = std::max<size_t>(rss_bytes.size() / 10, 1) - 1;
  const double base = static_cast<double>(rss_bytes[tenth]);
  return base > 0 ? static_cast<double>(rss_bytes.back()) / base - 1.0 : 0.0;
}

void write_outputs(const std::string& path, const ServeResult& s, int32_t parallel_samples) {
  const int32_t n = parallel_samples;
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
      {"ttft_ms_p50_later_turns", r.ttft_ms_p50_later_turns},
      {"ttft_ms_p99_later_turns", r.ttft_ms_p99_later_turns},
      {"later_turns", static_cast<int64_t>(s.ttft_later_turns_ms.size())},
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
      {"quantize_lm_head", r.quantize_lm_head},
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
      {"spec_mean_depth", s.spec_depth_rows > 0
                              ? static_cast<double>(s.spec_depth_sum) / static_cast<double>(s.spec_depth_rows)
                              : 0.0},
      {"spec_state_bytes", s.spec_state_bytes},
      {"leaked_slots", r.leaked_slots},
      {"leaked_request_indices", r.leaked_request_indices},
      {"leaked_kv_tokens", r.leaked_kv_tokens},
      {"model_weight_bytes", r.model_weight_bytes},
      {"active_weight_bytes", r.active_weight_bytes},
      {"active_params", r.active_params},
      {"kda_layers", r.kda_layers},
      {"mla_layers", r.mla_layers},
      {"moe_layers", r.moe_layers},
      {"num_experts", r.num_experts},
      {"experts_per_token", r.experts_per_token},
      {"kv_tokens", r.kv_tokens},
      {"kv_token_bytes", r.kv_token_bytes},
      {"kv_bytes", r.kv_bytes},
      {"peak_kv_tokens", s.peak_kv_tokens},
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
    j["draft_depth"] = to_string(r.spec.depth_mode);
    if (r.spec.algorithm == SpecAlgorithm::kReplay) {
      j["accept_rate"] = r.spec.accept_rate;
      j["replay_prerun_s"] = r.replay_prerun_s;
      j["replay_diverged"] = s.replay_diverged;
    }
  }
  if (r.check) {
    j["check_worst_error_ratio"] = r.check->worst_ratio;
    j["check_metric"] = r.check->metric;
    j["check_worst"] = r.check->worst;
    j["check_bound"] = r.check->bound;
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
