// The greedy pick over a logits row: the id of the largest value among the allowed ids, the lowest on a
// tie. The serving loop takes it for every plain-greedy row of a step (16 rows of 163840 at batch 16);
// the reference beside it is the definition, one scalar scan.
#pragma once

#include <cstdint>

namespace kda::sampling {

// The id of row[0..V)'s largest value among those `allowed` marks (null: all), the lowest id on a tie;
// -1 when none is allowed. As a scan of `row[v] > row[best]` from the first allowed id: a NaN never
// wins, except at the first allowed id, which then stays (nothing compares greater than a NaN). Where
// `nan` is not null, *nan says whether any allowed value is NaN: a row the sampler refuses, which the
// serving loop refuses too.
int32_t argmax_allowed(const float* row, int64_t V, const uint8_t* allowed, bool* nan = nullptr);

// argmax_allowed of each of rows[0..M) (V values each), the rows shared out over the OpenMP threads
// (a batch-16 step's 16 rows are 10 MB of logits): ids[m] and, where nan is not null, nan[m] (1: an
// allowed NaN), as argmax_allowed gives them for rows[m] alone.
void argmax_allowed_rows(const float* const* rows, int64_t M, int64_t V, const uint8_t* allowed, int32_t* ids,
                         uint8_t* nan = nullptr);

// The same by that scan, one id at a time.
int32_t argmax_allowed_reference(const float* row, int64_t V, const uint8_t* allowed, bool* nan = nullptr);

}  // namespace kda::sampling
