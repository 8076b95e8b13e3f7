#include "kda/bench/timing.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace kda::bench {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

double best_seconds(const std::function<void()>& fn, int min_reps, double min_seconds) {
  fn();  // warm-up: page faults, primitive creation, caches
  double best = INFINITY, total = 0.0;
  for (int r = 0; r < min_reps || total < min_seconds; ++r) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
    if (r > 200) break;
  }
  return best;
}

std::vector<double> best_interleaved(const std::vector<std::function<void()>>& fns, int min_rounds,
                                     double min_seconds) {
  for (const auto& fn : fns) fn();  // warm-up
  std::vector<double> best(fns.size(), INFINITY);
  double total = 0.0;
  for (int r = 0; r < min_rounds || total < min_seconds; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const auto t0 = Clock::now();
      fns[i]();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      best[i] = std::min(best[i], s);
      total += s;
    }
    if (r > 200) break;
  }
  return best;
}

}  // namespace kda::bench
