// The server's Prometheus metrics (GET /metrics, text format 0.0.4): the engine's gauges and totals
// (requests running / waiting, tokens in and out, pool and prefix-cache use) read from EngineStats at
// scrape time, and what only the server sees: finished requests by finish reason, rejected requests by
// status, the time-to-first-token and inter-token latency histograms, and the time a request takes to reach
// the engine (so that what the server adds to TTFT is the TTFT less the engine's part). Thread safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kda/serving/engine.h"

namespace kda::server {

// A cumulative Prometheus histogram: `bounds` are the buckets' upper bounds (ascending; +Inf is added).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // "# HELP", "# TYPE", NAME_bucket{le=...} (cumulative), NAME_sum, NAME_count.
  void render(std::string& out, const std::string& name, const std::string& help) const;
  int64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket (not cumulative); the last: above every bound
  double sum_ = 0.0;
  int64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();
  void observe_ttft(double seconds);                      // request received -> its first token
  void observe_inter_token(double seconds);               // between two tokens of one continuation
  void observe_prepare(double seconds);                   // request received -> submitted to the engine
  void count_finished(const std::string& finish_reason);  // per request: "stop" | "length" | "abort"
  void count_rejected(int status);                        // a request answered with an error status
  std::string render(const serving::EngineStats& s) const;

 private:
  mutable std::mutex mu_;
  Histogram ttft_, itl_, prepare_;
  std::map<std::string, int64_t> finished_;
  std::map<int, int64_t> rejected_;
};

}  // namespace kda::server
