#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/kernels/kda/kda.h"

namespace kda::bench {

double bench_chunk(const RowOptions& o, GemmCeiling& g32, nlohmann::json& j, std::vector<std::string>& lines,
                   double& plain) {
  const auto impl = kernels::parse_kernel_impl(o.kernel);
  // Each shape also with 4 snapshots per sequence (the states after interior positions, prefix caching),
  // in the same turns.
  ChunkCase one(1, 4096), many(16, 256), one_s(1, 4096, 4), many_s(16, 256, 4);
  PlainGemm p32(g32.M, g32.N, g32.K);
  const auto t =
      best_interleaved({[&] { g32.run(); }, [&] { p32.run(); }, [&] { one.run(impl); },
                        [&] { many.run(impl); }, [&] { one_s.run(impl); }, [&] { many_s.run(impl); }},
                       5, 8.0);
  const double ceiling = g32.gflops(t[0]);
  plain = p32.gflops(t[1]);
  int i = 2;
  for (ChunkCase* c : {&one, &many, &one_s, &many_s}) {
    const double s = t[i++];
    const double sn = o.skip_naive || c->snaps > 0
                          ? NAN
                          : best_seconds([&] { c->run(kernels::KernelImpl::Naive); }, 1, 0.0);
    const double flops = (6.0 * kK * kK + 3.0 * 64 * kK + 64.0 * 64) * kH * c->T;
    const double gf = flops / s / 1e9;
    j["kernels"].push_back({{"op", "chunk_kda"},
                            {"seqs", c->seqs},
                            {"tokens", c->T},
                            {"us_per_token", s / c->T * 1e6},
                            {"gflops", gf},
                            {"snapshots_per_seq", c->snaps},
                            {"naive_us_per_token", sn / c->T * 1e6}});
    char line[160];
    std::snprintf(line, sizeof line, "%-22s %6lld %8lld %12.2f %10.1f %9.0f%% %16.2f\n",
                  c->snaps > 0 ? "chunk_kda +4 snapshots" : "chunk_kda", static_cast<long long>(c->seqs),
                  static_cast<long long>(c->T), s / c->T * 1e6, gf, 100 * gf / ceiling, sn / c->T * 1e6);
    lines.emplace_back(line);
  }
  return ceiling;
}

void bench_recurrent(const RowOptions& o, double cp, nlohmann::json& j, const Say& say) {
  const int H = kH, K = kK;
  const auto impl = kernels::parse_kernel_impl(o.kernel);
  // fused_recurrent_kda: states spread over a pool larger than the caches.
  say("\n%-22s %6s %12s %10s %10s %16s\n", "kernel", "batch", "us/call", "GB/s", "% memcpy", "naive us/call");
  const int64_t pool_slots = 256;  // 256 x 2 MiB = 512 MiB
  std::vector<float> pool(static_cast<size_t>(pool_slots) * H * K * K, 0.01f);
  for (int64_t B : {int64_t{1}, int64_t{64}}) {
    KdaBenchInputs in(B, 1, H, K);
    std::vector<int32_t> idx(pool_slots);
    std::iota(idx.begin(), idx.end(), 0);
    std::shuffle(idx.begin(), idx.end(), std::mt19937_64(11));
    idx.resize(B);
    auto a = in.args(pool.data(), idx.data(), pool_slots);
    // Rotate over disjoint slot sets so that no call finds its states in cache from the previous one.
    std::vector<std::vector<int32_t>> sets;
    for (int r = 0; r < 4; ++r) {
      std::vector<int32_t> s(pool_slots);
      std::iota(s.begin(), s.end(), 0);
      std::shuffle(s.begin(), s.end(), std::mt19937_64(100 + r));
      s.resize(B);
      sets.push_back(s);
    }
    size_t which = 0;
    auto call = [&](kernels::KernelImpl impl) {
      a.state_indices = sets[which++ % sets.size()].data();
      kernels::fused_recurrent_kda(a, impl);
    };
    const double s = best_seconds([&] { call(impl); }, 20, 0.5);
    const double sn = o.skip_naive ? NAN : best_seconds([&] { call(kernels::KernelImpl::Naive); }, 3, 0.2);
    const double bytes = 2.0 * B * H * K * K * sizeof(float);
    const double gbps = bytes / s / 1e9;
    j["kernels"].push_back({{"op", "fused_recurrent_kda"},
                            {"batch", B},
                            {"us_per_call", s * 1e6},
                            {"gbps", gbps},
                            {"naive_us_per_call", sn * 1e6}});
    say("%-22s %6lld %12.1f %10.1f %9.0f%% %16.1f\n", "fused_recurrent_kda", static_cast<long long>(B),
        s * 1e6, gbps, 100 * gbps / cp, sn * 1e6);
  }
  pool.clear();
  pool.shrink_to_fit();
}

}  // namespace kda::bench
