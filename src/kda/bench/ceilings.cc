#include "kda/bench/ceilings.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kda/bench/timing.h"
#include "kda/common/isa.h"
#include "kda/kernels/kda/avx512.h"

namespace kda::bench {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

double copy_gbps(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  const int nt = omp_get_max_threads();
  const double s = best_seconds(
      [&] {
#pragma omp parallel num_threads(nt)
        {
          const size_t part = (bytes + nt - 1) / nt;
          const size_t lo = std::min(bytes, part * omp_get_thread_num());
          const size_t hi = std::min(bytes, lo + part);
          std::memcpy(b.data() + lo, a.data() + lo, hi - lo);
        }
      },
      3, 1.0);
  return 2.0 * bytes / s / 1e9;
}

void ReadBandwidth::run() {
  const int64_t n = static_cast<int64_t>(buf.size());
  const float* p = buf.data();
  float total = 0.0f;
#pragma omp parallel for simd schedule(static) reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += p[i];
  sink += total;
}

namespace {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KDA_HAVE_FMA512_PROBE 1
__attribute__((target("avx512f"))) double fma512_peak_gflops() {
  constexpr int kChains = 16;
  constexpr int64_t kIters = 1 << 24;
  const int nt = omp_get_max_threads();
  double best = INFINITY;
  float sink = 0.0f;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(nt) reduction(+ : sink)
    {
      const float seed = 1.0f + 1e-3f * static_cast<float>(omp_get_thread_num());
      __m512 acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(seed * static_cast<float>(c));
      const __m512 m = _mm512_set1_ps(0.999f), a = _mm512_set1_ps(1e-3f);
      for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 16
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], m, a);
      }
      for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_ps(acc[c]);
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (sink == 0.0f) std::fprintf(stderr, " ");  // keeps the loop's result alive
  return 2.0 * 16 * kChains * static_cast<double>(kIters) * nt / best / 1e9;
}
#endif
}  // namespace

double fma_peak_gflops() {
#if defined(KDA_HAVE_FMA512_PROBE)
  if (isa_supported_by_cpu(Isa::Avx512)) return fma512_peak_gflops();
#endif
  return NAN;  // no AVX-512: not measured
}

}  // namespace kda::bench
