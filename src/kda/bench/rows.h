// The rows of `kda bench` (src/kda/cli/bench_cmd.cc prints them around the ceilings): each measures one
// part at the Kimi-Linear shape, in turns with what it is compared against, and adds its results to the
// JSON report under its key ("kernels", "layer", "stack", "bf16_gemm", "spec", "model", "tokenizer",
// "sampling", "serve", "cache").
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kda/bench/ceilings.h"
#include "kda/bench/timing.h"

namespace kda::bench {

struct RowOptions {
  std::string kernel =
      "optimized";              // the optimized kernels' copy timed: optimized (this CPU's best) or an ISA
  bool skip_naive = false;      // do not time the reference kernels
  std::string weights = "all";  // all | bf16 | int8 | int4: the quantized layer rows beside the dense ones
  int experts = 0;  // the whole model's routed experts per MoE layer (0: serving::kDefaultExperts)
  int layers = 0;   // the whole model's first N decoder layers (0: all)
  int rounds = 1;   // the whole model's decode rounds per weights mode (bench_model)
};

// chunk_kda rows against the fp32 GEMM ceiling g32, which is measured in turns with them, and the
// plain-call GEMM rate; returns the ceiling in GFLOP/s, sets `plain` and leaves the printed rows in
// `lines` (they are printed after the ceilings).
double bench_chunk(const RowOptions& o, GemmCeiling& g32, nlohmann::json& j, std::vector<std::string>& lines,
                   double& plain);
// fused_recurrent_kda (decode) rows against memcpy bandwidth cp (GB/s).
void bench_recurrent(const RowOptions& o, double cp, nlohmann::json& j, const Say& say);
// The plain-form MLA prefill attention of a 2048-token prompt at the real shapes, flash-style against
// its reference ("mla_prefill"), and the absorbed form's decode step over a long context ("mla_decode").
void bench_mla_prefill(nlohmann::json& j, const Say& say);
// The layer (fp32, bf16, int8 / int4 weights) at EXTEND and DECODE, against its GEMMs alone.
void bench_layer(const RowOptions& o, double cp, nlohmann::json& j, const Say& say);
// The 20-layer stack decoding one request, bf16 against int8 / int4 weights.
void bench_stack(const RowOptions& o, nlohmann::json& j, const Say& say);
// Linear's two bf16 paths side by side on the layer's fused projection.
void bench_bf16_gemm(nlohmann::json& j, const Say& say);
// QuantLinear's two prefill paths (int8 / int4, bf16 precision) at prefill row counts on the model's
// prefill shapes, over the bf16 and fp32 GEMM ceilings of each shape ("quant_gemm").
void bench_quant_gemm(nlohmann::json& j, const Say& say);
// The quantized decode kernels (int8 / int4, AVX-512 and AMX) and QuantLinear at 1..64 rows on the model's
// projection shapes, over the bf16 projection timed in the same turns ("quant_decode").
void bench_quant_decode(nlohmann::json& j, const Say& say);
// Speculative decoding's cost side: verify steps against a decode step.
void bench_spec(nlohmann::json& j, const Say& say);
// Speculative decoding against plain decoding through the serving loop, in turns, on the first 4 decoder
// layers with o.experts routed experts (o.weights; "all": int4), batch 1: replay at accept rates 0.5 /
// 0.7 / 0.9 and ngram with nothing to match, d = 1, 2, 4, fixed and adaptive depth ("spec_serve" and the
// keys spec_<experts>_<accept|ngram>_d<d>[_adaptive]_over_plain).
void bench_spec_serve(const RowOptions& o, nlohmann::json& j, const Say& say);
// The whole model at its real shapes (o.layers: its first N layers) per weights mode: decode batch 1 and
// 16 (o.rounds times, each round held to the read bandwidth sampled between its own steps: the medians and
// their spread), a 2048-token prefill, beside this run's read bandwidth and bf16 / fp32 GEMM ceilings
// ("model" rows, their "ceilings").
void bench_model(const RowOptions& o, nlohmann::json& j, const Say& say);
// The tokenizer on one thread: encoding MB/s of ~2 MB of mixed English/Chinese text with a vocabulary of
// Kimi's size, decoding, and a 100 KB single "word" against 100 KB of text ("tokenizer").
void bench_tokenizer(nlohmann::json& j, const Say& say);
// The sampler on a 163840-wide row, optimized against the reference, beside one LM-head GEMV
// ("sampling", "sampling_gemv").
void bench_sampling(nlohmann::json& j, const Say& say);
// The OpenAI-compatible server against the engine it drives, in one process: tokens/s of 16 streaming
// clients over HTTP against the same requests submitted in-process, and the TTFT HTTP and tokenization
// add at a 1,000-token prompt ("serve").
void bench_serve(nlohmann::json& j, const Say& say);
// The hybrid prefix cache on a 4-layer whole model (3 KDA + 1 MLA), each workload served with the cache off
// and on: a multi-turn chat's computed prompt fraction and later turns' TTFT, a shared prompt's TTFT, and
// the serving wall time of a workload with no hits ("cache").
void bench_cache(nlohmann::json& j, const Say& say);

}  // namespace kda::bench
