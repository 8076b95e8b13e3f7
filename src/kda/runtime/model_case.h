// A whole-model case as `kda run --tokens` and `kda verify` read it (the model dumps' schema,
// tests/data/model_dumps/README.md): input_ids int32 [T] and, optionally, cu_seqlens int32 [N+1]; and the
// .npz the model's results are written to, in the same layout as the dumps' references. Every input is
// checked here, before a model is loaded, so that a bad case fails fast and no output is written.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/distributed/communicator.h"
#include "kda/io/config.h"
#include "kda/io/npy.h"
#include "kda/models/kimi_linear_case.h"

namespace kda::runtime {

struct TokenCase {
  int64_t T = 0, N = 0;
  std::vector<int32_t> input_ids;   // [T]
  std::vector<int32_t> cu_seqlens;  // [N+1]: 0 = c_0 <= c_1 <= ... <= c_N = T (absent in the file: {0, T})

  // std::invalid_argument naming `what` (the file) and the array: no input_ids, an input_ids that is not
  // 1-D integers, an id outside [0, vocab_size), a cu_seqlens that is not 1-D with >= 2 entries, does not
  // start at 0, decreases, or does not end at T.
  static TokenCase from_npz(const io::NpzArchive& npz, const io::KimiLinearConfig& cfg,
                            const std::string& what);
  int32_t seq_len(int64_t i) const { return cu_seqlens[i + 1] - cu_seqlens[i]; }
  // --decode-tail K: std::invalid_argument when K < 0 or K exceeds a sequence's length (naming it).
  void check_decode_tail(int k) const;
  // The first `len` tokens of a one-sequence case (the decode_tail case's prefill).
  TokenCase prefix(int64_t len) const;
};

// Whether the archive is a whole-model case (it has input_ids) rather than a KDA layer case.
bool is_token_case(const io::NpzArchive& npz);

// Under tensor parallelism the KDA states of a result are this rank's heads: every rank gathers the
// whole states (the MLA rows, logits and hidden states are replicated already). tp.size 1: no change.
void gather_kda_states(models::ModelCaseResult& r, const io::KimiLinearConfig& cfg,
                       const distributed::TensorParallel& tp);

// The result as the dumps lay it out: logits [T, V], hidden_final [T, D], kda_recurrent_state_{i}
// [N, H, K, K] and kda_conv_state_{i} [N, W-1, 3P] per KDA layer i, mla_ckv_{i} [T, R] and mla_kpe_{i}
// [T, r] per MLA layer i (whole states: gather_kda_states first under TP).
io::NpzArchive model_case_archive(const models::ModelCaseResult& r, const io::KimiLinearConfig& cfg,
                                  int64_t vocab);

}  // namespace kda::runtime
