// The MLPs of Kimi-Linear (kimi-linear-model.md, "MoE"): KimiMLP, the SwiGLU MLP of the dense layers
// and the MoE's shared expert, and KimiMoE, the sigmoid-routed mixture of experts.
//
//   l = W_gate x (fp32, an fp32 router in every mode)   s = sigmoid(l)   c = s + e_score_correction_bias
//   the top_k experts by c (ties to the lower id), w_i = s_i / sum s_j * routed_scaling_factor
//   y = sum_i w_i E_i(x) + shared(x)                     E(x) = down(silu(gate x) * (up x))
//
// Prefill groups a batch's tokens by expert: one gate|up GEMM and one down GEMM per slice (below) of
// each selected expert over its tokens, weighted and added into y in increasing expert id for every
// token, after the shared expert (so a token's sum is the same alone or in a batch). Small batches
// (decode) run the selected experts and the shared one side by side and read only those experts'
// weights, one job per thread: a whole MLP, or with MoeOptions::pieces > 1 one slice of its intermediate
// rows (layers/moe/swiglu.h, SwigluPieces), so that (top_k + 1) x pieces jobs of equal size can keep
// every thread busy to the end (top-8 + shared whole leave one of 2 threads idle a ninth of the layer).
//
// Tensor parallelism: every expert's, the shared expert's and the dense MLP's intermediate rows are split
// across ranks (gate/up column-parallel, down row-parallel); the router is replicated; the MoE sums the
// ranks' partial outputs with ONE allreduce per layer. In the bf16 mode each expert's down output is a
// rounding point; under tensor parallelism it is a partial sum, so there only y is rounded (after the
// allreduce).
//
// Thread safety: forward uses the object's own scratch (and per-thread scratch shared by every MoE
// layer of the calling thread): calls on one object must not overlap.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/distributed/communicator.h"
#include "kda/io/config.h"
#include "kda/io/safetensors.h"
#include "kda/layers/packed_linears.h"

namespace kda::layers::moe {
class RouterGate;
class SwigluMlp;
class SwigluPieces;
}  // namespace kda::layers::moe

namespace kda::models {

// How the selected experts' outputs are weighted (spec "MoE"): Unbiased (default; vLLM, sglang,
// llama.cpp) by s_i, Biased (the HF remote code) by c_i = s_i + bias_i.
enum class MoeCombine { Unbiased, Biased };
const char* to_string(MoeCombine c);
// "unbiased" | "biased"; anything else is std::invalid_argument naming the value.
MoeCombine parse_moe_combine(std::string_view s);

// One SwiGLU MLP's fp32 weights, PyTorch [out, in] layout.
struct MlpWeights {
  int64_t hidden = 0, intermediate = 0;   // D, I (this rank's I under tensor parallelism)
  std::vector<float> gate_proj, up_proj;  // [I, D]  (experts: w1 = gate, w3 = up)
  std::vector<float> down_proj;           // [D, I]  (experts: w2)
  // A packed checkpoint's "gate_up_proj" [2I, D] and "down_proj" [D, I] (io/packed_checkpoint.h), or
  // for an expert its pieces' "pieces.{p}.gate_up_proj" / "pieces.{p}.down_proj" (KimiMoE's slices, each
  // over I / pieces rows); the fp32 values above are then empty.
  layers::PackedLinears packed;

  // `prefix` is "model.layers.{i}.mlp", "...block_sparse_moe.experts.{e}" (expert_names: w1/w3/w2) or
  // "...block_sparse_moe.shared_experts"; every tensor's shape is checked ([I, D] / [D, I]), a missing
  // or mis-shaped one is std::runtime_error naming the key and the shapes. Rank r of n reads only its
  // intermediate rows [r I/n, (r+1) I/n) (I % n != 0: std::invalid_argument). A packed checkpoint
  // (tp_size 1 only) fills `packed` with views of its mapping: prefix.gate_up_proj, prefix.down_proj.
  static MlpWeights load(const io::Checkpoint& ckpt, const std::string& prefix, bool expert_names, int64_t D,
                         int64_t I, int tp_rank = 0, int tp_size = 1);
  // This rank's intermediate rows of the whole MLP (gate/up rows, down columns).
  MlpWeights shard(int tp_rank, int tp_size) const;
  // Seeded unit-variance draws (common/seeded.h, seeded_uniforms): gate/up / sqrt(D), down / sqrt(I); a
  // function of (seed, D, I) only.
  static MlpWeights synthetic(int64_t D, int64_t I, uint64_t seed);
};

// A layer's MoE weights in fp32: for small configs and tests (KimiMoE::from_checkpoint and ::synthetic
// never hold every expert's fp32 weights at once).
struct MoeOptions;
struct MoeWeights {
  std::vector<float> router;        // [E, D] block_sparse_moe.gate.weight
  std::vector<float> bias;          // [E]    e_score_correction_bias
  std::vector<MlpWeights> experts;  // E routed experts, [Ie, D] / [D, Ie]
  MlpWeights shared;                // [Ie * S, D] / [D, Ie * S]; intermediate 0 without shared experts
  // Exactly the weights KimiMoE::synthetic builds with the same arguments.
  static MoeWeights synthetic(const io::KimiLinearConfig& cfg, int layer_idx, uint64_t seed,
                              const MoeOptions& opts);
};

// The dense MLP (layers below first_k_dense_replace); the MoE runs its shared expert with the same math.
class KimiMLP {
 public:
  // `w` holds this rank's shard (w.intermediate = I / tp.size); `weights`: dense in the precision's type,
  // or int8 / int4 quantized (layers/quant_linear.h).
  KimiMLP(const MlpWeights& w, Precision precision, distributed::TensorParallel tp = {},
          Weights weights = Weights::BF16);
  ~KimiMLP();
  KimiMLP(KimiMLP&&) noexcept;
  KimiMLP& operator=(KimiMLP&&) noexcept;

  // x [T, D] (post-attention-normed) -> out [T, D]. bf16: the gate/up outputs, silu*up and the down
  // output are rounded. allreduce: sum the row-parallel partials over the tensor-parallel ranks here (the
  // dense MLP); false leaves this rank's partial (unrounded under TP) for a caller that sums once (MoE).
  void forward(const float* x, int64_t T, float* out, bool allreduce = true);
  // The calling thread's scratch grown to a forward of up to T tokens and touched (at load: a first long
  // prompt does not fault it in).
  void reserve(int64_t T) const;
  int64_t hidden() const;
  int64_t intermediate() const;  // this rank's
  int64_t weight_bytes() const;
  const layers::moe::SwigluMlp& mlp() const { return *mlp_; }

 private:
  std::unique_ptr<layers::moe::SwigluMlp> mlp_;
  Precision precision_;
  distributed::TensorParallel tp_;
};

struct MoeOptions {
  MoeCombine combine = MoeCombine::Unbiased;
  int num_experts = 0;  // 0: the config's (synthetic only: fewer experts, for benchmarks)
  // Slices of every expert's and the shared expert's intermediate rows (fewer where they do not split into
  // slices of a multiple of 32 rows; SwigluPieces::pieces_for). A layout choice, not the thread count, so
  // a model computes the same sums on any host. 1 (whole MLPs, one job per expert at decode) until 2 is
  // measured on a quiet host: on a loaded one, 2 did not move batch 1 and slowed batch 16 (each slice
  // gathers and converts its rows again).
  int pieces = 1;
};

class KimiMoE {
 public:
  // Layer `layer_idx`'s MoE, keys model.layers.{i}.block_sparse_moe.*; every shape checked against the
  // config (a missing or mis-shaped tensor names the key and the shapes). Loads expert by expert: each
  // expert's fp32 weights are converted into its projections and dropped. A layer the config gives a dense
  // MLP, or opts.num_experts other than 0 / the config's, is std::invalid_argument.
  static std::unique_ptr<KimiMoE> from_checkpoint(const io::Checkpoint& ckpt, const io::KimiLinearConfig& cfg,
                                                  int layer_idx, Precision precision,
                                                  distributed::TensorParallel tp = {},
                                                  Weights weights = Weights::BF16, MoeOptions opts = {});
  // Seeded weights at any config (those of MoeWeights::synthetic); opts.num_experts overrides E (top_k
  // stays the config's, clamped to E). The router: normals / sqrt(D); the bias: normals * 0.01.
  static std::unique_ptr<KimiMoE> synthetic(const io::KimiLinearConfig& cfg, int layer_idx, uint64_t seed,
                                            Precision precision, distributed::TensorParallel tp = {},
                                            Weights weights = Weights::BF16, MoeOptions opts = {});
  // From whole fp32 weights (w.experts.size() experts; this rank's shard is taken here).
  static std::unique_ptr<KimiMoE> from_weights(const MoeWeights& w, const io::KimiLinearConfig& cfg,
                                               int layer_idx, Precision precision,
                                               distributed::TensorParallel tp = {},
                                               Weights weights = Weights::BF16, MoeOptions opts = {});
  ~KimiMoE();
  KimiMoE(const KimiMoE&) = delete;
  KimiMoE& operator=(const KimiMoE&) = delete;

  // x [T, D] (post-attention-normed) -> out [T, D], allreduced once under tensor parallelism; bf16: y
  // rounded once after the routed sum and the shared expert are added in fp32.
  void forward(const float* x, int64_t T, float* out);
  // What a forward of up to T tokens uses, grown and touched at load: the router's logits, the grouped
  // pairs, and the calling thread's scratch for the shared expert and for an expert all T tokens pick.
  void reserve(int64_t T);

  int layer_idx() const { return layer_idx_; }
  int64_t hidden() const { return D_; }
  int num_experts() const { return E_; }
  int top_k() const { return k_; }
  MoeCombine combine() const { return combine_; }
  int64_t weight_bytes() const;         // every resident weight on this rank (router and bias included)
  int64_t active_weight_bytes() const;  // what one token reads: router + top_k experts + shared
  // What the last forward read: router, bias, the union of the experts its tokens selected, shared (a
  // batch reads each selected expert once, for every token routed to it). 0 before any forward.
  int64_t last_weight_bytes() const;
  // The last forward's selected experts [T, top_k], by descending c (the dumps' moe_topk_{i}).
  const std::vector<int32_t>& last_topk() const { return topk_ids_; }
  // Its combine weights [T, top_k], in the same order.
  const std::vector<float>& last_topk_weights() const { return topk_w_; }
  // Routed expert e's MLP and the shared expert's (nullptr without one), as kda quantize reads them.
  const layers::moe::SwigluPieces& expert(int e) const { return *experts_.at(static_cast<size_t>(e)); }
  const layers::moe::SwigluPieces* shared_expert() const { return shared_.get(); }

  // When the selected experts average at most this many rows (decode, small batches over many experts)
  // the routed ones run side by side, one slice per thread (MoeOptions::pieces), each GEMM single-threaded:
  // too few rows to thread one GEMM well, and every thread streams its own expert's weights. The shared
  // expert runs before them with its GEMMs threaded (as one more job it left one thread alone at the end
  // of every layer at batch 1: 9 jobs on 2 threads). More rows (prefill) run expert after expert with the
  // GEMMs threaded.
  static constexpr int64_t kSideBySideRows = 16;

 private:
  struct Source;
  KimiMoE(const io::KimiLinearConfig& cfg, int layer_idx, const Source& src, Precision precision,
          distributed::TensorParallel tp, Weights weights, MoeOptions opts);
  bool bf16_rows() const;
  void run_grouped(const float* x, int64_t T, float* y);
  // The shared expert into y, then the routed experts' rows of x (fp32 or bf16 rows, R) gathered into xe
  // and their outputs ye added, expert after expert.
  template <class R>
  void run_experts(const R* x, int64_t T, std::vector<R>& xe, std::vector<R>& ye, bool round_out, float* y);
  void run_side_by_side(const float* x, int64_t T, float* y);

  int layer_idx_;
  int64_t D_;
  int E_, k_;
  MoeCombine combine_;
  bool renormalize_;
  float factor_;
  Precision precision_;
  Weights weights_;
  int64_t unpadded_ = 0;  // an expert's row counts up to this run unpadded (its packed kernels' calls)
  // bf16 experts whose projections run calls of up to kernels::gemm::kAmxRows rows on the AMX decode
  // kernel (layers::Bf16Gemm::OneDnnAmx): run_experts then takes counts up to kChunkedRows unpadded, in
  // calls of at most kAmxRows (kimi_moe.cc says why).
  bool amx_chunks_ = false;
  distributed::TensorParallel tp_;
  std::unique_ptr<layers::moe::RouterGate> router_;  // fp32, dense in every mode
  std::vector<float> bias_;
  std::vector<std::unique_ptr<layers::moe::SwigluPieces>> experts_;
  std::unique_ptr<layers::moe::SwigluPieces> shared_;  // the shared expert (KimiMLP's math, no allreduce)
  std::vector<float> logits_, topk_w_;
  std::vector<int32_t> topk_ids_;
  std::vector<int64_t> offsets_;  // [E + 1] into rows_
  std::vector<int64_t> rows_;     // (token, slot) pairs grouped by expert, tokens ascending: t * k + j
};

}  // namespace kda::models
