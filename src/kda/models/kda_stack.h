// KdaStack: the KDA layers of a Kimi-Linear decoder as one model, with the decoder's residual stream
//   h_0 = embed(token);  h <- h + KDA_l(RMSNorm_l(h))      for each KDA layer l, in decoder order
// then the model's final RMSNorm and LM head, which pick the next token greedily (argmax of the logits)
// (the MLA and MoE parts of the decoder are not modelled). The embedding table [vocab, D], the final
// norm and the LM head [vocab, D] are replicated on every tensor-parallel rank. The stack owns its layers,
// their input RMSNorm weights and one KdaWorkspace shared by every layer; it holds no state and no backend:
// the states live in the RecurrentStatePool and the backend (with its per-step metadata) comes with the
// ForwardBatch, as in the decoder. The scheduler only sees forward() and the pool geometry, so a later
// tensor-parallel stack can swap the layer implementation behind the same interface.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "kda/common/precision.h"
#include "kda/distributed/communicator.h"
#include "kda/io/config.h"
#include "kda/layers/linear.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kimi_linear.h"

namespace kda::io {
class Checkpoint;
}

namespace kda::models {

class KdaStack {
 public:
  // The default vocabulary of a synthetic model (--vocab): the LM head of the real 163840-token
  // vocabulary would cost as much as the 20 layers to draw and as much memory bandwidth per decode
  // step as several layers; 8192 keeps both to a few percent of the run.
  static constexpr int64_t kDefaultVocab = 8192;

  // The first `num_layers` KDA layers of `cfg` (0: all) with seeded synthetic weights, layer l seeded
  // with seed + 1000 * (l + 1); RMSNorm weights are ones. A seeded embedding table (standard normals,
  // the scale of the hidden states the layers expect) and LM head (normals / sqrt(D)) of `vocab` rows.
  // With tensor parallelism (tp.size > 1) each layer holds this rank's shard of the same weights.
  // `weights`: the layers' projections dense (bf16: the precision's type) or int8 / int4, quantized
  // from this rank's shard at load (models/kimi_linear.h); the embedding and LM head stay dense.
  static std::unique_ptr<KdaStack> synthetic(const io::KimiLinearConfig& cfg, int num_layers,
                                             Precision precision, uint64_t seed,
                                             distributed::TensorParallel tp = {},
                                             int64_t vocab = kDefaultVocab, Weights weights = Weights::BF16);
  // The first `num_layers` KDA layers of a checkpoint folder (0: all). Only those layers' tensors are
  // read from the memory-mapped checkpoint; model.layers.{i}.input_layernorm.weight when present.
  // model.embed_tokens.weight, lm_head.weight and model.norm.weight when present; the embedding and
  // LM head are seeded (from `seed`, as in synthetic()) when absent, the final norm's weight is ones.
  // `vocab`: the vocabulary of seeded tables (checkpoint_vocab() when the checkpoint has one).
  static std::unique_ptr<KdaStack> from_checkpoint(const std::filesystem::path& dir, int num_layers,
                                                   Precision precision, distributed::TensorParallel tp = {},
                                                   int64_t vocab = kDefaultVocab, uint64_t seed = 0,
                                                   Weights weights = Weights::BF16);
  // The vocabulary of a checkpoint folder: the rows of model.embed_tokens.weight, else of
  // lm_head.weight, else 0 (neither present). Reads only the tensor headers.
  static int64_t checkpoint_vocab(const std::filesystem::path& dir);

  // Throws std::invalid_argument when num_layers is outside 0..(the config's KDA layer count).
  static std::vector<int> select_layers(const io::KimiLinearConfig& cfg, int num_layers);

  const io::KimiLinearConfig& config() const { return cfg_; }
  Precision precision() const { return precision_; }
  Weights weights() const { return weights_; }
  // Resident projection weight bytes of one layer on this rank (the mean over the layers; they are alike).
  int64_t layer_weight_bytes() const;
  int64_t hidden_size() const { return cfg_.hidden_size; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  const std::vector<int>& layer_ids() const { return layer_ids_; }

  // Pool geometry for `slots` usable slots: every layer's recurrent state and conv state (this rank's
  // heads and channels under tensor parallelism).
  mem_cache::RecurrentStatePoolConfig pool_config(int64_t slots) const;
  // Bytes one slot holds over all layers (recurrent fp32 + conv in the precision's conv dtype).
  static int64_t slot_bytes(const io::KimiLinearConfig& cfg, int num_layers, Precision precision);

  int64_t vocab_size() const { return vocab_; }

  // The embedding rows of tokens[0..T-1] -> x [T, D]. Throws std::out_of_range for an id outside
  // [0, vocab).
  void embed(const int32_t* tokens, int64_t T, float* x) const;
  // x [T, D] -> out [T, D], the residual stream after the last layer. The backend's metadata for
  // this batch must be initialised (once, for all layers) before the call.
  void forward(const float* x, int64_t T, const model_executor::ForwardBatch& fb,
               mem_cache::RecurrentStatePool& pool, float* out);
  // The greedy next token of each of M last-layer rows h [M, D] (row stride D): final RMSNorm, the LM
  // head's logits [M, vocab] (kept in logits() until the next call), argmax (the lowest id on a tie).
  void next_tokens(const float* h, int64_t M, int32_t* tokens);
  const std::vector<float>& logits() const { return logits_; }

 private:
  KdaStack(const io::KimiLinearConfig& cfg, Precision precision, distributed::TensorParallel tp,
           Weights weights)
      : cfg_(cfg), precision_(precision), weights_(weights), tp_(tp) {}

  io::KimiLinearConfig cfg_;
  Precision precision_;
  Weights weights_;
  distributed::TensorParallel tp_;
  std::vector<int> layer_ids_;  // decoder layer ids (0-based), in order
  std::vector<std::unique_ptr<KimiDeltaAttention>> layers_;
  std::vector<std::vector<float>> norm_w_;  // [layer][D]
  KdaWorkspace ws_;                         // shared by every layer: one layer runs at a time
  std::vector<float> normed_, attn_out_;    // [T, D] scratch
  int64_t vocab_ = 0;
  std::vector<float> embed_;  // [vocab, D] (bf16 values in the bf16 precision)
  std::vector<float> final_norm_w_;
  std::unique_ptr<layers::Linear> lm_head_;  // [vocab, D]
  std::vector<float> head_in_, logits_;      // [M, D], [M, vocab]

  void init_head(const io::Checkpoint* ckpt, int64_t vocab, uint64_t seed);
};

}  // namespace kda::models
