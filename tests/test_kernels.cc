// KDA kernels (chunk_kda / fused_recurrent_kda, naive and optimized) against a float64 per-token
// recurrence written here from the spec (steps 3, 5, 6), plus the pool semantics and the dispatcher.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "kda/common/isa.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/kda/impl.h"
#include "kda/kernels/kda/kda.h"
#include "support/test_support.h"

namespace kda::kernels {
namespace {

using ::kda::testing::max_error_ratio;
using ::kda::testing::random_normal;
using ::kda::testing::random_uniform;

constexpr double kAtol = 1e-5;
constexpr double kRtol = 1e-5;

// ---------------------------------------------------------------------------------------------------
// Worst error ratios seen per kernel, printed once at the end of the run.

struct Worst {
  double out = 0.0;
  double state = 0.0;
};

// Every kernel this build and CPU run: the references, and each available ISA's copy of the optimized
// ones, forced (KernelImpl::Portable / Avx2 / Avx512), so that every path is checked on every problem.
struct NamedKernel {
  std::string name;
  std::function<void(const KdaArgs&)> fn;
};

KernelImpl impl_of(Isa isa) {
  switch (isa) {
    case Isa::Avx2:
      return KernelImpl::Avx2;
    case Isa::Avx512:
      return KernelImpl::Avx512;
    default:
      return KernelImpl::Portable;
  }
}

std::vector<Isa> available_isas() {
  std::vector<Isa> v;
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512}) {
    if (isa_available(isa)) v.push_back(isa);
  }
  return v;
}

const std::vector<NamedKernel>& all_kernels() {
  static const std::vector<NamedKernel> ks = [] {
    std::vector<NamedKernel> v = {
        {"chunk/naive", [](const KdaArgs& a) { chunk_kda(a, KernelImpl::Naive); }},
        {"recurrent/naive", [](const KdaArgs& a) { fused_recurrent_kda(a, KernelImpl::Naive); }}};
    for (Isa isa : available_isas()) {
      const KernelImpl impl = impl_of(isa);
      v.push_back({std::string("chunk/") + to_string(isa), [impl](const KdaArgs& a) { chunk_kda(a, impl); }});
      v.push_back({std::string("recurrent/") + to_string(isa),
                   [impl](const KdaArgs& a) { fused_recurrent_kda(a, impl); }});
    }
    return v;
  }();
  return ks;
}

std::map<std::string, Worst> g_worst;

class WorstEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& k : all_kernels()) {
      std::printf("[ worst    ] %-18s output %.3f  state %.3f  (of the 1e-5 + 1e-5|b| bound)\n",
                  k.name.c_str(), g_worst[k.name].out, g_worst[k.name].state);
    }
  }
};
[[maybe_unused]] ::testing::Environment* const g_env =
    ::testing::AddGlobalTestEnvironment(new WorstEnvironment);

// ---------------------------------------------------------------------------------------------------
// Problems.

enum class GateKind { kRealistic, kStrong };

struct Problem {
  int64_t T = 0;
  int H = 2, K = 64, V = 64;
  std::vector<int32_t> cu;  // empty: no cu_seqlens (N equal segments)
  int64_t N = 1;
  std::vector<int32_t> idx;       // empty: sequence i <-> slot i
  std::vector<uint8_t> has_init;  // empty: all true
  int64_t slots = 0;              // 0: no pool
  bool l2 = false, gate = false, out_final = true;
  float scale = 0.0f;
  std::vector<float> q, k, v, g, beta, A_log, dt_bias, pool;

  KdaArgs args(float* o, float* state) const {
    KdaArgs a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.g = g.data();
    a.beta = beta.data();
    a.T = T;
    a.H = H;
    a.K = K;
    a.V = V;
    a.cu_seqlens = cu.empty() ? nullptr : cu.data();
    a.N = N;
    a.scale = scale;
    a.use_qk_l2norm_in_kernel = l2;
    a.use_gate_in_kernel = gate;
    a.A_log = gate ? A_log.data() : nullptr;
    a.dt_bias = gate && !dt_bias.empty() ? dt_bias.data() : nullptr;
    a.state = state;
    a.state_indices = idx.empty() ? nullptr : idx.data();
    a.num_state_slots = slots;
    a.has_initial_state = has_init.empty() ? nullptr : has_init.data();
    a.output_final_state = out_final;
    a.o = o;
    return a;
  }
  size_t state_size() const { return static_cast<size_t>(slots) * H * K * V; }
};

// Fills the tensors of `p` (shape fields already set). q, k are either raw (l2norm in kernel) or l2
// normalised here; g is the raw gate input f (gate in kernel) or a log-space decay.
void fill(Problem& p, uint64_t seed, GateKind kind = GateKind::kRealistic) {
  const size_t tk = static_cast<size_t>(p.T) * p.H * p.K;
  p.q = random_normal(tk, seed + 1);
  p.k = random_normal(tk, seed + 2);
  p.v = random_normal(static_cast<size_t>(p.T) * p.H * p.V, seed + 3);
  p.beta = random_uniform(static_cast<size_t>(p.T) * p.H, seed + 4, 0.01f, 0.99f);
  if (!p.l2) {
    for (size_t row = 0; row < tk; row += p.K) {
      for (std::vector<float>* x : {&p.q, &p.k}) {
        float ss = 0.0f;
        for (int d = 0; d < p.K; ++d) ss += (*x)[row + d] * (*x)[row + d];
        const float r = 1.0f / std::sqrt(ss);
        for (int d = 0; d < p.K; ++d) (*x)[row + d] *= r;
      }
    }
  }
  std::mt19937_64 rng(seed + 5);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::normal_distribution<float> nrm(0.0f, 1.0f);
  p.g.resize(tk);
  if (p.gate) {
    // Raw gate f; -exp(A_log) * softplus(f + dt_bias) then spans roughly -1e-4 .. -5 (realistic) or
    // reaches -1e3 on the heads with a large A_log (strong).
    p.A_log = random_uniform(p.H, seed + 6, -4.0f, 0.5f);
    p.dt_bias = random_uniform(static_cast<size_t>(p.H) * p.K, seed + 7, -3.0f, 1.0f);
    for (auto& x : p.g) x = nrm(rng);
    if (kind == GateKind::kStrong) {
      for (int h = 0; h < p.H; h += 2) p.A_log[h] = 6.0f;  // exp = 403
      for (auto& x : p.g) x = uni(rng) < 0.2f ? 2.0f + 2.0f * uni(rng) : -6.0f + nrm(rng);
    }
  } else if (kind == GateKind::kRealistic) {
    // g = -exp(u) * softplus(z): a mix of slow (-1e-4) and fast (-3) channels.
    for (auto& x : p.g) {
      const float z = nrm(rng) - 1.0f;
      x = -std::exp(-6.0f + 6.5f * uni(rng)) * std::log1p(std::exp(z));
    }
  } else {
    // Forget spikes: every third channel takes g in [-1000, -100] on 30% of the tokens, the rest decays
    // slowly, so small differences after a spike carry the result.
    for (size_t i = 0; i < tk; ++i) {
      const int d = static_cast<int>(i % p.K);
      p.g[i] = (d % 3 == 0 && uni(rng) < 0.3f) ? -100.0f - 900.0f * uni(rng) : -0.1f * uni(rng);
    }
  }
  if (p.slots > 0) p.pool = random_normal(p.state_size(), seed + 8, 0.3f);
}

// ---------------------------------------------------------------------------------------------------
// Float64 ground truth: the per-token recurrence, with the pool semantics of kda.h.

struct Reference {
  std::vector<float> o;
  std::vector<float> pool;
};

Reference reference(const Problem& p) {
  const int H = p.H, K = p.K, V = p.V;
  const double scale = p.scale > 0.0f ? p.scale : 1.0 / std::sqrt(static_cast<double>(K));
  Reference ref;
  ref.o.assign(static_cast<size_t>(p.T) * H * V, 0.0f);
  ref.pool = p.pool;
  std::vector<double> S(static_cast<size_t>(K) * V), q(K), k(K), g(K), u(V);
  for (int64_t i = 0; i < p.N; ++i) {
    const int64_t bos = p.cu.empty() ? i * (p.T / p.N) : p.cu[i];
    const int64_t eos = p.cu.empty() ? (i + 1) * (p.T / p.N) : p.cu[i + 1];
    const int64_t slot = p.idx.empty() ? i : p.idx[i];
    if (slot < 0) continue;  // padded row: zero output (already), nothing read or written
    const bool init = p.slots > 0 && (p.has_init.empty() || p.has_init[i] != 0);
    for (int h = 0; h < H; ++h) {
      const size_t base = ((slot * H) + h) * static_cast<size_t>(K) * V;
      for (size_t x = 0; x < S.size(); ++x) S[x] = init ? p.pool[base + x] : 0.0;
      for (int64_t t = bos; t < eos; ++t) {
        const size_t off = (t * H + h) * static_cast<size_t>(K);
        double sq = 0.0, sk = 0.0;
        for (int d = 0; d < K; ++d) {
          q[d] = p.q[off + d];
          k[d] = p.k[off + d];
          sq += q[d] * q[d];
          sk += k[d] * k[d];
        }
        if (p.l2) {
          for (int d = 0; d < K; ++d) {
            q[d] /= std::sqrt(sq + 1e-6);
            k[d] /= std::sqrt(sk + 1e-6);
          }
        }
        for (int d = 0; d < K; ++d) {
          if (p.gate) {
            const double z =
                static_cast<double>(p.g[off + d]) + (p.dt_bias.empty() ? 0.0 : p.dt_bias[h * K + d]);
            const double sp = z > 20.0 ? z : std::log1p(std::exp(z));
            g[d] = -std::exp(static_cast<double>(p.A_log[h])) * sp;
          } else {
            g[d] = p.g[off + d];
          }
        }
        const double b = p.beta[t * H + h];
        const float* vt = p.v.data() + (t * H + h) * V;
        for (int d = 0; d < K; ++d) {
          const double e = std::exp(g[d]);
          for (int x = 0; x < V; ++x) S[d * V + x] *= e;
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
          ref.o[(t * H + h) * V + x] = static_cast<float>(scale * acc);
        }
      }
      if (p.slots > 0 && p.out_final) {
        for (size_t x = 0; x < S.size(); ++x) ref.pool[base + x] = static_cast<float>(S[x]);
      }
    }
  }
  return ref;
}

// ---------------------------------------------------------------------------------------------------
// Runs the four kernels through the dispatcher and checks each against the reference: outputs and
// final states within tolerance, padded rows exactly zero, slots not written bit-for-bit unchanged.

bool all_finite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float f) { return std::isfinite(f); });
}

void check_all_kernels(const Problem& p, const std::string& label) {
  SCOPED_TRACE(label);
  const Reference ref = reference(p);
  const size_t n_o = static_cast<size_t>(p.T) * p.H * p.V;
  const size_t slot_size = static_cast<size_t>(p.H) * p.K * p.V;

  std::vector<bool> written(p.slots, false);
  if (p.out_final) {
    for (int64_t i = 0; i < p.N && p.slots > 0; ++i) {
      const int64_t s = p.idx.empty() ? i : p.idx[i];
      if (s >= 0) written[s] = true;
    }
  }

  std::string line = label + ":";
  for (const auto& kernel : all_kernels()) {
    SCOPED_TRACE(kernel.name);
    std::vector<float> o(n_o, 7.0f);  // garbage: every row must be written
    std::vector<float> pool = p.pool;
    kernel.fn(p.args(o.data(), pool.empty() ? nullptr : pool.data()));

    EXPECT_TRUE(all_finite(o));
    const double eo = max_error_ratio(o.data(), ref.o.data(), n_o, kAtol, kRtol);
    EXPECT_LE(eo, 1.0) << "output";
    const double es =
        pool.empty() ? 0.0 : max_error_ratio(pool.data(), ref.pool.data(), pool.size(), kAtol, kRtol);
    EXPECT_LE(es, 1.0) << "final state";
    EXPECT_TRUE(all_finite(pool));
    Worst& w = g_worst[kernel.name];
    w.out = std::max(w.out, eo);
    w.state = std::max(w.state, es);
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %s %.3f/%.3f", kernel.name.c_str(), eo, es);
    line += buf;

    for (int64_t s = 0; s < p.slots; ++s) {
      if (written[s]) continue;
      EXPECT_EQ(0, std::memcmp(pool.data() + s * slot_size, p.pool.data() + s * slot_size,
                               slot_size * sizeof(float)))
          << "slot " << s << " is not named by any sequence (or not kept) and must stay untouched";
    }
    for (int64_t i = 0; i < p.N && !p.idx.empty(); ++i) {
      if (p.idx[i] >= 0) continue;
      const int64_t bos = p.cu.empty() ? i * (p.T / p.N) : p.cu[i];
      const int64_t eos = p.cu.empty() ? (i + 1) * (p.T / p.N) : p.cu[i + 1];
      for (size_t x = bos * p.H * p.V; x < static_cast<size_t>(eos) * p.H * p.V; ++x) {
        ASSERT_EQ(o[x], 0.0f) << "padded sequence " << i << " output element " << x;
      }
    }
  }
  std::printf("[ error    ] %s\n", line.c_str());
}

std::string flags_label(bool l2, bool gate) {
  return std::string(l2 ? "l2norm" : "prenorm") + (gate ? "+gate" : "+g");
}

// ---------------------------------------------------------------------------------------------------
// Correctness.

TEST(KdaKernels, SingleSequenceLengths) {
  for (int64_t T : {0, 1, 63, 64, 65, 1000}) {
    for (int f = 0; f < 4; ++f) {
      Problem p;
      p.T = T;
      p.H = 2;
      p.K = 64;
      p.V = 48;
      p.slots = 1;
      p.l2 = f & 1;
      p.gate = f & 2;
      fill(p, 100 + T * 4 + f);
      check_all_kernels(p, "T=" + std::to_string(T) + " " + flags_label(p.l2, p.gate));
    }
  }
}

TEST(KdaKernels, VarlenPoolSlotsAndPadding) {
  for (int f = 0; f < 4; ++f) {
    Problem p;
    p.cu = {0, 0, 1, 1, 66, 130, 131, 300};
    p.N = 7;
    p.T = 300;
    p.H = 3;
    p.K = 32;
    p.V = 64;
    // Slots out of order, a padded 1-token row (-1), two zero-length rows (slot 3 keeps its state;
    // slot 1 has no initial state, so its final state is zero), slots 2, 4 and 7 never named.
    p.idx = {3, -1, 1, 5, 0, 6, 8};
    p.has_init = {1, 1, 0, 1, 1, 0, 1};
    p.slots = 9;
    p.l2 = f & 1;
    p.gate = f & 2;
    fill(p, 200 + f);
    check_all_kernels(p, "varlen " + flags_label(p.l2, p.gate));
  }
}

TEST(KdaKernels, NoFinalStateLeavesPoolUntouched) {
  Problem p;
  p.cu = {0, 70, 71, 200};
  p.N = 3;
  p.T = 200;
  p.idx = {2, 0, 1};
  p.slots = 3;
  p.out_final = false;
  p.l2 = true;
  fill(p, 300);
  check_all_kernels(p, "output_final_state=false");
}

TEST(KdaKernels, NoPool) {
  Problem p;
  p.T = 130;
  p.N = 2;  // two sequences of 65 without cu_seqlens
  p.idx = {0, -1};
  p.gate = true;
  p.scale = 0.25f;
  fill(p, 400);
  check_all_kernels(p, "no pool, explicit scale");
}

TEST(KdaKernels, OddHeadSizes) {
  for (auto [K, V] : {std::pair{40, 24}, std::pair{17, 5}, std::pair{128, 80}}) {
    Problem p;
    p.cu = {0, 1, 100, 170};
    p.N = 3;
    p.T = 170;
    p.H = 2;
    p.K = K;
    p.V = V;
    p.slots = 4;
    p.idx = {1, 3, 0};
    p.l2 = true;
    p.gate = true;
    fill(p, 500 + K);
    check_all_kernels(p, "K=" + std::to_string(K) + " V=" + std::to_string(V));
  }
}

// A decode batch: one token for each of idx.size() sequences (T == N, no cu_seqlens) in `slots` pool
// slots, K = 128, l2norm and gate in the kernel.
Problem decode_problem(int H, int V, int64_t slots, std::vector<int32_t> idx, std::vector<uint8_t> has_init,
                       uint64_t seed) {
  Problem p;
  p.T = p.N = static_cast<int64_t>(idx.size());
  p.H = H;
  p.K = 128;
  p.V = V;
  p.slots = slots;
  p.idx = std::move(idx);
  p.has_init = std::move(has_init);
  p.l2 = true;
  p.gate = true;
  fill(p, seed);
  return p;
}

TEST(KdaKernels, Decode) {
  // Slots permuted, one padded row, one sequence without an initial state.
  const Problem p = decode_problem(4, 128, 10, {9, 0, -1, 4, 2, 7, 1, 5}, {1, 1, 1, 0, 1, 1, 1, 1}, 600);
  check_all_kernels(p, "decode");
}

// The state-locality hint only decides whether fused_recurrent_kda_opt prefetches: every setting
// gives the same bits, with the prefetch (Memory) and without (Cache; Auto at this size).
TEST(KdaKernels, RecurrentStateLocalityLeavesResultsUnchanged) {
  // V = 160: two full strips of 64 columns and a partial one.
  const Problem p = decode_problem(3, 160, 8, {5, 0, -1, 3, 7, 1}, {1, 0, 1, 1, 1, 1}, 650);
  using Loc = KdaArgs::StateLocality;
  std::vector<float> o0, pool0;
  for (Loc loc : {Loc::Auto, Loc::Cache, Loc::Memory}) {
    std::vector<float> o(static_cast<size_t>(p.T) * p.H * p.V, -1.0f), pool = p.pool;
    KdaArgs a = p.args(o.data(), pool.data());
    a.state_locality = loc;
    fused_recurrent_kda(a, KernelImpl::Optimized);
    if (loc == Loc::Auto) {
      o0 = o;
      pool0 = pool;
      EXPECT_NE(pool0, p.pool);
      continue;
    }
    EXPECT_EQ(o, o0) << static_cast<int>(loc);
    EXPECT_EQ(pool, pool0) << static_cast<int>(loc);
  }
}

TEST(KdaKernels, StrongGates) {
  for (int f = 0; f < 4; ++f) {
    Problem p;
    p.cu = {0, 37, 300};
    p.N = 2;
    p.T = 300;
    p.H = 2;
    p.K = 64;
    p.V = 64;
    p.slots = 2;
    p.l2 = f & 1;
    p.gate = f & 2;
    fill(p, 700 + f, GateKind::kStrong);
    check_all_kernels(p, "strong gates " + flags_label(p.l2, p.gate));
  }
}

#if defined(__x86_64__) || defined(__i386__)
// chunk_kda_opt flushes subnormals (FTZ/DAZ) in its threads; the caller's floating-point mode is what
// it was before the call, whichever mode that was.
TEST(KdaKernels, ChunkOptRestoresTheCallersFloatingPointMode) {
  Problem p;
  p.T = 200;
  p.H = 4;
  p.slots = 1;
  p.gate = true;
  fill(p, 750, GateKind::kStrong);
  std::vector<float> o(static_cast<size_t>(p.T) * p.H * p.V), pool(p.state_size(), 0.0f);
  const unsigned saved = _mm_getcsr();
  for (const unsigned mode : {saved & ~0x8040u, saved | 0x8040u, (saved & ~0x8040u) | 0x6000u}) {
    _mm_setcsr(mode);
    chunk_kda(p.args(o.data(), pool.data()), KernelImpl::Optimized);
    const unsigned after = _mm_getcsr();
    _mm_setcsr(saved);
    EXPECT_EQ(after & ~0x3Fu, mode & ~0x3Fu) << "MXCSR before " << mode << ", after " << after;
  }
}
#endif

// The model's head shape, two sequences (100 and 156 tokens) in slots out of order: several work items
// per thread in chunk_kda_opt.
Problem kimi_shape_problem(uint64_t seed) {
  Problem p;
  p.cu = {0, 100, 256};
  p.N = 2;
  p.T = 256;
  p.H = io::KimiLinear48bShape::kHeads;
  p.K = io::KimiLinear48bShape::kHeadDim;
  p.V = io::KimiLinear48bShape::kHeadDim;
  p.slots = 3;
  p.idx = {2, 0};
  p.l2 = true;
  p.gate = true;
  fill(p, seed);
  return p;
}

TEST(KdaKernels, KimiLinearShape) { check_all_kernels(kimi_shape_problem(800), "H=32 K=V=128 T=256"); }

TEST(KdaKernels, PrefillThenDecodeMatchesOnePrefill) {
  // 100 tokens by chunk_kda then 5 tokens one by one by fused_recurrent_kda, against 105 at once.
  Problem p;
  p.T = 105;
  p.H = 2;
  p.K = 64;
  p.V = 64;
  p.slots = 1;
  p.l2 = true;
  p.gate = true;
  fill(p, 900);
  const Reference ref = reference(p);

  std::vector<float> pool = p.pool, o(static_cast<size_t>(p.T) * p.H * p.V, 7.0f);
  Problem pre = p;
  pre.T = 100;
  chunk_kda(pre.args(o.data(), pool.data()));
  for (int64_t t = 100; t < 105; ++t) {
    const size_t ok = t * p.H * p.K, ov = t * p.H * p.V;
    KdaArgs a = p.args(o.data() + ov, pool.data());
    a.q += ok;
    a.k += ok;
    a.g += ok;
    a.v += ov;
    a.beta += t * p.H;
    a.T = 1;
    fused_recurrent_kda(a);
  }
  EXPECT_LE(max_error_ratio(o.data(), ref.o.data(), o.size(), kAtol, kRtol), 1.0);
  EXPECT_LE(max_error_ratio(pool.data(), ref.pool.data(), pool.size(), kAtol, kRtol), 1.0);
}

// ---------------------------------------------------------------------------------------------------
// Snapshots: the state after interior positions, written in the same pass as the output.

// Sequence i of p cut to its first `len` tokens, alone: its initial state (or zero) in slot 0 of a
// one-slot pool, its final state kept there.
Problem prefix_problem(const Problem& p, int64_t i, int64_t len) {
  const int64_t bos = p.cu.empty() ? i * (p.T / p.N) : p.cu[i];
  Problem t = p;
  t.T = len;
  t.N = 1;
  t.cu.clear();
  t.idx.clear();
  t.slots = 1;
  t.out_final = true;
  const size_t qk = static_cast<size_t>(p.H) * p.K, vr = static_cast<size_t>(p.H) * p.V;
  const auto cut = [&](const std::vector<float>& x, size_t row) {
    return std::vector<float>(x.begin() + bos * row, x.begin() + (bos + len) * row);
  };
  t.q = cut(p.q, qk);
  t.k = cut(p.k, qk);
  t.g = cut(p.g, qk);
  t.v = cut(p.v, vr);
  t.beta = cut(p.beta, p.H);
  const size_t kv = static_cast<size_t>(p.H) * p.K * p.V;
  const int64_t slot = p.idx.empty() ? i : p.idx[i];
  const bool init = p.slots > 0 && (p.has_init.empty() || p.has_init[i] != 0);
  t.has_init = {static_cast<uint8_t>(init ? 1 : 0)};
  t.pool.assign(kv, 0.0f);
  if (init) std::copy(p.pool.begin() + slot * kv, p.pool.begin() + (slot + 1) * kv, t.pool.begin());
  return t;
}

// Every kernel with `snaps` (into a buffer of their own, or with `in_pool` into p's pool itself, whose
// slots the sequences do not use): the snapshot slots hold the final states of the kernel's own runs over
// the prefixes and of the float64 reference's (fp32 tolerance; bit for bit for the reference kernels and
// the recurrent ones, whose arithmetic does not depend on where a chunk or a token block ends); the
// other slots are untouched; o and the final states are those of a call without snapshots (bit for bit
// except in the optimized chunk kernel, whose chunks then end at the snapshots: within tolerance of the
// float64 reference).
void check_snapshots(const Problem& p, const std::vector<KdaSnapshot>& snaps, const std::string& label,
                     bool in_pool = false) {
  SCOPED_TRACE(label);
  const size_t n_o = static_cast<size_t>(p.T) * p.H * p.V, kv = static_cast<size_t>(p.H) * p.K * p.V;
  int64_t nslots = 0;
  for (const KdaSnapshot& s : snaps) nslots = std::max<int64_t>(nslots, s.slot + 1);
  if (in_pool) {
    ASSERT_GE(p.slots, nslots);
    nslots = p.slots;
  } else {
    ++nslots;  // one slot no snapshot names
  }
  std::vector<bool> named(nslots, false);
  for (const KdaSnapshot& s : snaps) named[s.slot] = true;
  // The float64 prefix states.
  std::vector<std::vector<float>> want(snaps.size());
  for (size_t j = 0; j < snaps.size(); ++j)
    want[j] = reference(prefix_problem(p, snaps[j].seq, snaps[j].pos)).pool;

  std::string line = label + ":";
  for (const auto& kernel : all_kernels()) {
    SCOPED_TRACE(kernel.name);
    // Every kernel keeps its chunk grid, so asking for snapshots leaves o and the final states as they
    // are, bit for bit. A recurrent snapshot is a copy of the running state, and the optimized chunk
    // kernels' is the final state of a side chunk that ends there, each the bits of a cut run. The naive
    // chunk kernel's partial state inside a chunk takes other reduction lengths than a cut run (omp simd
    // may order them differently, e.g. under -march=native): within tolerance only.
    const bool exact_snapshots = kernel.name != "chunk/naive";
    std::vector<float> o0(n_o, 7.0f), pool0 = p.pool;
    kernel.fn(p.args(o0.data(), pool0.empty() ? nullptr : pool0.data()));

    std::vector<float> o(n_o, 7.0f), pool = p.pool;
    std::vector<float> own(in_pool ? 0 : nslots * kv, 7.0f);
    KdaArgs a = p.args(o.data(), pool.empty() ? nullptr : pool.data());
    a.snapshots = snaps.data();
    a.num_snapshots = static_cast<int64_t>(snaps.size());
    a.snapshot_state = in_pool ? pool.data() : own.data();
    a.num_snapshot_slots = nslots;
    kernel.fn(a);
    const float* sbuf = a.snapshot_state;
    const std::vector<float>& base = in_pool ? p.pool : own;  // `own` is only read below if untouched

    EXPECT_EQ(o, o0) << "output changed by asking for snapshots";
    double worst = 0.0;
    for (size_t j = 0; j < snaps.size(); ++j) {
      const KdaSnapshot& s = snaps[j];
      const float* got = sbuf + s.slot * kv;
      const Problem t = prefix_problem(p, s.seq, s.pos);
      std::vector<float> to(static_cast<size_t>(t.T) * t.H * t.V), tpool = t.pool;
      kernel.fn(t.args(to.data(), tpool.data()));
      const std::string what = "snapshot seq " + std::to_string(s.seq) + " pos " + std::to_string(s.pos);
      const double e = max_error_ratio(got, want[j].data(), kv, kAtol, kRtol);
      EXPECT_LE(e, 1.0) << what << " against the float64 prefix state";
      EXPECT_LE(max_error_ratio(got, tpool.data(), kv, kAtol, kRtol), 1.0)
          << what << " against the kernel's prefix run";
      if (exact_snapshots) {
        EXPECT_EQ(0, std::memcmp(got, tpool.data(), kv * sizeof(float))) << what << " not bit for bit";
      }
      worst = std::max(worst, e);
    }
    for (int64_t sl = 0; sl < nslots; ++sl) {
      if (named[sl]) continue;
      if (in_pool) {
        // Slots of the sequences hold their final states (checked below); the others are untouched.
        bool used = false;
        for (int64_t i = 0; i < p.N; ++i) used = used || (p.idx.empty() ? i : p.idx[i]) == sl;
        if (used) continue;
        EXPECT_EQ(0, std::memcmp(pool.data() + sl * kv, base.data() + sl * kv, kv * sizeof(float)))
            << "slot " << sl;
      } else {
        EXPECT_TRUE(std::all_of(own.begin() + sl * kv, own.begin() + (sl + 1) * kv,
                                [](float x) { return x == 7.0f; }))
            << "snapshot slot " << sl << " named by no snapshot was written";
      }
    }
    // Final states: every slot but the snapshot slots as without snapshots.
    for (int64_t sl = 0; sl < p.slots; ++sl) {
      if (in_pool && named[sl]) continue;
      const float* x = pool.data() + sl * kv;
      const float* y = pool0.data() + sl * kv;
      EXPECT_EQ(0, std::memcmp(x, y, kv * sizeof(float))) << "final state of slot " << sl << " changed";
    }
    Worst& w = g_worst[kernel.name];
    w.state = std::max(w.state, worst);
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %s %.3f", kernel.name.c_str(), worst);
    line += buf;
  }
  std::printf("[ snapshot ] %s\n", line.c_str());
}

TEST(KdaSnapshots, InsideChunksAndAtBoundaries) {
  for (int f = 0; f < 4; ++f) {
    Problem p;
    p.T = 300;
    p.H = 2;
    p.K = 64;
    p.V = 48;
    p.slots = 1;
    p.l2 = f & 1;
    p.gate = f & 2;
    fill(p, 1200 + f);
    // Any order; the initial state (0), inside chunks, at and next to chunk boundaries, the final state.
    const std::vector<KdaSnapshot> snaps = {{0, 100, 4}, {0, 1, 0}, {0, 63, 1},  {0, 64, 2},  {0, 65, 3},
                                            {0, 300, 5}, {0, 0, 6}, {0, 128, 7}, {0, 129, 8}, {0, 299, 9}};
    check_snapshots(p, snaps, "T=300 " + flags_label(p.l2, p.gate));
  }
}

TEST(KdaSnapshots, VarlenInitialStatesAndTheStatePoolItself) {
  for (int f = 0; f < 4; ++f) {
    Problem p;
    p.cu = {0, 1, 1, 66, 200, 330, 331};
    p.N = 6;
    p.T = 331;
    p.H = 3;
    p.K = 32;
    p.V = 64;
    p.idx = {3, 1, 6, 0, 8, 4};
    p.has_init = {1, 1, 0, 1, 1, 0};
    p.slots = 12;  // 2, 5, 7, 9, 10, 11 free
    p.l2 = f & 1;
    p.gate = f & 2;
    fill(p, 1300 + f);
    // 1-token segments (0: with an initial state, 5: without), an empty one, several snapshots per
    // sequence, two at one position.
    const std::vector<KdaSnapshot> snaps = {{0, 1, 2},   {0, 0, 5},   {1, 0, 7},  {2, 64, 9}, {2, 1, 10},
                                            {2, 65, 11}, {3, 134, 0}, {3, 70, 1}, {3, 7, 3},  {3, 70, 4},
                                            {4, 64, 6},  {4, 128, 8}, {5, 1, 12}, {5, 0, 13}, {4, 129, 14}};
    check_snapshots(p, snaps, "varlen " + flags_label(p.l2, p.gate));
    // Into the pool itself, its free slots.
    const std::vector<KdaSnapshot> in_pool = {{0, 1, 2},  {2, 1, 5},    {2, 65, 7},
                                              {3, 70, 9}, {4, 100, 10}, {5, 1, 11}};
    check_snapshots(p, in_pool, "varlen into the pool " + flags_label(p.l2, p.gate), true);
  }
}

TEST(KdaSnapshots, StrongGatesNoPoolNoFinalStateOddShapes) {
  for (int f = 0; f < 4; ++f) {
    Problem p;
    p.cu = {0, 37, 300};
    p.N = 2;
    p.T = 300;
    p.slots = 2;
    p.l2 = f & 1;
    p.gate = f & 2;
    fill(p, 1400 + f, GateKind::kStrong);
    check_snapshots(p, {{0, 36, 0}, {0, 37, 1}, {1, 1, 2}, {1, 100, 3}, {1, 200, 4}, {1, 263, 5}},
                    "strong gates " + flags_label(p.l2, p.gate));
  }
  {
    Problem p;
    p.T = 130;
    p.N = 2;  // no cu_seqlens, no pool, the second sequence padded
    p.idx = {0, -1};
    p.gate = true;
    fill(p, 1410);
    check_snapshots(p, {{0, 0, 0}, {0, 1, 1}, {0, 64, 2}, {0, 65, 3}}, "no pool");
  }
  {
    Problem p;
    p.cu = {0, 70, 71, 200};
    p.N = 3;
    p.T = 200;
    p.idx = {2, 0, 1};
    p.slots = 3;
    p.out_final = false;
    p.l2 = true;
    fill(p, 1420);
    check_snapshots(p, {{0, 70, 0}, {1, 1, 1}, {2, 64, 2}, {2, 100, 3}}, "output_final_state=false");
  }
  for (auto [K, V] : {std::pair{17, 5}, std::pair{128, 80}}) {
    Problem p;
    p.cu = {0, 1, 100, 170};
    p.N = 3;
    p.T = 170;
    p.K = K;
    p.V = V;
    p.slots = 4;
    p.idx = {1, 3, 0};
    p.l2 = true;
    p.gate = true;
    fill(p, 1430 + K);
    check_snapshots(p, {{0, 1, 0}, {1, 50, 1}, {1, 99, 2}, {2, 3, 3}, {2, 64, 4}, {2, 69, 5}},
                    "K=" + std::to_string(K) + " V=" + std::to_string(V));
  }
}

// ---------------------------------------------------------------------------------------------------
// Row strides: the same values laid out as column slices of wider rows must give bit-identical results.

// Output and final pool of `fn` on p's inputs, dense or strided. Strided: q, k and v are column slices of
// one [T, 2P + H*V + 5] row (as the layer's conv output q||k||v, with an odd pad so that rows are not
// 64-byte aligned), and g starts at column 3 of a [T, P + 7] row (a slice of a wider projection output).
std::vector<float> run_layout(const Problem& p, const std::function<void(const KdaArgs&)>& fn, bool strided) {
  const int64_t P = static_cast<int64_t>(p.H) * p.K, Pv = static_cast<int64_t>(p.H) * p.V;
  const int64_t qkv_w = 2 * P + Pv + 5, g_w = P + 7, g_off = 3;
  std::vector<float> qkv(static_cast<size_t>(p.T * qkv_w), NAN), g(static_cast<size_t>(p.T * g_w), NAN);
  for (int64_t t = 0; t < p.T; ++t) {
    std::copy_n(p.q.begin() + t * P, P, qkv.begin() + t * qkv_w);
    std::copy_n(p.k.begin() + t * P, P, qkv.begin() + t * qkv_w + P);
    std::copy_n(p.v.begin() + t * Pv, Pv, qkv.begin() + t * qkv_w + 2 * P);
    std::copy_n(p.g.begin() + t * P, P, g.begin() + t * g_w + g_off);
  }
  std::vector<float> o(static_cast<size_t>(p.T) * Pv, 7.0f), pool = p.pool;
  KdaArgs a = p.args(o.data(), pool.empty() ? nullptr : pool.data());
  if (strided) {
    a.q = qkv.data();
    a.k = qkv.data() + P;
    a.v = qkv.data() + 2 * P;
    a.g = g.data() + g_off;
    a.q_stride = a.k_stride = a.v_stride = qkv_w;
    a.g_stride = g_w;
  }
  fn(a);
  o.insert(o.end(), pool.begin(), pool.end());
  return o;
}

// Problems that cover varlen with padding and initial-state flags, decode, and V with and without a
// partial 64-column strip, with each combination of the l2norm / gate flags.
std::vector<Problem> stride_problems() {
  std::vector<Problem> out;
  for (int f = 0; f < 4; ++f) {
    Problem p;
    p.cu = {0, 1, 70, 70, 150};
    p.N = 4;
    p.T = 150;
    p.H = 3;
    p.K = 32;
    p.V = 48;
    p.idx = {2, 0, -1, 3};
    p.has_init = {1, 0, 1, 1};
    p.slots = 4;
    p.l2 = f & 1;
    p.gate = f & 2;
    fill(p, 1300 + f);
    out.push_back(p);
  }
  Problem d;  // decode
  d.T = 5;
  d.N = 5;
  d.H = 2;
  d.K = 64;
  d.V = 80;
  d.idx = {4, 1, 0, -1, 2};
  d.slots = 5;
  d.l2 = true;
  d.gate = true;
  fill(d, 1310);
  out.push_back(d);
  return out;
}

void expect_strided_matches_dense(const char* name, const std::function<void(const KdaArgs&)>& fn) {
  SCOPED_TRACE(name);
  int n = 0;
  for (const Problem& p : stride_problems()) {
    SCOPED_TRACE("problem " + std::to_string(n++));
    const auto dense = run_layout(p, fn, false);
    const auto strided = run_layout(p, fn, true);
    ASSERT_EQ(dense.size(), strided.size());
    EXPECT_TRUE(all_finite(strided));
    EXPECT_EQ(0, std::memcmp(dense.data(), strided.data(), dense.size() * sizeof(float)))
        << "strided inputs must give bit-identical outputs and final states";
  }
}

TEST(KdaStrides, NaiveAndRecurrentMatchDense) {
  expect_strided_matches_dense("chunk/naive", [](const KdaArgs& a) { chunk_kda(a, KernelImpl::Naive); });
  expect_strided_matches_dense("recurrent/naive",
                               [](const KdaArgs& a) { fused_recurrent_kda(a, KernelImpl::Naive); });
  expect_strided_matches_dense("recurrent/opt",
                               [](const KdaArgs& a) { fused_recurrent_kda(a, KernelImpl::Optimized); });
}

// chunk_kda_opt on its own, so that its stride support shows separately.
TEST(KdaStrides, ChunkOptMatchesDense) {
  expect_strided_matches_dense("chunk/opt", [](const KdaArgs& a) { chunk_kda(a, KernelImpl::Optimized); });
}

// The strided call is also right, not only self-consistent: against the float64 reference.
TEST(KdaStrides, RecurrentOptStridedWithinTolerance) {
  for (const Problem& p : stride_problems()) {
    const Reference ref = reference(p);
    const auto got = run_layout(p, fused_recurrent_kda_opt, true);
    const size_t n_o = static_cast<size_t>(p.T) * p.H * p.V;
    EXPECT_LE(max_error_ratio(got.data(), ref.o.data(), n_o, kAtol, kRtol), 1.0);
    EXPECT_LE(max_error_ratio(got.data() + n_o, ref.pool.data(), ref.pool.size(), kAtol, kRtol), 1.0);
  }
}

// ---------------------------------------------------------------------------------------------------
// bf16 q, k, v (the bf16 mode's conv outputs) and / or bf16 g: every kernel gives, bit for bit, what it
// gives on fp32 inputs holding the same values, dense or in the stride tests' layout (q, k, v column
// slices of one padded [T, 2P + Pv + 5] row, g from column 3 of a [T, P + 7] row).

// x as E (float, or bf16_t for a value that is already a bf16 one).
template <class E>
E as(float x) {
  if constexpr (std::is_same_v<E, bf16_t>) {
    return f32_to_bf16(x);
  } else {
    return x;
  }
}

// x's [T, n] rows as E, row t at dst + t * ld.
template <class E>
void put_rows(const std::vector<float>& x, int64_t n, E* dst, int64_t ld) {
  for (int64_t t = 0; t < static_cast<int64_t>(x.size()) / n; ++t) {
    for (int64_t j = 0; j < n; ++j) dst[t * ld + j] = as<E>(x[t * n + j]);
  }
}

// Points a's q, k, v (as fp32 or bf16 by the type) at p's, laid out in buf; NaN in the padding.
template <class E>
void lay_out_qkv(const Problem& p, bool strided, std::vector<E>& buf, KdaArgs& a) {
  const int64_t P = static_cast<int64_t>(p.H) * p.K, Pv = static_cast<int64_t>(p.H) * p.V;
  const int64_t w = 2 * P + Pv + (strided ? 5 : 0);
  buf.assign(static_cast<size_t>(p.T * w), as<E>(NAN));
  E* q = buf.data();
  E* k = strided ? q + P : q + p.T * P;
  E* v = strided ? q + 2 * P : k + p.T * P;
  put_rows(p.q, P, q, strided ? w : P);
  put_rows(p.k, P, k, strided ? w : P);
  put_rows(p.v, Pv, v, strided ? w : Pv);
  a.q = a.k = a.v = nullptr;
  a.q_bf16 = a.k_bf16 = a.v_bf16 = nullptr;
  if constexpr (std::is_same_v<E, bf16_t>) {
    a.q_bf16 = q;
    a.k_bf16 = k;
    a.v_bf16 = v;
  } else {
    a.q = q;
    a.k = k;
    a.v = v;
  }
  a.q_stride = a.k_stride = a.v_stride = strided ? w : 0;
}

// Likewise g.
template <class E>
void lay_out_g(const Problem& p, bool strided, std::vector<E>& buf, KdaArgs& a) {
  const int64_t P = static_cast<int64_t>(p.H) * p.K, w = strided ? P + 7 : P, off = strided ? 3 : 0;
  buf.assign(static_cast<size_t>(p.T * w), as<E>(NAN));
  put_rows(p.g, P, buf.data() + off, w);
  a.g = nullptr;
  a.g_bf16 = nullptr;
  if constexpr (std::is_same_v<E, bf16_t>) {
    a.g_bf16 = buf.data() + off;
  } else {
    a.g = buf.data() + off;
  }
  a.g_stride = strided ? w : 0;
}

// Rounds p's q, k, v and g to bf16 values; returns the outputs and final states of fn on them, q, k, v
// as bf16 when qkv_bf16 (else fp32) and g as bf16 when g_bf16, in the strided layout when `strided`.
std::vector<float> run_bf16_inputs(Problem p, const std::function<void(const KdaArgs&)>& fn, bool qkv_bf16,
                                   bool g_bf16, bool strided) {
  for (std::vector<float>* x : {&p.q, &p.k, &p.v, &p.g}) {
    for (float& e : *x) e = round_bf16(e);
  }
  std::vector<float> o(static_cast<size_t>(p.T) * p.H * p.V, 7.0f), pool = p.pool, qkv32, g32;
  std::vector<bf16_t> qkv16, g16;
  KdaArgs a = p.args(o.data(), pool.empty() ? nullptr : pool.data());
  if (qkv_bf16) {
    lay_out_qkv(p, strided, qkv16, a);
  } else {
    lay_out_qkv(p, strided, qkv32, a);
  }
  if (g_bf16) {
    lay_out_g(p, strided, g16, a);
  } else {
    lay_out_g(p, strided, g32, a);
  }
  fn(a);
  o.insert(o.end(), pool.begin(), pool.end());
  return o;
}

// Every combination of q, k, v and g precisions, dense and strided (all fp32 strided is KdaStrides'),
// with and without the gate in the kernel and l2norm (stride_problems covers the four flag pairs).
TEST(KdaBf16Inputs, EveryKernelMatchesFp32InputsOfTheSameValues) {
  std::vector<Problem> problems = stride_problems();
  problems.push_back(kimi_shape_problem(1400));
  for (const auto& [name, fn] : all_kernels()) {
    SCOPED_TRACE(name);
    int n = 0;
    for (const Problem& p : problems) {
      SCOPED_TRACE("problem " + std::to_string(n++));
      const auto f32 = run_bf16_inputs(p, fn, false, false, false);
      EXPECT_TRUE(all_finite(f32));
      for (const bool strided : {false, true}) {
        for (const bool qkv_bf16 : {false, true}) {
          for (const bool g_bf16 : {false, true}) {
            if (!qkv_bf16 && !g_bf16) continue;
            const auto b16 = run_bf16_inputs(p, fn, qkv_bf16, g_bf16, strided);
            ASSERT_EQ(f32.size(), b16.size());
            EXPECT_EQ(0, std::memcmp(f32.data(), b16.data(), f32.size() * sizeof(float)))
                << (strided ? "strided" : "dense") << " inputs, q/k/v " << (qkv_bf16 ? "bf16" : "fp32")
                << ", g " << (g_bf16 ? "bf16" : "fp32") << ", differ from fp32 inputs of the same values";
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Dispatcher.

TEST(KdaDispatch, ParseAndPrint) {
  for (KernelImpl k : {KernelImpl::Auto, KernelImpl::Naive, KernelImpl::Optimized, KernelImpl::Portable,
                       KernelImpl::Avx2, KernelImpl::Avx512}) {
    EXPECT_EQ(parse_kernel_impl(to_string(k)), k);
  }
  EXPECT_THROW(parse_kernel_impl("fast"), std::invalid_argument);
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512}) EXPECT_EQ(parse_isa(to_string(isa)), isa);
  EXPECT_THROW(parse_isa("sse"), std::invalid_argument);
}

// Auto and Optimized name the fastest available copy, a forced ISA itself; the portable copy is always
// there, and best_isa() is the last available one (ascending order).
TEST(KdaDispatch, KernelNames) {
  const auto isas = available_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), Isa::Portable);
  if (std::getenv("KDA_ISA") == nullptr) {
    EXPECT_EQ(best_isa(), isas.back());  // else capped
  }
  EXPECT_STREQ(kernel_name(KernelImpl::Naive), "naive");
  EXPECT_STREQ(kernel_name(KernelImpl::Auto), to_string(best_isa()));
  EXPECT_STREQ(kernel_name(KernelImpl::Optimized), to_string(best_isa()));
  for (Isa isa : isas) EXPECT_STREQ(kernel_name(impl_of(isa)), to_string(isa));
  EXPECT_EQ(isa_available(Isa::Avx512), isa_compiled(Isa::Avx512) && isa_supported_by_cpu(Isa::Avx512));
}

// Forcing a copy that the build or the CPU lacks is an error naming it, before anything is touched.
TEST(KdaDispatch, ForcingAnUnavailableIsaThrows) {
  int checked = 0;
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (isa_available(isa)) continue;
    ++checked;
    Problem p;
    p.T = 20;
    p.slots = 1;
    fill(p, 1200);
    const size_t n_o = static_cast<size_t>(p.T) * p.H * p.V;
    std::vector<float> o(n_o, 7.0f), pool = p.pool;
    for (bool chunk : {true, false}) {
      try {
        const KdaArgs a = p.args(o.data(), pool.data());
        chunk ? chunk_kda(a, impl_of(isa)) : fused_recurrent_kda(a, impl_of(isa));
        ADD_FAILURE() << "no exception for " << to_string(isa);
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(to_string(isa)), std::string::npos) << e.what();
      }
    }
    EXPECT_THROW(kernel_name(impl_of(isa)), std::invalid_argument);
    EXPECT_EQ(pool, p.pool);
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 7.0f; }));
  }
  if (checked == 0) GTEST_SKIP() << "every ISA is available here";
}

// The copies against each other on random problems of many shapes (head sizes below, at and above a
// vector, odd ones, varlen, decode): within twice the reference tolerance of the portable copy, whose
// loops are the plain form of the same algorithm.
TEST(KdaDispatch, IsaCopiesAgree) {
  const auto isas = available_isas();
  if (isas.size() < 2) GTEST_SKIP() << "only the portable copy runs here";
  std::mt19937_64 rng(77);
  for (int trial = 0; trial < 12; ++trial) {
    Problem p;
    const int dims[] = {1, 7, 16, 33, 64, 100, 128};
    p.K = dims[rng() % 7];
    p.V = dims[rng() % 7];
    p.H = 1 + static_cast<int>(rng() % 3);
    p.N = 1 + static_cast<int64_t>(rng() % 3);
    p.cu = {0};
    for (int64_t i = 0; i < p.N; ++i) p.cu.push_back(p.cu.back() + static_cast<int32_t>(rng() % 90));
    p.T = p.cu.back();
    p.slots = p.N;
    p.l2 = rng() % 2 == 0;
    p.gate = rng() % 2 == 0;
    fill(p, 1300 + trial);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": H=" + std::to_string(p.H) +
                 " K=" + std::to_string(p.K) + " V=" + std::to_string(p.V) + " T=" + std::to_string(p.T));
    const size_t n_o = static_cast<size_t>(p.T) * p.H * p.V;
    for (bool chunk : {true, false}) {
      auto run = [&](Isa isa) {
        std::vector<float> o(n_o), pool = p.pool;
        const KdaArgs a = p.args(o.data(), pool.data());
        chunk ? chunk_kda(a, impl_of(isa)) : fused_recurrent_kda(a, impl_of(isa));
        o.insert(o.end(), pool.begin(), pool.end());
        return o;
      };
      const auto base = run(Isa::Portable);
      for (size_t i = 1; i < isas.size(); ++i) {
        const auto got = run(isas[i]);
        EXPECT_LE(max_error_ratio(got.data(), base.data(), got.size(), 2 * kAtol, 2 * kRtol), 1.0)
            << (chunk ? "chunk " : "recurrent ") << to_string(isas[i]) << " vs portable";
      }
    }
  }
}

TEST(KdaDispatch, SelectsTheRequestedKernel) {
  Problem p;
  p.T = 130;
  p.slots = 1;
  p.l2 = true;
  p.gate = true;
  fill(p, 1000);
  const size_t n_o = static_cast<size_t>(p.T) * p.H * p.V;
  auto run = [&](const std::function<void(const KdaArgs&)>& fn) {
    std::vector<float> o(n_o), pool = p.pool;
    fn(p.args(o.data(), pool.data()));
    o.insert(o.end(), pool.begin(), pool.end());
    return o;
  };
  const auto naive = run(chunk_kda_naive);
  const auto opt = run(chunk_kda_opt);
  ASSERT_NE(naive, opt);  // the two kernels round differently, so bitwise equality identifies them
  EXPECT_EQ(run([](const KdaArgs& a) { chunk_kda(a, KernelImpl::Naive); }), naive);
  EXPECT_EQ(run([](const KdaArgs& a) { chunk_kda(a, KernelImpl::Optimized); }), opt);
  EXPECT_EQ(run([](const KdaArgs& a) { chunk_kda(a); }), opt);

  const auto rnaive = run(fused_recurrent_kda_naive);
  const auto ropt = run(fused_recurrent_kda_opt);
  ASSERT_NE(rnaive, ropt);
  EXPECT_EQ(run([](const KdaArgs& a) { fused_recurrent_kda(a, KernelImpl::Naive); }), rnaive);
  EXPECT_EQ(run([](const KdaArgs& a) { fused_recurrent_kda(a, KernelImpl::Optimized); }), ropt);
  EXPECT_EQ(run([](const KdaArgs& a) { fused_recurrent_kda(a); }), ropt);
}

// Each malformed call must throw std::invalid_argument whose message contains `what`, through both
// dispatchers and every implementation, before touching the pool or the output.
void expect_rejected(const Problem& p, const std::string& what,
                     const std::function<void(KdaArgs&)>& edit = {}) {
  SCOPED_TRACE(what);
  const size_t n_o = static_cast<size_t>(p.T) * p.H * p.V;
  for (KernelImpl impl : {KernelImpl::Auto, KernelImpl::Naive, KernelImpl::Optimized}) {
    for (bool chunk : {true, false}) {
      std::vector<float> o(n_o, 7.0f), pool = p.pool;
      KdaArgs a = p.args(o.data(), pool.empty() ? nullptr : pool.data());
      if (edit) edit(a);
      try {
        chunk ? chunk_kda(a, impl) : fused_recurrent_kda(a, impl);
        ADD_FAILURE() << "no exception";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << "message: " << e.what();
      }
      EXPECT_EQ(pool, p.pool) << "the pool changed";
      EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 7.0f; })) << "the output changed";
    }
  }
}

TEST(KdaDispatch, ValidationErrors) {
  Problem base;
  base.cu = {0, 10, 30, 40};
  base.N = 3;
  base.T = 40;
  base.H = 2;
  base.K = 16;
  base.V = 16;
  base.slots = 4;
  base.idx = {0, 2, 3};
  fill(base, 1100);

  {
    Problem p = base;
    p.cu = {0, 30, 10, 40};
    expect_rejected(p, "non-monotonic cu_seqlens at index 2: 30 > 10");
  }
  {
    Problem p = base;
    p.cu = {0, 10, 30, 39};
    expect_rejected(p, "cu_seqlens[N] != T");
  }
  {
    Problem p = base;
    p.cu = {1, 10, 30, 40};
    expect_rejected(p, "cu_seqlens[0] must be 0");
  }
  {
    Problem p = base;
    p.idx = {0, 4, 3};
    expect_rejected(p, "state index out of range");
    p.idx = {0, -2, 3};
    expect_rejected(p, "state index out of range");
  }
  {
    Problem p = base;
    p.idx = {3, 2, 3};
    expect_rejected(p, "duplicate state slot 3 used by sequences 0 and 2");
  }
  {
    std::vector<bf16_t> b(base.q.size());
    expect_rejected(base, "q, k, v are given both as fp32 and as bf16",
                    [&](KdaArgs& a) { a.k_bf16 = b.data(); });
    expect_rejected(base, "v_bf16 is null with T=40", [&](KdaArgs& a) {
      a.q = a.k = a.v = nullptr;
      a.q_bf16 = a.k_bf16 = b.data();
    });
    // g: exactly one of g, g_bf16, whatever q, k, v are.
    expect_rejected(base, "g is given both as fp32 (g) and as bf16 (g_bf16)",
                    [&](KdaArgs& a) { a.g_bf16 = b.data(); });
    expect_rejected(base, "g is given both as fp32 (g) and as bf16 (g_bf16)", [&](KdaArgs& a) {
      a.q = a.k = a.v = nullptr;
      a.q_bf16 = a.k_bf16 = a.v_bf16 = b.data();
      a.g_bf16 = b.data();
    });
    expect_rejected(base, "g (or g_bf16) is null with T=40", [](KdaArgs& a) { a.g = nullptr; });
  }
  {
    Problem p = base;
    p.cu.clear();
    p.N = 3;
    p.T = 40;
    expect_rejected(p, "T not divisible by N");
  }
  expect_rejected(base, "use_gate_in_kernel requires A_log", [](KdaArgs& a) {
    a.use_gate_in_kernel = true;
    a.A_log = nullptr;
  });
  expect_rejected(base, "q is null", [](KdaArgs& a) { a.q = nullptr; });
  expect_rejected(base, "H, K and V must be positive", [](KdaArgs& a) { a.K = 0; });
  expect_rejected(base, "T must be >= 0", [](KdaArgs& a) { a.T = -1; });
  // Strides: 0 or at least a dense row (H*K = 32 for q, k, g; H*V = 32 for v).
  expect_rejected(base, "q_stride must be 0 (dense) or >= 32 (got 31)", [](KdaArgs& a) { a.q_stride = 31; });
  expect_rejected(base, "k_stride must be 0 (dense) or >= 32 (got -1)", [](KdaArgs& a) { a.k_stride = -1; });
  expect_rejected(base, "v_stride must be 0 (dense) or >= 32 (got 16)", [](KdaArgs& a) { a.v_stride = 16; });
  expect_rejected(base, "g_stride must be 0 (dense) or >= 32 (got 1)", [](KdaArgs& a) { a.g_stride = 1; });
  expect_rejected(base, "state index out of range", [](KdaArgs& a) {
    a.state_indices = nullptr;  // sequences 0..2 on a 2-slot pool
    a.num_state_slots = 2;
  });

  // Accepted: a padded row may share nothing; -1 twice is fine; no pool with any indices.
  Problem ok = base;
  ok.idx = {-1, 1, -1};
  std::vector<float> o(static_cast<size_t>(ok.T) * ok.H * ok.V), pool = ok.pool;
  EXPECT_NO_THROW(chunk_kda(ok.args(o.data(), pool.data())));
  EXPECT_NO_THROW(fused_recurrent_kda(ok.args(o.data(), nullptr)));
}

// Bad snapshots: each an invalid_argument naming it, through every kernel, with the pool, the output
// and the snapshot buffer unchanged.
TEST(KdaDispatch, SnapshotValidationErrors) {
  Problem base;
  base.cu = {0, 10, 30, 40};
  base.N = 3;
  base.T = 40;
  base.H = 2;
  base.K = 16;
  base.V = 16;
  base.slots = 4;
  base.idx = {0, 2, 3};  // slot 1 free
  fill(base, 1500);
  const size_t kv = static_cast<size_t>(base.H) * base.K * base.V;
  std::vector<float> snap(3 * kv, 7.0f);
  std::vector<KdaSnapshot> snaps;
  const auto with = [&](std::vector<KdaSnapshot> s, int64_t slots = 3) {
    return [&, s, slots](KdaArgs& a) {
      snaps = s;
      a.snapshots = snaps.data();
      a.num_snapshots = static_cast<int64_t>(snaps.size());
      a.snapshot_state = snap.data();
      a.num_snapshot_slots = slots;
    };
  };
  expect_rejected(base, "snapshot 1: seq=3 not in [0, N=3)", with({{0, 1, 0}, {3, 1, 1}}));
  expect_rejected(base, "snapshot 0: seq=-1 not in [0, N=3)", with({{-1, 1, 0}}));
  expect_rejected(base, "snapshot 0: pos=21 not in [0, 20] (sequence 1 has 20 tokens)", with({{1, 21, 0}}));
  expect_rejected(base, "snapshot 0: pos=-1 not in [0, 10]", with({{0, -1, 0}}));
  expect_rejected(base, "snapshot 1: slot=3 not in [0, num_snapshot_slots=3)", with({{0, 1, 0}, {1, 2, 3}}));
  expect_rejected(base, "snapshot 0: slot=-1 not in [0, num_snapshot_slots=3)", with({{0, 1, -1}}));
  expect_rejected(base, "duplicate snapshot slot 2 used by snapshots 0 and 2",
                  with({{0, 1, 2}, {1, 1, 0}, {2, 1, 2}}));
  expect_rejected(base, "num_snapshots must be >= 0", [&](KdaArgs& a) { a.num_snapshots = -1; });
  expect_rejected(base, "snapshots is null with num_snapshots=1", [&](KdaArgs& a) {
    a.num_snapshots = 1;
    a.snapshot_state = snap.data();
    a.num_snapshot_slots = 3;
  });
  expect_rejected(base, "snapshot_state is null with num_snapshots=1", [&](KdaArgs& a) {
    with({{0, 1, 0}})(a);
    a.snapshot_state = nullptr;
  });
  {
    Problem p = base;
    p.idx = {0, -1, 3};
    expect_rejected(p, "snapshot 0: sequence 1 is a padded row", with({{1, 5, 0}}));
  }
  // Into the state pool itself: never a slot of a sequence of the call.
  expect_rejected(base, "snapshot 1: slot 2 is the state slot of sequence 1", [&](KdaArgs& a) {
    with({{0, 1, 1}, {0, 2, 2}}, base.slots)(a);
    a.snapshot_state = a.state;
  });
  EXPECT_TRUE(std::all_of(snap.begin(), snap.end(), [](float x) { return x == 7.0f; }))
      << "a snapshot was written";

  // Accepted: a free slot of the pool itself; an empty list with null pointers.
  std::vector<float> o(static_cast<size_t>(base.T) * base.H * base.V), pool = base.pool;
  KdaArgs a = base.args(o.data(), pool.data());
  const KdaSnapshot ok[] = {{0, 10, 1}};
  a.snapshots = ok;
  a.num_snapshots = 1;
  a.snapshot_state = pool.data();
  a.num_snapshot_slots = base.slots;
  EXPECT_NO_THROW(chunk_kda(a));
  EXPECT_NO_THROW(fused_recurrent_kda(a));
  a.snapshots = nullptr;
  a.num_snapshots = 0;
  a.snapshot_state = nullptr;
  EXPECT_NO_THROW(chunk_kda(a));
}

// ---------------------------------------------------------------------------------------------------
// Speculative verification (TARGET_VERIFY): each request's row is its last accepted token and its
// drafts; the recurrent kernels keep the state after every position (snapshots) without touching the
// committed state (output_final_state = false), and run tree drafts through KdaArgs::parents.

// The recurrent kernels: the reference and each available ISA's optimized copy.
std::vector<NamedKernel> recurrent_kernels() {
  std::vector<NamedKernel> v;
  for (const auto& k : all_kernels())
    if (k.name.rfind("recurrent", 0) == 0) v.push_back(k);
  return v;
}

// A verify batch: rows of `lens` tokens (the last accepted token and its drafts) on slots `idx` (-1: a
// padded row) of a pool of `slots` random states, at the layer's flags.
Problem verify_problem(const std::vector<int32_t>& lens, std::vector<int32_t> idx, int64_t slots, int H,
                       int K, int V, uint64_t seed) {
  Problem p;
  p.N = static_cast<int64_t>(lens.size());
  p.cu = {0};
  for (int32_t l : lens) p.cu.push_back(p.cu.back() + l);
  p.T = p.cu.back();
  p.H = H;
  p.K = K;
  p.V = V;
  p.idx = std::move(idx);
  p.slots = slots;
  p.l2 = true;
  p.gate = true;
  p.out_final = false;
  fill(p, seed);
  return p;
}

// Token j of sequence i and its ancestors (root first) as a chain run alone from the sequence's initial
// state, in slot 0 of a one-slot pool, its final state kept.
Problem path_problem(const Problem& p, const std::vector<int32_t>& parents, int64_t i, int64_t j) {
  const int64_t bos = p.cu[i];
  std::vector<int64_t> path;
  for (int64_t t = j; t >= 0; t = parents[bos + t]) path.insert(path.begin(), bos + t);
  Problem t = prefix_problem(p, i, 0);
  t.T = static_cast<int64_t>(path.size());
  const size_t qk = static_cast<size_t>(p.H) * p.K, vr = static_cast<size_t>(p.H) * p.V;
  const auto gather = [&](const std::vector<float>& x, size_t row) {
    std::vector<float> out;
    for (int64_t r : path) out.insert(out.end(), x.begin() + r * row, x.begin() + (r + 1) * row);
    return out;
  };
  t.q = gather(p.q, qk);
  t.k = gather(p.k, qk);
  t.g = gather(p.g, qk);
  t.v = gather(p.v, vr);
  t.beta = gather(p.beta, p.H);
  return t;
}

// Every recurrent kernel on p with `parents` (empty: a chain) and a snapshot of every position 1..len
// of every non-padded row: token j's state (snapshot pos j+1) and output equal those of its path run
// alone (the kernel's own run and the float64 reference, fp32 tolerance); padded rows give zeros and the
// pool is untouched (output_final_state is false). With output_final_state, each slot then holds the
// state of its row's last token.
void check_verify(const Problem& p, const std::vector<int32_t>& parents, const std::string& label) {
  SCOPED_TRACE(label);
  const size_t kv = static_cast<size_t>(p.H) * p.K * p.V, vr = static_cast<size_t>(p.H) * p.V;
  std::vector<KdaSnapshot> snaps;
  for (int64_t i = 0; i < p.N; ++i) {
    if (p.idx[i] < 0) continue;
    for (int32_t pos = 1; pos <= p.cu[i + 1] - p.cu[i]; ++pos)
      snaps.push_back({static_cast<int32_t>(i), pos, static_cast<int32_t>(snaps.size())});
  }
  std::vector<int32_t> par = parents;
  if (par.empty()) {
    for (int64_t i = 0; i < p.N; ++i)
      for (int32_t j = 0; j < p.cu[i + 1] - p.cu[i]; ++j) par.push_back(j - 1);
  }
  for (const auto& kernel : recurrent_kernels()) {
    SCOPED_TRACE(kernel.name);
    for (bool final_state : {false, true}) {
      std::vector<float> o(static_cast<size_t>(p.T) * vr, 7.0f), pool = p.pool;
      std::vector<float> states(snaps.size() * kv, 7.0f);
      KdaArgs a = p.args(o.data(), pool.data());
      a.output_final_state = final_state;
      a.parents = parents.empty() ? nullptr : parents.data();
      a.snapshots = snaps.data();
      a.num_snapshots = static_cast<int64_t>(snaps.size());
      a.snapshot_state = states.data();
      a.num_snapshot_slots = static_cast<int64_t>(snaps.size());
      kernel.fn(a);
      size_t sn = 0;
      for (int64_t i = 0; i < p.N; ++i) {
        const int64_t bos = p.cu[i], len = p.cu[i + 1] - p.cu[i];
        if (p.idx[i] < 0) {
          EXPECT_TRUE(
              std::all_of(o.begin() + bos * vr, o.begin() + (bos + len) * vr, [](float x) { return x == 0; }))
              << "padded row " << i;
          continue;
        }
        for (int64_t j = 0; j < len; ++j, ++sn) {
          const std::string what = "row " + std::to_string(i) + " token " + std::to_string(j);
          const Problem t = path_problem(p, par, i, j);
          const Reference ref = reference(t);
          std::vector<float> to(static_cast<size_t>(t.T) * vr), tpool = t.pool;
          kernel.fn(t.args(to.data(), tpool.data()));
          const float* got = states.data() + sn * kv;
          EXPECT_LE(max_error_ratio(got, ref.pool.data(), kv, kAtol, kRtol), 1.0)
              << what << " state (float64)";
          EXPECT_LE(max_error_ratio(got, tpool.data(), kv, kAtol, kRtol), 1.0)
              << what << " state (own path run)";
          const float* og = o.data() + (bos + j) * vr;
          EXPECT_LE(max_error_ratio(og, ref.o.data() + (t.T - 1) * vr, vr, kAtol, kRtol), 1.0)
              << what << " output";
          EXPECT_LE(max_error_ratio(og, to.data() + (t.T - 1) * vr, vr, kAtol, kRtol), 1.0)
              << what << " output (own path run)";
          if (final_state && j == len - 1) {
            EXPECT_EQ(0, std::memcmp(pool.data() + p.idx[i] * kv, got, kv * sizeof(float)))
                << what << ": the final state is the last token's";
          }
        }
      }
      for (int64_t sl = 0; sl < p.slots; ++sl) {
        bool written = false;
        for (int64_t i = 0; i < p.N; ++i) written = written || (final_state && p.idx[i] == sl);
        if (written) continue;
        EXPECT_EQ(0, std::memcmp(pool.data() + sl * kv, p.pool.data() + sl * kv, kv * sizeof(float)))
            << "slot " << sl << " changed";
      }
    }
  }
}

TEST(KdaVerify, ChainPerTokenStatesEqualPrefixStates) {
  // Rows of d+1 tokens, d = 4, 0, 2 and 9 (more than a token block), one padded row.
  for (uint64_t seed : {1700u, 1701u}) {
    const Problem p = verify_problem({5, 1, 3, 2, 10}, {3, 0, -1, 5, 1}, 6, 3, 32, 80, seed);
    check_verify(p, {}, "chain seed " + std::to_string(seed));
  }
}

TEST(KdaVerify, TreeTokensEqualTheirPathsRunAlone) {
  // Row 0: two branches off the last accepted token and a deeper one; row 1: a chain written as
  // parents; row 2 padded; row 3: one token; row 4: a wide tree of 11 tokens (two token blocks).
  const std::vector<int32_t> parents = {-1, 0, 0, 1, 3, 2,                  // row 0 (6 tokens)
                                        -1, 0, 1,                           // row 1
                                        -1, 0,                              // row 2 (padded)
                                        -1,                                 // row 3
                                        -1, 0, 0, 0, 1, 1, 2, 3, 7, 8, 9};  // row 4 (11)
  for (int K : {32, 128}) {
    const Problem p =
        verify_problem({6, 3, 2, 1, 11}, {2, 4, -1, 0, 5}, 6, 2, K, K == 32 ? 70 : 128, 1710 + K);
    check_verify(p, parents, "tree K=" + std::to_string(K));
  }
}

TEST(KdaVerify, BadParentsAreErrorsThatWriteNothing) {
  const Problem p = verify_problem({3, 2}, {0, 1}, 2, 2, 16, 16, 1720);
  const std::vector<std::pair<std::vector<int32_t>, std::string>> bad = {
      {{-1, 0, 2, -1, 0}, "parents[2]=2: token 2 of sequence 0 must name an earlier token"},
      {{-1, 0, 1, -1, 1}, "parents[4]=1: token 1 of sequence 1"},
      {{0, 0, 1, -1, 0}, "parents[0]=0"},
      {{-1, -2, 1, -1, 0}, "parents[1]=-2"},
  };
  for (const auto& [par, what] : bad) {
    for (KernelImpl impl : {KernelImpl::Naive, KernelImpl::Optimized}) {
      std::vector<float> o(static_cast<size_t>(p.T) * p.H * p.V, 7.0f), pool = p.pool;
      KdaArgs a = p.args(o.data(), pool.data());
      a.output_final_state = true;
      a.parents = par.data();
      try {
        fused_recurrent_kda(a, impl);
        ADD_FAILURE() << "no error for " << what;
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
      EXPECT_EQ(pool, p.pool);
      EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 7.0f; }));
    }
  }
  // The chunk kernels take no parents.
  const std::vector<int32_t> chain = {-1, 0, 1, -1, 0};
  std::vector<float> o(static_cast<size_t>(p.T) * p.H * p.V, 7.0f), pool = p.pool;
  KdaArgs a = p.args(o.data(), pool.data());
  a.parents = chain.data();
  EXPECT_THROW(chunk_kda(a, KernelImpl::Naive), std::invalid_argument);
  EXPECT_THROW(chunk_kda(a, KernelImpl::Optimized), std::invalid_argument);
  EXPECT_EQ(pool, p.pool);
}

}  // namespace
}  // namespace kda::kernels
