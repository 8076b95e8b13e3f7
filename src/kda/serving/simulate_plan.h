// kda simulate's plan: what the options resolve to (the model's shape and layers, the pool's request,
// snapshot and verify-buffer shares of the memory budgets, the scheduler's options, the requests the
// self-check re-runs), every option checked before any work: each error a std::invalid_argument naming
// the option.
#pragma once

#include <cstdint>
#include <vector>

#include "kda/io/config.h"
#include "kda/kernels/kda/kda.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/server_args.h"
#include "kda/serving/request.h"
#include "kda/serving/scheduler.h"
#include "kda/serving/simulate.h"

namespace kda::serving {

struct Plan {
  io::KimiLinearConfig cfg;
  int layers = 0;                                      // decoder layers (the first N of the pattern)
  int kda_layers = 0, mla_layers = 0, moe_layers = 0;  // of those
  int num_experts = 0;                                 // routed experts per MoE layer the model is built with
  int64_t kv_token_bytes = 0, kv_tokens = 0;           // MLA token KV pool (0 / 0 without MLA layers)
  kernels::KernelImpl kernel = kernels::KernelImpl::Auto;
  ServerArgs server_args;
  SchedulerOptions sched;
  int64_t vocab = 0;
  int64_t slot_bytes = 0, slots = 0;
  bool cache = false;
  int64_t cache_slots = 0;   // snapshot slots on top of `slots` (the pool holds slots + cache_slots)
  int64_t cache_budget = 0;  // the cache's bytes: its snapshot slots and the KV rows its tokens hold
  int verify_tokens = 0;     // speculative decoding: the verify buffer's tokens per row, and its rows
  int64_t verify_rows = 0;
  std::vector<int64_t> check_requests;  // workload indices
};

// State slots a request holds while it decodes: one per continuation (one when it only prefills).
int32_t slots_for(const RequestSpec& r, int32_t n);

Plan make_plan(const SimulateOptions& o);

// The model the plan serves: o's precision, weights and tensor-parallel group, the plan's layers and
// kernel, and for synthetic weights (no model_dir) the plan's experts and vocabulary. One place for
// `kda simulate`, its benchmarks and tests, so that they build the model the plan sized its pools for.
models::ModelOptions model_options(const Plan& p, const SimulateOptions& o);

}  // namespace kda::serving
