// ForwardMode and ForwardBatch: what one model step runs (sglang's forward_batch_info).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kda::layers::attention::linear {
class LinearRecurrentAttnBackend;
}

namespace kda::model_executor {

enum class ForwardMode {
  EXTEND,         // prefill (chunked or not), and mixed batches of prefill chunks and 1-token decodes
  DECODE,         // one token per request
  IDLE,           // nothing to run on this rank: zero output
  DUMMY_FIRST,    // a warm-up / padding step: zero output, no state touched
  DRAFT_EXTEND,   // speculative decoding (the draft model's extend): not supported by the KDA backend
  TARGET_VERIFY,  // speculative decoding: each row is the last accepted token and its drafts (see below)
};

const char* to_string(ForwardMode m);

struct ForwardBatch {
  ForwardMode forward_mode = ForwardMode::EXTEND;
  // Per request in the batch, in token order. -1 marks a padded row (its tokens produce zero output
  // and no state is read or written).
  std::vector<int32_t> req_pool_indices;
  // Tokens each request contributes to this step (EXTEND); all 1 for DECODE.
  std::vector<int32_t> extend_seq_lens;
  // Tokens each request had processed before this step; > 0 means its slot holds a state to continue.
  std::vector<int32_t> extend_prefix_lens;
  // The shared linear-attention backend (one instance serves every KDA layer).
  layers::attention::linear::LinearRecurrentAttnBackend* attn_backend = nullptr;

  // Interior states to keep (prefix caching): after the first `pos` tokens of batch row `row`'s extend
  // segment (1 <= pos <= extend_seq_lens[row]), the request's recurrent AND conv state of every KDA layer is
  // written into pool slot `slot` (a slot the caller allocated in the same RecurrentStatePool).
  struct StateSnapshot {
    int32_t row = 0;
    int32_t pos = 0;
    int32_t slot = 0;
  };
  std::vector<StateSnapshot> state_snapshots;  // EXTEND only; an error in other modes

  // TARGET_VERIFY: row i is the request's last accepted token followed by its d_i drafted tokens
  // (extend_seq_lens[i] = d_i + 1, d_i >= 0). Tree drafts: draft_parents lists, row after row, each
  // draft's parent as an index among the row's drafts (0..j-1 for draft j), or -1 for the last accepted
  // token; empty: every row is a chain (draft j's parent is draft j-1). The forward returns an output for
  // every position and leaves the requests' committed states as they were; then the backend's accept()
  // moves each request's slot to the state after its accepted tokens.
  std::vector<int32_t> draft_parents;

  int64_t batch_size() const { return static_cast<int64_t>(req_pool_indices.size()); }
  int64_t num_tokens() const;  // sum of extend_seq_lens

  // Throws std::invalid_argument naming what is inconsistent (sizes, negative lengths, DECODE rows
  // that are not exactly one token; snapshots outside EXTEND, on a padded row, at a position outside
  // [1, extend_seq_lens[row]], or two into one slot). Whether a snapshot slot is allocated and not
  // one of the batch's own is the backend's check (it sees the pool and the slots).
  void validate() const;

  static ForwardBatch extend(std::vector<int32_t> req_pool_indices, std::vector<int32_t> extend_seq_lens,
                             std::vector<int32_t> extend_prefix_lens);
  static ForwardBatch decode(std::vector<int32_t> req_pool_indices);
  // TARGET_VERIFY over rows of draft_lens[i] + 1 tokens; draft_parents as above (empty: chains).
  static ForwardBatch target_verify(std::vector<int32_t> req_pool_indices,
                                    const std::vector<int32_t>& draft_lens,
                                    std::vector<int32_t> draft_parents = {});
};

}  // namespace kda::model_executor
