#include "kda/serving/spec_step.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kda::serving {

int32_t verify_depth(const Sequence& q, int32_t want) {
  return std::max(0, std::min(want, q.total_len() - q.processed - 1));
}

void begin_verify(ScheduledBatch& b) {
  if (b.mode != model_executor::ForwardMode::DECODE)
    throw std::logic_error("begin_verify: only a DECODE batch becomes a verify batch");
  b.mode = model_executor::ForwardMode::TARGET_VERIFY;
  b.decode_tokens = 0;
  b.draft_parents.clear();
}

void add_verify_row(ScheduledBatch& b, BatchRow& row, const Draft& d) {
  row.len = 1 + d.size();
  b.decode_tokens += row.len;
  b.draft_parents.insert(b.draft_parents.end(), d.parents.begin(), d.parents.end());
}

bool end_drafting(ScheduledBatch& b, bool keep) {
  if (!b.draft_parents.empty() || keep) return true;
  b.mode = model_executor::ForwardMode::DECODE;
  return false;
}

void verify_inputs(const ScheduledBatch& b, const std::vector<Draft>& drafts,
                   const std::function<int32_t(size_t)>& first, int32_t* toks) {
  if (drafts.size() != b.rows.size())
    throw std::logic_error("verify_inputs: " + std::to_string(drafts.size()) + " drafts for " +
                           std::to_string(b.rows.size()) + " rows");
  int64_t t = 0;
  for (size_t i = 0; i < b.rows.size(); ++i) {
    toks[t++] = first(i);
    for (const int32_t tok : drafts[i].tokens) toks[t++] = tok;
  }
}

void commit_verify_rows(ScheduledBatch& b, const std::vector<int32_t>& emitted) {
  if (emitted.size() != b.rows.size())
    throw std::logic_error("commit_verify_rows: " + std::to_string(emitted.size()) + " counts for " +
                           std::to_string(b.rows.size()) + " rows");
  b.decode_tokens = 0;
  for (size_t i = 0; i < b.rows.size(); ++i) {
    if (emitted[i] < 1 || emitted[i] > b.rows[i].len)
      throw std::logic_error("commit_verify_rows: row " + std::to_string(i) + " commits " +
                             std::to_string(emitted[i]) + " of its " + std::to_string(b.rows[i].len) +
                             " tokens");
    b.rows[i].len = emitted[i];
    b.decode_tokens += emitted[i];
  }
}

}  // namespace kda::serving
