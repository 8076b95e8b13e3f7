// chunk_kda_opt: the chunked WY form (spec "Chunked form", C = 64) organised for speed.
//
// Work items are (sequence, head) pairs, spread over OpenMP threads; each thread owns one aligned scratch
// block for its whole lifetime, so nothing is allocated per chunk. Per chunk of L <= 64 rows:
//   1. load q-hat (scale folded in), k-hat, g (gate fused), beta, v into contiguous rows;
//   2. forward decays exp(Gamma_r) and reverse decays exp(Gamma_last - Gamma_r), each a running sum;
//   3. Aqk, Akk in 16x16 sub-blocks: off-diagonal blocks anchored at the query block's first row n,
//      (x_r * exp(Gamma_r - Gamma_n)) . (k_s * exp(Gamma_n - Gamma_s)) with both factors <= 1; diagonal
//      blocks from running sums over exactly the rows each pair spans;
//   4. Vn = T (diag(beta) V - diag(beta)(exp(Gamma) * K) S), T = (I + Akk)^-1 applied by blocked forward
//      substitution;
//   5. O = (Q * exp(Gamma)) S + Aqk Vn, written straight into o;
//   6. S <- diag(exp(Gamma_last)) S + (K * exp(Gamma_last - Gamma))^T Vn, in the pool slot when possible.
// Steps 4-6 are small GEMMs done by register-tiled loops (4 rows x 64 columns of accumulators) that GCC
// vectorises for AVX-512; no positive exponent and no difference of cumulative sums is ever formed.
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

constexpr int kChunk = 64;  // C
constexpr int kSub = 16;    // sub-chunk for the Aqk / Akk anchoring

// expf for the kernel's arguments (always <= 0 here), written so that `omp simd` loops vectorise it:
// Cephes range reduction + degree-6 polynomial, ~1 ulp. Below -87 the result flushes to 0, which is
// the right answer for a decay (the channel is forgotten) and keeps 2^n a normal number.
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.5f), 88.0f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
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

// softplus(z) = z for z > 20, else log1p(e^z); computed as max(z,0) + log1p(e^-|z|) so that it
// vectorises: with w = e^-|z| in (0,1], log1p(w) = 2 atanh(s), s = w / (2 + w) <= 1/3, whose odd series
// is below fp32 resolution after s^15. For z > 20 the correction is < 2.1e-9 and rounds away.
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

enum class Op { kSet, kAdd, kSub };

// C[0:MR, 0:NR] (op)= A[0:MR, 0:kd] B[0:kd, 0:NR]; the accumulators are a fixed-size local array that
// GCC keeps in vector registers (4 x 64 floats = 16 zmm).
template <int MR, int NR, Op op>
inline void gemm_tile(int kd, const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                      float* __restrict Cm, int64_t ldc) {
  float acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
#pragma omp simd
    for (int j = 0; j < NR; ++j) acc[i][j] = 0.0f;
  }
  for (int d = 0; d < kd; ++d) {
    const float* __restrict b = B + d * ldb;
    for (int i = 0; i < MR; ++i) {
      const float ai = A[i * lda + d];
#pragma omp simd
      for (int j = 0; j < NR; ++j) acc[i][j] += ai * b[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* __restrict c = Cm + i * ldc;
#pragma omp simd
    for (int j = 0; j < NR; ++j) {
      if constexpr (op == Op::kSet) c[j] = acc[i][j];
      if constexpr (op == Op::kAdd) c[j] += acc[i][j];
      if constexpr (op == Op::kSub) c[j] -= acc[i][j];
    }
  }
}

// One NR-wide column strip of C: all rows, 4 at a time, so the strip of B stays in L1 across row blocks.
template <int NR, Op op>
inline void gemm_strip(int M, int kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* Cm,
                       int64_t ldc, bool lower) {
  int r = 0;
  for (; r + 4 <= M; r += 4) {
    const int k = lower ? std::min(kd, r + 4) : kd;
    gemm_tile<4, NR, op>(k, A + r * lda, lda, B, ldb, Cm + r * ldc, ldc);
  }
  for (; r < M; ++r) {
    const int k = lower ? std::min(kd, r + 1) : kd;
    gemm_tile<1, NR, op>(k, A + r * lda, lda, B, ldb, Cm + r * ldc, ldc);
  }
}

// C[M, N] (op)= A[M, kd] B[kd, N], all row-major with leading dimensions. `lower`: A is lower triangular
// (zeros above the diagonal), so a block of rows r..r+3 only needs the first r+4 columns of A.
template <Op op>
void gemm(int M, int N, int kd, const float* A, int64_t lda, const float* B, int64_t ldb, float* Cm,
          int64_t ldc, bool lower = false) {
  int j = 0;
  for (; j + 64 <= N; j += 64) gemm_strip<64, op>(M, kd, A, lda, B + j, ldb, Cm + j, ldc, lower);
  for (; j + 16 <= N; j += 16) gemm_strip<16, op>(M, kd, A, lda, B + j, ldb, Cm + j, ldc, lower);
  for (; j < N; ++j) gemm_strip<1, op>(M, kd, A, lda, B + j, ldb, Cm + j, ldc, lower);
}

// One thread's scratch, carved from a single 64-byte aligned allocation.
struct Scratch {
  std::unique_ptr<float, decltype(&std::free)> mem{nullptr, &std::free};
  float* S = nullptr;     // [K, V] private state when the pool slot cannot be updated in place
  float* Q = nullptr;     // [C, K] scale * q-hat
  float* Kh = nullptr;    // [C, K] k-hat
  float* G = nullptr;     // [C, K] log-space gate
  float* Qf = nullptr;    // [C, K] Q * exp(Gamma)
  float* Wf = nullptr;    // [C, K] beta * k-hat * exp(Gamma)
  float* KrT = nullptr;   // [K, C] (k-hat * exp(Gamma_last - Gamma))^T
  float* KcT = nullptr;   // [K, C] (k-hat_s * exp(Gamma_n - Gamma_s))^T for s < n
  float* Xa = nullptr;    // [kSub, K] row factors q * exp(Gamma_r - Gamma_n)
  float* Ka = nullptr;    // [kSub, K] row factors k * exp(Gamma_r - Gamma_n)
  float* acc = nullptr;   // [K] running sums
  float* last = nullptr;  // [K] exp(Gamma_last)
  float* Aqk = nullptr;   // [C, C]
  float* Akk = nullptr;   // [C, C]
  float* Vn = nullptr;    // [C, V]
  float* B = nullptr;     // [C] beta

  Scratch(int K, int V) {
    const size_t K_ = K, V_ = V, C = kChunk;
    const size_t sizes[] = {K_ * V_,   C * K_,    C * K_, C * K_, C * K_, C * K_, K_ * C, K_ * C,
                            kSub * K_, kSub * K_, K_,     K_,     C * C,  C * C,  C * V_, C};
    float** ptrs[] = {&S, &Q, &Kh, &G, &Qf, &Wf, &KrT, &KcT, &Xa, &Ka, &acc, &last, &Aqk, &Akk, &Vn, &B};
    size_t total = 0;
    for (size_t n : sizes) total += (n + 15) / 16 * 16;  // keep every array 64-byte aligned
    mem.reset(static_cast<float*>(std::aligned_alloc(64, total * sizeof(float))));
    if (!mem) throw std::bad_alloc();
    float* p = mem.get();
    for (size_t i = 0; i < std::size(sizes); ++i) {
      *ptrs[i] = p;
      p += (sizes[i] + 15) / 16 * 16;
    }
  }
};

// Steps 1-2: rows of the chunk starting at token c0, and every per-row decay.
void load_chunk(const KdaArgs& a, int h, int64_t c0, int L, float scale, Scratch& w) {
  const int K = a.K, H = a.H;
  const float neg_a = a.use_gate_in_kernel ? -std::exp(a.A_log[h]) : 0.0f;
  const float* bias = (a.use_gate_in_kernel && a.dt_bias != nullptr) ? a.dt_bias + h * K : nullptr;
  for (int r = 0; r < L; ++r) {
    const int64_t off = ((c0 + r) * H + h) * K;
    const float* __restrict q = a.q + off;
    const float* __restrict k = a.k + off;
    const float* __restrict g = a.g + off;
    float* __restrict Q = w.Q + r * K;
    float* __restrict Kh = w.Kh + r * K;
    float* __restrict G = w.G + r * K;
    float rq = scale, rk = 1.0f;
    if (a.use_qk_l2norm_in_kernel) {
      float sq = 0.0f, sk = 0.0f;
#pragma omp simd reduction(+ : sq, sk)
      for (int d = 0; d < K; ++d) {
        sq += q[d] * q[d];
        sk += k[d] * k[d];
      }
      rq = scale / std::sqrt(sq + 1e-6f);
      rk = 1.0f / std::sqrt(sk + 1e-6f);
    }
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      Q[d] = q[d] * rq;
      Kh[d] = k[d] * rk;
    }
    if (!a.use_gate_in_kernel) {
      std::memcpy(G, g, K * sizeof(float));
    } else if (bias != nullptr) {
#pragma omp simd
      for (int d = 0; d < K; ++d) G[d] = neg_a * softplus_approx(g[d] + bias[d]);
    } else {
#pragma omp simd
      for (int d = 0; d < K; ++d) G[d] = neg_a * softplus_approx(g[d]);
    }
    w.B[r] = a.beta[(c0 + r) * H + h];
  }

  float* __restrict acc = w.acc;
  // Forward running sum from the chunk start: Qf = Q exp(Gamma_r), Wf = beta k exp(Gamma_r).
#pragma omp simd
  for (int d = 0; d < K; ++d) acc[d] = 0.0f;
  for (int r = 0; r < L; ++r) {
    const float* __restrict G = w.G + r * K;
    const float* __restrict Q = w.Q + r * K;
    const float* __restrict Kh = w.Kh + r * K;
    float* __restrict Qf = w.Qf + r * K;
    float* __restrict Wf = w.Wf + r * K;
    const float b = w.B[r];
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      acc[d] += G[d];
      const float e = exp_approx(acc[d]);
      Qf[d] = Q[d] * e;
      Wf[d] = b * Kh[d] * e;
    }
  }
#pragma omp simd
  for (int d = 0; d < K; ++d) w.last[d] = exp_approx(acc[d]);
    // Reverse running sum from the chunk end: KrT[d][r] = k_r[d] exp(sum_{r<i<=last} g_i[d]).
#pragma omp simd
  for (int d = 0; d < K; ++d) acc[d] = 0.0f;
  for (int r = L - 1; r >= 0; --r) {
    const float* __restrict G = w.G + r * K;
    const float* __restrict Kh = w.Kh + r * K;
    float* __restrict KrT = w.KrT + r;
#pragma omp simd
    for (int d = 0; d < K; ++d) {
      KrT[d * kChunk] = Kh[d] * exp_approx(acc[d]);
      acc[d] += G[d];
    }
  }
}

// Step 3: Aqk (lower, with diagonal; scale already in Q) and Akk (strictly lower, times beta_r).
void build_attention(int K, int L, Scratch& w) {
  constexpr int C = kChunk;
  // Zero the upper parts: the 4-row GEMM tiles over Aqk read a little above the diagonal.
  std::memset(w.Aqk, 0, sizeof(float) * L * C);
  std::memset(w.Akk, 0, sizeof(float) * L * C);
  float* __restrict acc = w.acc;
  for (int n = 0; n < L; n += kSub) {
    const int m = std::min(kSub, L - n);  // rows n..n+m-1
    if (n > 0) {
      // Row factors exp(Gamma_r - Gamma_n) = exp(sum_{n<i<=r} g_i), accumulated from n.
      std::memcpy(w.Xa, w.Q + n * K, K * sizeof(float));  // row n itself: decay 1
      std::memcpy(w.Ka, w.Kh + n * K, K * sizeof(float));
#pragma omp simd
      for (int d = 0; d < K; ++d) acc[d] = 0.0f;
      for (int i = 1; i < m; ++i) {
        const float* __restrict G = w.G + (n + i) * K;
        const float* __restrict Q = w.Q + (n + i) * K;
        const float* __restrict Kh = w.Kh + (n + i) * K;
        float* __restrict Xa = w.Xa + i * K;
        float* __restrict Ka = w.Ka + i * K;
#pragma omp simd
        for (int d = 0; d < K; ++d) {
          acc[d] += G[d];
          const float e = exp_approx(acc[d]);
          Xa[d] = Q[d] * e;
          Ka[d] = Kh[d] * e;
        }
      }
      // Column factors exp(Gamma_n - Gamma_s) = exp(sum_{s<i<=n} g_i), accumulated from n down to s.
#pragma omp simd
      for (int d = 0; d < K; ++d) acc[d] = 0.0f;
      for (int s = n - 1; s >= 0; --s) {
        const float* __restrict G = w.G + (s + 1) * K;
        const float* __restrict Kh = w.Kh + s * K;
        float* __restrict KcT = w.KcT + s;
#pragma omp simd
        for (int d = 0; d < K; ++d) {
          acc[d] += G[d];
          KcT[d * C] = Kh[d] * exp_approx(acc[d]);
        }
      }
      gemm<Op::kSet>(m, n, K, w.Xa, K, w.KcT, C, w.Aqk + n * C, C);
      gemm<Op::kSet>(m, n, K, w.Ka, K, w.KcT, C, w.Akk + n * C, C);
      for (int i = 0; i < m; ++i) {
        const float b = w.B[n + i];
        float* __restrict row = w.Akk + (n + i) * C;
#pragma omp simd
        for (int s = 0; s < n; ++s) row[s] *= b;
      }
    }
    // Diagonal block: exp(sum_{s<i<=r} g_i) accumulated from s, pair by pair.
    for (int s = n; s < n + m; ++s) {
      const float* __restrict ks = w.Kh + s * K;
      const float* __restrict qs = w.Q + s * K;
      float dqs = 0.0f;
#pragma omp simd reduction(+ : dqs)
      for (int d = 0; d < K; ++d) {
        dqs += qs[d] * ks[d];
        acc[d] = 0.0f;
      }
      w.Aqk[s * C + s] = dqs;
      for (int r = s + 1; r < n + m; ++r) {
        const float* __restrict G = w.G + r * K;
        const float* __restrict Q = w.Q + r * K;
        const float* __restrict kr = w.Kh + r * K;
        float dq = 0.0f, dk = 0.0f;
#pragma omp simd reduction(+ : dq, dk)
        for (int d = 0; d < K; ++d) {
          acc[d] += G[d];
          const float e = ks[d] * exp_approx(acc[d]);
          dq += Q[d] * e;
          dk += kr[d] * e;
        }
        w.Aqk[r * C + s] = dq;
        w.Akk[r * C + s] = w.B[r] * dk;
      }
    }
  }
}

void process_item(const KdaArgs& a, int64_t i, int h, float scale, Scratch& w) {
  const int K = a.K, V = a.V, H = a.H;
  constexpr int C = kChunk;
  int64_t bos, eos;
  if (a.cu_seqlens != nullptr) {
    bos = a.cu_seqlens[i];
    eos = a.cu_seqlens[i + 1];
  } else {
    bos = i * (a.T / a.N);
    eos = bos + a.T / a.N;
  }
  const int64_t slot = a.state_indices != nullptr ? a.state_indices[i] : i;
  const int64_t ldo = static_cast<int64_t>(H) * V;
  if (slot < 0) {  // padded row: zero output, the pool is not touched
    for (int64_t t = bos; t < eos; ++t) std::memset(a.o + t * ldo + h * V, 0, V * sizeof(float));
    return;
  }

  // The state lives in the pool slot when the final state is kept there; otherwise in scratch.
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

  for (int64_t c0 = bos; c0 < eos; c0 += C) {
    const int L = static_cast<int>(std::min<int64_t>(C, eos - c0));
    load_chunk(a, h, c0, L, scale, w);
    build_attention(K, L, w);

    // Step 4: Vn = beta v - Wf S, then Vn <- (I + Akk)^-1 Vn: rows of earlier sub-blocks enter as one
    // GEMM per sub-block, rows inside a sub-block by plain forward substitution.
    for (int r = 0; r < L; ++r) {
      const float* __restrict v = a.v + ((c0 + r) * H + h) * V;
      float* __restrict vn = w.Vn + r * V;
      const float b = w.B[r];
#pragma omp simd
      for (int x = 0; x < V; ++x) vn[x] = b * v[x];
    }
    gemm<Op::kSub>(L, V, K, w.Wf, K, S, V, w.Vn, V);
    for (int n = 0; n < L; n += kSub) {
      const int m = std::min(kSub, L - n);
      if (n > 0) gemm<Op::kSub>(m, V, n, w.Akk + n * C, C, w.Vn, V, w.Vn + n * V, V);
      for (int r = n + 1; r < n + m; ++r) {
        float* __restrict vr = w.Vn + r * V;
        for (int j = n; j < r; ++j) {
          const float c = w.Akk[r * C + j];
          const float* __restrict vj = w.Vn + j * V;
#pragma omp simd
          for (int x = 0; x < V; ++x) vr[x] -= c * vj[x];
        }
      }
    }

    // Step 5: O = Qf S + Aqk Vn.
    float* o = a.o + c0 * ldo + h * V;
    gemm<Op::kSet>(L, V, K, w.Qf, K, S, V, o, ldo);
    gemm<Op::kAdd>(L, V, L, w.Aqk, C, w.Vn, V, o, ldo, /*lower=*/true);

    // Step 6: S <- diag(exp(Gamma_last)) S + KrT Vn.
    for (int d = 0; d < K; ++d) {
      float* __restrict row = S + d * V;
      const float e = w.last[d];
#pragma omp simd
      for (int x = 0; x < V; ++x) row[x] *= e;
    }
    gemm<Op::kAdd>(K, V, L, w.KrT, C, w.Vn, V, S, V);
  }

  if (pool != nullptr && a.output_final_state && S != pool) std::memcpy(pool, S, kv * sizeof(float));
}

}  // namespace

void chunk_kda_opt(const KdaArgs& a) {
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.K));
  const int64_t N = a.N;
  const int H = a.H;
#pragma omp parallel
  {
    Scratch w(a.K, a.V);
    // Dynamic: varlen segments make (sequence, head) items very uneven.
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t i = 0; i < N; ++i) {
      for (int h = 0; h < H; ++h) process_item(a, i, h, scale, w);
    }
  }
}

}  // namespace kda::kernels
