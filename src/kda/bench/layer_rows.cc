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
#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/layers/bf16_vnni_rows.h"
#include "kda/layers/linear.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kimi_linear.h"

namespace kda::bench {

namespace {

using Shape = io::KimiLinear48bShape;

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
                                                  .conv_kernel = Shape::kConvKernel,
                                                  .conv_dim = Shape::kConvDim,
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

}  // namespace

void bench_layer(const RowOptions& o, double cp, nlohmann::json& j, const Say& say) {
  const io::KimiLinearConfig cfg = io::kimi_linear_48b_one_layer_config();
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
  // about a minute where it has not (oneDNN's bf16 GEMM falls back to slow code, e.g. on an Ice Lake
  // class Xeon).
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
      const double state_bytes =
          2.0 * B *
          (double(kH) * kK * kK * 4 + double(Shape::kConvDim) * (Shape::kConvKernel - 1) * conv_elem);
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

// Linear's bf16 paths side by side (Bf16Gemm: oneDNN's bf16 matmul, the same with its decode rows on the
// AVX512_BF16 kernel where this CPU gives it oneDNN's bits, and the widened bf16 kernels) on the layer's
// fused projection [3P + 2K + H, D], at decode, verify and prefill row counts. Each path has enough copies
// of W that they do not fit in the caches (> 512 MiB): a call's weights come from memory, as in a stack
// of layers. The bytes of W over the time is each path's read rate.
void bench_bf16_gemm(nlohmann::json& j, const Say& say) {
  const int64_t in = kD, out = LayerCase::n_proj();
  const std::vector<float> w = bench_randn(static_cast<size_t>(in * out), 1, 0.02f);
  const int64_t bytes = in * out * 2,
                copies = std::max<int64_t>(2, ((int64_t{512} << 20) + bytes - 1) / bytes);
  const bool vnni = layers::onednn_bf16_k_chunk(in, out) >= 0;
  std::vector<layers::Linear> onednn, widened, with_vnni;
  for (int64_t c = 0; c < copies; ++c) {
    onednn.emplace_back(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnn);
    widened.emplace_back(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::Widened);
    if (vnni)
      with_vnni.emplace_back(in, out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnnVnni);
  }
  say("\n%-30s %6s %12s %12s %12s %12s %12s %12s\n", "bf16 GEMM (fused projection)", "rows", "oneDNN ms",
      "widened ms", "+vnni ms", "oneDNN GB/s", "widened GB/s", "+vnni GB/s");
  for (int64_t M : {1, 2, 5, 9, 16, 32, 64, 512}) {
    const std::vector<float> x = bench_randn(static_cast<size_t>(M * in), 3);
    std::vector<bf16_t> y(static_cast<size_t>(M * out));
    int64_t next = 0;
    const auto run = [&](std::vector<layers::Linear>& lin) {
      return [&lin, &x, &y, &next, M, in, out] {
        lin[next % lin.size()].forward(x.data(), M, in, y.data(), out);
        ++next;
      };
    };
    std::vector<std::function<void()>> fns{run(onednn), run(widened)};
    if (vnni) fns.push_back(run(with_vnni));
    const auto t = best_interleaved(fns, M >= 512 ? 3 : 2 * static_cast<int>(copies), M >= 512 ? 2.0 : 1.0);
    const double tv = vnni ? t[2] : std::nan("");
    nlohmann::json row{{"rows", M},
                       {"in", in},
                       {"out", out},
                       {"onednn_ms", t[0] * 1e3},
                       {"widened_ms", t[1] * 1e3},
                       {"speedup", t[0] / t[1]},
                       {"widened_read_gbps", bytes / t[1] / 1e9}};
    if (vnni) {
      row["onednn_vnni_ms"] = tv * 1e3;
      row["onednn_vnni_read_gbps"] = bytes / tv / 1e9;
    }
    j["bf16_gemm"].push_back(row);
    say("%-30s %6ld %12.2f %12.2f %12.2f %12.1f %12.1f %12.1f\n", "", static_cast<long>(M), t[0] * 1e3,
        t[1] * 1e3, tv * 1e3, bytes / t[0] / 1e9, bytes / t[1] / 1e9, bytes / tv / 1e9);
  }
}

}  // namespace kda::bench
