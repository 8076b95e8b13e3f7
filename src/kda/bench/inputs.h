// Seeded random inputs for benchmarking the KDA kernels at a given shape, shared by `kda bench` and the
// Google Benchmark suite (bench/) so that both time the same problem: `seqs` sequences of `len` tokens, raw
// gates (A_log / dt_bias / softplus applied in the kernel, as the layer calls it), l2norm in the kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/kda/kda.h"

namespace kda::bench {

using kernels::KdaArgs;
using kernels::KdaSnapshot;

// The model's shape, as the benchmarks name it.
constexpr int kH = io::KimiLinear48bShape::kHeads, kK = io::KimiLinear48bShape::kHeadDim;
constexpr int64_t kD = io::KimiLinear48bShape::kHidden, kP = io::KimiLinear48bShape::kProjection;

inline std::vector<float> bench_randn(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct KdaBenchInputs {
  int H, K;
  std::vector<float> q, k, v, g, beta, o, A_log, dt_bias;
  std::vector<int32_t> cu;

  KdaBenchInputs(int64_t seqs, int64_t len, int heads, int head_dim) : H(heads), K(head_dim) {
    const size_t T = static_cast<size_t>(seqs * len), P = static_cast<size_t>(H) * K;
    q = bench_randn(T * P, 3);
    k = bench_randn(T * P, 4);
    v = bench_randn(T * P, 5);
    g = bench_randn(T * P, 6);
    beta.resize(T * H);
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<float> u(0.05f, 0.95f);
    for (auto& b : beta) b = u(rng);
    o.resize(T * P);
    A_log.resize(H);
    for (int h = 0; h < H; ++h) A_log[h] = std::log(1.0f + h * 0.4f);
    dt_bias.assign(P, 0.1f);
    cu.resize(seqs + 1);
    for (int64_t i = 0; i <= seqs; ++i) cu[i] = static_cast<int32_t>(i * len);
  }

  // Arguments over these inputs (which must outlive them), states in `state` slots `idx`.
  KdaArgs args(float* state, const int32_t* idx, int64_t slots) {
    KdaArgs a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.g = g.data();
    a.beta = beta.data();
    a.T = static_cast<int64_t>(beta.size()) / H;
    a.H = H;
    a.K = K;
    a.V = K;
    a.cu_seqlens = cu.data();
    a.N = static_cast<int64_t>(cu.size()) - 1;
    a.use_qk_l2norm_in_kernel = true;
    a.use_gate_in_kernel = true;
    a.A_log = A_log.data();
    a.dt_bias = dt_bias.data();
    a.state = state;
    a.state_indices = idx;
    a.num_state_slots = slots;
    a.o = o.data();
    return a;
  }
};

// One chunk_kda problem: `seqs` sequences of `len` tokens, zero initial states; with `snaps`, that many
// snapshots per sequence (prefix caching) at len * j / (snaps + 1), j = 1..snaps (none a multiple of 64
// at the bench's lengths), into a buffer of their own. The model's head shape unless given. Holds
// pointers into itself: not movable.
struct ChunkCase {
  int64_t seqs, T, snaps;
  KdaBenchInputs in;
  std::vector<float> state, snap_state;
  std::vector<int32_t> idx;
  std::vector<KdaSnapshot> snap;
  KdaArgs a;
  ChunkCase(int64_t s, int64_t len, int64_t n = 0, int heads = kH, int head_dim = kK)
      : seqs(s),
        T(s * len),
        snaps(n),
        in(s, len, heads, head_dim),
        state(static_cast<size_t>(s) * heads * head_dim * head_dim),
        snap_state(static_cast<size_t>(s * n) * heads * head_dim * head_dim),
        idx(s) {
    std::iota(idx.begin(), idx.end(), 0);
    a = in.args(state.data(), idx.data(), seqs);
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t j = 1; j <= n; ++j) {
        snap.push_back({static_cast<int32_t>(i), static_cast<int32_t>(len * j / (n + 1)),
                        static_cast<int32_t>(snap.size())});
      }
    }
    a.snapshots = snap.data();
    a.num_snapshots = static_cast<int64_t>(snap.size());
    a.snapshot_state = snap_state.data();
    a.num_snapshot_slots = a.num_snapshots;
  }
  ChunkCase(const ChunkCase&) = delete;
  ChunkCase& operator=(const ChunkCase&) = delete;
  void run(kernels::KernelImpl impl) { kernels::chunk_kda(a, impl); }
};

}  // namespace kda::bench
