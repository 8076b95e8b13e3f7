// The steps of speculative decoding that the Engine takes around a TARGET_VERIFY forward: a DECODE batch
// becomes a verify batch of each row's token and drafts, its input tokens are laid out, and after
// verification each row's length becomes the tokens it committed (what Scheduler::complete advances the
// sequence by).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kda/serving/scheduler.h"
#include "kda/serving/speculative.h"

namespace kda::serving {

// The deepest draft a row of sequence q may hold: `want`, but never past the sequence's end (a verify row
// emits up to 1 + depth tokens, and q has total_len - processed left).
int32_t verify_depth(const Sequence& q, int32_t want);

// A DECODE batch becomes TARGET_VERIFY, its rows still without drafts (add_verify_row adds them).
void begin_verify(ScheduledBatch& b);
// Row `row` of b (already in b.rows) runs its token and the drafts d.
void add_verify_row(ScheduledBatch& b, BatchRow& row, const Draft& d);
// After every row's drafts: a batch in which no row has a draft (ngram found no match) goes back to a
// plain DECODE step (rows of one token), unless `keep` (a probe that verifies a batch without drafts).
// Returns whether the batch is a TARGET_VERIFY one.
bool end_drafting(ScheduledBatch& b, bool keep);

// The verify batch's input tokens [b.num_tokens()]: each row's first token (first(row index)), then its
// drafts in order.
void verify_inputs(const ScheduledBatch& b, const std::vector<Draft>& drafts,
                   const std::function<int32_t(size_t)>& first, int32_t* toks);

// After verification: row i committed emitted[i] tokens (its first token and the accepted drafts fed
// before its last emitted token), so its length is that, and b.decode_tokens their sum.
void commit_verify_rows(ScheduledBatch& b, const std::vector<int32_t>& emitted);

}  // namespace kda::serving
