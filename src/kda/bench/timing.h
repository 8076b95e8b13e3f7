// Timing for `kda bench` and the benchmark programs: best-of-repetitions wall times, and functions timed
// in turns so that ratios between them hold on a shared, noisy machine; and the rows' printer.
#pragma once

#include <cstdio>
#include <functional>
#include <vector>

namespace kda::bench {

// Best wall time of fn over repetitions (at least min_reps, until min_seconds have passed), after one
// warm-up call.
double best_seconds(const std::function<void()>& fn, int min_reps = 3, double min_seconds = 0.5);

// Best wall time of each of fns, run in turns (one call of each per round) for at least min_rounds rounds
// and min_seconds: on a shared machine the load changes from second to second, and taking turns lets
// every function meet the same quiet moments, so ratios between them hold.
std::vector<double> best_interleaved(const std::vector<std::function<void()>>& fns, int min_rounds,
                                     double min_seconds);

// Prints to stdout unless the results go out as JSON.
struct Say {
  bool quiet = false;
  template <typename... A>
  void operator()(const char* fmt, A... args) const {
    if (!quiet) std::printf(fmt, args...);
    std::fflush(stdout);
  }
};

}  // namespace kda::bench
