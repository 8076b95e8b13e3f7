#include "kda/serving/model_runner.h"

#include <stdexcept>

namespace kda::serving {

ModelRunner::ModelRunner(models::KimiLinearForCausalLM& model, int64_t slots, int64_t kv_tokens,
                         kernels::KernelImpl kernel, int max_verify_tokens, int64_t verify_rows)
    : model_(&model),
      pools_(model.make_pools(slots, model.mla_layer_ids().empty() ? 0 : kv_tokens, max_verify_tokens,
                              verify_rows)),
      backend_(kernel) {}

void ModelRunner::forward(model_executor::ForwardBatch& fb, const int32_t* input_ids, float* out) {
  fb.attn_backend = &backend_;
  verify_lens_.clear();
  if (fb.forward_mode == model_executor::ForwardMode::TARGET_VERIFY)
    for (const int32_t r : fb.req_pool_indices)
      verify_lens_.push_back(r < 0 ? 0 : pools_->req_to_token_pool.seq_len(r));
  model_->forward(input_ids, fb.num_tokens(), fb, *pools_, out);
}

void ModelRunner::accept(const model_executor::ForwardBatch& fb, std::span<const int32_t> accepted) {
  if (verify_lens_.size() != fb.req_pool_indices.size() || accepted.size() != verify_lens_.size())
    throw std::logic_error("ModelRunner::accept: not after this batch's TARGET_VERIFY forward");
  // The KDA states move to the accepted tokens; each request keeps the token slots of its accepted path
  // (a chain's first accepted + 1 row tokens; a tree's accepted token and its ancestors) and frees the
  // rest, so its length becomes its committed tokens.
  model_->accept(fb, accepted, *pools_);
  verify_lens_.clear();
}

void ModelRunner::logits(const float* h, int64_t M, float* out) { model_->compute_logits(h, M, out); }

}  // namespace kda::serving
