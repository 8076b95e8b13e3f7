// `kda bench --only gemm`, the quantized rows: QuantLinear's prefill paths (int8 / int4 weights, bf16
// precision) at prefill row counts on the model's prefill shapes, beside the dense GEMM ceilings of the
// same shape measured in the same turns: oneDNN's bf16 matmul (the precision's ceiling) and its fp32 one
// (the ceiling of fp32 activations, what the fp32 tiles run on). Both prefill paths are timed on every
// shape, so the rows say which is faster at each size on this CPU (QuantLinear::prefill_path_for picks).
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/common/bf16.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/gemm/quant_amx.h"
#include "kda/kernels/gemm/quant_dpbf16.h"
#include "kda/layers/linear.h"
#include "kda/layers/quant_linear.h"

namespace kda::bench {

namespace {

using Prefill = layers::QuantLinear::Prefill;

struct GemmShape {
  const char* name;
  int64_t in, out;
};

}  // namespace

void bench_quant_gemm(nlohmann::json& j, const Say& say) {
  using S = io::KimiLinear48bShape;
  const GemmShape shapes[] = {
      {"KDA fused projection", kD, 3 * kP + 2 * kK + kH},
      {"expert gate+up", kD, 2 * S::kMoeIntermediate},
      {"expert down", S::kMoeIntermediate, kD},
  };
  say("\n%-22s %5s %6s %-10s %10s %9s %12s %12s %10s\n", "quantized GEMM (bf16)", "wts", "rows", "path", "ms",
      "GFLOP/s", "% bf16 GEMM", "% fp32 GEMM", "picked");
  j["quant_gemm"] = nlohmann::json::array();
  for (const GemmShape& sh : shapes) {
    const std::vector<float> w = bench_randn(static_cast<size_t>(sh.in * sh.out), 5, 0.02f);
    const layers::Linear d16(sh.in, sh.out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnn),
        d32(sh.in, sh.out, w, Precision::FP32, Weights::BF16);
    std::vector<std::unique_ptr<layers::QuantLinear>> q;
    for (Weights wt : {Weights::Int8, Weights::Int4})
      for (Prefill p : {Prefill::Bf16Tiles, Prefill::Fp32Tiles, Prefill::Dpbf16, Prefill::AmxBf16})
        if ((p != Prefill::Dpbf16 || kernels::gemm::cpu_has_quant_dpbf16()) &&
            (p != Prefill::AmxBf16 || kernels::gemm::cpu_has_amx_bf16()))
          q.push_back(std::make_unique<layers::QuantLinear>(sh.in, sh.out, w, wt, Precision::BF16, p));
    for (int64_t M : {int64_t{128}, int64_t{512}, int64_t{2048}}) {
      std::vector<float> x = bench_randn(static_cast<size_t>(M * sh.in), 6);
      round_bf16_inplace(x.data(), x.size());
      std::vector<bf16_t> xb(x.size()), yb(static_cast<size_t>(M * sh.out));
      f32_to_bf16_array(x.data(), xb.data(), xb.size());
      std::vector<float> y(static_cast<size_t>(M * sh.out));
      std::vector<std::function<void()>> fns{[&] { d16.forward(xb.data(), M, sh.in, yb.data(), sh.out); },
                                             [&] { d32.forward(x.data(), M, sh.in, y.data(), sh.out); }};
      for (const auto& ql : q)
        fns.push_back([&, l = ql.get()] { l->forward(xb.data(), M, sh.in, yb.data(), sh.out); });
      const std::vector<double> t = best_interleaved(fns, 3, M >= 2048 ? 3.0 : 1.0);
      const double flops = 2.0 * M * sh.in * sh.out, g16 = flops / t[0] / 1e9, g32 = flops / t[1] / 1e9;
      for (size_t i = 0; i < q.size(); ++i) {
        const layers::QuantLinear& l = *q[i];
        const double s = t[2 + i], gf = flops / s / 1e9;
        // At these rows on this CPU (int8 on AMX sends up to 256 rows to its packed kernels instead).
        const bool picked =
            layers::QuantLinear::prefill_path_for(l.weights(), Precision::BF16) == l.prefill_path() &&
            M > layers::QuantLinear::decode_rows_for(l.weights(), Precision::BF16, sh.in);
        j["quant_gemm"].push_back({{"shape", sh.name},
                                   {"in", sh.in},
                                   {"out", sh.out},
                                   {"rows", M},
                                   {"weights", to_string(l.weights())},
                                   {"path", layers::to_string(l.prefill_path())},
                                   {"picked", picked},
                                   {"ms", s * 1e3},
                                   {"gflops", gf},
                                   {"gemm_bf16_gflops", g16},
                                   {"gemm_f32_gflops", g32},
                                   {"over_bf16_gemm", gf / g16},
                                   {"over_f32_gemm", gf / g32}});
        say("%-22s %5s %6lld %-10s %10.3f %9.1f %11.1f%% %11.1f%% %10s\n", i == 0 ? sh.name : "",
            to_string(l.weights()), static_cast<long long>(M), layers::to_string(l.prefill_path()), s * 1e3,
            gf, 100 * gf / g16, 100 * gf / g32, picked ? "yes" : "");
      }
      say("%-22s %5s %6lld ceilings: bf16 %.1f GFLOP/s (%.3f ms), fp32 %.1f GFLOP/s (%.3f ms)\n", "", "",
          static_cast<long long>(M), g16, t[0] * 1e3, g32, t[1] * 1e3);
    }
  }
}

}  // namespace kda::bench
