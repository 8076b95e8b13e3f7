// What the prefix-cache tests share: a run with the cache (hot) against the same workload served without
// it (cold).
#pragma once

#include "kda/serving/simulate.h"

namespace kda::testing {

// The same generated tokens and prompts per sequence, the cold run computed every row (rows_from 0), and
// every row the hot run computed (from its restored prefix on) within |a - b| <= tol + tol * |b| of the cold
// one's. The rows are the last layer's residual stream before the final norm.
void expect_same_as_cold(const serving::SimulateResult& hot, const serving::SimulateResult& cold,
                         double tol = 1e-5);

}  // namespace kda::testing
