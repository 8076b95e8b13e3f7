// Row-and-span loops over the OpenMP threads, for the copies and conversions between kernels: a few rows
// of tens of thousands of values (a verify step's tokens), which one thread moved while the other waited
// for the next parallel region (a verify step's largest serial part). f(row, c0, c1) covers values [c0, c1)
// of row `row`; it must not throw (no exception may leave an OpenMP region). Small loops stay on the calling
// thread.
#pragma once

#include <algorithm>
#include <cstdint>

namespace kda {

template <class F>
void parallel_spans(int64_t rows, int64_t n, F&& f) {
  constexpr int64_t kSpan = 4096, kMinParallel = int64_t{1} << 15;
  if (rows <= 0 || n <= 0) return;
  const int64_t spans = (n + kSpan - 1) / kSpan, items = rows * spans;
#pragma omp parallel for schedule(static) if (items > 1 && rows * n >= kMinParallel)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t r = it / spans, c0 = it % spans * kSpan;
    f(r, c0, std::min(n, c0 + kSpan));
  }
}

}  // namespace kda
