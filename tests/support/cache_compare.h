// What the prefix-cache tests share: a run with the cache (hot) against the same workload served without
// it (cold).
#pragma once

#include <cstdint>
#include <vector>

#include "kda/io/config.h"
#include "kda/serving/simulate.h"

namespace kda::testing {

// kda simulate's options for the serving tests on a small synthetic `cfg`: fp32, seed 7, every output
// kept, 1 GiB of state memory.
serving::SimulateOptions simulate_test_options(const io::KimiLinearConfig& cfg,
                                               std::vector<serving::RequestSpec> reqs);

// The same with the prefix cache on or off at the cache tests' settings: prefill chunks of 48 tokens
// (they split the snapshots' positions), a snapshot every 64 tokens, `cache_bytes` for the cache.
serving::SimulateOptions cache_test_options(const io::KimiLinearConfig& cfg,
                                            std::vector<serving::RequestSpec> reqs, bool cache,
                                            int64_t cache_bytes);

// The same generated tokens and prompts per sequence, the cold run computed every row (rows_from 0), and
// every row the hot run computed (from its restored prefix on) within |a - b| <= tol + tol * |b| of the cold
// one's. The rows are the last layer's residual stream before the final norm.
void expect_same_as_cold(const serving::SimulateResult& hot, const serving::SimulateResult& cold,
                         double tol = 1e-5);

}  // namespace kda::testing
