#include "kda/model_executor/forward_batch_info.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace kda::model_executor {

const char* to_string(ForwardMode m) {
  switch (m) {
    case ForwardMode::EXTEND:
      return "EXTEND";
    case ForwardMode::DECODE:
      return "DECODE";
    case ForwardMode::IDLE:
      return "IDLE";
    case ForwardMode::DUMMY_FIRST:
      return "DUMMY_FIRST";
    case ForwardMode::DRAFT_EXTEND:
      return "DRAFT_EXTEND";
    case ForwardMode::TARGET_VERIFY:
      return "TARGET_VERIFY";
  }
  return "?";
}

int64_t ForwardBatch::num_tokens() const {
  int64_t n = 0;
  for (int32_t l : extend_seq_lens) n += l;
  return n;
}

void ForwardBatch::validate() const {
  const size_t b = req_pool_indices.size();
  if (extend_seq_lens.size() != b)
    throw std::invalid_argument("ForwardBatch: extend_seq_lens has " +
                                std::to_string(extend_seq_lens.size()) + " entries for " + std::to_string(b) +
                                " requests");
  if (!extend_prefix_lens.empty() && extend_prefix_lens.size() != b)
    throw std::invalid_argument("ForwardBatch: extend_prefix_lens has " +
                                std::to_string(extend_prefix_lens.size()) + " entries for " +
                                std::to_string(b) + " requests");
  for (size_t i = 0; i < b; ++i) {
    if (req_pool_indices[i] < -1)
      throw std::invalid_argument("ForwardBatch: request " + std::to_string(i) + " has req_pool_index " +
                                  std::to_string(req_pool_indices[i]));
    if (extend_seq_lens[i] < 0)
      throw std::invalid_argument("ForwardBatch: request " + std::to_string(i) + " has a negative length " +
                                  std::to_string(extend_seq_lens[i]));
    if (!extend_prefix_lens.empty() && extend_prefix_lens[i] < 0)
      throw std::invalid_argument("ForwardBatch: request " + std::to_string(i) + " has a negative prefix " +
                                  std::to_string(extend_prefix_lens[i]));
    if (forward_mode == ForwardMode::DECODE && extend_seq_lens[i] != 1)
      throw std::invalid_argument("ForwardBatch: DECODE request " + std::to_string(i) + " has " +
                                  std::to_string(extend_seq_lens[i]) + " tokens (must be 1)");
  }
  if (!state_snapshots.empty() && forward_mode != ForwardMode::EXTEND)
    throw std::invalid_argument(
        std::string("ForwardBatch: state_snapshots are for EXTEND batches only (mode ") +
        to_string(forward_mode) + ")");
  if (!draft_parents.empty() && forward_mode != ForwardMode::TARGET_VERIFY)
    throw std::invalid_argument(
        std::string("ForwardBatch: draft_parents are for TARGET_VERIFY batches only (mode ") +
        to_string(forward_mode) + ")");
  if (forward_mode == ForwardMode::TARGET_VERIFY) {
    int64_t drafts = 0;
    for (size_t i = 0; i < b; ++i) {
      if (extend_seq_lens[i] < 1)
        throw std::invalid_argument("ForwardBatch: TARGET_VERIFY row " + std::to_string(i) + " has " +
                                    std::to_string(extend_seq_lens[i]) +
                                    " tokens (must be >= 1: the last accepted token, then its drafts)");
      drafts += extend_seq_lens[i] - 1;
    }
    if (!draft_parents.empty()) {
      if (static_cast<int64_t>(draft_parents.size()) != drafts)
        throw std::invalid_argument("ForwardBatch: draft_parents has " +
                                    std::to_string(draft_parents.size()) + " entries for " +
                                    std::to_string(drafts) + " drafted tokens");
      size_t at = 0;
      for (size_t i = 0; i < b; ++i) {
        for (int32_t j = 0; j < extend_seq_lens[i] - 1; ++j, ++at) {
          if (draft_parents[at] < -1 || draft_parents[at] >= j)
            throw std::invalid_argument("ForwardBatch: draft " + std::to_string(j) + " of row " +
                                        std::to_string(i) + " names parent " +
                                        std::to_string(draft_parents[at]) +
                                        " (must be -1, the last accepted token, or an earlier draft 0.." +
                                        std::to_string(j - 1) + ": a parent comes before its child)");
        }
      }
    }
  }
  std::vector<int32_t> slots;
  slots.reserve(state_snapshots.size());
  for (size_t j = 0; j < state_snapshots.size(); ++j) {
    const StateSnapshot& s = state_snapshots[j];
    const std::string at = "ForwardBatch: state snapshot " + std::to_string(j) + ": ";
    if (s.row < 0 || static_cast<size_t>(s.row) >= b)
      throw std::invalid_argument(at + "row " + std::to_string(s.row) + " is not in [0, " +
                                  std::to_string(b) + ")");
    if (req_pool_indices[s.row] < 0)
      throw std::invalid_argument(at + "row " + std::to_string(s.row) + " is a padded row");
    if (s.pos < 1 || s.pos > extend_seq_lens[s.row])
      throw std::invalid_argument(at + "pos " + std::to_string(s.pos) + " is not in [1, " +
                                  std::to_string(extend_seq_lens[s.row]) + "] (row " + std::to_string(s.row) +
                                  "'s extend length)");
    if (s.slot < 0) throw std::invalid_argument(at + "negative slot " + std::to_string(s.slot));
    slots.push_back(s.slot);
  }
  std::sort(slots.begin(), slots.end());
  if (const auto d = std::adjacent_find(slots.begin(), slots.end()); d != slots.end())
    throw std::invalid_argument("ForwardBatch: two state snapshots into slot " + std::to_string(*d));
}

ForwardBatch ForwardBatch::extend(std::vector<int32_t> req_pool_indices, std::vector<int32_t> extend_seq_lens,
                                  std::vector<int32_t> extend_prefix_lens) {
  ForwardBatch fb;
  fb.forward_mode = ForwardMode::EXTEND;
  fb.req_pool_indices = std::move(req_pool_indices);
  fb.extend_seq_lens = std::move(extend_seq_lens);
  fb.extend_prefix_lens = std::move(extend_prefix_lens);
  return fb;
}

ForwardBatch ForwardBatch::decode(std::vector<int32_t> req_pool_indices) {
  ForwardBatch fb;
  fb.forward_mode = ForwardMode::DECODE;
  fb.extend_seq_lens.assign(req_pool_indices.size(), 1);
  fb.extend_prefix_lens.assign(req_pool_indices.size(), 1);
  fb.req_pool_indices = std::move(req_pool_indices);
  return fb;
}

ForwardBatch ForwardBatch::target_verify(std::vector<int32_t> req_pool_indices,
                                         const std::vector<int32_t>& draft_lens,
                                         std::vector<int32_t> draft_parents) {
  if (draft_lens.size() != req_pool_indices.size())
    throw std::invalid_argument("ForwardBatch::target_verify: " + std::to_string(draft_lens.size()) +
                                " draft lengths for " + std::to_string(req_pool_indices.size()) +
                                " requests");
  ForwardBatch fb;
  fb.forward_mode = ForwardMode::TARGET_VERIFY;
  fb.extend_seq_lens.resize(draft_lens.size());
  for (size_t i = 0; i < draft_lens.size(); ++i) {
    // The row runs its drafts and the token before them: draft_lens[i] + 1 must fit int32.
    if (draft_lens[i] < 0 || draft_lens[i] == std::numeric_limits<int32_t>::max())
      throw std::invalid_argument("ForwardBatch::target_verify: row " + std::to_string(i) + " has " +
                                  std::to_string(draft_lens[i]) + " drafts");
    fb.extend_seq_lens[i] = draft_lens[i] + 1;
  }
  fb.extend_prefix_lens.assign(req_pool_indices.size(), 1);
  fb.req_pool_indices = std::move(req_pool_indices);
  fb.draft_parents = std::move(draft_parents);
  return fb;
}

}  // namespace kda::model_executor
