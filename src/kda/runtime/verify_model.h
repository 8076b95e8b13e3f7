// kda verify on whole-model dumps (tests/data/model_dumps/README.md): each case through
// KimiLinearForCausalLM against the float64 references with the spec's tolerances
// (kimi-linear-model.md, "Tolerances"):
//   fp32: logits and hidden_final within 1e-4 + 1e-4|b|, every KDA state and MLA cache row within
//         1e-5 + 1e-5|b|, elementwise;
//   bf16: the relative L2 of the logits <= 2x that of the case's own bf16 emulation (logits_bf16 against
//         logits), which also fails on any NaN or Inf.
// Each case runs twice: as one prefill, and with each sequence's last tokens as single-token DECODE steps
// (the decode_tail case: its last T - prefill_len; the others: 8, or the whole of a shorter sequence);
// both against the same references, which is the spec's prefill -> decode invariance. The decode_tail
// case's prefill alone is also checked against its prefill_* states (fp32).
#pragma once

#include <filesystem>
#include <string>

#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/models/kimi_moe.h"
#include "kda/runtime/verify.h"

namespace kda::runtime {

// Whether `dir` holds whole-model dumps: its config.json has the model fields (vocab_size) and its first
// case has input_ids. A config with the model fields is then read with io::load_model_config.
bool is_model_dumps(const std::filesystem::path& dir);

// How the dumps were generated (meta.json, when present): the MoE combine and kv_a_layernorm's eps
// (0: rms_norm_eps). Absent file or fields: unbiased, 0.
struct ModelDumpsMeta {
  models::MoeCombine moe_combine = models::MoeCombine::Unbiased;
  double kv_norm_eps = 0.0;
};
ModelDumpsMeta read_model_dumps_meta(const std::filesystem::path& dir);

// The decode tail the invariance run of this case uses (see above).
int invariance_tail(const io::NpzArchive& npz, int64_t T, const std::filesystem::path& case_file);

CaseReport verify_model_case(models::KimiLinearForCausalLM& model, const std::filesystem::path& case_file);

}  // namespace kda::runtime
