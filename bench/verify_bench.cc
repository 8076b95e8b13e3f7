// Speculative verification at the Kimi-Linear shape (one layer's KDA, H = 32, K = V = 128), d = 4 drafts
// per request (rows of 5 tokens), `accepted` of them accepted, batch B; two ways to commit the accepted
// state:
//   BM_VerifyKeptStates: the verify call keeps the state after each of its 5 positions (snapshots, 5 x
//     2 MiB written per request) and accept copies the accepted one into the slot;
//   BM_VerifyReplay: the verify call keeps nothing and accept re-runs the recurrence of the accepted + 1
//     tokens from the committed state (their inputs kept from verify), writing the slot.
// Between verify and accept, 64 MiB are streamed (the other layers' weights and states), so accept
// finds the states in memory, as in a model; that streaming is not timed. Args: {B, accepted}. The
// counters give verify and accept apart (us per call); the reported time is their sum.
//   ./build/kda_benchmarks --benchmark_filter=Verify
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/kda/kda.h"

namespace {

using kda::bench::KdaBenchInputs;
using kda::kernels::KdaArgs;
using Shape = kda::io::KimiLinear48bShape;
using Clock = std::chrono::steady_clock;

constexpr int kDrafts = 4, kRow = kDrafts + 1;

void run_verify(benchmark::State& state, bool kept_states) {
  const int B = static_cast<int>(state.range(0)), acc = static_cast<int>(state.range(1));
  const int H = Shape::kHeads, K = Shape::kHeadDim;
  const size_t kv = static_cast<size_t>(H) * K * K;
  KdaBenchInputs in(B, kRow, H, K);
  // The accepted tokens' inputs, gathered (the first acc + 1 of each row).
  KdaBenchInputs rin(B, acc + 1, H, K);
  const size_t qk = static_cast<size_t>(H) * K;
  for (int i = 0; i < B; ++i) {
    for (int t = 0; t <= acc; ++t) {
      const size_t src = static_cast<size_t>(i) * kRow + t, dst = static_cast<size_t>(i) * (acc + 1) + t;
      for (auto [from, to] : {std::pair{&in.q, &rin.q}, {&in.k, &rin.k}, {&in.v, &rin.v}, {&in.g, &rin.g}})
        std::memcpy(to->data() + dst * qk, from->data() + src * qk, qk * sizeof(float));
      std::memcpy(rin.beta.data() + dst * H, in.beta.data() + src * H, H * sizeof(float));
    }
  }
  std::vector<float> pool(B * kv, 0.01f), states(static_cast<size_t>(B) * kRow * kv);
  std::vector<float> flush(size_t{16} << 20);
  std::vector<int32_t> idx(B);
  std::iota(idx.begin(), idx.end(), 0);
  std::vector<kda::kernels::KdaSnapshot> snaps;
  for (int i = 0; i < B; ++i)
    for (int pos = 1; pos <= kRow; ++pos) snaps.push_back({i, pos, i * kRow + pos - 1});

  KdaArgs verify = in.args(pool.data(), idx.data(), B);
  verify.output_final_state = false;
  verify.state_locality = KdaArgs::StateLocality::Memory;
  if (kept_states) {
    verify.snapshots = snaps.data();
    verify.num_snapshots = static_cast<int64_t>(snaps.size());
    verify.snapshot_state = states.data();
    verify.num_snapshot_slots = verify.num_snapshots;
  }
  KdaArgs replay = rin.args(pool.data(), idx.data(), B);
  replay.state_locality = KdaArgs::StateLocality::Memory;

  double verify_s = 0.0, accept_s = 0.0;
  for (auto _ : state) {
    for (float& x : flush) x += 1.0f;
    const auto t0 = Clock::now();
    kda::kernels::fused_recurrent_kda(verify, kda::kernels::KernelImpl::Optimized);
    const auto t1 = Clock::now();
    for (float& x : flush) x += 1.0f;
    const auto t2 = Clock::now();
    if (kept_states) {
      for (int i = 0; i < B; ++i)
        std::memcpy(pool.data() + i * kv, states.data() + (static_cast<size_t>(i) * kRow + acc) * kv,
                    kv * sizeof(float));
    } else {
      kda::kernels::fused_recurrent_kda(replay, kda::kernels::KernelImpl::Optimized);
    }
    const auto t3 = Clock::now();
    benchmark::ClobberMemory();
    const double v = std::chrono::duration<double>(t1 - t0).count();
    const double a = std::chrono::duration<double>(t3 - t2).count();
    verify_s += v;
    accept_s += a;
    state.SetIterationTime(v + a);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["verify_us"] = verify_s / n * 1e6;
  state.counters["accept_us"] = accept_s / n * 1e6;
  benchmark::DoNotOptimize(flush.data());
}

void BM_VerifyKeptStates(benchmark::State& state) { run_verify(state, true); }
void BM_VerifyReplay(benchmark::State& state) { run_verify(state, false); }

void verify_args(benchmark::internal::Benchmark* b) {
  for (int B : {1, 8})
    for (int acc : {0, 2, 4}) b->Args({B, acc});
  b->Unit(benchmark::kMicrosecond)->UseManualTime();
}
BENCHMARK(BM_VerifyKeptStates)->Apply(verify_args);
BENCHMARK(BM_VerifyReplay)->Apply(verify_args);

}  // namespace
