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

namespace {

// Sums S runs of len floats each (run s at p + s len; len a multiple of 16 floats times the vectors a
// stream has), read in lockstep into 2 S independent vector accumulators (8 for one stream): loads that do
// not wait on each other's adds, so that memory, not the add's latency, sets the pace. One accumulator over
// one stream (an OpenMP simd reduction) read well below what the LM head's kernel streamed on an AMX host,
// and 4 streams read the head's own rate there (docs/performance.md, "The read ceiling, measured again"); on
// huge pages one stream of 8 accumulators read more than 4 on a Zen 4 host ("The read ceiling on huge
// pages").
template <int S>
constexpr int kAccumulators = S == 1 ? 8 : 2 * S;
#if defined(__GNUC__) && defined(__x86_64__)
#define KDA_HAVE_READ_PROBE 1
template <int S>
__attribute__((target("avx512f"))) float sum_avx512(const float* p, int64_t len) {
  constexpr int A = kAccumulators<S>, V = A / S;  // vectors per stream and step
  __m512 a[A];
  for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 16 * V)
    for (int s = 0; s < S; ++s)
      for (int v = 0; v < V; ++v)
        a[s * V + v] = _mm512_add_ps(a[s * V + v], _mm512_loadu_ps(p + s * len + i + 16 * v));
  for (int j = 1; j < A; ++j) a[0] = _mm512_add_ps(a[0], a[j]);
  return _mm512_reduce_add_ps(a[0]);
}
template <int S>
__attribute__((target("avx2"))) float sum_avx2(const float* p, int64_t len) {
  constexpr int A = kAccumulators<S>, V = A / S;
  __m256 a[A];
  for (auto& v : a) v = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; i += 8 * V)
    for (int s = 0; s < S; ++s)
      for (int v = 0; v < V; ++v)
        a[s * V + v] = _mm256_add_ps(a[s * V + v], _mm256_loadu_ps(p + s * len + i + 8 * v));
  for (int j = 1; j < A; ++j) a[0] = _mm256_add_ps(a[0], a[j]);
  alignas(32) float v[8];
  _mm256_store_ps(v, a[0]);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}
#endif

template <int S>
float sum_portable(const float* p, int64_t len) {
  constexpr int A = kAccumulators<S>, V = A / S;
  float a[A] = {};
  for (int64_t i = 0; i < len; i += V)
    for (int s = 0; s < S; ++s)
      for (int v = 0; v < V; ++v) a[s * V + v] += p[s * len + i + v];
  float t = 0.0f;
  for (float v : a) t += v;
  return t;
}

// One thread's part: S runs of len floats.
template <int S>
float sum_part(const float* p, int64_t len) {
#if defined(KDA_HAVE_READ_PROBE)
  if (isa_supported_by_cpu(Isa::Avx512)) return sum_avx512<S>(p, len);
  if (isa_supported_by_cpu(Isa::Avx2)) return sum_avx2<S>(p, len);
#endif
  return sum_portable<S>(p, len);
}

}  // namespace

ReadBandwidth::ReadBandwidth(size_t bytes)
    : buf(allocate_weights(bytes / sizeof(float) * sizeof(float))), n(bytes / sizeof(float)) {
  float* p = static_cast<float*>(buf.get());
  std::fill(p, p + n, 1.0f);
}

void ReadBandwidth::run() {
  // Each thread a contiguous part: 4 runs of a multiple of 32 floats, or one of a multiple of 128, by turns.
  constexpr int64_t kUnit = 128;
  const bool four = runs++ % 2 == 0;
  const int64_t units = static_cast<int64_t>(n) / kUnit;
  const float* p = static_cast<const float*>(buf.get());
  float total = 0.0f;
#pragma omp parallel reduction(+ : total)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
    const float* part = p + u0 * kUnit;
    const int64_t floats = (u1 - u0) * kUnit;
    total += four ? sum_part<4>(part, floats / 4) : sum_part<1>(part, floats);
  }
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
