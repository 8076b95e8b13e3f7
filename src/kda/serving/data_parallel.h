// kda simulate's data parallelism: the workload dealt to --dp groups (a conversation stays in one
// group), each group served by `run_group` on its own pool, and the groups' statistics, self-checks
// and outputs merged on every rank of the world (rank 0 writes the --outputs archive).
#pragma once

#include <functional>

#include "kda/serving/simulate.h"

namespace kda::serving {

SimulateResult run_data_parallel(const SimulateOptions& o,
                                 const std::function<SimulateResult(const SimulateOptions&)>& run_group);

}  // namespace kda::serving
