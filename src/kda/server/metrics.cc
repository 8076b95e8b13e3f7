#include "kda/server/metrics.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <utility>

namespace kda::server {

namespace {

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void metric(std::string& out, const char* name, const char* type, const char* help, int64_t value) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " +
         std::to_string(value) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end()) ||
      std::adjacent_find(bounds_.begin(), bounds_.end()) != bounds_.end())
    throw std::invalid_argument("Histogram: bounds must be strictly ascending");
}

void Histogram::observe(double v) {
  const auto it = std::lower_bound(bounds_.begin(), bounds_.end(), v);  // le: v <= bound
  ++counts_[static_cast<size_t>(it - bounds_.begin())];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  int64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    char le[32];
    std::snprintf(le, sizeof le, "%.12g", bounds_[i]);
    out += name + "_bucket{le=\"" + le + "\"} " + std::to_string(cum) + "\n";
  }
  cum += counts_.back();
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cum) + "\n";
  out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

// Bucket bounds in seconds, as vLLM's (design values, not measurements): TTFT 0.001 to 160, inter-token
// latency 0.01 to 80; a request's preparation (parsing, the chat template, tokenization) 0.0001 to 1. CPU
// decode steps of a large model are slow, so the upper buckets matter.
Metrics::Metrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,
             0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0}),
      itl_({0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3, 0.4,
            0.5,   0.75,  1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0}),
      prepare_({0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0}) {}

void Metrics::observe_ttft(double seconds) {
  std::lock_guard lock(mu_);
  ttft_.observe(seconds);
}

void Metrics::observe_inter_token(double seconds) {
  std::lock_guard lock(mu_);
  itl_.observe(seconds);
}

void Metrics::observe_prepare(double seconds) {
  std::lock_guard lock(mu_);
  prepare_.observe(seconds);
}

void Metrics::count_finished(const std::string& finish_reason) {
  std::lock_guard lock(mu_);
  ++finished_[finish_reason];
}

void Metrics::count_rejected(int status) {
  std::lock_guard lock(mu_);
  ++rejected_[status];
}

std::string Metrics::render(const serving::EngineStats& s) const {
  std::string out;
  out.reserve(4096);
  metric(out, "kda_requests_running", "gauge", "Requests being prefilled or decoded.", s.running);
  metric(out, "kda_requests_waiting", "gauge", "Requests queued for a slot.", s.waiting);
  metric(out, "kda_prompt_tokens_total", "counter", "Prompt tokens of the admitted requests.",
         s.prompt_tokens);
  metric(out, "kda_prompt_tokens_computed_total", "counter",
         "Prompt tokens that ran through the layers (the rest came from the prefix cache).",
         s.prompt_tokens_computed);
  metric(out, "kda_generation_tokens_total", "counter", "Generated tokens.", s.generation_tokens);
  metric(out, "kda_spec_draft_tokens_total", "counter", "Speculative decoding: drafted tokens verified.",
         s.spec_draft_tokens);
  metric(out, "kda_spec_accepted_tokens_total", "counter",
         "Speculative decoding: drafted tokens accepted (and emitted).", s.spec_accepted_tokens);
  metric(out, "kda_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
         s.cached_tokens);
  metric(out, "kda_slots_used", "gauge", "Request slots (recurrent state) in use.", s.slots_used);
  metric(out, "kda_slots_total", "gauge", "Request slots (recurrent state) in the pool.", s.slots_total);
  metric(out, "kda_kv_tokens_used", "gauge",
         "MLA KV token slots requests hold (shared with the prefix cache or not).", s.kv_tokens_used);
  metric(out, "kda_kv_tokens_total", "gauge", "MLA KV token slots in the pool.", s.kv_tokens_total);
  metric(out, "kda_prefix_cache_bytes", "gauge",
         "Bytes the prefix cache holds (state snapshots and cached tokens' MLA KV rows).",
         s.prefix_cache_bytes);
  metric(out, "kda_prefix_cache_snapshots", "gauge", "State snapshots the prefix cache holds.",
         s.prefix_cache_snapshots);
  metric(out, "kda_prefix_cache_evictions_total", "counter", "Prefix-cache snapshots evicted.",
         s.prefix_cache_evictions);
  metric(out, "kda_prefix_cache_kv_tokens", "gauge", "MLA KV token slots the prefix cache holds.",
         s.prefix_cache_kv_tokens);
  metric(out, "kda_engine_steps_total", "counter", "Engine steps run.", s.steps);
  metric(out, "kda_admission_waits_total", "counter",
         "Times the engine, woken from idle, held its first step for more arrivals (--admission-window-ms).",
         s.admission_waits);
  out +=
      "# HELP kda_admission_wait_seconds_total Seconds the engine held first steps for more arrivals.\n"
      "# TYPE kda_admission_wait_seconds_total counter\nkda_admission_wait_seconds_total " +
      num(s.admission_wait_s) + "\n";
  std::lock_guard lock(mu_);
  out += "# HELP kda_requests_total Finished requests by finish reason.\n# TYPE kda_requests_total counter\n";
  for (const char* r : {"stop", "length", "abort"}) {
    const auto it = finished_.find(r);
    out += std::string("kda_requests_total{finish_reason=\"") + r + "\"} " +
           std::to_string(it == finished_.end() ? 0 : it->second) + "\n";
  }
  out +=
      "# HELP kda_request_errors_total Requests answered with an error status.\n"
      "# TYPE kda_request_errors_total counter\n";
  for (const auto& [status, n] : rejected_)
    out += "kda_request_errors_total{status=\"" + std::to_string(status) + "\"} " + std::to_string(n) + "\n";
  ttft_.render(out, "kda_time_to_first_token_seconds", "Time from a request's arrival to its first token.");
  itl_.render(out, "kda_inter_token_latency_seconds", "Time between two tokens of one continuation.");
  prepare_.render(
      out, "kda_request_prepare_seconds",
      "Time from a request's arrival to its submission to the engine (parsing, the chat template, "
      "tokenization).");
  return out;
}

}  // namespace kda::server
