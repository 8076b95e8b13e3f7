// fused_recurrent_kda_opt: the per-token recurrence (spec "Forward" step 6), usually one token per
// sequence (decode). Work items are (sequence, head) pairs over OpenMP threads; the state is updated in
// the pool slot in place. Each token costs two passes over the K x V state:
//   pass 1 (read):        y = S^T (k * exp(g))          -- the decay folded into the key, S not written
//   pass 2 (read/write):  S <- diag(exp(g)) S + k (beta (v - y))^T,  o = S^T (scale q-hat)
// Both passes run over 64-column strips of V with the strip's accumulators held in vector registers.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "kda/kernels/kda/kda.h"

namespace kda::kernels {
namespace {

// Same vectorisable expf / softplus as chunk_kda.cc (kept file-local so each kernel inlines them).
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.5f), 88.0f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float pow2n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * pow2n;
}

inline float softplus_approx(float z) {
  const float w = exp_approx(-std::fabs(z));
  const float s = w / (2.0f + w);
  const float s2 = s * s;
  float p = 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return std::max(z, 0.0f) + 2.0f * s * p;
}

struct Scratch {
  std::unique_ptr<float, decltype(&std::free)> mem{nullptr, &std::free};
  float* S = nullptr;   // [K, V] private state when the slot is not updated in place
  float* q = nullptr;   // [K] scale * q-hat
  float* k = nullptr;   // [K] k-hat
  float* e = nullptr;   // [K] exp(g)
  float* ke = nullptr;  // [K] k-hat * exp(g)
  float* u = nullptr;   // [V] beta (v - S'^T k)

  Scratch(int K, int V) {
    const size_t kv = (static_cast<size_t>(K) * V + 15) / 16 * 16;
    const size_t k16 = (static_cast<size_t>(K) + 15) / 16 * 16;
    const size_t v16 = (static_cast<size_t>(V) + 15) / 16 * 16;
    mem.reset(static_cast<float*>(std::aligned_alloc(64, (kv + 4 * k16 + v16) * sizeof(float))));
    if (!mem) throw std::bad_alloc();
    S = mem.get();
    q = S + kv;
    k = q + k16;
    e = k + k16;
    ke = e + k16;
    u = ke + k16;
  }
};

// Pass 1 over columns [j0, j0+NR): y = sum_d ke[d] S[d, :]; writes u = beta (v - y).
template <int NR>
inline void pass1(int K, int V, const float* __restrict S, const float* __restrict ke,
                  const float* __restrict v, float b, float* __restrict u, int j0, int nr) {
  float acc[NR];
#pragma omp simd
  for (int j = 0; j < NR; ++j) acc[j] = 0.0f;
  for (int d = 0; d < K; ++d) {
    const float* __restrict s = S + d * V + j0;
    const float c = ke[d];
    if (nr == NR) {
#pragma omp simd
      for (int j = 0; j < NR; ++j) acc[j] += c * s[j];
    } else {
      for (int j = 0; j < nr; ++j) acc[j] += c * s[j];
    }
  }
  for (int j = 0; j < nr; ++j) u[j0 + j] = b * (v[j0 + j] - acc[j]);
}

// Pass 2 over columns [j0, j0+NR): S <- e S + k u^T, o = sum_d q[d] S[d, :].
template <int NR>
inline void pass2(int K, int V, float* __restrict S, const float* __restrict e, const float* __restrict k,
                  const float* __restrict q, const float* __restrict u, float* __restrict o, int j0, int nr) {
  float acc[NR], uu[NR];
  for (int j = 0; j < NR; ++j) {
    acc[j] = 0.0f;
    uu[j] = j < nr ? u[j0 + j] : 0.0f;
  }
  for (int d = 0; d < K; ++d) {
    float* __restrict s = S + d * V + j0;
    const float ed = e[d], kd = k[d], qd = q[d];
    if (nr == NR) {
#pragma omp simd
      for (int j = 0; j < NR; ++j) {
        const float x = ed * s[j] + kd * uu[j];
        s[j] = x;
        acc[j] += qd * x;
      }
    } else {
      for (int j = 0; j < nr; ++j) {
        const float x = ed * s[j] + kd * uu[j];
        s[j] = x;
        acc[j] += qd * x;
      }
    }
  }
  for (int j = 0; j < nr; ++j) o[j0 + j] = acc[j];
}

void process_item(const KdaArgs& a, int64_t i, int h, float scale, Scratch& w) {
  const int K = a.K, V = a.V, H = a.H;
  int64_t bos, eos;
  if (a.cu_seqlens != nullptr) {
    bos = a.cu_seqlens[i];
    eos = a.cu_seqlens[i + 1];
  } else {
    bos = i * (a.T / a.N);
    eos = bos + a.T / a.N;
  }
  const int64_t slot = a.state_indices != nullptr ? a.state_indices[i] : i;
  if (slot < 0) {  // padded row: zero output, the pool is not touched
    for (int64_t t = bos; t < eos; ++t) std::memset(a.o + (t * H + h) * V, 0, V * sizeof(float));
    return;
  }

  const size_t kv = static_cast<size_t>(K) * V;
  const bool has_init = a.state != nullptr && (a.has_initial_state == nullptr || a.has_initial_state[i] != 0);
  float* pool = a.state != nullptr ? a.state + (slot * H + h) * kv : nullptr;
  float* S = w.S;
  if (pool != nullptr && a.output_final_state) {
    S = pool;
    if (!has_init) std::memset(S, 0, kv * sizeof(float));
  } else if (has_init) {
    std::memcpy(S, pool, kv * sizeof(float));
  } else {
    std::memset(S, 0, kv * sizeof(float));
  }

  const float neg_a = a.use_gate_in_kernel ? -std::exp(a.A_log[h]) : 0.0f;
  const float* bias = (a.use_gate_in_kernel && a.dt_bias != nullptr) ? a.dt_bias + h * K : nullptr;
  for (int64_t t = bos; t < eos; ++t) {
    const int64_t off = (t * H + h) * K;
    const float* __restrict qt = a.q + off;
    const float* __restrict kt = a.k + off;
    const float* __restrict gt = a.g + off;
    float rq = scale, rk = 1.0f;
    if (a.use_qk_l2norm_in_kernel) {
      float sq = 0.0f, sk = 0.0f;
#pragma omp simd reduction(+ : sq, sk)
      for (int d = 0; d < K; ++d) {
        sq += qt[d] * qt[d];
        sk += kt[d] * kt[d];
      }
      rq = scale / std::sqrt(sq + 1e-6f);
      rk = 1.0f / std::sqrt(sk + 1e-6f);
    }
    float* __restrict q = w.q;
    float* __restrict k = w.k;
    float* __restrict e = w.e;
    float* __restrict ke = w.ke;
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      float g = gt[d];
      if (a.use_gate_in_kernel) g = neg_a * softplus_approx(g + (bias != nullptr ? bias[d] : 0.0f));
      q[d] = qt[d] * rq;
      k[d] = kt[d] * rk;
      e[d] = exp_approx(g);
      ke[d] = k[d] * e[d];
    }

    const float b = a.beta[t * H + h];
    const float* v = a.v + (t * H + h) * V;
    float* o = a.o + (t * H + h) * V;
    int j = 0;
    for (; j + 64 <= V; j += 64) pass1<64>(K, V, S, ke, v, b, w.u, j, 64);
    for (; j < V; j += 16) pass1<16>(K, V, S, ke, v, b, w.u, j, std::min(16, V - j));
    j = 0;
    for (; j + 64 <= V; j += 64) pass2<64>(K, V, S, e, k, q, w.u, o, j, 64);
    for (; j < V; j += 16) pass2<16>(K, V, S, e, k, q, w.u, o, j, std::min(16, V - j));
  }

  if (pool != nullptr && a.output_final_state && S != pool) std::memcpy(pool, S, kv * sizeof(float));
}

}  // namespace

void fused_recurrent_kda_opt(const KdaArgs& a) {
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.K));
  const int64_t N = a.N;
  const int H = a.H;
#pragma omp parallel
  {
    Scratch w(a.K, a.V);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t i = 0; i < N; ++i) {
      for (int h = 0; h < H; ++h) process_item(a, i, h, scale, w);
    }
  }
}

}  // namespace kda::kernels
