// ModelRunner: one model step, as sglang's model runner does it: the memory pools (request -> slot
// and the recurrent state pool, layer ids = the stack's KDA layers), one KDAAttnBackend shared by
// every layer, and the per-step metadata computed once (init_forward_metadata) before the first layer.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "kda/kernels/kda/kda.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kda_stack.h"

namespace kda::serving {

class ModelRunner {
 public:
  // A pool of `slots` usable slots (request indices: as many). Speculative decoding: a verify buffer of
  // `verify_rows` rows of `max_verify_tokens` tokens (0: none, TARGET_VERIFY is an error).
  ModelRunner(models::KdaStack& stack, int64_t slots, kernels::KernelImpl kernel, int max_verify_tokens = 0,
              int64_t verify_rows = 0);

  models::KdaStack& stack() { return *stack_; }
  mem_cache::MemoryPools& pools() { return *pools_; }

  // x [T, D] -> out [T, D] for the batch (T = fb.num_tokens()).
  void forward(model_executor::ForwardBatch& fb, const float* x, float* out);
  // After a TARGET_VERIFY forward of `fb`: each request's slot moves to the state after its accepted
  // tokens (accepted[i]: row position of request i's last accepted token; KDAAttnBackend::accept).
  void accept(const model_executor::ForwardBatch& fb, std::span<const int32_t> accepted);

 private:
  models::KdaStack* stack_;
  std::unique_ptr<mem_cache::MemoryPools> pools_;
  layers::attention::linear::KDAAttnBackend backend_;
};

}  // namespace kda::serving
