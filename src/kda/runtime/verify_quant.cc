#include "kda/runtime/verify_quant.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/io/npy.h"
#include "kda/layers/quant_linear.h"
#include "kda/runtime/compare.h"
#include "kda/runtime/layer_runner.h"

namespace kda::runtime {
namespace {

constexpr double kSchemeFactor = 1.1;  // x the scheme's own error vs float64
constexpr double kInvariance = 5e-3;   // prefill -> decode, rel L2

void add(CaseReport& r, std::string check, double value, double limit) {
  r.rows.push_back({std::move(check), "rel L2", value, limit, value <= limit});
}

std::vector<float> round_trip(const std::vector<float>& m, int64_t in, Weights weights) {
  const int64_t out = static_cast<int64_t>(m.size()) / in;
  return layers::QuantLinear(in, out, m, weights, Precision::FP32).dequantized();
}

}  // namespace

models::KdaLayerWeights dequantized_projections(const models::KdaLayerWeights& w,
                                                const io::KimiLinearConfig& cfg, Weights weights) {
  if (weights == Weights::BF16)
    throw std::invalid_argument("dequantized_projections: weights must be int8 or int4");
  const int64_t D = cfg.hidden_size, K = cfg.head_dim, P = static_cast<int64_t>(w.o_proj.size()) / D;
  models::KdaLayerWeights q = w;
  for (auto* m : {&q.q_proj, &q.k_proj, &q.v_proj, &q.f_a_proj, &q.g_a_proj, &q.b_proj})
    *m = round_trip(*m, D, weights);
  q.f_b_proj = round_trip(w.f_b_proj, K, weights);
  q.g_b_proj = round_trip(w.g_b_proj, K, weights);
  q.o_proj = round_trip(w.o_proj, P, weights);
  return q;
}

CaseReport verify_case_quantized(models::KimiDeltaAttention& quantized, models::KimiDeltaAttention& scheme,
                                 const io::KimiLinearConfig& cfg, const std::filesystem::path& case_file,
                                 kernels::KernelImpl kernel, int invariance_tail) {
  const io::NpzArchive npz = io::read_npz(case_file);
  const LayerCase c = LayerCase::from_npz(npz, cfg);
  CaseReport rep;
  rep.name = case_file.stem().string();
  rep.precision = quantized.precision();
  const LayerResult full = run_layer_case(quantized, cfg, c, 0, kernel);
  const LayerResult tail = run_layer_case(quantized, cfg, c, invariance_tail, kernel);
  const LayerResult sch = run_layer_case(scheme, cfg, c, 0, kernel);
  const auto out_f64 = need(npz, "out_fp32", case_file);
  const auto rec_ref = need(npz, "recurrent_state_chunk", case_file);
  const std::string w = to_string(quantized.weights());
  // The bf16 precision adds its own rounding (the dump's out_bf16 error against float64, as the dense
  // bf16 checks take it), independent of the quantization's: the two add in quadrature.
  double e16 = 0.0;
  std::string plus;
  if (quantized.precision() == Precision::BF16) {
    e16 = rel_l2(need(npz, "out_bf16", case_file), out_f64);
    plus = " (+) out_bf16's";
  }
  const auto bound = [&](double e) { return kSchemeFactor * std::sqrt(e * e + e16 * e16); };
  add(rep, "out vs out_fp32 (1.1x the " + w + " scheme's" + plus + ")", rel_l2(full.out, out_f64),
      bound(rel_l2(sch.out, out_f64)));
  add(rep, "recurrent state vs reference (1.1x the scheme's" + plus + ")",
      rel_l2(full.recurrent_state, rec_ref), bound(rel_l2(sch.recurrent_state, rec_ref)));
  add(rep, "invariance: out", rel_l2(tail.out, full.out), kInvariance);
  add(rep, "invariance: recurrent state", rel_l2(tail.recurrent_state, full.recurrent_state), kInvariance);
  add(rep, "invariance: conv state", rel_l2(tail.conv_state, full.conv_state), kInvariance);
  return rep;
}

}  // namespace kda::runtime
