// Linear-recurrent attention backends (RFC §4.3.1 / §4.3.2).
//
// LinearRecurrentAttnBackend is the shared base for KDA and future GDN / Mamba2 backends (sglang's
// MambaAttnBackendBase): it holds no weights and no pool reference. Per batch, get_forward_metadata
// computes cu_q_lens, recurrent_indices and has_initial_state once; every layer then calls forward,
// which dispatches on the forward mode: EXTEND -> short conv (extend) + dispatch_chunk, DECODE -> short
// conv (decode) + dispatch_recurrent, IDLE / DUMMY_FIRST -> zeros with no state touched, TARGET_VERIFY ->
// the verify pass (below), DRAFT_EXTEND -> a clear not-supported error. The layer's states are read from and
// written to the pool in place, through the layer's view (get_linear_recurrent_layer_cache(layer_id)). An
// EXTEND batch's state_snapshots are written by every layer into its own part of the snapshot slots: the
// recurrent state by the kernel (in the same pass), the conv state by the backend.
//
// Thread safety: a backend is not thread-safe (its forward metadata, pending verify batch, verify buffer
// and scratch are members): one backend per thread that runs forwards; distinct backends may run at once,
// on disjoint slots of one pool too (TARGET_VERIFY and accept included: each keeps its own verify buffer).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/kda/kda.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"

namespace kda::layers {
class RadixLinearAttention;
}

namespace kda::layers::attention::linear {

struct LinearRecurrentAttnBackendMetadata {
  std::vector<int32_t> cu_q_lens;          // [B+1] token boundaries of the batch's requests
  std::vector<int32_t> recurrent_indices;  // [B] pool slot per request; -1: padded row
  std::vector<uint8_t> has_initial_state;  // [B] 1 when the slot holds a state to continue from
  model_executor::ForwardMode forward_mode = model_executor::ForwardMode::EXTEND;
  // The batch's state_snapshots (EXTEND): seq = batch row, pos, slot; the kernel writes each layer's
  // recurrent state into the slot, the backend its conv state.
  std::vector<kernels::KdaSnapshot> snapshots;
  // TARGET_VERIFY with tree drafts: each token's parent within its row (-1: the committed state), the
  // kernel's KdaArgs::parents; empty for chains. output_final_state is false for TARGET_VERIFY (the
  // committed states stay as they are).
  std::vector<int32_t> parents;
  bool output_final_state = true;
  int64_t num_tokens() const { return cu_q_lens.empty() ? 0 : cu_q_lens.back(); }
};

// The raw projections a layer hands its backend, token-major. Each of the three is fp32 or bf16: exactly
// one pointer of each pair is set. The bf16 mode's projections are bf16 values (rounding points of the
// spec), and handing them over as bf16 halves what the GEMMs write and the conv and the kernel read.
struct LinearAttnInputs {
  // [T, qkv_stride]: raw pre-conv projections q||k||v in the first conv_dim() columns
  const float* mixed_qkv = nullptr;
  const bf16_t* mixed_qkv_bf16 = nullptr;
  int64_t qkv_stride = 0;
  // [T, a_stride]: the raw forget gate f in the first H*K columns (the kernel applies A_log, dt_bias and
  // softplus)
  const float* a = nullptr;
  const bf16_t* a_bf16 = nullptr;
  int64_t a_stride = 0;
  // [T, b_stride]: beta logits in the first H columns (sigmoid applied in the backend)
  const float* b = nullptr;
  const bf16_t* b_bf16 = nullptr;
  int64_t b_stride = 0;

  // All three fp32, or all three bf16.
  static LinearAttnInputs of(const float* mixed_qkv, int64_t qkv_stride, const float* a, int64_t a_stride,
                             const float* b, int64_t b_stride) {
    return {.mixed_qkv = mixed_qkv,
            .qkv_stride = qkv_stride,
            .a = a,
            .a_stride = a_stride,
            .b = b,
            .b_stride = b_stride};
  }
  static LinearAttnInputs of(const bf16_t* mixed_qkv, int64_t qkv_stride, const bf16_t* a, int64_t a_stride,
                             const bf16_t* b, int64_t b_stride) {
    return {.mixed_qkv_bf16 = mixed_qkv,
            .qkv_stride = qkv_stride,
            .a_bf16 = a,
            .a_stride = a_stride,
            .b_bf16 = b,
            .b_stride = b_stride};
  }
};

namespace detail {
// One row of a conv window and where it comes from: a row of a committed window (`old`, of the conv
// state's type) or a raw input row (fp32). dst is of the conv state's type.
struct WindowRow {
  void* dst;
  const void* old;
  const float* raw;
};
}  // namespace detail

// The arguments a dispatch hands to a kernel, prepared by the base class.
struct LinearRecurrentDispatch {
  const RadixLinearAttention* layer = nullptr;
  const LinearRecurrentAttnBackendMetadata* metadata = nullptr;
  // Column slices of the conv output [T, qkv_stride] (after conv + silu): q [T, H*K], k, v; fp32, or bf16
  // (q_bf16, k_bf16, v_bf16 instead) where the bf16 mode keeps its EXTEND conv output in bf16.
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const bf16_t* q_bf16 = nullptr;
  const bf16_t* k_bf16 = nullptr;
  const bf16_t* v_bf16 = nullptr;
  int64_t qkv_stride = 0;
  const float* a = nullptr;        // [T, a_stride]: the raw forget gate in the first H*K columns
  const bf16_t* a_bf16 = nullptr;  // or as bf16
  int64_t a_stride = 0;
  const float* beta = nullptr;  // [T, H] sigmoid(b), fp32
  mem_cache::LinearRecurrentLayerCache cache;
  float* o = nullptr;  // [T, H*V]
  // Where the metadata's snapshots go: [num_snapshot_slots, H, K, V] (null: the pool's recurrent buffer).
  // accept's replay writes the new states there, to commit them only once every layer has them.
  float* snapshot_state = nullptr;
  int64_t num_snapshot_slots = 0;
};

class LinearRecurrentAttnBackend {
 public:
  virtual ~LinearRecurrentAttnBackend() = default;

  // Per batch, before the first layer (outside the layers). recurrent_indices come from
  // req_to_token_pool.get_recurrent_indices(req_pool_indices). Throws for unsupported modes.
  LinearRecurrentAttnBackendMetadata get_forward_metadata(const model_executor::ForwardBatch& forward_batch,
                                                          std::span<const int32_t> recurrent_indices) const;
  void init_forward_metadata(const model_executor::ForwardBatch& forward_batch,
                             std::span<const int32_t> recurrent_indices);
  const LinearRecurrentAttnBackendMetadata& forward_metadata() const { return forward_metadata_; }

  // The buffers an EXTEND forward of up to T tokens through `layer` uses (its conv output and
  // beta), grown and touched: a model sizes them at load for the scheduler's token budget.
  void reserve(const RadixLinearAttention& layer, int64_t T);

  // o: [T, Hv * Dv] kernel output.
  void forward(const RadixLinearAttention& layer, const model_executor::ForwardBatch& forward_batch,
               const LinearAttnInputs& in, mem_cache::RecurrentStatePool& recurrent_state_pool, float* o);
  // fp32 inputs.
  void forward(const RadixLinearAttention& layer, const model_executor::ForwardBatch& forward_batch,
               const float* mixed_qkv, int64_t qkv_stride, const float* a, int64_t a_stride, const float* b,
               int64_t b_stride, mem_cache::RecurrentStatePool& recurrent_state_pool, float* o) {
    forward(layer, forward_batch, LinearAttnInputs::of(mixed_qkv, qkv_stride, a, a_stride, b, b_stride),
            recurrent_state_pool, o);
  }

  // Speculative decoding. A TARGET_VERIFY forward (ForwardBatch::target_verify) runs, in every KDA layer,
  // the conv and the recurrence over each row's last accepted token and drafts -- a tree token's conv
  // window is its own ancestors' raw inputs, its state its parent's advanced by it -- and returns an
  // output for every position; the committed states are only read. Each layer keeps, in this backend's
  // verify buffer (limits: RecurrentStatePoolConfig::max_verify_tokens and verify_rows), its tokens' raw
  // conv inputs and the recurrence's inputs (conv output, gate, beta). accept() then leaves in each
  // request's slot, for every layer, exactly the state after its accepted tokens, with no layer pass: the
  // conv state is the path's last W-1 raw inputs, the recurrent state the committed one advanced by the
  // accepted tokens (fused_recurrent_kda over their kept inputs).
  //
  // Why replay and not the d+1 per-position states kept during verify: keeping them writes (d+1) states
  // per request per layer and accept still copies one, while replay writes no state during verify and
  // accept re-runs a+1 tokens on a state it streams once; a kept token is 2C + H*K + H floats, far less
  // than a state (H*K*V). The verify buffer is the backend's own (not the pool's, indexed by batch row)
  // so that backends verifying disjoint slots of one pool on several threads keep apart what each
  // replays; it is sized once, for the pool's limits, at the backend's first verify.
  //
  // accept is two-phase: every layer's new conv window and recurrent state is computed into the
  // backend's scratch first (the replay reads the committed state and writes the new one there), and
  // only then copied over the slots, so an error in any layer leaves every slot as it was (and the
  // verify still pending). That scratch holds one recurrent state per verified row and KDA layer.
  //
  // accepted[i]: the row position (0..d_i) of request i's last accepted token. For a chain it is a_i, the
  // number of accepted drafts; for a tree the accepted path is that token and its ancestors. `batch` must
  // be the verify batch (same rows, lengths and parents) run through every KDA layer of the pool, and one
  // verify batch is accepted once. Any later batch on this backend (init_forward_metadata) ends the
  // pending verify, and a slot written since the verify (by a batch of another backend, or alloc / free /
  // copy_slot / set_linear_recurrent_layer_cache: its generation moved) cannot be accepted. Bad or late
  // input is a std::invalid_argument before any state changes.
  void accept(const model_executor::ForwardBatch& batch, std::span<const int32_t> accepted,
              mem_cache::RecurrentStatePool& recurrent_state_pool);
  bool has_pending_verify() const { return verify_pending_; }

 protected:
  virtual void dispatch_chunk(const LinearRecurrentDispatch& d) = 0;
  virtual void dispatch_recurrent(const LinearRecurrentDispatch& d) = 0;

 private:
  void run_conv(const RadixLinearAttention& layer, const LinearAttnInputs& in, int64_t T,
                const mem_cache::LinearRecurrentLayerCache& cache, bool decode, bool bf16_out);
  // The conv state at each snapshot's position into its slot (before run_conv moves the requests' own
  // conv states on: a snapshot before position W-1 reads the request's previous one).
  void write_conv_snapshots(const RadixLinearAttention& layer, const LinearAttnInputs& in,
                            const mem_cache::LinearRecurrentLayerCache& cache) const;
  // beta_ [T, H] = sigmoid(W_b x), from the fp32 or bf16 projection (EXTEND / DECODE and verify alike).
  void compute_beta(const RadixLinearAttention& layer, const LinearAttnInputs& in, int64_t T);

  void forward_checked(const RadixLinearAttention& layer, const model_executor::ForwardBatch& forward_batch,
                       const LinearAttnInputs& in, mem_cache::RecurrentStatePool& recurrent_state_pool,
                       float* o);
  void forward_verify(const RadixLinearAttention& layer, const LinearAttnInputs& in,
                      const mem_cache::LinearRecurrentLayerCache& cache,
                      const mem_cache::RecurrentStatePool& recurrent_state_pool, float* o);
  // accept's checks, everything before the first state is computed.
  void check_accept(const model_executor::ForwardBatch& batch, std::span<const int32_t> accepted,
                    const mem_cache::RecurrentStatePool& recurrent_state_pool) const;
  // The replay of layer `li` of the verify batch into the scratch (accept's first phase).
  void replay_layer(size_t li, const mem_cache::LinearRecurrentLayerCache& cache);
  // Layer li's kept row of verify row i, token j.
  float* kept_row(size_t li, int64_t i, int64_t j);

  // The dispatch of one layer: q, k and v as column slices of one conv output (fp32 or bf16) of row
  // stride qkv_stride, the gate as given, beta and the output.
  template <class QkvT>
  static LinearRecurrentDispatch make_dispatch(const RadixLinearAttention& layer,
                                               const LinearRecurrentAttnBackendMetadata& md,
                                               const mem_cache::LinearRecurrentLayerCache& cache,
                                               const QkvT* qkv, int64_t qkv_stride, const float* a,
                                               const bf16_t* a_bf16, int64_t a_stride, const float* beta,
                                               float* o);
  static int64_t conv_out_stride(const RadixLinearAttention& layer, int64_t elem_bytes);

  LinearRecurrentAttnBackendMetadata forward_metadata_;
  bool has_metadata_ = false;

  // The pending TARGET_VERIFY batch: its metadata, rows, pool, its slots' generations and the layers
  // that ran it (by pool layer, in the order they first ran; kept rows of layer li at li).
  bool verify_pending_ = false;
  bool verify_failed_ = false;  // a layer of the current verify batch threw: nothing to accept
  // Why no verify is pending, for accept's error.
  enum class VerifyEnd : uint8_t { None, Accepted, LaterBatch, LayerFailed };
  VerifyEnd verify_end_ = VerifyEnd::None;
  model_executor::ForwardMode verify_ended_by_ = model_executor::ForwardMode::EXTEND;
  LinearRecurrentAttnBackendMetadata verify_md_;
  std::vector<int32_t> verify_req_, verify_lens_, verify_parents_;
  const mem_cache::RecurrentStatePool* verify_pool_ = nullptr;
  std::vector<uint64_t> verify_gen_;  // [B] the slots' generations at the verify (0 for padded rows)
  std::vector<const RadixLinearAttention*> verify_layers_;
  // The verify buffer [pool layers, verify_rows, verify_tokens, verify_token_elems]: each verify token's
  // raw conv input | conv output | gate | beta.
  std::vector<float> verify_kept_;
  int64_t kept_rows_ = 0, kept_tokens_ = 0, kept_elems_ = 0;
  std::vector<float> verify_conv_f32_;  // [T, W-1, C] each verify token's conv window
  std::vector<bf16_t> verify_conv_bf16_;

  // Scratch of forward_verify and accept, reused across layers and steps (grown, never shrunk).
  std::vector<int32_t> tok_slot_;
  std::vector<float*> tok_kept_;
  std::vector<const float*> anc_, rows_;
  std::vector<int64_t> path_;
  std::vector<detail::WindowRow> win_rows_;
  std::vector<int64_t> paths_, path_off_;  // accept: each row's accepted path, row positions, flattened
  LinearRecurrentAttnBackendMetadata replay_md_;
  std::vector<mem_cache::LinearRecurrentLayerCache> accept_caches_;
  std::vector<float> accept_rows_, accept_beta_, accept_o_;
  // accept's first phase: per verified layer and row, the new conv window [W-1, C] and recurrent state
  // [H, K, V].
  std::vector<float> accept_win_f32_;
  std::vector<bf16_t> accept_win_bf16_;
  std::vector<float> accept_state_;

  // Scratch reused across layers and steps (grown, never shrunk).
  std::vector<float> conv_out_;
  std::vector<bf16_t> conv_out_bf16_;  // the bf16 mode's EXTEND conv output
  std::vector<float> beta_;
  std::vector<uint8_t> seen_;  // slot check
};

// KDA: binds the dispatches to the chunk_kda / fused_recurrent_kda kernels (optimized by default, the
// reference when asked for, with fallback as kernels/kda decides). One instance serves every KDA layer.
// Not final: a test derives from it to make one dispatch fail.
class KDAAttnBackend : public LinearRecurrentAttnBackend {
 public:
  explicit KDAAttnBackend(kernels::KernelImpl kernel = kernels::KernelImpl::Auto) : kernel_(kernel) {}
  kernels::KernelImpl kernel() const { return kernel_; }

 protected:
  void dispatch_chunk(const LinearRecurrentDispatch& d) override;
  void dispatch_recurrent(const LinearRecurrentDispatch& d) override;

 private:
  kernels::KdaArgs kernel_args(const LinearRecurrentDispatch& d) const;
  kernels::KernelImpl kernel_;
};

}  // namespace kda::layers::attention::linear
