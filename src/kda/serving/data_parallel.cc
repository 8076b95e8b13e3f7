#include "kda/serving/data_parallel.h"

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kda/serving/simulate_plan.h"
#include "kda/serving/simulate_report.h"

namespace kda::serving {

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
    {"peak_kv_tokens", &ServeResult::peak_kv_tokens},
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
    {"spec_depth_sum", &ServeResult::spec_depth_sum},
    {"spec_depth_rows", &ServeResult::spec_depth_rows},
    {"replay_diverged", &ServeResult::replay_diverged},
};

// One group's result as bytes (statistics and kept outputs), for the gather to world rank 0.
std::vector<uint8_t> pack(const SimulateResult& r) {
  const auto& s = r.serve;
  nlohmann::json j = {{"wall_s", s.wall_s},
                      {"step_ms", s.step_ms},
                      {"ttft_ms", s.ttft_ms},
                      {"ttft_later_turns_ms", s.ttft_later_turns_ms},
                      {"interrupted", s.interrupted},
                      {"has_check", r.check.has_value()},
                      {"leaked_slots", r.leaked_slots},
                      {"leaked_request_indices", r.leaked_request_indices},
                      {"leaked_kv_tokens", r.leaked_kv_tokens},
                      {"cache_consistent", r.cache_consistent},
                      {"accounting_error", r.accounting_error}};
  for (const auto& [name, field] : kCounters) j[name] = s.*field;
  if (r.check)
    j["check"] = {{"ids", r.check->request_ids},
                  {"metric", r.check->metric},
                  {"worst", r.check->worst},
                  {"bound", r.check->bound},
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
                    {"tokens", q.tokens},
                    {"cached_tokens", q.cached_tokens}});
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
  const auto tl = j.at("ttft_later_turns_ms").get<std::vector<double>>();
  s.ttft_later_turns_ms.insert(s.ttft_later_turns_ms.end(), tl.begin(), tl.end());
  s.interrupted = s.interrupted || j.at("interrupted").get<bool>();
  m.leaked_slots += j.at("leaked_slots").get<int64_t>();
  m.leaked_request_indices += j.at("leaked_request_indices").get<int64_t>();
  m.leaked_kv_tokens += j.at("leaked_kv_tokens").get<int64_t>();
  m.cache_consistent = m.cache_consistent && j.at("cache_consistent").get<bool>();
  if (m.accounting_error.empty()) m.accounting_error = j.at("accounting_error").get<std::string>();
  if (j.at("has_check").get<bool>()) {
    const auto& c = j.at("check");
    if (!m.check) {
      m.check = CheckReport{};
      m.check->metric = c.at("metric").get<std::string>();
      m.check->bound = c.at("bound").get<double>();  // the groups run the same layers
    }
    const auto ids = c.at("ids").get<std::vector<int64_t>>();
    m.check->request_ids.insert(m.check->request_ids.end(), ids.begin(), ids.end());
    m.check->worst = std::max(m.check->worst, c.at("worst").get<double>());
    m.check->worst_ratio = m.check->worst / m.check->bound;
    m.check->ok = m.check->ok && c.at("ok").get<bool>();
    m.check->wall_s = std::max(m.check->wall_s, c.at("wall_s").get<double>());
    m.check->tokens_matched += c.at("tokens_matched").get<int64_t>();
    m.check->tokens_total += c.at("tokens_total").get<int64_t>();
  }
  for (const auto& q : j.at("outputs"))
    s.outputs.push_back({q.at("id").get<int64_t>(), q.at("sample").get<int32_t>(),
                         q.at("prompt_len").get<int32_t>(), q.at("rows_from").get<int32_t>(),
                         q.at("rows").get<std::vector<float>>(), q.at("prompt").get<std::vector<int32_t>>(),
                         q.at("tokens").get<std::vector<int32_t>>(), q.at("cached_tokens").get<int32_t>()});
}

}  // namespace

// Each group serves its share of the workload; world rank 0 merges what the groups report.
SimulateResult run_data_parallel(const SimulateOptions& o,
                                 const std::function<SimulateResult(const SimulateOptions&)>& run_group) {
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
  m.leaked_slots = m.leaked_request_indices = m.leaked_kv_tokens = 0;  // summed over the groups below
  m.cache_consistent = true;
  m.accounting_error.clear();
  for (const auto& b : all)
    if (!b.empty()) unpack_into(b, m);
  std::sort(m.serve.outputs.begin(), m.serve.outputs.end(),
            [](const SequenceOutput& a, const SequenceOutput& b) {
              return a.request_id != b.request_id ? a.request_id < b.request_id : a.sample < b.sample;
            });
  if (m.check) std::sort(m.check->request_ids.begin(), m.check->request_ids.end());
  set_percentiles(m);
  if (!o.outputs_path.empty() && o.world->rank() == 0)
    write_outputs(o.outputs_path, m.serve, o.parallel_samples);
  if (!o.keep_outputs)
    for (auto& q : m.serve.outputs) std::vector<float>().swap(q.rows);
  return m;
}

}  // namespace kda::serving
