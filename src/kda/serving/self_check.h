// kda simulate's self-check: each sampled request re-run alone on a fresh pool, teacher-forced on the
// batched run's tokens, and every position's last-layer output compared with the batched run's. With the
// prefix cache on, a request whose prompt the batched run partly restored is re-run with what it restored
// computed the same way first: the session's earlier turns (their generated tokens as decode steps) and a
// shared prefix, on the re-run's own pool and prefix cache.
//
// fp32: the spec's elementwise tolerance |a - b| <= 1e-5 + 1e-5 |b| (metric "max_err_ratio", bound 1).
// bf16: the relative L2 of each continuation's rows (metric "rel_l2", bound bf16_check_bound(layers)).
// int8 / int4 weights (either precision): the relative L2, bound quantized_check_bound() (self_check.cc
// says why it is looser).
#pragma once

#include "kda/models/kimi_linear_model.h"
#include "kda/serving/simulate.h"
#include "kda/serving/simulate_plan.h"
#include "kda/serving/workload_driver.h"

namespace kda::serving {

double bf16_check_bound(int layers);
double quantized_check_bound();

// `interrupted` is set when a stop request ended a re-run (the report is then incomplete).
CheckReport self_check(const SimulateOptions& o, const Plan& p, models::KimiLinearForCausalLM& model,
                       const ServeResult& batched, bool* interrupted);

}  // namespace kda::serving
