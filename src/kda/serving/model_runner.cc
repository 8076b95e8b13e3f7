#include "kda/serving/model_runner.h"

namespace kda::serving {

namespace {
mem_cache::RecurrentStatePoolConfig with_verify(mem_cache::RecurrentStatePoolConfig pc, int tokens,
                                                int64_t rows) {
  pc.max_verify_tokens = tokens;
  pc.verify_rows = rows;
  return pc;
}
}  // namespace

ModelRunner::ModelRunner(models::KdaStack& stack, int64_t slots, kernels::KernelImpl kernel,
                         int max_verify_tokens, int64_t verify_rows)
    : stack_(&stack),
      pools_(std::make_unique<mem_cache::MemoryPools>(
          with_verify(stack.pool_config(slots), max_verify_tokens, verify_rows), slots)),
      backend_(kernel) {}

void ModelRunner::accept(const model_executor::ForwardBatch& fb, std::span<const int32_t> accepted) {
  backend_.accept(fb, accepted, pools_->recurrent_state_pool);
}

void ModelRunner::forward(model_executor::ForwardBatch& fb, const float* x, float* out) {
  fb.attn_backend = &backend_;
  const auto slots = pools_->req_to_token_pool.get_recurrent_indices(fb.req_pool_indices);
  backend_.init_forward_metadata(fb, slots);  // once per step, shared by all layers
  stack_->forward(x, fb.num_tokens(), fb, pools_->recurrent_state_pool, out);
}

}  // namespace kda::serving
