#include "kda/serving/model_runner.h"

namespace kda::serving {

ModelRunner::ModelRunner(KdaStack& stack, int64_t slots, kernels::KernelImpl kernel)
    : stack_(&stack),
      pools_(std::make_unique<mem_cache::MemoryPools>(stack.pool_config(slots), slots)),
      backend_(kernel) {}

void ModelRunner::forward(model_executor::ForwardBatch& fb, const float* x, float* out) {
  fb.attn_backend = &backend_;
  const auto slots = pools_->req_to_token_pool.get_recurrent_indices(fb.req_pool_indices);
  backend_.init_forward_metadata(fb, slots);  // once per step, shared by all layers
  stack_->forward(x, fb.num_tokens(), fb, pools_->recurrent_state_pool, out);
}

}  // namespace kda::serving
