// Reference kernels: plain fp32 loops that follow the spec line by line ("Forward" steps 5-6 and
// "Chunked form"). Single-threaded and allocation-happy on purpose: they exist to be obviously right.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kda/kernels/kda/impl.h"

namespace kda::kernels {
namespace {

constexpr int kChunk = 64;

struct Segment {
  int64_t bos = 0;
  int64_t eos = 0;
};

Segment segment_of(const KdaArgs& a, int64_t i) {
  if (a.cu_seqlens != nullptr) return {a.cu_seqlens[i], a.cu_seqlens[i + 1]};
  const int64_t len = a.T / a.N;
  return {i * len, (i + 1) * len};
}

// Pool slot of sequence i, or -1 for a padded row.
int64_t slot_of(const KdaArgs& a, int64_t i) { return a.state_indices != nullptr ? a.state_indices[i] : i; }

float effective_scale(const KdaArgs& a) {
  return a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.K));
}

float softplus(float z) { return z > 20.0f ? z : std::log1p(std::exp(z)); }

// Row strides (elements between consecutive tokens), 0 meaning dense.
int64_t qk_dense(const KdaArgs& a) { return static_cast<int64_t>(a.H) * a.K; }
int64_t q_stride(const KdaArgs& a) { return a.q_stride > 0 ? a.q_stride : qk_dense(a); }
int64_t k_stride(const KdaArgs& a) { return a.k_stride > 0 ? a.k_stride : qk_dense(a); }
int64_t g_stride(const KdaArgs& a) { return a.g_stride > 0 ? a.g_stride : qk_dense(a); }
int64_t v_stride(const KdaArgs& a) { return a.v_stride > 0 ? a.v_stride : static_cast<int64_t>(a.H) * a.V; }

// Row of v for token t, head h.
const float* v_row(const KdaArgs& a, int64_t t, int h) { return a.v + t * v_stride(a) + h * a.V; }

// q-hat, k-hat and the log-space gate g of token t, head h (spec steps 3 and 5; no scale yet).
void load_token(const KdaArgs& a, int64_t t, int h, float* q, float* k, float* g) {
  const int K = a.K;
  const float* qt = a.q + t * q_stride(a) + h * K;
  const float* kt = a.k + t * k_stride(a) + h * K;
  const float* gt = a.g + t * g_stride(a) + h * K;
  for (int d = 0; d < K; ++d) {
    q[d] = qt[d];
    k[d] = kt[d];
  }
  if (a.use_qk_l2norm_in_kernel) {
    float sq = 0.0f, sk = 0.0f;
    for (int d = 0; d < K; ++d) {
      sq += q[d] * q[d];
      sk += k[d] * k[d];
    }
    const float rq = 1.0f / std::sqrt(sq + 1e-6f);
    const float rk = 1.0f / std::sqrt(sk + 1e-6f);
    for (int d = 0; d < K; ++d) {
      q[d] *= rq;
      k[d] *= rk;
    }
  }
  for (int d = 0; d < K; ++d) {
    if (a.use_gate_in_kernel) {
      const float bias = a.dt_bias != nullptr ? a.dt_bias[h * K + d] : 0.0f;
      g[d] = -std::exp(a.A_log[h]) * softplus(gt[d] + bias);
    } else {
      g[d] = gt[d];
    }
  }
}

// Initial state of sequence i, head h: the pool slot, or zeros without a pool / initial state.
void load_state(const KdaArgs& a, int64_t i, int64_t slot, int h, float* S) {
  const size_t n = static_cast<size_t>(a.K) * a.V;
  const bool has_init = a.has_initial_state == nullptr || a.has_initial_state[i] != 0;
  if (a.state != nullptr && has_init) {
    std::memcpy(S, a.state + (slot * a.H + h) * n, n * sizeof(float));
  } else {
    std::memset(S, 0, n * sizeof(float));
  }
}

void store_state(const KdaArgs& a, int64_t slot, int h, const float* S) {
  if (a.state == nullptr || !a.output_final_state) return;
  const size_t n = static_cast<size_t>(a.K) * a.V;
  std::memcpy(a.state + (slot * a.H + h) * n, S, n * sizeof(float));
}

// Head h's state S into the slots of the snapshots [*s, e) taken after `pos` tokens; advances *s past them.
void take_snapshots(const KdaArgs& a, const KdaSnapshot*& s, const KdaSnapshot* e, int64_t pos, int h,
                    const float* S) {
  const size_t n = static_cast<size_t>(a.K) * a.V;
  for (; s != e && s->pos == pos; ++s) std::memcpy(snapshot_head(a, *s, h), S, n * sizeof(float));
}

void zero_output_rows(const KdaArgs& a, const Segment& sg) {
  const size_t row = static_cast<size_t>(a.H) * a.V;
  if (sg.eos > sg.bos) std::memset(a.o + sg.bos * row, 0, (sg.eos - sg.bos) * row * sizeof(float));
}

}  // namespace

namespace {
void recurrent_step(const KdaArgs& a, int64_t t, int h, float scale, float* S, float* q, float* k, float* g,
                    float* u);
}  // namespace

void fused_recurrent_kda_naive(const KdaArgs& args) {
  std::vector<float> widened;  // bf16 q, k, v, g read as fp32
  const KdaArgs a = with_f32_inputs(args, widened);
  const int K = a.K, V = a.V, H = a.H;
  const float scale = effective_scale(a);
  const SnapshotPlan plan = plan_snapshots(a);
  std::vector<float> S(static_cast<size_t>(K) * V), q(K), k(K), g(K), u(V);
  for (int64_t i = 0; i < a.N; ++i) {
    const Segment sg = segment_of(a, i);
    const int64_t slot = slot_of(a, i);
    if (slot < 0) {
      zero_output_rows(a, sg);
      continue;
    }
    for (int h = 0; h < H; ++h) {
      load_state(a, i, slot, h, S.data());
      const KdaSnapshot *snap = plan.first(i), *snap_end = plan.last(i);
      if (a.parents != nullptr) {
        // Tree: every token's state kept, states[j + 1] after token j, states[0] the initial one; token j
        // starts from its parent's.
        const int64_t len = sg.eos - sg.bos;
        std::vector<std::vector<float>> states(static_cast<size_t>(len + 1));
        states[0] = S;
        for (int64_t j = 0; j < len; ++j) {
          S = states[static_cast<size_t>(a.parents[sg.bos + j] + 1)];
          recurrent_step(a, sg.bos + j, h, scale, S.data(), q.data(), k.data(), g.data(), u.data());
          states[static_cast<size_t>(j + 1)] = S;
        }
        for (; snap != snap_end; ++snap)
          std::memcpy(snapshot_head(a, *snap, h), states[static_cast<size_t>(snap->pos)].data(),
                      sizeof(float) * K * V);
        store_state(a, slot, h, states[static_cast<size_t>(len)].data());
        continue;
      }
      take_snapshots(a, snap, snap_end, 0, h, S.data());
      for (int64_t t = sg.bos; t < sg.eos; ++t) {
        recurrent_step(a, t, h, scale, S.data(), q.data(), k.data(), g.data(), u.data());
        take_snapshots(a, snap, snap_end, t + 1 - sg.bos, h, S.data());
      }
      store_state(a, slot, h, S.data());
    }
  }
}

namespace {

// One token of the recurrence on head h's state S (K x V): decay, delta-rule update, output row.
void recurrent_step(const KdaArgs& a, int64_t t, int h, float scale, float* S, float* q, float* k, float* g,
                    float* u) {
  const int K = a.K, V = a.V, H = a.H;
  load_token(a, t, h, q, k, g);
  const float b = a.beta[t * H + h];
  const float* vt = v_row(a, t, h);
  // S <- diag(exp(g)) S
  for (int d = 0; d < K; ++d) {
    const float e = std::exp(g[d]);
    for (int j = 0; j < V; ++j) S[d * V + j] *= e;
  }
  // u = v - S^T k
  for (int j = 0; j < V; ++j) {
    float acc = 0.0f;
    for (int d = 0; d < K; ++d) acc += S[d * V + j] * k[d];
    u[j] = vt[j] - acc;
  }
  // S <- S + beta k u^T
  for (int d = 0; d < K; ++d) {
    for (int j = 0; j < V; ++j) S[d * V + j] += b * k[d] * u[j];
  }
  // o = scale S^T q
  float* ot = a.o + (t * H + h) * V;
  for (int j = 0; j < V; ++j) {
    float acc = 0.0f;
    for (int d = 0; d < K; ++d) acc += S[d * V + j] * q[d];
    ot[j] = scale * acc;
  }
}

}  // namespace

void chunk_kda_naive(const KdaArgs& args) {
  std::vector<float> widened;  // bf16 q, k, v, g read as fp32
  const KdaArgs a = with_f32_inputs(args, widened);
  const int K = a.K, V = a.V, H = a.H;
  const float scale = effective_scale(a);
  constexpr int C = kChunk;
  std::vector<float> S(static_cast<size_t>(K) * V);
  // Chunk-local rows: q-hat, k-hat, g, v, beta.
  std::vector<float> Q(C * K), Kh(C * K), G(C * K), Vc(C * V), B(C);
  std::vector<float> fwd(C * K);  // exp(sum_{i<=r} g_i), forward running sum from the chunk start
  std::vector<float> rev(C * K);  // exp(sum_{r<i<=last} g_i), reverse running sum from the chunk end
  std::vector<float> Akk(C * C), Aqk(C * C), Tm(C * C);
  std::vector<float> Wm(C * K), Um(C * V), Vn(C * V), acc(K);
  const SnapshotPlan plan = plan_snapshots(a);
  std::vector<float> Sp(a.num_snapshots > 0 ? static_cast<size_t>(K) * V : 0);  // a chunk's partial state
  std::vector<float> revp(C);

  for (int64_t i = 0; i < a.N; ++i) {
    const Segment sg = segment_of(a, i);
    const int64_t slot = slot_of(a, i);
    if (slot < 0) {
      zero_output_rows(a, sg);
      continue;
    }
    for (int h = 0; h < H; ++h) {
      load_state(a, i, slot, h, S.data());
      const KdaSnapshot *snap = plan.first(i), *snap_end = plan.last(i);
      take_snapshots(a, snap, snap_end, 0, h, S.data());
      for (int64_t c0 = sg.bos; c0 < sg.eos; c0 += C) {
        const int L = static_cast<int>(std::min<int64_t>(C, sg.eos - c0));
        for (int r = 0; r < L; ++r) {
          const int64_t t = c0 + r;
          load_token(a, t, h, &Q[r * K], &Kh[r * K], &G[r * K]);
          B[r] = a.beta[t * H + h];
          const float* vt = v_row(a, t, h);
          for (int j = 0; j < V; ++j) Vc[r * V + j] = vt[j];
        }

        // Forward decays exp(Gamma_r): a running sum from the chunk start.
        for (int d = 0; d < K; ++d) acc[d] = 0.0f;
        for (int r = 0; r < L; ++r) {
          for (int d = 0; d < K; ++d) {
            acc[d] += G[r * K + d];
            fwd[r * K + d] = std::exp(acc[d]);
          }
        }
        // Reverse decays exp(Gamma_last - Gamma_r): a running sum from the chunk end down to r+1.
        for (int d = 0; d < K; ++d) acc[d] = 0.0f;
        for (int r = L - 1; r >= 0; --r) {
          for (int d = 0; d < K; ++d) rev[r * K + d] = std::exp(acc[d]);
          for (int d = 0; d < K; ++d) acc[d] += G[r * K + d];
        }

        // Akk (strictly lower) and Aqk (lower incl. diagonal). The pair decay exp(Gamma_r - Gamma_s) is
        // exp of sum_{s<i<=r} g_i, accumulated from s so no two cumulative sums are ever subtracted.
        std::fill(Akk.begin(), Akk.end(), 0.0f);
        std::fill(Aqk.begin(), Aqk.end(), 0.0f);
        for (int s = 0; s < L; ++s) {
          for (int d = 0; d < K; ++d) acc[d] = 0.0f;
          for (int r = s; r < L; ++r) {
            if (r > s) {
              for (int d = 0; d < K; ++d) acc[d] += G[r * K + d];
            }
            float dq = 0.0f, dk = 0.0f;
            for (int d = 0; d < K; ++d) {
              const float e = std::exp(acc[d]);
              dq += Q[r * K + d] * Kh[s * K + d] * e;
              dk += Kh[r * K + d] * Kh[s * K + d] * e;
            }
            Aqk[r * C + s] = scale * dq;
            if (r > s) Akk[r * C + s] = B[r] * dk;
          }
        }

        // T = (I + Akk)^-1 by forward substitution: T[r][j] = delta_rj - sum_{j<=m<r} Akk[r][m] T[m][j].
        std::fill(Tm.begin(), Tm.end(), 0.0f);
        for (int r = 0; r < L; ++r) {
          Tm[r * C + r] = 1.0f;
          for (int j = 0; j < r; ++j) {
            float sum = 0.0f;
            for (int m = j; m < r; ++m) sum += Akk[r * C + m] * Tm[m * C + j];
            Tm[r * C + j] = -sum;
          }
        }

        // Wm = T diag(beta) (exp(Gamma) * K-hat),  Um = T diag(beta) V.
        for (int r = 0; r < L; ++r) {
          for (int d = 0; d < K; ++d) {
            float sum = 0.0f;
            for (int j = 0; j <= r; ++j) sum += Tm[r * C + j] * B[j] * fwd[j * K + d] * Kh[j * K + d];
            Wm[r * K + d] = sum;
          }
          for (int x = 0; x < V; ++x) {
            float sum = 0.0f;
            for (int j = 0; j <= r; ++j) sum += Tm[r * C + j] * B[j] * Vc[j * V + x];
            Um[r * V + x] = sum;
          }
        }

        // Vn = Um - Wm S.
        for (int r = 0; r < L; ++r) {
          for (int x = 0; x < V; ++x) {
            float sum = 0.0f;
            for (int d = 0; d < K; ++d) sum += Wm[r * K + d] * S[d * V + x];
            Vn[r * V + x] = Um[r * V + x] - sum;
          }
        }

        // O = scale (Q-hat * exp(Gamma)) S + Aqk Vn   (Aqk already carries the scale).
        for (int r = 0; r < L; ++r) {
          float* ot = a.o + ((c0 + r) * H + h) * V;
          for (int x = 0; x < V; ++x) {
            float inter = 0.0f;
            for (int d = 0; d < K; ++d) inter += Q[r * K + d] * fwd[r * K + d] * S[d * V + x];
            float intra = 0.0f;
            for (int j = 0; j <= r; ++j) intra += Aqk[r * C + j] * Vn[j * V + x];
            ot[x] = scale * inter + intra;
          }
        }

        // Snapshots inside the chunk, after its first P < L rows: the state update below over rows 0..P-1
        // only. Vn's rows 0..P-1 (T is lower triangular) and the decays are those of a chunk that ends
        // there, so this is exactly what a run over those tokens would compute as its final state.
        while (snap != snap_end && sg.bos + snap->pos < c0 + L) {
          const int P = static_cast<int>(sg.bos + snap->pos - c0);  // >= 1: earlier ones are taken
          for (int d = 0; d < K; ++d) {
            const float decay = fwd[(P - 1) * K + d];
            float rs = 0.0f;  // exp(sum_{r<i<P} g_i): the reverse decays of a chunk of P rows
            for (int r = P - 1; r >= 0; --r) {
              revp[r] = std::exp(rs);
              rs += G[r * K + d];
            }
            for (int x = 0; x < V; ++x) {
              float sum = 0.0f;
              for (int r = 0; r < P; ++r) sum += Kh[r * K + d] * revp[r] * Vn[r * V + x];
              Sp[d * V + x] = decay * S[d * V + x] + sum;
            }
          }
          take_snapshots(a, snap, snap_end, snap->pos, h, Sp.data());
        }

        // S <- diag(exp(Gamma_last)) S + (K-hat * exp(Gamma_last - Gamma))^T Vn.
        for (int d = 0; d < K; ++d) {
          const float decay = fwd[(L - 1) * K + d];
          for (int x = 0; x < V; ++x) {
            float sum = 0.0f;
            for (int r = 0; r < L; ++r) sum += Kh[r * K + d] * rev[r * K + d] * Vn[r * V + x];
            S[d * V + x] = decay * S[d * V + x] + sum;
          }
        }
        take_snapshots(a, snap, snap_end, c0 + L - sg.bos, h, S.data());
      }
      store_state(a, slot, h, S.data());
    }
  }
}

}  // namespace kda::kernels
