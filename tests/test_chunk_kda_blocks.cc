// chunk_kda_opt specifics: row strides (q, k, v as column slices of one conv output, g of a wider
// projection) must give bit-for-bit the dense result, and the head-group / staging paths (heads that
// advance together, the next chunk copied while one computes, ragged groups, padded rows, private
// states) must match a float64 recurrence at the fp32 tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kda/kernels/kda/impl.h"
#include "kda/kernels/kda/kda.h"
#include "support/test_support.h"

namespace kda::kernels {
namespace {

using ::kda::testing::max_error_ratio;
using ::kda::testing::random_normal;
using ::kda::testing::random_uniform;

struct Case {
  int H = 4, K = 64, V = 64;
  std::vector<int32_t> cu;   // sequence boundaries, N = cu.size() - 1
  std::vector<int32_t> idx;  // empty: sequence i <-> slot i
  std::vector<uint8_t> has_init;
  int64_t slots = 0;  // 0: no pool
  bool out_final = true;
  std::vector<float> q, k, v, g, beta, A_log, dt_bias, pool;

  int64_t T() const { return cu.back(); }
  int64_t N() const { return static_cast<int64_t>(cu.size()) - 1; }

  void fill(uint64_t seed) {
    const size_t tk = static_cast<size_t>(T()) * H * K;
    q = random_normal(tk, seed + 1);
    k = random_normal(tk, seed + 2);
    v = random_normal(static_cast<size_t>(T()) * H * V, seed + 3);
    g = random_normal(tk, seed + 4);  // raw gate: the kernel applies A_log, dt_bias, softplus
    beta = random_uniform(static_cast<size_t>(T()) * H, seed + 5, 0.05f, 0.95f);
    A_log = random_uniform(H, seed + 6, -3.0f, 1.0f);
    dt_bias = random_uniform(static_cast<size_t>(H) * K, seed + 7, -2.0f, 1.0f);
    if (slots > 0) pool = random_normal(static_cast<size_t>(slots) * H * K * V, seed + 8, 0.3f);
  }

  KdaArgs args(float* o, float* state) const {
    KdaArgs a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.g = g.data();
    a.beta = beta.data();
    a.T = T();
    a.H = H;
    a.K = K;
    a.V = V;
    a.cu_seqlens = cu.data();
    a.N = N();
    a.use_qk_l2norm_in_kernel = true;
    a.use_gate_in_kernel = true;
    a.A_log = A_log.data();
    a.dt_bias = dt_bias.data();
    a.state = state;
    a.state_indices = idx.empty() ? nullptr : idx.data();
    a.num_state_slots = slots;
    a.has_initial_state = has_init.empty() ? nullptr : has_init.data();
    a.output_final_state = out_final;
    a.o = o;
    return a;
  }
};

// Float64 per-token recurrence (spec "Forward" steps 3, 5, 6) with the pool semantics of kda.h.
void reference(const Case& c, std::vector<float>& o, std::vector<float>& pool) {
  const int H = c.H, K = c.K, V = c.V;
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  o.assign(static_cast<size_t>(c.T()) * H * V, 0.0f);
  pool = c.pool;
  std::vector<double> S(static_cast<size_t>(K) * V), q(K), k(K), g(K), u(V);
  for (int64_t i = 0; i < c.N(); ++i) {
    const int64_t slot = c.idx.empty() ? i : c.idx[i];
    if (slot < 0) continue;
    const bool init = c.slots > 0 && (c.has_init.empty() || c.has_init[i] != 0);
    for (int h = 0; h < H; ++h) {
      const size_t base = (slot * H + h) * static_cast<size_t>(K) * V;
      for (size_t x = 0; x < S.size(); ++x) S[x] = init ? c.pool[base + x] : 0.0;
      for (int64_t t = c.cu[i]; t < c.cu[i + 1]; ++t) {
        const size_t off = (t * H + h) * static_cast<size_t>(K);
        double sq = 0.0, sk = 0.0;
        for (int d = 0; d < K; ++d) {
          q[d] = c.q[off + d];
          k[d] = c.k[off + d];
          sq += q[d] * q[d];
          sk += k[d] * k[d];
        }
        for (int d = 0; d < K; ++d) {
          q[d] /= std::sqrt(sq + 1e-6);
          k[d] /= std::sqrt(sk + 1e-6);
          const double z = static_cast<double>(c.g[off + d]) + c.dt_bias[h * K + d];
          g[d] = -std::exp(static_cast<double>(c.A_log[h])) * (z > 20.0 ? z : std::log1p(std::exp(z)));
        }
        const double b = c.beta[t * H + h];
        const float* vt = c.v.data() + (t * H + h) * V;
        for (int d = 0; d < K; ++d) {
          for (int x = 0; x < V; ++x) S[d * V + x] *= std::exp(g[d]);
        }
        for (int x = 0; x < V; ++x) {
          double acc = 0.0;
          for (int d = 0; d < K; ++d) acc += S[d * V + x] * k[d];
          u[x] = vt[x] - acc;
        }
        for (int d = 0; d < K; ++d) {
          for (int x = 0; x < V; ++x) S[d * V + x] += b * k[d] * u[x];
        }
        for (int x = 0; x < V; ++x) {
          double acc = 0.0;
          for (int d = 0; d < K; ++d) acc += S[d * V + x] * q[d];
          o[(t * H + h) * V + x] = static_cast<float>(scale * acc);
        }
      }
      if (c.slots > 0 && c.out_final) {
        for (size_t x = 0; x < S.size(); ++x) pool[base + x] = static_cast<float>(S[x]);
      }
    }
  }
}

void check_against_reference(const Case& c, const std::string& label) {
  SCOPED_TRACE(label);
  std::vector<float> ref_o, ref_pool;
  reference(c, ref_o, ref_pool);
  std::vector<float> o(ref_o.size(), 7.0f), pool = c.pool;
  chunk_kda_opt(c.args(o.data(), pool.empty() ? nullptr : pool.data()));
  EXPECT_LE(max_error_ratio(o.data(), ref_o.data(), o.size(), 1e-5, 1e-5), 1.0) << "output";
  if (!pool.empty()) {
    EXPECT_LE(max_error_ratio(pool.data(), ref_pool.data(), pool.size(), 1e-5, 1e-5), 1.0) << "state";
  }
}

TEST(ChunkKdaOpt, StridedRowsMatchDenseBitForBit) {
  for (auto [K, V] : {std::pair{64, 64}, std::pair{128, 128}, std::pair{40, 24}}) {
    Case c;
    c.H = 6;
    c.K = K;
    c.V = V;
    c.cu = {0, 70, 71, 200};
    c.slots = 3;
    c.fill(10 + K);
    const int64_t T = c.T();
    const int64_t P = static_cast<int64_t>(c.H) * K, PV = static_cast<int64_t>(c.H) * V;

    std::vector<float> o_dense(static_cast<size_t>(T) * PV), pool_dense = c.pool;
    chunk_kda_opt(c.args(o_dense.data(), pool_dense.data()));

    // q, k, v as column slices of one [T, 2P + PV + 5] conv output; g a slice of a [T, P + 24] output.
    const int64_t ld = 2 * P + PV + 5, ldg = P + 24;
    std::vector<float> conv(static_cast<size_t>(T) * ld, NAN), gate(static_cast<size_t>(T) * ldg, NAN);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(&conv[t * ld], &c.q[t * P], P * sizeof(float));
      std::memcpy(&conv[t * ld + P], &c.k[t * P], P * sizeof(float));
      std::memcpy(&conv[t * ld + 2 * P], &c.v[t * PV], PV * sizeof(float));
      std::memcpy(&gate[t * ldg + 8], &c.g[t * P], P * sizeof(float));
    }
    std::vector<float> o_strided(o_dense.size(), 7.0f), pool_strided = c.pool;
    KdaArgs a = c.args(o_strided.data(), pool_strided.data());
    a.q = conv.data();
    a.k = conv.data() + P;
    a.v = conv.data() + 2 * P;
    a.g = gate.data() + 8;
    a.q_stride = a.k_stride = a.v_stride = ld;
    a.g_stride = ldg;
    chunk_kda_opt(a);

    EXPECT_EQ(0, std::memcmp(o_strided.data(), o_dense.data(), o_dense.size() * sizeof(float)))
        << "K=" << K << " V=" << V << ": output";
    EXPECT_EQ(0, std::memcmp(pool_strided.data(), pool_dense.data(), pool_dense.size() * sizeof(float)))
        << "K=" << K << " V=" << V << ": state";
  }
}

TEST(ChunkKdaOpt, HeadGroupsAndStaging) {
  // Several heads per work item (group sizes depend on the thread count), sequences of 1..300 tokens
  // so that staging crosses chunk, head and item boundaries, slots out of order, a padded row, a
  // sequence without initial state.
  for (int H : {16, 7, 3}) {
    Case c;
    c.H = H;
    c.cu = {0, 1, 130, 130, 200, 264, 300};
    c.idx = {4, 0, 2, -1, 1, 5};
    c.has_init = {1, 0, 1, 1, 1, 1};
    c.slots = 6;
    c.fill(100 + H);
    check_against_reference(c, "H=" + std::to_string(H));
  }
}

TEST(ChunkKdaOpt, PrivateStates) {
  // Without a pool, and with output_final_state = false, the states live in scratch.
  Case c;
  c.H = 8;
  c.K = 128;
  c.V = 128;
  c.cu = {0, 100, 229};
  c.fill(300);
  check_against_reference(c, "no pool");
  c.slots = 2;
  c.out_final = false;
  c.fill(301);
  check_against_reference(c, "output_final_state=false");
}

}  // namespace
}  // namespace kda::kernels
