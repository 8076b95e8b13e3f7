// Seeded random inputs for benchmarking the KDA kernels at a given shape, shared by `kda bench` and the
// Google Benchmark suite so that both time the same problem: `seqs` sequences of `len` tokens, raw
// gates (A_log / dt_bias / softplus applied in the kernel, as the layer calls it), l2norm in the kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kda/kernels/kda/kda.h"

namespace kda::kernels {

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

}  // namespace kda::kernels
