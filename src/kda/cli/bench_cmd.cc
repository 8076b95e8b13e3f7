// kda bench: the kernels and the layer measured against ceilings taken in the same process (oneDNN
// GEMM rates, memcpy bandwidth), so that results read as ratios on a shared, noisy machine.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <dnnl.hpp>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <vector>

#include "kda/cli/commands.h"
#include "kda/common/isa.h"
#include "kda/kernels/kda/avx512.h"
#include "kda/kernels/kda/bench_inputs.h"
#include "kda/kernels/kda/kda.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/layers/linear.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/models/kda_stack.h"
#include "kda/models/kimi_linear.h"
#include "kda/serving/model_runner.h"

namespace kda::cli {

namespace {

using Clock = std::chrono::steady_clock;

// Best wall time of fn over repetitions (at least min_reps, until min_seconds have passed).
double best_seconds(const std::function<void()>& fn, int min_reps = 3, double min_seconds = 0.5) {
  fn();  // warm-up: page faults, primitive creation, caches
  double best = INFINITY, total = 0.0;
  for (int r = 0; r < min_reps || total < min_seconds; ++r) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
    if (r > 200) break;
  }
  return best;
}

// Best wall time of each of fns, run in turns (one call of each per round) for at least min_rounds rounds
// and min_seconds: on a shared machine the load changes from second to second, and taking turns lets
// every function meet the same quiet moments, so ratios between them hold.
std::vector<double> best_interleaved(const std::vector<std::function<void()>>& fns, int min_rounds,
                                     double min_seconds) {
  for (const auto& fn : fns) fn();  // warm-up
  std::vector<double> best(fns.size(), INFINITY);
  double total = 0.0;
  for (int r = 0; r < min_rounds || total < min_seconds; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const auto t0 = Clock::now();
      fns[i]();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      best[i] = std::min(best[i], s);
      total += s;
    }
    if (r > 200) break;
  }
  return best;
}

using kernels::bench_randn;
using kernels::KdaBenchInputs;

// The GEMM ceiling: oneDNN matmul at M x N x K through the same Linear the layer uses.
struct GemmCeiling {
  int64_t M, N, K;
  layers::Linear lin;
  std::vector<float> x, y;
  GemmCeiling(Precision p, int64_t m, int64_t n, int64_t k)
      : M(m),
        N(n),
        K(k),
        lin(k, n, bench_randn(static_cast<size_t>(n * k), 1, 0.02f), p, Weights::BF16,
            p == Precision::BF16 ? layers::Bf16Gemm::OneDnn : layers::Bf16Gemm::Auto),
        x(bench_randn(m * k, 2)),
        y(m * n) {
    if (p == Precision::BF16) round_bf16_inplace(x.data(), x.size());
  }
  void run() { lin.forward(x.data(), M, y.data()); }
  double gflops(double seconds) const { return 2.0 * M * N * K / seconds / 1e9; }
};

// The same fp32 GEMM as one plain oneDNN matmul call on row-major operands (W^T as stored), which repacks
// W on every call as a BLAS sgemm call does: the rate the yardstick was first quoted at. Shown
// for reference; the kernels are held to the higher pre-packed rate above.
struct PlainGemm {
  int64_t M, N, K;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  std::vector<float> x, w, y;
  dnnl::memory xm, wm, ym;
  dnnl::matmul mm;
  PlainGemm(int64_t m, int64_t n, int64_t k)
      : M(m), N(n), K(k), x(bench_randn(m * k, 2)), w(bench_randn(n * k, 1, 0.02f)), y(m * n) {
    using dnnl::memory;
    const memory::desc xd({M, K}, memory::data_type::f32, memory::dims{K, 1});
    const memory::desc wd({K, N}, memory::data_type::f32, memory::dims{1, K});
    const memory::desc yd({M, N}, memory::data_type::f32, memory::dims{N, 1});
    mm = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(xd, wd, yd), eng));
    xm = memory(xd, eng, x.data());
    wm = memory(wd, eng, w.data());
    ym = memory(yd, eng, y.data());
  }
  void run() {
    mm.execute(strm, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}});
    strm.wait();
  }
  double gflops(double seconds) const { return 2.0 * M * N * K / seconds / 1e9; }
};

// Bytes read + written per second by memcpy over `bytes` (both directions counted, as the state
// bandwidth of the recurrent kernel counts the state read and written once).
double copy_gbps(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  const int nt = omp_get_max_threads();
  const double s = best_seconds(
      [&] {
#pragma omp parallel num_threads(nt)
        {
          const size_t part = (bytes + nt - 1) / nt;
          const size_t lo = std::min(bytes, part * omp_get_thread_num());
          const size_t hi = std::min(bytes, lo + part);
          std::memcpy(b.data() + lo, a.data() + lo, hi - lo);
        }
      },
      3, 1.0);
  return 2.0 * bytes / s / 1e9;
}

// Read bandwidth: every thread sums its part of a buffer larger than the caches (the weights of a decode
// step are read, not written). Timed by the caller, in turns with what it bounds.
struct ReadBandwidth {
  std::vector<float> buf;
  float sink = 0.0f;
  explicit ReadBandwidth(size_t bytes) : buf(bytes / sizeof(float), 1.0f) {}
  void run() {
    const int64_t n = static_cast<int64_t>(buf.size());
    const float* p = buf.data();
    float total = 0.0f;
#pragma omp parallel for simd schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) total += p[i];
    sink += total;
  }
  double gbps(double seconds) const {
    return static_cast<double>(buf.size() * sizeof(float)) / seconds / 1e9;
  }
};

// The cores' fp32 multiply-add peak: every thread runs independent chains of 16-wide FMAs on registers
// for ~0.3 s. It tells which kind of host a run landed on: this VM has been seen on hosts that retire
// two 512-bit FMAs per cycle and on hosts that retire one (the same code then runs at half the rate),
// so absolute times only compare between runs on the same kind.
// Compiled for AVX-512 (the target attribute, not the build's flags) and run only where the CPU has it.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KDA_HAVE_FMA512_PROBE 1
__attribute__((target("avx512f"))) double fma512_peak_gflops() {
  constexpr int kChains = 16;
  constexpr int64_t kIters = 1 << 24;
  const int nt = omp_get_max_threads();
  double best = INFINITY;
  float sink = 0.0f;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(nt) reduction(+ : sink)
    {
      const float seed = 1.0f + 1e-3f * static_cast<float>(omp_get_thread_num());
      __m512 acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(seed * static_cast<float>(c));
      const __m512 m = _mm512_set1_ps(0.999f), a = _mm512_set1_ps(1e-3f);
      for (int64_t i = 0; i < kIters; ++i) {
#pragma GCC unroll 16
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], m, a);
      }
      for (int c = 0; c < kChains; ++c) sink += _mm512_reduce_add_ps(acc[c]);
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (sink == 0.0f) std::fprintf(stderr, " ");  // keeps the loop's result alive
  return 2.0 * 16 * kChains * static_cast<double>(kIters) * nt / best / 1e9;
}
#endif

double fma_peak_gflops() {
#if defined(KDA_HAVE_FMA512_PROBE)
  if (isa_supported_by_cpu(Isa::Avx512)) return fma512_peak_gflops();
#endif
  return NAN;  // no AVX-512: not measured
}

// Prints to stdout unless the results go out as JSON.
struct Say {
  bool quiet = false;
  template <typename... A>
  void operator()(const char* fmt, A... args) const {
    if (!quiet) std::printf(fmt, args...);
    std::fflush(stdout);
  }
};

constexpr int kH = 32, kK = 128;
constexpr int64_t kD = 2304, kP = int64_t{kH} * kK;

// One chunk_kda row: `seqs` sequences of `len` tokens, zero initial states; with `snaps`, that many
// snapshots per sequence (prefix caching) at len * j / (snaps + 1), j = 1..snaps (none a multiple of 64
// at the bench's lengths), into a buffer of their own. Holds pointers into itself: not movable.
struct ChunkCase {
  int64_t seqs, T, snaps;
  KdaBenchInputs in;
  std::vector<float> state, snap_state;
  std::vector<int32_t> idx;
  std::vector<kernels::KdaSnapshot> snap;
  kernels::KdaArgs a;
  ChunkCase(int64_t s, int64_t len, int64_t n = 0)
      : seqs(s),
        T(s * len),
        snaps(n),
        in(s, len, kH, kK),
        state(static_cast<size_t>(s) * kH * kK * kK),
        snap_state(static_cast<size_t>(s * n) * kH * kK * kK),
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

// chunk_kda rows against the fp32 GEMM ceiling, which is measured in turns with them (see
// best_interleaved), and the plain-call GEMM rate; returns the ceiling in GFLOP/s and sets `plain`.
double bench_chunk(const BenchOptions& o, GemmCeiling& g32, nlohmann::json& j,
                   std::vector<std::string>& lines, double& plain) {
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

void bench_recurrent(const BenchOptions& o, double cp, nlohmann::json& j, const Say& say) {
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
// One precision's layer (with dense or int8 / int4 projections) with its pool, and the same GEMMs the
// layer runs, alone.
struct LayerCase {
  static constexpr int64_t kSlots = 80;
  Precision p;
  Weights wts;
  models::KimiDeltaAttention layer;
  layers::attention::linear::KDAAttnBackend backend;
  mem_cache::MemoryPools pools;
  layers::Linear proj, fb, gb, op;
  std::vector<float> gx, gy, gf, gz;
  std::vector<bf16_t> gy16, gf16;

  LayerCase(const io::KimiLinearConfig& cfg, const models::KdaLayerWeights& w, Precision prec,
            kernels::KernelImpl impl, Weights weights = Weights::BF16)
      : p(prec),
        wts(weights),
        layer(cfg, 0, w, prec, {}, weights),
        backend(impl),
        pools(mem_cache::RecurrentStatePoolConfig{.layer_ids = {0},
                                                  .size = kSlots,
                                                  .num_heads = kH,
                                                  .head_k_dim = kK,
                                                  .head_v_dim = kK,
                                                  .conv_kernel = 4,
                                                  .conv_dim = 3 * kP,
                                                  .conv_dtype = prec},
              kSlots),
        proj(kD, n_proj(), bench_randn(n_proj() * kD, 1, 0.02f), prec, weights),
        fb(kK, kP, bench_randn(kP * kK, 2, 0.02f), prec, weights),
        gb(kK, kP, bench_randn(kP * kK, 3, 0.02f), prec, weights),
        op(kP, kD, bench_randn(kD * kP, 4, 0.02f), prec, weights) {}

  static int64_t n_proj() { return 3 * kP + 2 * kK + kH; }
  // "fp32", "bf16" (dense weights) or "bf16/int8", "bf16/int4".
  std::string name() const {
    return wts == Weights::BF16 ? to_string(p) : std::string(to_string(p)) + "/" + to_string(wts);
  }

  // The layer's GEMMs on its shapes, on the layer's activation arrays: fp32, or bf16 in the bf16 mode.
  void gemms(int64_t M) {
    const int64_t np = n_proj(), fa = 3 * kP, ga = fa + kK;
    gx.resize(M * kD);
    gz.resize(M * kD);
    const auto run = [&](auto& y, auto& f) {
      y.resize(M * np);
      f.resize(M * kP);
      proj.forward(gx.data(), M, kD, y.data(), np);
      fb.forward(y.data() + fa, M, np, f.data(), kP);
      gb.forward(y.data() + ga, M, np, f.data(), kP);
      op.forward(f.data(), M, kP, gz.data(), kD);
    };
    if (p == Precision::BF16) {
      run(gy16, gf16);
    } else {
      run(gy, gf);
    }
  }
};

// A batch of one mode on a case's pool: requests allocated, metadata set, freed on destruction.
struct Batch {
  LayerCase& c;
  std::vector<int32_t> reqs;
  model_executor::ForwardBatch fb;
  std::vector<float> x, y;

  Batch(LayerCase& lc, bool decode, int64_t n, uint64_t seed) : c(lc) {
    reqs = c.pools.req_to_token_pool.alloc(decode ? n : 1);
    const auto slots = c.pools.req_to_token_pool.get_recurrent_indices(reqs);
    fb = decode ? model_executor::ForwardBatch::decode(reqs)
                : model_executor::ForwardBatch::extend(reqs, {static_cast<int32_t>(n)}, {0});
    fb.attn_backend = &c.backend;
    c.backend.init_forward_metadata(fb, slots);
    x = bench_randn(n * kD, seed);
    y.resize(n * kD);
  }
  ~Batch() { c.pools.req_to_token_pool.free(reqs); }
  void run() { c.layer.forward(x.data(), fb.num_tokens(), fb, c.pools.recurrent_state_pool, y.data()); }
};

void bench_layer(const BenchOptions& o, double cp, nlohmann::json& j, const Say& say) {
  io::KimiLinearConfig cfg;
  cfg.hidden_size = kD;
  cfg.rms_norm_eps = 1e-5;
  cfg.num_hidden_layers = 1;
  cfg.num_heads = kH;
  cfg.head_dim = kK;
  cfg.short_conv_kernel_size = 4;
  cfg.kda_layers = {1};
  const auto w = models::KdaLayerWeights::synthetic(cfg, 1234);
  const auto impl = kernels::parse_kernel_impl(o.kernel);
  LayerCase f32(cfg, w, Precision::FP32, impl), b16(cfg, w, Precision::BF16, impl),
      q8(cfg, w, Precision::BF16, impl, Weights::Int8), q4(cfg, w, Precision::BF16, impl, Weights::Int4);
  // --weights: which quantized modes run beside the dense ones (fp32 and bf16 are always the baseline).
  std::vector<LayerCase*> cases{&f32, &b16}, dense{&b16};
  for (LayerCase* c : {&q8, &q4}) {
    if (o.weights == "all" || o.weights == to_string(c->wts)) {
      cases.push_back(c);
      dense.push_back(c);
    }
  }
  say("\n%-9s %-7s %8s %14s %16s %8s %22s\n", "layer", "mode", "size", "time", "GEMMs alone", "ratio",
      "state bytes/step");

  // EXTEND of 4096 tokens (one new request), every mode and its GEMMs in turns (the best of each over
  // the rounds, so that every mode meets the same quiet moments of this shared machine): at least 24 s
  // and 3 rounds. A round takes a few seconds where the bf16 GEMM has AVX512_BF16 or AMX to run on, and
  // about a minute where it has not (oneDNN's bf16 GEMM at 15 GFLOP/s on an Ice Lake class Xeon).
  const int64_t T = 4096;
  {
    std::vector<std::unique_ptr<Batch>> b;
    std::vector<std::function<void()>> fns;
    for (LayerCase* c : cases) {
      b.push_back(std::make_unique<Batch>(*c, false, T, 21));
      fns.push_back([&b, k = b.size() - 1] { b[k]->run(); });
      fns.push_back([c, T] { c->gemms(T); });
    }
    const auto t = best_interleaved(fns, 3, 24.0);
    for (size_t i = 0; i < cases.size(); ++i) {
      const LayerCase& c = *cases[i];
      const double s = t[2 * i], sg = t[2 * i + 1];
      j["layer"].push_back({{"precision", to_string(c.p)},
                            {"weights", to_string(c.wts)},
                            {"mode", "extend"},
                            {"tokens", T},
                            {"us_per_token", s / T * 1e6},
                            {"gemm_us_per_token", sg / T * 1e6},
                            {"weight_bytes", c.layer.weight_bytes()}});
      say("%-9s %-7s %8lld %11.2f us/tok %13.2f us/tok %8.2f\n", c.name().c_str(), "extend",
          static_cast<long long>(T), s / T * 1e6, sg / T * 1e6, s / sg);
    }
    say("bf16 extend is %.2fx faster than fp32\n", t[0] / t[2]);
    for (size_t i = 2; i < cases.size(); ++i)
      say("%s extend takes %.2fx the bf16 time\n", cases[i]->name().c_str(), t[2 * i] / t[2]);
  }
  // DECODE step at batch 64.
  const int64_t B = 64;
  {
    std::vector<std::unique_ptr<Batch>> b;
    std::vector<std::function<void()>> fns;
    for (LayerCase* c : cases) {
      b.push_back(std::make_unique<Batch>(*c, true, B, 22));
      fns.push_back([&b, k = b.size() - 1] { b[k]->run(); });
      fns.push_back([c, B] { c->gemms(B); });
    }
    const auto t = best_interleaved(fns, 5, 4.0);
    for (size_t i = 0; i < cases.size(); ++i) {
      const LayerCase& c = *cases[i];
      const double s = t[2 * i], sg = t[2 * i + 1];
      const size_t conv_elem = c.p == Precision::BF16 ? 2 : 4;
      const double state_bytes = 2.0 * B * (double(kH) * kK * kK * 4 + 3.0 * kP * 3 * conv_elem);
      j["layer"].push_back({{"precision", to_string(c.p)},
                            {"weights", to_string(c.wts)},
                            {"mode", "decode"},
                            {"batch", B},
                            {"ms_per_step", s * 1e3},
                            {"gemm_ms_per_step", sg * 1e3},
                            {"state_bytes_per_step", state_bytes},
                            {"weight_bytes", c.layer.weight_bytes()}});
      const double bound = sg + state_bytes / (cp * 1e9);
      say("%-9s %-7s %8lld %11.3f ms    %10.3f ms     %8.2f %22.0f  (vs GEMMs + state/memcpy: %.2f)\n",
          c.name().c_str(), "decode", static_cast<long long>(B), s * 1e3, sg * 1e3, s / sg, state_bytes,
          s / bound);
    }
  }
  // DECODE at batch 1, the latency case: bound by the weight bytes one step reads. The read bandwidth
  // (a sum over a buffer larger than the caches) is measured in the same turns.
  {
    std::vector<std::unique_ptr<Batch>> b;
    std::vector<std::function<void()>> fns;
    for (LayerCase* c : dense) {
      b.push_back(std::make_unique<Batch>(*c, true, 1, 23));
      fns.push_back([&b, k = b.size() - 1] { b[k]->run(); });
      fns.push_back([c] { c->gemms(1); });
    }
    ReadBandwidth rb(size_t{1} << 30);
    fns.push_back([&rb] { rb.run(); });
    const auto t = best_interleaved(fns, 20, 6.0);
    const double rd = rb.gbps(t.back());
    j["ceilings"]["read_gbps"] = rd;
    say("\n%-9s %-7s %8s %11s %14s %12s %12s %10s %10s\n", "layer", "mode", "batch", "time", "GEMMs alone",
        "weight MB", "bytes/read", "time/bound", "GEMM/bound");
    for (size_t i = 0; i < dense.size(); ++i) {
      const LayerCase& c = *dense[i];
      const double s = t[2 * i], sg = t[2 * i + 1];
      const double wb = static_cast<double>(c.layer.weight_bytes()), bound = wb / (rd * 1e9);
      j["layer"].push_back({{"precision", to_string(c.p)},
                            {"weights", to_string(c.wts)},
                            {"mode", "decode"},
                            {"batch", 1},
                            {"ms_per_step", s * 1e3},
                            {"gemm_ms_per_step", sg * 1e3},
                            {"weight_bytes", wb},
                            {"read_gbps", rd},
                            {"weight_read_bound_ms", bound * 1e3}});
      say("%-9s %-7s %8d %8.3f ms %11.3f ms %12.1f %9.3f ms %10.2f %10.2f\n", c.name().c_str(), "decode", 1,
          s * 1e3, sg * 1e3, wb / 1e6, bound * 1e3, s / bound, sg / bound);
    }
    say("read bandwidth (sum over 1 GiB, in the same turns): %.1f GB/s\n", rd);
    for (size_t i = 1; i < dense.size(); ++i)
      say("%s decode step: %.2fx faster than bf16 (GEMMs alone %.2fx)\n", dense[i]->name().c_str(),
          t[0] / t[2 * i], t[1] / t[2 * i + 1]);
  }
}

// The 20-layer stack decoding one request (embedding, every layer, final norm, LM head over a 1024-token
// vocabulary so that its bytes do not hide the layers'), for bf16, int8 and int4 weights in one process:
// one step of each in turn, the best of each over the rounds, so that the three meet the same moments of
// a shared machine (separate `kda simulate` runs minutes apart do not).
void bench_stack(const BenchOptions& o, nlohmann::json& j, const Say& say) {
  const io::KimiLinearConfig cfg = models::kimi_linear_48b_config();
  const int layers = 20;
  struct One {
    std::unique_ptr<models::KdaStack> stack;
    layers::attention::linear::KDAAttnBackend backend;
    std::unique_ptr<mem_cache::MemoryPools> pools;
    std::vector<int32_t> reqs;
    model_executor::ForwardBatch fb;
    std::vector<float> x, y;
    int32_t token = 1;
  };
  std::vector<Weights> modes{Weights::BF16};
  for (Weights w : {Weights::Int8, Weights::Int4})
    if (o.weights == "all" || o.weights == to_string(w)) modes.push_back(w);
  std::vector<std::unique_ptr<One>> st;
  for (Weights w : modes) {
    auto s = std::make_unique<One>();
    s->stack = models::KdaStack::synthetic(cfg, layers, Precision::BF16, 7, {}, 1024, w);
    s->pools = std::make_unique<mem_cache::MemoryPools>(s->stack->pool_config(1), 1);
    s->reqs = s->pools->req_to_token_pool.alloc(1);
    s->fb = model_executor::ForwardBatch::decode(s->reqs);
    s->fb.attn_backend = &s->backend;
    s->backend.init_forward_metadata(s->fb, s->pools->req_to_token_pool.get_recurrent_indices(s->reqs));
    s->x.resize(kD);
    s->y.resize(kD);
    st.push_back(std::move(s));
  }
  std::vector<std::function<void()>> fns;
  for (auto& s : st) {
    One* p = s.get();
    fns.push_back([p] {
      p->stack->embed(&p->token, 1, p->x.data());
      p->stack->forward(p->x.data(), 1, p->fb, p->pools->recurrent_state_pool, p->y.data());
      p->stack->next_tokens(p->y.data(), 1, &p->token);
    });
  }
  const auto t = best_interleaved(fns, 30, 20.0);
  say("\n%-22s %8s %14s %12s %14s\n", "stack (20 layers)", "weights", "ms per token", "tokens/s",
      "vs bf16 weights");
  for (size_t i = 0; i < st.size(); ++i) {
    j["stack"].push_back({{"layers", layers},
                          {"weights", to_string(modes[i])},
                          {"ms_per_token", t[i] * 1e3},
                          {"tokens_per_s", 1.0 / t[i]},
                          {"weight_bytes", st[i]->stack->layer_weight_bytes()},
                          {"speedup_vs_bf16", t[0] / t[i]}});
    say("%-22s %8s %14.2f %12.2f %13.2fx\n", "decode, batch 1", to_string(modes[i]), t[i] * 1e3, 1.0 / t[i],
        t[0] / t[i]);
  }
}

// Linear's two bf16 paths side by side (Bf16Gemm: oneDNN's bf16 matmul, and the widened bf16 kernels)
// on the layer's fused projection [3P + 2K + H, D], at decode, verify and prefill row counts. Each path
// has enough copies of W that they do not fit in the caches (> 512 MiB): a call's weights come from
// memory, as in a stack of layers. The bytes of W over the time is the widened path's read rate.
void bench_bf16_gemm(nlohmann::json& j, const Say& say) {
  const int64_t in = kD, out = LayerCase::n_proj();
  const std::vector<float> w = bench_randn(static_cast<size_t>(in * out), 1, 0.02f);
  const int64_t bytes = in * out * 2,
                copies = std::max<int64_t>(2, ((int64_t{512} << 20) + bytes - 1) / bytes);
  std::vector<layers::Linear> onednn, widened;
  for (int64_t c = 0; c < copies; ++c) {
    onednn.emplace_back(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnn);
    widened.emplace_back(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::Widened);
  }
  say("\n%-30s %6s %12s %12s %10s %12s\n", "bf16 GEMM (fused projection)", "rows", "oneDNN ms", "widened ms",
      "speedup", "widened GB/s");
  for (int64_t M : {1, 2, 5, 9, 16, 64, 512}) {
    const std::vector<float> x = bench_randn(static_cast<size_t>(M * in), 3);
    std::vector<bf16_t> y(static_cast<size_t>(M * out));
    int64_t next = 0;
    const auto run = [&](std::vector<layers::Linear>& lin) {
      return [&lin, &x, &y, &next, M, in, out] {
        lin[next % lin.size()].forward(x.data(), M, in, y.data(), out);
        ++next;
      };
    };
    const auto t = best_interleaved({run(onednn), run(widened)}, M >= 512 ? 3 : 2 * static_cast<int>(copies),
                                    M >= 512 ? 2.0 : 1.0);
    j["bf16_gemm"].push_back({{"rows", M},
                              {"in", in},
                              {"out", out},
                              {"onednn_ms", t[0] * 1e3},
                              {"widened_ms", t[1] * 1e3},
                              {"speedup", t[0] / t[1]},
                              {"widened_read_gbps", bytes / t[1] / 1e9}});
    say("%-30s %6ld %12.2f %12.2f %9.2fx %12.1f\n", "", static_cast<long>(M), t[0] * 1e3, t[1] * 1e3,
        t[0] / t[1], bytes / t[1] / 1e9);
  }
}

// Speculative decoding's cost side: the 20-layer bf16 stack (the simulate's default vocabulary) with one
// request, a decode step (1 token through every layer, final norm, LM head, argmax) and TARGET_VERIFY steps
// of d = 1, 2, 4, 8 chained drafts (d + 1 rows, the LM head over all of them, then accept of d / 2 drafts:
// a replay of d / 2 + 1 tokens), in turns. A verify step that emits n tokens on average beats plain
// decoding when its time is under n decode steps: at accept rate 0.7 and d = 4, n = 2.77.
void bench_spec(nlohmann::json& j, const Say& say) {
  const io::KimiLinearConfig cfg = models::kimi_linear_48b_config();
  const int layers = 20, dmax = 8;
  auto stack = models::KdaStack::synthetic(cfg, layers, Precision::BF16, 7);
  serving::ModelRunner runner(*stack, 1, kernels::KernelImpl::Auto, dmax + 1, 1);
  const std::vector<int32_t> reqs = runner.pools().req_to_token_pool.alloc(1);
  const int64_t D = stack->hidden_size();
  std::vector<float> x(static_cast<size_t>((dmax + 1) * D)), y(x.size());
  std::vector<int32_t> toks(dmax + 1, 1), picks(dmax + 1);
  const std::vector<int> drafts{0, 1, 2, 4, 8};  // 0: the decode step
  std::vector<std::function<void()>> fns;
  for (const int d : drafts) {
    fns.push_back([&, d] {
      auto fb = d == 0 ? model_executor::ForwardBatch::decode(reqs)
                       : model_executor::ForwardBatch::target_verify(reqs, {d});
      stack->embed(toks.data(), d + 1, x.data());
      runner.forward(fb, x.data(), y.data());
      stack->next_tokens(y.data(), d + 1, picks.data());
      if (d > 0) runner.accept(fb, std::vector<int32_t>{d / 2});
    });
  }
  const auto t = best_interleaved(fns, 10, 20.0);
  say("\n%-34s %12s %12s\n", "speculative steps (20 layers, bf16)", "ms", "vs decode");
  for (size_t i = 0; i < drafts.size(); ++i) {
    j["spec"].push_back({{"draft_tokens", drafts[i]}, {"ms", t[i] * 1e3}, {"vs_decode", t[i] / t[0]}});
    const std::string what =
        drafts[i] == 0 ? "decode step" : "verify step, " + std::to_string(drafts[i]) + " drafts";
    say("%-34s %12.2f %11.2fx\n", what.c_str(), t[i] * 1e3, t[i] / t[0]);
  }
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const int threads = omp_get_max_threads();
  nlohmann::json j;
  const Say say{o.json};
  // Which copy of the optimized kernels runs (kernels::kernel_name): the one this CPU runs fastest, or
  // the one --kernel forces; the short conv and the gated norm take this CPU's best (KDA_ISA caps it).
  const char* ran = kernels::kernel_name(kernels::parse_kernel_impl(o.kernel));
  say("kda bench: %d threads, kernels: %s (short conv: %s)\n", threads, ran, to_string(best_isa()));

  // Ceilings. The fp32 GEMM rate is the chunk kernel's yardstick, so it is measured in turns with it.
  j["kernels"] = nlohmann::json::array();
  j["layer"] = nlohmann::json::array();
  if (o.only == "stack") {  // no ceilings: the rows are ratios between weights modes
    j["stack"] = nlohmann::json::array();
    bench_stack(o, j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "spec") {  // no ceilings: the rows are ratios to the decode step
    j["spec"] = nlohmann::json::array();
    bench_spec(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "gemm") {  // no ceilings: the rows are ratios between the two bf16 paths
    j["bf16_gemm"] = nlohmann::json::array();
    bench_bf16_gemm(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  const bool kernels = o.only != "layer";
  std::vector<std::string> chunk_lines;
  double g32 = 0.0, plain32 = NAN;
  {
    GemmCeiling c32(Precision::FP32, 1024, 4096, 2304);
    g32 =
        kernels ? bench_chunk(o, c32, j, chunk_lines, plain32) : c32.gflops(best_seconds([&] { c32.run(); }));
  }
  GemmCeiling c16(Precision::BF16, 1024, 4096, 2304);
  const double g16 = c16.gflops(best_seconds([&] { c16.run(); }));
  const double cp = copy_gbps(size_t{512} << 20);
  const double fma = fma_peak_gflops();
  j["threads"] = threads;
  j["kernel"] = ran;
  j["short_conv_isa"] = to_string(best_isa());
  j["ceilings"] = {{"gemm_f32_gflops", g32}, {"gemm_bf16_gflops", g16}, {"copy_gbps", cp}};
  if (!std::isnan(fma)) j["ceilings"]["fma_peak_f32_gflops"] = fma;
  if (!std::isnan(plain32)) j["ceilings"]["gemm_f32_plain_call_gflops"] = plain32;
  say("\nceilings: oneDNN GEMM 1024x4096x2304 with pre-packed weights (as the layer runs it) fp32 %.1f "
      "GFLOP/s, "
      "bf16 %.1f GFLOP/s; memcpy 512 MiB %.1f GB/s (read + write)\n",
      g32, g16, cp);
  if (!std::isnan(plain32))
    say("(for reference: the fp32 GEMM as a plain call that repacks W each time, as BLAS does: %.1f "
        "GFLOP/s)\n",
        plain32);
  if (!std::isnan(fma))
    say("(the cores' fp32 FMA peak, registers only: %.1f GFLOP/s, %.1f per thread; GEMM at %.0f%% of it)\n",
        fma, fma / threads, 100 * g32 / fma);

  if (kernels) {
    say("\n%-22s %6s %8s %12s %10s %10s %16s\n", "kernel", "seqs", "tokens", "us/token", "GFLOP/s", "% GEMM",
        "naive us/token");
    for (const auto& l : chunk_lines) say("%s", l.c_str());
    bench_recurrent(o, cp, j, say);
  }
  if (o.only != "kernels") bench_layer(o, cp, j, say);
  if (o.json) std::printf("%s\n", j.dump(2).c_str());
  return 0;
}

}  // namespace kda::cli
