// KimiLinearForCausalLM (models/kimi_linear_model): the whole Kimi-Linear decoder of
// kimi-linear-model.md, "Decoder":
//
//   h = embed_tokens[token]
//   for each decoder layer i:  h += attn_i(RMSNorm(h; input_layernorm_i))        KDA or MLA
//                              h += mlp_i(RMSNorm(h; post_attention_layernorm_i)) dense MLP or MoE
//   logits = lm_head · RMSNorm(h; model.norm)
//
// Names as in sglang / vLLM: KimiLinearForCausalLM holds a KimiLinearModel (embed_tokens, layers, norm)
// and the LM head; a KimiDecoderLayer holds its two RMSNorm weights, KimiDeltaAttention or
// KimiMLAAttention, and KimiMLP or KimiMoE.
//
// State lives in mem_cache::MemoryPools, as for the KDA layer: every KDA layer's recurrent and conv state
// in the RecurrentStatePool (one slot per request), every MLA layer's latent cache (ĉ and k_pe per token)
// in the MLATokenToKVPool, the request -> slot / token slots mapping in the HybridReqToTokenPool. The pool
// geometry comes from recurrent_pool_config() / kv_pool_config() (or make_pools()).
//
// Precision (spec, "Precision modes"): fp32, or bf16 with the embedding output and the residual stream h
// after every addition rounded to bf16 and every RMSNorm output rounded once, after the weight multiply;
// the layers round at their own points. The LM head is dense in every weights mode (its logits fp32)
// unless ModelOptions::quantize_lm_head.
//
// Tensor parallelism (tp.size > 1): the attention and MLP layers hold this rank's shard and sum their
// partial outputs; the embedding, the norms and the LM head are replicated, so every rank ends a step
// with the same h and the same logits.
//
// Thread safety: one forward at a time per model (the layers share the model's scratch).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/distributed/communicator.h"
#include "kda/io/config.h"
#include "kda/kernels/kda/kda.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/layers/linear.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/mem_cache/mla_token_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kimi_linear.h"
#include "kda/models/kimi_mla.h"
#include "kda/models/kimi_moe.h"

namespace kda::io {
class Checkpoint;
}

namespace kda::models {

struct ModelOptions {
  Precision precision = Precision::FP32;
  Weights weights = Weights::BF16;  // every projection, expert and dense-MLP weight (not router/norms/embed)
  MoeCombine moe_combine = MoeCombine::Unbiased;
  double kv_norm_eps = 0.0;  // kv_a_layernorm's eps (0: rms_norm_eps)
  MlaForm mla_form = MlaForm::Auto;
  distributed::TensorParallel tp = {};
  int num_layers = 0;              // the first N decoder layers of the config's pattern (0: all)
  int num_experts = 0;             // synthetic only: routed experts per MoE layer (0: the config's)
  int64_t vocab = 0;               // synthetic only: vocabulary (0: the config's vocab_size)
  bool quantize_lm_head = false;   // the LM head in `weights` too (int8 / int4); default dense
  int64_t lm_head_block_rows = 0;  // LM head rows per block (0: as many as keep a block <= 64 M weights)
  kernels::KernelImpl kernel = kernels::KernelImpl::Auto;  // the model's own KDA backend's kernel
};

// y = w ⊙ (x · rsqrt(mean(x²) + eps)) over T rows of D, statistics in fp32; in bf16 the output is rounded
// once, after the weight multiply.
void rms_norm_rows(const float* x, int64_t T, int64_t D, const float* w, double eps, Precision precision,
                   float* y);

class KimiDecoderLayer {
 public:
  KimiDecoderLayer(int layer_idx, std::vector<float> input_layernorm,
                   std::vector<float> post_attention_layernorm, std::unique_ptr<KimiDeltaAttention> kda,
                   std::unique_ptr<KimiMLAAttention> mla, std::unique_ptr<KimiMLP> mlp,
                   std::unique_ptr<KimiMoE> moe);

  int layer_idx() const { return layer_idx_; }
  bool is_kda() const { return kda_ != nullptr; }
  bool is_moe() const { return moe_ != nullptr; }
  KimiDeltaAttention* kda() { return kda_.get(); }
  KimiMLAAttention* mla() { return mla_.get(); }
  KimiMLP* mlp() { return mlp_.get(); }
  KimiMoE* moe() { return moe_.get(); }
  int64_t weight_bytes() const;         // attention + MLP (+ the two norms), this rank
  int64_t active_weight_bytes() const;  // what one decoded token reads of them

  // h [T, D] in place: h += attn(norm(h)); h += mlp(norm(h)). `normed` / `tmp`: [T, D] scratch.
  void forward(float* h, int64_t T, const model_executor::ForwardBatch& fb, mem_cache::MemoryPools& pools,
               double eps, Precision precision, KdaWorkspace& ws, float* normed, float* tmp);
  // What forward uses for up to T tokens, grown and touched (KimiLinearForCausalLM::reserve).
  void reserve(int64_t T, layers::attention::linear::LinearRecurrentAttnBackend& backend, KdaWorkspace& ws);

 private:
  int layer_idx_;
  std::vector<float> input_layernorm_, post_attention_layernorm_;
  std::unique_ptr<KimiDeltaAttention> kda_;
  std::unique_ptr<KimiMLAAttention> mla_;
  std::unique_ptr<KimiMLP> mlp_;
  std::unique_ptr<KimiMoE> moe_;
};

class KimiLinearModel {
 public:
  KimiLinearModel(const io::KimiLinearConfig& cfg, Precision precision, std::vector<float> embed_tokens,
                  int64_t vocab, std::vector<std::unique_ptr<KimiDecoderLayer>> layers,
                  std::vector<float> norm);
  // The bf16 precision's table as bf16 values (a loader reads it so, without an fp32 copy).
  KimiLinearModel(const io::KimiLinearConfig& cfg, std::vector<bf16_t> embed_tokens, int64_t vocab,
                  std::vector<std::unique_ptr<KimiDecoderLayer>> layers, std::vector<float> norm);
  // The bf16 precision's table read in place from a mapped checkpoint: `embed_tokens` [vocab, D] bf16
  // stays valid while `owner` lives (the mapping); its pages are the file's, shared between processes.
  KimiLinearModel(const io::KimiLinearConfig& cfg, const bf16_t* embed_tokens,
                  std::shared_ptr<const void> owner, int64_t vocab,
                  std::vector<std::unique_ptr<KimiDecoderLayer>> layers, std::vector<float> norm);

  int64_t vocab_size() const { return vocab_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  KimiDecoderLayer& layer(int i) { return *layers_[static_cast<size_t>(i)]; }
  const std::vector<float>& norm_weight() const { return norm_; }
  int64_t weight_bytes() const;  // embedding + layers + final norm, this rank
  // The bf16 table (bf16 precision): the model's copy or the mapping's.
  const bf16_t* embed_bf16() const { return embed16_view_; }
  bool embed_mapped() const { return embed_owner_ != nullptr; }

  // Embedding rows of ids[0..T-1] -> h [T, D]. Every id is checked first (std::out_of_range naming the
  // id, its position and the vocabulary); nothing is written on an error.
  void embed(const int32_t* ids, int64_t T, float* h) const;
  // h [T, D] through every layer, in place (the residual stream before model.norm).
  void forward_layers(float* h, int64_t T, const model_executor::ForwardBatch& fb,
                      mem_cache::MemoryPools& pools);
  // forward_layers' buffers and every layer's workspaces for up to T tokens through `backend`.
  void reserve(int64_t T, layers::attention::linear::LinearRecurrentAttnBackend& backend);

 private:
  io::KimiLinearConfig cfg_;
  Precision precision_;
  int64_t vocab_;
  std::vector<float> embed_;              // [V, D] fp32 (fp32 precision)
  std::vector<bf16_t> embed16_;           // [V, D] bf16 (bf16 precision: the table as stored, half the bytes)
  const bf16_t* embed16_view_ = nullptr;  // embed16_'s data, or the mapped table embed_owner_ keeps alive
  std::shared_ptr<const void> embed_owner_;
  std::vector<std::unique_ptr<KimiDecoderLayer>> layers_;
  std::vector<float> norm_;
  KdaWorkspace ws_;
  std::vector<float> normed_, tmp_;
};

class KimiLinearForCausalLM {
 public:
  // A checkpoint folder in the real layout (config.json, shards + model.safetensors.index.json, BF16 with
  // F32 A_log / dt_bias, or F32): the config through io::load_model_config (refusing what the spec does
  // not define), then layer by layer, each shard's mapping dropped once no later layer needs it. A missing
  // or mis-shaped tensor is a std::runtime_error naming the key and the shapes; tensors the model does
  // not use are listed in one warning on stderr. tie_word_embeddings: lm_head is embed_tokens.
  static std::unique_ptr<KimiLinearForCausalLM> from_pretrained(const std::filesystem::path& dir,
                                                                const ModelOptions& opts = {});
  // Seeded weights at any config (benchmarks, the serving driver): options.vocab / num_experts /
  // num_layers shrink it. The same seed gives the same weights at every tp.size (each rank its shard).
  static std::unique_ptr<KimiLinearForCausalLM> synthetic(const io::KimiLinearConfig& cfg,
                                                          const ModelOptions& opts, uint64_t seed);
  ~KimiLinearForCausalLM();

  const io::KimiLinearConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  Precision precision() const { return opts_.precision; }
  Weights weights() const { return opts_.weights; }
  KimiLinearModel& model() { return *model_; }
  int num_layers() const { return model_->num_layers(); }
  // 0-based decoder ids of the model's KDA / MLA layers (pool order), MoE layers.
  const std::vector<int>& kda_layer_ids() const { return kda_ids_; }
  const std::vector<int>& mla_layer_ids() const { return mla_ids_; }
  std::vector<int> moe_layer_ids() const;

  // Pool geometry: `slots` KDA request slots (every KDA layer's recurrent + conv state, this rank's
  // heads) and `tokens` MLA token slots (every MLA layer's ĉ ‖ k_pe; fp32 or bf16 as the precision).
  mem_cache::RecurrentStatePoolConfig recurrent_pool_config(int64_t slots) const;
  mem_cache::MLATokenToKVPoolConfig kv_pool_config(int64_t tokens) const;
  // Pools for `max_requests` requests (as many KDA slots) and `kv_tokens` MLA token slots; speculative
  // limits as RecurrentStatePoolConfig's.
  std::unique_ptr<mem_cache::MemoryPools> make_pools(int64_t max_requests, int64_t kv_tokens,
                                                     int max_verify_tokens = 0,
                                                     int64_t verify_rows = 0) const;

  // One step over fb's rows (EXTEND / DECODE / TARGET_VERIFY, chains and trees; IDLE / DUMMY_FIRST give
  // zeros): input_ids [T], T == fb.num_tokens(). When fb.attn_backend is null the model's own KDA backend is
  // used (fb.attn_backend is set to it). Before any layer runs: fb is validated, every id is checked against
  // the vocabulary, each row's extend_prefix_lens must equal its request's seq_len, the step's MLA token
  // slots are allocated (all or nothing) and the backend's metadata initialised. An error before the first
  // layer changes nothing; an error inside a layer frees the step's token slots again (the requests' KDA
  // states are then those of a half-run step: free or reset the requests). hidden_final [T, D]: the residual
  // stream after the last layer, before model.norm.
  void forward(const int32_t* input_ids, int64_t T, model_executor::ForwardBatch& fb,
               mem_cache::MemoryPools& pools, float* hidden_final);
  // Sizes the workspaces a forward of up to T tokens uses (one prompt of T tokens: the layers' buffers,
  // the KDA backend's -- `backend`, or the model's own when null --, MLA's expanded keys for T keys, the
  // MoE's for an expert all T tokens pick, the projections' conversion scratch) and touches them now, as
  // llama.cpp reserves its compute buffers for n_ubatch at context creation: a server's first long
  // prompt then costs what later ones do, not their page faults besides. The thread scratch is the calling
  // thread's: call it from the thread that runs the forwards. A larger step still grows them.
  void reserve(int64_t T, layers::attention::linear::LinearRecurrentAttnBackend* backend = nullptr);
  // model.norm + lm_head on M rows of hidden [M, D] -> logits [M, V] fp32.
  void compute_logits(const float* hidden, int64_t M, float* logits);
  // After a TARGET_VERIFY forward: the KDA states move to the accepted tokens (KDAAttnBackend::accept) and
  // each request keeps the accepted path's MLA token slots (HybridReqToTokenPool::accept_tokens).
  void accept(const model_executor::ForwardBatch& fb, std::span<const int32_t> accepted,
              mem_cache::MemoryPools& pools);
  layers::attention::linear::KDAAttnBackend& backend() { return backend_; }

  int64_t vocab_size() const { return model_->vocab_size(); }
  int64_t hidden_size() const { return cfg_.hidden_size; }
  int64_t weight_bytes() const;  // resident on this rank: embedding, layers, norms, LM head
  // Read per decoded token (this rank): one embedding row, every layer's attention, dense MLP / router +
  // top-k + shared experts, the head.
  int64_t active_weight_bytes() const;
  int64_t active_params() const;  // the whole model's active parameters per token (every rank's)
  // The LM head's bytes one call reads (dense unless quantize_lm_head).
  int64_t head_weight_bytes() const;

 private:
  KimiLinearForCausalLM(const io::KimiLinearConfig& cfg, const ModelOptions& opts);
  void init_ids();

  io::KimiLinearConfig cfg_;
  ModelOptions opts_;
  std::vector<int> kda_ids_, mla_ids_;
  std::unique_ptr<KimiLinearModel> model_;
  // lm_head [V, D] in row blocks of at most kHeadBlockValues weights: a loader's fp32 copy of the head
  // (the real one is 1.5 GB in fp32) is then one block at a time. Block b holds rows from head_begin_[b].
  static constexpr int64_t kHeadBlockValues = int64_t{1} << 26;
  std::vector<layers::Linear> lm_head_;
  std::vector<int64_t> head_begin_;
  // Instead of lm_head_ where the AMX kernel applies (bf16 precision, a dense head, a CPU with AMX-BF16:
  // amx_head() says), the head as one bf16 matrix [V, D] in that kernel's tiled layout (bf16_amx.h), which
  // it reads for every row count (compute_logits says why): one copy of the head's bytes, where oneDNN's
  // layouts took one at load and another at the first one-row call beside the kernel's own. It lives in
  // memory of its own in huge pages (head_owner_ holds it): the kernel reads it 1.3x as fast as from 4 KiB
  // pages (a file mapping's; docs/performance.md, "The LM head in one copy"), and in tile order faster at
  // one row than in the checkpoint's layout, slower from 32 rows ("The LM head in tile order").
  const bf16_t* head_amx_ = nullptr;
  std::shared_ptr<void> head_owner_;
  bool amx_head() const;
  bf16_t* reset_head(int64_t V);  // the head emptied; the AMX head's memory where it applies
  // Builds the head's blocks from rows(begin, end, out): out = fp32 [end - begin, D]. One buffer serves every
  // block, so a loader's fp32 copy reuses the same pages block after block.
  void build_head(int64_t V, const std::function<void(int64_t, int64_t, std::vector<float>&)>& rows);
  // The same from the head as bf16 [V, D] rows (the checkpoint's mapping, or the tied embedding), read as
  // they are, with no fp32 copy: only for a dense head in the bf16 precision (bf16_head_source()).
  // block_done(begin, end), when given, follows each block's build.
  void build_head(int64_t V, const bf16_t* head,
                  const std::function<void(int64_t, int64_t)>& block_done = nullptr);
  bool bf16_head_source() const;
  int64_t head_block_rows() const;  // rows per head block: the option's, or kHeadBlockValues' worth
  layers::attention::linear::KDAAttnBackend backend_;
  // compute_logits' normed rows [M, D], and one block's logits [M, block] before they go to their columns
  // (compute_logits says why); the normed rows in bf16 for the AMX head.
  std::vector<float> head_in_, head_out_;
  std::vector<bf16_t> head_in_bf16_;
};

// Active parameters per decoded token of the first `num_layers` layers (0: all) of `cfg`, with
// `num_experts` routed experts per MoE layer (0: the config's; top-k clamped to it) and `vocab` (0: the
// config's): attention projections and conv, router + top-k + shared experts, dense MLPs, norms, LM head
// (the embedding row is a lookup). The 48B config gives the spec's 3.107 B.
int64_t kimi_linear_active_params(const io::KimiLinearConfig& cfg, int num_layers = 0, int num_experts = 0,
                                  int64_t vocab = 0);
// One MoE layer's share of it: the router and its bias, the top-k routed experts and the shared ones, with
// `num_experts` routed experts (0: the config's; top-k clamped to it).
int64_t kimi_moe_active_params(const io::KimiLinearConfig& cfg, int num_experts = 0);

// The decoder layer ids a model with `num_layers` (0: all) runs: 0..N-1. Throws std::invalid_argument
// when num_layers is outside 0..num_hidden_layers.
int model_layer_count(const io::KimiLinearConfig& cfg, int num_layers);

}  // namespace kda::models
