#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "kda/cli/commands.h"
#include "kda/distributed/parallel.h"
#include "kda/io/config.h"
#include "kda/io/safetensors.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/runtime/verify.h"
#include "kda/runtime/verify_model.h"
#include "kda/runtime/verify_model_quant.h"
#include "kda/runtime/verify_quant.h"

namespace kda::cli {

namespace {

// One case's report: as JSON (appended to `jcases`) or as a printed table.
void report_case(const runtime::CaseReport& rep, const VerifyOptions& o, const char* ran, Precision p,
                 nlohmann::json& jcases) {
  if (o.json) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& r : rep.rows)
      rows.push_back(
          {{"check", r.check}, {"metric", r.metric}, {"value", r.value}, {"limit", r.limit}, {"ok", r.ok}});
    jcases.push_back({{"case", rep.name},
                      {"precision", to_string(p)},
                      {"weights", o.weights},
                      {"ok", rep.ok()},
                      {"checks", rows}});
    return;
  }
  std::printf("\n%s  [%s, %s weights, kernel %s: %s]  %s\n", rep.name.c_str(), to_string(p),
              o.weights.c_str(), o.kernel.c_str(), ran, rep.ok() ? "PASS" : "FAIL");
  std::printf("  %-48s %-12s %12s %12s\n", "check", "metric", "value", "limit");
  for (const auto& r : rep.rows)
    std::printf("  %-48s %-12s %12.4g %12.4g  %s\n", r.check.c_str(), r.metric.c_str(), r.value, r.limit,
                r.ok ? "ok" : "FAIL");
}

std::vector<Precision> precisions_of(const VerifyOptions& o) {
  std::vector<Precision> precisions;
  if (o.precision == "all" || o.precision == "fp32") precisions.push_back(Precision::FP32);
  if (o.precision == "all" || o.precision == "bf16") precisions.push_back(Precision::BF16);
  return precisions;
}

// Whole-model dumps: every case through KimiLinearForCausalLM (runtime/verify_model.h), the model built
// with the MoE combine and kv_a_layernorm eps the dumps' meta.json names.
int verify_model_dumps(const VerifyOptions& o) {
  io::load_model_config(o.dumps);  // refuses a config the spec does not define, before anything runs
  const auto kernel = kernels::parse_kernel_impl(o.kernel);
  const char* ran = kernels::kernel_name(kernel);
  const auto meta = runtime::read_model_dumps_meta(o.dumps);
  const auto cases = runtime::list_cases(o.dumps);
  auto par = distributed::make_parallel_context(o.tp, 1);
  if (!par.is_root() && !std::freopen("/dev/null", "w", stdout))
    throw std::runtime_error("cannot silence stdout");
  nlohmann::json jcases = nlohmann::json::array();
  nlohmann::json worst = nlohmann::json::object();
  int failed = 0, total = 0;
  models::ModelOptions mo;
  mo.moe_combine = meta.moe_combine;
  mo.kv_norm_eps = meta.kv_norm_eps;
  mo.kernel = kernel;
  mo.tp = par.tensor_parallel();
  // Quantized weights: held to their scheme's own error (runtime/verify_model_quant.h), measured by a
  // dense fp32 model on the dequantized weights of a scratch copy of the checkpoint.
  const Weights weights = parse_weights(o.weights);
  std::unique_ptr<runtime::DequantizedCheckpoint> scheme_ckpt;
  std::unique_ptr<models::KimiLinearForCausalLM> scheme;
  if (weights != Weights::BF16) {
    scheme_ckpt = std::make_unique<runtime::DequantizedCheckpoint>(o.dumps, weights);
    mo.precision = Precision::FP32;
    scheme = models::KimiLinearForCausalLM::from_pretrained(scheme_ckpt->dir(), mo);
  }
  for (Precision p : precisions_of(o)) {
    mo.precision = p;
    mo.weights = weights;
    auto model = models::KimiLinearForCausalLM::from_pretrained(o.dumps, mo);
    double worst_ratio = 0.0;
    for (const auto& file : cases) {
      const auto rep = scheme ? runtime::verify_model_case_quantized(*model, *scheme, file)
                              : runtime::verify_model_case(*model, file);
      ++total;
      if (!rep.ok()) ++failed;
      for (const auto& r : rep.rows) worst_ratio = std::max(worst_ratio, r.value / r.limit);
      report_case(rep, o, ran, p, jcases);
    }
    worst[to_string(p)] = worst_ratio;
    if (!o.json) std::printf("\n%s: worst value/limit over all checks = %.4g\n", to_string(p), worst_ratio);
  }
  if (o.json) {
    nlohmann::json j = {{"dumps", o.dumps},
                        {"kind", "model"},
                        {"moe_combine", models::to_string(meta.moe_combine)},
                        {"weights", o.weights},
                        {"kernel", o.kernel},
                        {"kernel_ran", ran},
                        {"ok", failed == 0},
                        {"worst_value_over_limit", worst},
                        {"cases", jcases}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("\nverify: %d passed, %d failed\n", total - failed, failed);
  }
  return failed == 0 ? 0 : 1;
}

// KDA layer dumps: the first KDA layer of the checkpoint on every case.
int verify_layer_dumps(const VerifyOptions& o) {
  const auto cfg = io::load_config(o.dumps);
  const io::Checkpoint ckpt(o.dumps);
  const auto kernel = kernels::parse_kernel_impl(o.kernel);
  const char* ran = kernels::kernel_name(kernel);  // which kernel that is on this CPU
  const auto precisions = precisions_of(o);
  const auto cases = runtime::list_cases(o.dumps);
  if (cases.empty()) throw std::runtime_error("no case files (*.npz) in " + o.dumps);
  const auto layer_ids = cfg.kda_layer_ids();
  if (layer_ids.empty()) throw std::runtime_error(o.dumps + "/config.json lists no KDA layer");
  models::check_tensor_parallel(cfg, o.tp);
  // Under --tp every rank runs its shard; rank 0 reports (all ranks hold the whole results).
  auto par = distributed::make_parallel_context(o.tp, 1);
  // The other ranks hold the same results: only rank 0 prints.
  if (!par.is_root() && !std::freopen("/dev/null", "w", stdout))
    throw std::runtime_error("cannot silence stdout");

  nlohmann::json jcases = nlohmann::json::array();
  nlohmann::json worst = nlohmann::json::object();
  bool all_ok = true;
  int failed = 0, total = 0;
  // Quantized projections: checked against their scheme's own error (runtime/verify_quant.h), through an
  // fp32 dense layer on the dequantized weights of this rank's shard.
  const Weights weights = parse_weights(o.weights);
  std::unique_ptr<models::KimiDeltaAttention> scheme;
  if (weights != Weights::BF16) {
    const auto tp = par.tensor_parallel();
    const auto w = models::KdaLayerWeights::load(ckpt, cfg, layer_ids.front(), tp.rank, tp.size);
    scheme = std::make_unique<models::KimiDeltaAttention>(
        cfg, layer_ids.front(), runtime::dequantized_projections(w, cfg, weights), Precision::FP32, tp);
  }
  for (Precision p : precisions) {
    auto layer = models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, layer_ids.front(), p,
                                                             par.tensor_parallel(), weights);
    double worst_ratio = 0.0;  // worst value/limit over every check of this precision
    for (const auto& file : cases) {
      const auto rep = scheme ? runtime::verify_case_quantized(*layer, *scheme, cfg, file, kernel)
                              : runtime::verify_case(*layer, cfg, file, kernel);
      ++total;
      if (!rep.ok()) ++failed;
      all_ok = all_ok && rep.ok();
      for (const auto& r : rep.rows) worst_ratio = std::max(worst_ratio, r.value / r.limit);
      report_case(rep, o, ran, p, jcases);
    }
    worst[to_string(p)] = worst_ratio;
    if (!o.json) std::printf("\n%s: worst value/limit over all checks = %.4g\n", to_string(p), worst_ratio);
  }
  if (o.json) {
    nlohmann::json j = {{"dumps", o.dumps},  {"weights", o.weights}, {"kernel", o.kernel},
                        {"kernel_ran", ran}, {"ok", all_ok},         {"worst_value_over_limit", worst},
                        {"cases", jcases}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("\nverify: %d passed, %d failed\n", total - failed, failed);
  }
  return all_ok ? 0 : 1;
}

}  // namespace

int run_verify(const VerifyOptions& o) {
  // Recognised by their config (the model fields) and their cases (input_ids); the rest are layer dumps.
  return runtime::is_model_dumps(o.dumps) ? verify_model_dumps(o) : verify_layer_dumps(o);
}

}  // namespace kda::cli
