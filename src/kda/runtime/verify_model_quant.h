// kda verify --weights int8 | int4 on whole-model dumps: the spec's rule (kimi-linear-model.md,
// "Tolerances"): the relative L2 of the logits against the float64 reference <= 1.1x that of the same
// model with its weights quantized by the same scheme. The scheme's own error is measured as the layer
// dumps' check measures it (runtime/verify_quant.h): a dense fp32 model on the quantized-then-dequantized
// weights (layers::QuantLinear's dequantized(), exactly what the kernels multiply by), loaded from a
// scratch copy of the checkpoint in which every projection, expert and dense-MLP weight is replaced so.
// In the bf16 precision the bound also holds the bf16 rounding's own error (logits_bf16 against the
// float64 logits), in quadrature with the scheme's. Each case also runs with its decode tail (as
// runtime/verify_model.h) under the same bound, and in fp32 the decode tail's logits are within 5e-3
// (rel L2) of the prefill's, as for quantized layers.
#pragma once

#include <filesystem>
#include <string>

#include "kda/common/weights.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/runtime/verify.h"

namespace kda::runtime {

// Whether a checkpoint tensor is one the --weights modes quantize: every attention projection (KDA
// q/k/v/f_a/f_b/g_a/g_b/b/o, MLA q / kv_a_proj_with_mqa / kv_b / o), dense-MLP and expert weight (the
// shared experts too); not the router, norms, conv, A_log / dt_bias, embeddings or lm_head.
bool is_quantized_weight(const std::string& key);

// A scratch folder holding `src`'s checkpoint with every is_quantized_weight tensor quantized by
// `weights` and dequantized back (F32), every other tensor as stored (widened to F32), the same shards,
// index and config.json. Removed with the object.
class DequantizedCheckpoint {
 public:
  DequantizedCheckpoint(const std::filesystem::path& src, Weights weights);
  ~DequantizedCheckpoint();
  DequantizedCheckpoint(const DequantizedCheckpoint&) = delete;
  DequantizedCheckpoint& operator=(const DequantizedCheckpoint&) = delete;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

// `quantized`: the model under test; `scheme`: the fp32 dense model on the DequantizedCheckpoint.
CaseReport verify_model_case_quantized(models::KimiLinearForCausalLM& quantized,
                                       models::KimiLinearForCausalLM& scheme,
                                       const std::filesystem::path& case_file);

}  // namespace kda::runtime
