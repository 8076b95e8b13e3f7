// What the prefix-cache tests share: a run with the cache (hot) against the same workload served without
// it (cold).
#pragma once

#include "kda/serving/simulate.h"

namespace kda::testing {

// The same generated tokens and prompts per sequence, the cold run computed every row (rows_from 0), and
// every row the hot run computed (from its restored prefix on) within the fp32 bound of the cold one's.
void expect_same_as_cold(const serving::SimulateResult& hot, const serving::SimulateResult& cold);

}  // namespace kda::testing
