// kda bench: the kernels and the layer measured against ceilings taken in the same process (oneDNN
// GEMM rates, memcpy bandwidth), so that results read as ratios on a shared, noisy machine.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/bench/ceilings.h"
#include "kda/bench/rows.h"
#include "kda/bench/timing.h"
#include "kda/cli/commands.h"
#include "kda/common/isa.h"
#include "kda/kernels/kda/kda.h"

namespace kda::cli {

using bench::best_seconds;
using bench::GemmCeiling;
using bench::kD;
using bench::kP;
using bench::Say;

namespace {
// The ceilings' GEMM: 1024 rows through the layer's largest projection shape, P x D.
constexpr int64_t kGemmRows = 1024;
}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const int threads = omp_get_max_threads();
  nlohmann::json j;
  const Say say{o.json};
  const bench::RowOptions ro{o.kernel, o.skip_naive, o.weights, o.experts, o.layers, o.rounds};
  if (o.experts != 0 && o.only != "model" && o.only != "spec")
    throw std::invalid_argument("--experts is for --only model or --only spec");
  if (o.layers != 0 && o.only != "model") throw std::invalid_argument("--layers is for --only model");
  if (o.rounds < 1)
    throw std::invalid_argument("--rounds " + std::to_string(o.rounds) + ": must be positive");
  if (o.rounds != 1 && o.only != "model") throw std::invalid_argument("--rounds is for --only model");
  // Which copy of the optimized kernels runs (kernels::kernel_name): the one this CPU runs fastest, or
  // the one --kernel forces; the short conv and the gated norm take this CPU's best (KDA_ISA caps it).
  const char* ran = kernels::kernel_name(kernels::parse_kernel_impl(o.kernel));
  say("kda bench: %d threads, kernels: %s (short conv: %s)\n", threads, ran, to_string(best_isa()));

  // Ceilings. The fp32 GEMM rate is the chunk kernel's yardstick, so it is measured in turns with it.
  j["kernels"] = nlohmann::json::array();
  j["layer"] = nlohmann::json::array();
  if (o.only == "stack") {  // no ceilings: the rows are ratios between weights modes
    j["stack"] = nlohmann::json::array();
    bench::bench_stack(ro, j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "spec") {  // no ceilings: the rows are ratios to the decode step
    j["spec"] = nlohmann::json::array();
    bench::bench_spec(j, say);
    bench::bench_spec_serve(ro, j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "model") {  // its own ceilings (read bandwidth, the bf16 GEMM at the prefill's rows)
    bench::bench_model(ro, j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "tokenizer") {  // no ceilings: MB/s on one thread, and a ratio between two inputs
    bench::bench_tokenizer(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "sampling") {  // no ceilings: the rows are ratios to the reference and to the LM-head GEMV
    j["sampling"] = nlohmann::json::array();
    bench::bench_sampling(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "serve") {  // no ceilings: the rows are ratios between HTTP and in-process
    bench::bench_serve(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "cache") {  // no ceilings: the rows are ratios between the cache off and on
    bench::bench_cache(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "qdecode") {  // gemm's decode rows alone: ratios to the bf16 projection
    bench::bench_quant_decode(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  if (o.only == "gemm") {  // the bf16 paths' ratios; the quantized rows measure their own ceilings
    j["bf16_gemm"] = nlohmann::json::array();
    bench::bench_bf16_gemm(j, say);
    bench::bench_quant_gemm(j, say);
    bench::bench_quant_decode(j, say);
    if (o.json) std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  const bool kernels = o.only != "layer";
  std::vector<std::string> chunk_lines;
  double g32 = 0.0, plain32 = NAN;
  {
    GemmCeiling c32(Precision::FP32, kGemmRows, kP, kD);
    g32 = kernels ? bench::bench_chunk(ro, c32, j, chunk_lines, plain32)
                  : c32.gflops(best_seconds([&] { c32.run(); }));
  }
  GemmCeiling c16(Precision::BF16, kGemmRows, kP, kD);
  const double g16 = c16.gflops(best_seconds([&] { c16.run(); }));
  const double cp = bench::copy_gbps(size_t{512} << 20);
  const double fma = bench::fma_peak_gflops();
  j["threads"] = threads;
  j["kernel"] = ran;
  j["short_conv_isa"] = to_string(best_isa());
  j["ceilings"] = {{"gemm_f32_gflops", g32}, {"gemm_bf16_gflops", g16}, {"copy_gbps", cp}};
  if (!std::isnan(fma)) j["ceilings"]["fma_peak_f32_gflops"] = fma;
  if (!std::isnan(plain32)) j["ceilings"]["gemm_f32_plain_call_gflops"] = plain32;
  say("\nceilings: oneDNN GEMM %lldx%lldx%lld with pre-packed weights (as the layer runs it) fp32 %.1f "
      "GFLOP/s, "
      "bf16 %.1f GFLOP/s; memcpy 512 MiB %.1f GB/s (read + write)\n",
      static_cast<long long>(kGemmRows), static_cast<long long>(kP), static_cast<long long>(kD), g32, g16,
      cp);
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
    bench::bench_recurrent(ro, cp, j, say);
    bench::bench_mla_prefill(j, say);
  }
  if (o.only != "kernels") bench::bench_layer(ro, cp, j, say);
  if (o.json) std::printf("%s\n", j.dump(2).c_str());
  return 0;
}

}  // namespace kda::cli
