// ModelRunner: one model step, as sglang's model runner does it: the memory pools (request -> KDA slot and
// MLA token slots, the recurrent state pool, the MLA token KV pool; the model's geometry), one
// KDAAttnBackend shared by every KDA layer of the step, and the greedy pick from the last-layer rows.
// The model (KimiLinearForCausalLM) allocates each step's MLA token slots and initialises the backend's
// per-step metadata before its first layer.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kda/kernels/kda/kda.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kimi_linear_model.h"

namespace kda::serving {

class ModelRunner {
 public:
  // `slots` request slots (request indices: as many) and `kv_tokens` MLA token slots (unused by a model
  // without MLA layers). Speculative decoding: a verify buffer of `verify_rows` rows of
  // `max_verify_tokens` tokens (0: none, TARGET_VERIFY is an error).
  ModelRunner(models::KimiLinearForCausalLM& model, int64_t slots, int64_t kv_tokens,
              kernels::KernelImpl kernel, int max_verify_tokens = 0, int64_t verify_rows = 0);

  models::KimiLinearForCausalLM& model() { return *model_; }
  mem_cache::MemoryPools& pools() { return *pools_; }

  // input_ids [T] -> out [T, D], the residual stream after the last layer (T = fb.num_tokens()).
  void forward(model_executor::ForwardBatch& fb, const int32_t* input_ids, float* out);
  // The model's workspaces for a step of up to T tokens through this runner's backend, sized and touched
  // on the calling thread (KimiLinearForCausalLM::reserve).
  void reserve(int64_t T) { model_->reserve(T, &backend_); }
  // After a TARGET_VERIFY forward of `fb`: each request's slot moves to the state after its accepted
  // tokens (accepted[i]: row position of request i's last accepted token; KDAAttnBackend::accept), and its
  // length (and token slots) back to the committed tokens.
  void accept(const model_executor::ForwardBatch& fb, std::span<const int32_t> accepted);
  // The logits of M last-layer rows h [M, D]: model.norm and the LM head -> out [M, vocab] fp32.
  void logits(const float* h, int64_t M, float* out);

 private:
  models::KimiLinearForCausalLM* model_;
  std::unique_ptr<mem_cache::MemoryPools> pools_;
  layers::attention::linear::KDAAttnBackend backend_;
  std::vector<int64_t> verify_lens_;  // the last TARGET_VERIFY step's request lengths before it
};

}  // namespace kda::serving
