#include "kda/serving/self_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kda/serving/model_runner.h"

namespace kda::serving {

// Why batched and alone differ in bf16, and the bound set from measuring it. The batched run cuts a
// prompt where the alone re-run does not: the token budget's chunked prefill and the prefix cache's
// snapshot positions end chunk_kda's chunks at other points than the re-run's single EXTEND, which moves
// the recurrent states by fp32 rounding. The bf16 rounding points (the kernel output, the projections'
// bf16 inputs and outputs) turn some of those differences into one-ulp flips, and the residual stream
// carries each layer's flips into the next. The bf16 GEMMs add nothing of their own: the widened kernels
// give a row the same bits at any row count (kernels/gemm/bf16_gemm.h), and so did oneDNN's bf16 matmul
// on an AVX512_BF16 CPU at these shapes: with every prompt whole (no prefix cache, a token budget above
// the prompts) batched and alone were equal bit for bit on both paths, decode and verify steps alike.
// Measured on the synthetic Kimi-shape stack (the worst relative L2 over the re-run requests, both paths
// alike): about 5e-5 at 1 layer, 2e-3 at 4, and at 20 5e-3 with random prompts and 8.4e-3 with
// multi-turn prompts restored from snapshots. The bound grows as sqrt(layers), as independent roundings
// add, and is three times the worst at 20 layers (more at fewer). A scheduling bug (a wrong slot, a lost
// state) moves the output by O(1), far above it.
double bf16_check_bound(int layers) { return 6e-3 * std::sqrt(static_cast<double>(std::max(layers, 1))); }

// Quantized weights (int8 / int4) are held to a looser bound, in either precision. QuantLinear multiplies
// up to kDecodeRows rows with its packed kernels and more rows by dequantizing tiles for oneDNN's fp32
// matmul, and the two agree only to about 1e-3 relative (the fp32 error ratio of a KDA-only stack
// re-run alone was already 2 on the mini checkpoint). A MoE layer's top-k selection turns such a
// difference into an O(1) one wherever a token's k-th and (k+1)-th experts nearly tie, and the KDA states
// carry it to every later position. Measured on the tiny model checkpoint (8 requests of up to 120
// tokens, a token budget of 64, every request re-run, seeds 1-3) the worst relative L2 was 0.09 (int8) and
// 0.11 (int4), in bf16 and fp32 alike, and 0.12 on the test suite's hybrid config; the bound is twice the
// worst. A request served from another's state, or fed other tokens, moves its rows by O(1).
double quantized_check_bound() { return 0.25; }

namespace {

// The metric's value for one continuation: fp32 the worst elementwise error ratio, bf16 the relative L2
// (infinite when the sizes differ or a value is not finite).
double metric_of(const std::vector<float>& a, const std::vector<float>& b, const std::string& metric) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (a.size() != b.size() || a.empty()) return kInf;
  if (metric == "max_err_ratio") {
    double worst = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
      if (!std::isfinite(d)) return kInf;
      worst = std::max(worst, d / (1e-5 + 1e-5 * std::fabs(static_cast<double>(b[i]))));
    }
    return worst;
  }
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  const double rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  return std::isfinite(rel) ? rel : kInf;
}

}  // namespace

// Each sampled request alone on a fresh pool, teacher-forced on the batched run's tokens: its whole
// prompt in one EXTEND, then DECODE steps of its own continuations only, each fed the token the batched
// run generated there. Its own argmax picks are compared with the batched run's tokens and counted.
CheckReport self_check(const SimulateOptions& o, const Plan& p, models::KimiLinearForCausalLM& model,
                       const ServeResult& batched, bool* interrupted) {
  CheckReport rep;
  if (o.weights != Weights::BF16) {
    rep.metric = "rel_l2";
    rep.bound = quantized_check_bound();
  } else if (o.precision == Precision::FP32) {
    rep.metric = "max_err_ratio";
    rep.bound = 1.0;
  } else {
    rep.metric = "rel_l2";
    rep.bound = bf16_check_bound(model.num_layers());
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int32_t n = o.parallel_samples;
  for (const int64_t r : p.check_requests) {
    const SequenceOutput& first = batched.outputs[r * n];
    RequestSpec spec;
    spec.id = o.requests[r].id;
    spec.output_len = o.requests[r].output_len;
    spec.sample_base = o.requests[r].sample_base;
    spec.prompt = first.prompt;  // a session's turn: with its history, as the batched run built it
    spec.prompt_len = static_cast<int32_t>(spec.prompt.size());
    for (int32_t j = 0; j < n; ++j) spec.forced.push_back(batched.outputs[r * n + j].tokens);
    rep.request_ids.push_back(spec.id);
    ModelRunner alone(model, slots_for(spec, n), kv_tokens_for(spec, n), p.kernel);
    ServeOptions so;
    so.scheduler.token_budget = spec.prompt_len;
    so.scheduler.max_batch = n;
    so.scheduler.parallel_samples = n;
    so.seed = o.seed;
    so.keep = {1};
    so.stop = o.stop;
    agree_across_ranks(o.tp, so);
    const ServeResult ar = serve(alone, {spec}, so);
    if (ar.interrupted) {
      *interrupted = true;
      break;
    }
    for (int32_t j = 0; j < n; ++j) {
      const auto& b = batched.outputs[r * n + j];
      // A prefix-cache hit's rows start at rows_from: compare the positions both runs computed.
      const auto& full = ar.outputs[j].rows;
      const size_t skip = static_cast<size_t>(b.rows_from) * static_cast<size_t>(model.hidden_size());
      const std::vector<float> tail(full.begin() + static_cast<std::ptrdiff_t>(std::min(skip, full.size())),
                                    full.end());
      rep.worst = std::max(rep.worst, metric_of(b.rows, tail, rep.metric));
      const auto& mine = ar.outputs[j].tokens;
      rep.tokens_total += static_cast<int64_t>(std::max(b.tokens.size(), mine.size()));
      for (size_t k = 0; k < std::min(b.tokens.size(), mine.size()); ++k)
        rep.tokens_matched += b.tokens[k] == mine[k];
    }
  }
  rep.worst_ratio = rep.worst / rep.bound;
  rep.ok = rep.worst <= rep.bound;
  rep.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace kda::serving
