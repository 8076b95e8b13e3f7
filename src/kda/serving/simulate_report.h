// kda simulate's report: the step and time-to-first-token percentiles, the --outputs archive; the
// --json summary and the archive's keys are declared in simulate.h.
#pragma once

#include <cstdint>
#include <string>

#include "kda/serving/simulate.h"
#include "kda/serving/workload_driver.h"

namespace kda::serving {

// step_ms_p50 / _p99 and ttft_ms_p50 / _p99 from r.serve's samples.
void set_percentiles(SimulateResult& r);

// Every sequence's kept rows ([tokens, hidden] float32) and generated tokens (int32) as an .npz.
void write_outputs(const std::string& path, const ServeResult& s, int32_t parallel_samples);

}  // namespace kda::serving
