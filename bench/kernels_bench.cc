// Google Benchmark suite for the kernels at the Kimi-Linear shape (kda/io/kimi_linear_48b.h: H = 32,
// K = V = 128, conv width 3 * H * K = 12288):
//   ./build/kda_benchmarks                               everything (under ~2 minutes)
//   ./build/kda_benchmarks --benchmark_filter=Recurrent  one family
// The kernels run on OpenMP threads, so every benchmark reports wall time (UseRealTime). Rates come as
// counters: GFLOP/s for chunk_kda (6K^2 + 3CK + C^2 per head-token, C = 64), GB/s elsewhere; the
// MemcpyReference line gives the machine's memcpy GB/s in the same run (read + write counted, as the
// state traffic of the recurrent kernel is), so that rates can be read as ratios on a noisy machine.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/common/bf16.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/kda/kda.h"
#include "kda/kernels/short_conv.h"

namespace {

using kda::kernels::KdaArgs;
using kda::kernels::KernelImpl;

using Shape = kda::io::KimiLinear48bShape;
using kda::bench::kH;
using kda::bench::kK;  // K = V
constexpr int kChunk = 64;
constexpr int64_t kPoolSlots = 256;  // 256 x 2 MiB = 512 MiB of recurrent states, far beyond the L3

using kda::bench::bench_randn;

// Per-second rate of `per_iteration` units, scaled (1e-9: giga).
benchmark::Counter rate(double per_iteration, double scale = 1e-9) {
  return benchmark::Counter(per_iteration * scale, benchmark::Counter::kIsIterationInvariantRate);
}

// KDA inputs at the model's head shape (shared with `kda bench`).
struct KdaInputs : kda::bench::KdaBenchInputs {
  KdaInputs(int64_t seqs, int64_t len) : KdaBenchInputs(seqs, len, kH, kK) {}
};

// The shared 512 MiB recurrent-state pool, allocated (and faulted in) once for the whole run.
std::vector<float>& state_pool() {
  static std::vector<float> pool(static_cast<size_t>(kPoolSlots) * kH * kK * kK, 0.01f);
  return pool;
}

// ---------------------------------------------------------------------------------------------------
// chunk_kda (prefill): args = {sequences, tokens per sequence}.

void BM_ChunkKda(benchmark::State& state, KernelImpl impl) {
  const int64_t seqs = state.range(0), len = state.range(1), T = seqs * len;
  kda::bench::ChunkCase c(seqs, len);  // the problem `kda bench` times
  for (auto _ : state) {
    c.run(impl);
    benchmark::ClobberMemory();
  }
  const double flops = (6.0 * kK * kK + 3.0 * kChunk * kK + 1.0 * kChunk * kChunk) * kH * T;
  // q, k, v, g and beta read, o written (the state is small next to them at these lengths).
  const double bytes = (5.0 * kH * kK + kH) * sizeof(float) * T;
  state.SetItemsProcessed(state.iterations() * T);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["GFLOP/s"] = rate(flops);
  state.counters["us/token"] = benchmark::Counter(
      T * 1e-6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK_CAPTURE(BM_ChunkKda, optimized, KernelImpl::Optimized)
    ->Args({1, 4096})
    ->Args({16, 256})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
// The reference is far slower: one short sequence, a single iteration.
BENCHMARK_CAPTURE(BM_ChunkKda, naive, KernelImpl::Naive)
    ->Args({1, 128})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// fused_recurrent_kda on a prefill: one sequence of `arg` tokens through the per-token recurrence, the
// same problem as BM_ChunkKda's {1, 4096}, for the ratio of the two forms (same GFLOP/s formula).
void BM_FusedRecurrentKdaPrefill(benchmark::State& state, KernelImpl impl) {
  const int64_t T = state.range(0);
  KdaInputs in(1, T);
  std::vector<float> st(static_cast<size_t>(kH) * kK * kK, 0.0f);
  const int32_t idx = 0;
  const KdaArgs a = in.args(st.data(), &idx, 1);
  for (auto _ : state) {
    kda::kernels::fused_recurrent_kda(a, impl);
    benchmark::ClobberMemory();
  }
  const double flops = (6.0 * kK * kK + 3.0 * kChunk * kK + 1.0 * kChunk * kChunk) * kH * T;
  state.SetItemsProcessed(state.iterations() * T);
  state.counters["GFLOP/s"] = rate(flops);
  state.counters["us/token"] = benchmark::Counter(
      T * 1e-6, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK_CAPTURE(BM_FusedRecurrentKdaPrefill, optimized, KernelImpl::Optimized)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_FusedRecurrentKdaPrefill, naive, KernelImpl::Naive)
    ->Arg(512)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// ---------------------------------------------------------------------------------------------------
// fused_recurrent_kda (decode): arg = batch. As `kda bench` does, the batch's states are spread over
// the 512 MiB pool and the calls rotate over disjoint slot sets, so that no call finds its states in
// cache from the previous one.

// Calls on batches of `state.range(0)` slots from the pool, a shuffle of its slots (seeded) cut into
// consecutive sets; the calls rotate over the first min(max_sets, all) of them.
void run_recurrent(benchmark::State& state, KernelImpl impl, int64_t max_sets, uint64_t seed,
                   KdaArgs::StateLocality locality) {
  const int64_t B = state.range(0);
  KdaInputs in(B, 1);
  std::vector<int32_t> perm(kPoolSlots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed));
  const int64_t n_sets = std::min<int64_t>(max_sets, kPoolSlots / B);
  KdaArgs a = in.args(state_pool().data(), perm.data(), kPoolSlots);
  a.state_locality = locality;
  int64_t which = 0;
  for (auto _ : state) {
    a.state_indices = perm.data() + (which++ % n_sets) * B;
    kda::kernels::fused_recurrent_kda(a, impl);
    benchmark::ClobberMemory();
  }
  const double bytes = 2.0 * B * kH * kK * kK * sizeof(float);  // each state read and written once
  state.SetItemsProcessed(state.iterations() * B);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["GB/s"] = rate(bytes);
}

void BM_FusedRecurrentKda(benchmark::State& state, KernelImpl impl) {
  run_recurrent(state, impl, 4, 11, KdaArgs::StateLocality::Auto);
}
BENCHMARK_CAPTURE(BM_FusedRecurrentKda, optimized, KernelImpl::Optimized)
    ->Arg(1)
    ->Arg(64)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_FusedRecurrentKda, naive, KernelImpl::Naive)
    ->Arg(1)
    ->Arg(64)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The same with the states in memory, as in a model where other layers and the layer's own weights
// pass through the caches between two steps on a slot: every call takes fresh slots from the 512 MiB
// pool, and says so (StateLocality::Memory, as the layer's backend does), so the kernel prefetches.
void BM_FusedRecurrentKdaFromMemory(benchmark::State& state) {
  run_recurrent(state, KernelImpl::Optimized, kPoolSlots, 12, KdaArgs::StateLocality::Memory);
}
BENCHMARK(BM_FusedRecurrentKdaFromMemory)->Arg(1)->Arg(8)->Unit(benchmark::kMicrosecond)->UseRealTime();

// memcpy over 512 MiB on all OpenMP threads, as `kda bench` takes its ceiling.
void BM_MemcpyReference(benchmark::State& state) {
  const size_t bytes = size_t{512} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 2);
  const int nt = omp_get_max_threads();
  for (auto _ : state) {
#pragma omp parallel num_threads(nt)
    {
      const size_t part = (bytes + nt - 1) / nt;
      const size_t lo = std::min(bytes, part * omp_get_thread_num());
      const size_t hi = std::min(bytes, lo + part);
      std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2.0 * bytes));
  state.counters["GB/s"] = rate(2.0 * bytes);
}
BENCHMARK(BM_MemcpyReference)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---------------------------------------------------------------------------------------------------
// Short convolution at C = 3 * H * K (q || k || v), W = 4, fp32 or bf16 state.

constexpr int64_t kConvC = Shape::kConvDim;
constexpr int kConvW = Shape::kConvKernel;

// EXTEND: one sequence of `arg` tokens from a zero history, the state kept.
template <class StateT>
void BM_ShortConvExtend(benchmark::State& state) {
  const int64_t T = state.range(0);
  const auto x = bench_randn(static_cast<size_t>(T * kConvC), 21);
  const auto w = bench_randn(static_cast<size_t>(kConvC * kConvW), 22, 0.5f);
  std::vector<float> y(static_cast<size_t>(T * kConvC));
  std::vector<StateT> st(static_cast<size_t>((kConvW - 1) * kConvC));
  const uint8_t no_init = 0;
  kda::kernels::ShortConvArgs<StateT> a;
  a.x = x.data();
  a.x_stride = kConvC;
  a.T = T;
  a.C = kConvC;
  a.weight = w.data();
  a.W = kConvW;
  a.N = 1;
  a.state = st.data();
  a.num_slots = 1;
  a.has_initial_state = &no_init;
  a.y = y.data();
  for (auto _ : state) {
    kda::kernels::short_conv_extend(a);
    benchmark::ClobberMemory();
  }
  const double bytes = 2.0 * T * kConvC * sizeof(float);  // x read, y written
  state.SetItemsProcessed(state.iterations() * T);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["GB/s"] = rate(bytes);
}
BENCHMARK_TEMPLATE(BM_ShortConvExtend, float)->Arg(4096)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_ShortConvExtend, kda::bf16_t)->Arg(4096)->Unit(benchmark::kMicrosecond)->UseRealTime();

// DECODE: `arg` sequences of one token, states in a pool of 256 slots, rotating over disjoint sets.
template <class StateT>
void BM_ShortConvDecode(benchmark::State& state) {
  const int64_t B = state.range(0), slots = 256;
  const auto x = bench_randn(static_cast<size_t>(B * kConvC), 23);
  const auto w = bench_randn(static_cast<size_t>(kConvC * kConvW), 24, 0.5f);
  std::vector<float> y(static_cast<size_t>(B * kConvC));
  std::vector<StateT> pool(static_cast<size_t>(slots * (kConvW - 1) * kConvC));
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(25));
  const int64_t n_sets = std::min<int64_t>(4, slots / B);
  kda::kernels::ShortConvArgs<StateT> a;
  a.x = x.data();
  a.x_stride = kConvC;
  a.T = B;
  a.C = kConvC;
  a.weight = w.data();
  a.W = kConvW;
  a.N = B;
  a.state = pool.data();
  a.num_slots = slots;
  a.y = y.data();
  int64_t which = 0;
  for (auto _ : state) {
    a.indices = perm.data() + (which++ % n_sets) * B;
    kda::kernels::short_conv_decode(a);
    benchmark::ClobberMemory();
  }
  // x read, y written, each state read and written.
  const double bytes = B * kConvC * (2.0 * sizeof(float) + 2.0 * (kConvW - 1) * sizeof(StateT));
  state.SetItemsProcessed(state.iterations() * B);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["GB/s"] = rate(bytes);
}
BENCHMARK_TEMPLATE(BM_ShortConvDecode, float)->Arg(1)->Arg(64)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_ShortConvDecode, kda::bf16_t)
    ->Arg(1)
    ->Arg(64)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
