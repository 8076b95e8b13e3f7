// run_model_case: one whole-model case in the model dumps' layout (tests/data/model_dumps/README.md),
// shared by the tests, `kda run --tokens` / `kda verify` and the Python binding.
//
// The case's sequences (cu_seqlens; empty: one sequence) start empty, each in its own request. The tokens
// before each sequence's decode tail run as EXTEND steps (one step over every sequence, or `prefill_chunks`
// steps each taking a near-equal share of every sequence's prefill), then the last `decode_tail` tokens of
// every sequence as single-token DECODE steps over the sequences still decoding. Rows of the outputs are
// in token order whatever the steps were.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "kda/models/kimi_linear_model.h"

namespace kda::models {

struct ModelCaseOptions {
  int decode_tail = 0;     // each sequence's last K tokens (fewer when it is shorter) as DECODE steps
  int prefill_chunks = 1;  // EXTEND steps the rest is split into (chunked prefill)
  bool states = true;      // also read back the KDA states and MLA cache rows
};

struct ModelCaseResult {
  int64_t T = 0, N = 0;
  std::vector<float> logits;        // [T, V]
  std::vector<float> hidden_final;  // [T, D], before model.norm
  // Per KDA layer id: each sequence's final states, [N, H, K, V] and [N, W-1, 3P] (this rank's heads).
  std::map<int, std::vector<float>> kda_recurrent_state, kda_conv_state;
  // Per MLA layer id: every token's cache row, packed like input_ids, [T, R] and [T, r].
  std::map<int, std::vector<float>> mla_ckv, mla_kpe;
};

// Throws std::invalid_argument when cu_seqlens is not 0 = c_0 <= c_1 <= ... = T (naming the entry), or an
// option is out of range; the model's own errors otherwise. Uses pools of its own, sized for the case.
ModelCaseResult run_model_case(KimiLinearForCausalLM& model, std::span<const int32_t> input_ids,
                               std::span<const int32_t> cu_seqlens, const ModelCaseOptions& opts = {});

}  // namespace kda::models
