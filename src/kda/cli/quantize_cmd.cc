// kda quantize: models/quantize_checkpoint.h, a summary line, and with --check the two loads side by side.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kda/cli/commands.h"
#include "kda/common/precision.h"
#include "kda/models/kimi_linear_case.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/models/quantize_checkpoint.h"

namespace kda::cli {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The process's CPU time (every thread, user + system): on a shared host the wall clock also counts
// other processes' turns.
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

}  // namespace

int run_quantize(const QuantizeOptions& o) {
  const Weights weights = parse_weights(o.weights);
  auto t0 = std::chrono::steady_clock::now();
  const models::QuantizeSummary s = models::quantize_checkpoint(o.model, o.out, weights);
  std::printf(
      "kda quantize: %s -> %s: %d layers, %lld projections packed as %s, %lld tensors copied, "
      "%.3f GB written in %.2f s\n",
      o.model.c_str(), o.out.c_str(), s.layers, static_cast<long long>(s.packed), o.weights.c_str(),
      static_cast<long long>(s.copied), static_cast<double>(s.bytes) / 1e9, seconds_since(t0));
  if (!o.check) return 0;

  models::ModelOptions mo;
  mo.precision = parse_precision(o.precision);
  mo.weights = weights;
  t0 = std::chrono::steady_clock::now();
  double c0 = cpu_seconds();
  auto converted = models::KimiLinearForCausalLM::from_pretrained(o.model, mo);
  const double t_convert = seconds_since(t0), c_convert = cpu_seconds() - c0;
  t0 = std::chrono::steady_clock::now();
  c0 = cpu_seconds();
  auto mapped = models::KimiLinearForCausalLM::from_pretrained(o.out, mo);
  const double t_mapped = seconds_since(t0), c_mapped = cpu_seconds() - c0;
  std::vector<int32_t> ids(16);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<int32_t>((i * 7919 + 11) % static_cast<size_t>(converted->vocab_size()));
  const models::ModelCaseOptions co{4, 1, false};  // a prefill, then 4 decode steps
  // Each model runs the case twice: the first run of the mapped one also faults its weight pages in, the
  // second shows whether reading weights from the file's pages costs anything once they are resident.
  double t_run[2][2];
  std::vector<float> logits[2];
  for (int m = 0; m < 2; ++m)
    for (int r = 0; r < 2; ++r) {
      t0 = std::chrono::steady_clock::now();
      auto res = models::run_model_case(m == 0 ? *converted : *mapped, ids, {}, co);
      t_run[m][r] = seconds_since(t0);
      logits[m] = std::move(res.logits);
    }
  const bool same = logits[0] == logits[1];
  std::printf(
      "kda quantize --check (%s, %s): load converting %.3f s (cpu %.3f s), mapped %.3f s (cpu %.3f s): "
      "%.1f%% (cpu %.1f%%); %zu tokens (first run, second run): converted %.3f s, %.3f s; mapped %.3f s, "
      "%.3f s; logits %s\n",
      o.precision.c_str(), o.weights.c_str(), t_convert, c_convert, t_mapped, c_mapped,
      100.0 * t_mapped / t_convert, 100.0 * c_mapped / c_convert, ids.size(), t_run[0][0], t_run[0][1],
      t_run[1][0], t_run[1][1], same ? "identical" : "DIFFER");
  return same ? 0 : 1;
}

}  // namespace kda::cli
