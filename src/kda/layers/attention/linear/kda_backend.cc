#include "kda/layers/attention/linear/kda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/common/aligned_scratch.h"
#include "kda/common/bf16.h"
#include "kda/common/parallel_spans.h"
#include "kda/kernels/short_conv.h"
#include "kda/layers/radix_linear_attention.h"

namespace kda::layers::attention::linear {

using model_executor::ForwardBatch;
using model_executor::ForwardMode;

namespace {

void check_mode_supported(ForwardMode m) {
  if (m == ForwardMode::DRAFT_EXTEND)
    throw std::runtime_error(std::string("forward mode ") + model_executor::to_string(m) +
                             " (speculative decoding's draft extend) is not supported by the KDA backend");
}

}  // namespace

LinearRecurrentAttnBackendMetadata LinearRecurrentAttnBackend::get_forward_metadata(
    const ForwardBatch& forward_batch, std::span<const int32_t> recurrent_indices) const {
  forward_batch.validate();
  check_mode_supported(forward_batch.forward_mode);
  const int64_t B = forward_batch.batch_size();
  if (static_cast<int64_t>(recurrent_indices.size()) != B)
    throw std::invalid_argument("get_forward_metadata: " + std::to_string(recurrent_indices.size()) +
                                " recurrent indices for a batch of " + std::to_string(B));
  LinearRecurrentAttnBackendMetadata md;
  md.forward_mode = forward_batch.forward_mode;
  md.cu_q_lens.resize(B + 1);
  md.cu_q_lens[0] = 0;
  int64_t total = 0;
  for (int64_t i = 0; i < B; ++i) {
    total += forward_batch.extend_seq_lens[i];
    if (total > INT32_MAX) throw std::invalid_argument("get_forward_metadata: batch exceeds 2^31 tokens");
    md.cu_q_lens[i + 1] = static_cast<int32_t>(total);
  }
  md.recurrent_indices.assign(recurrent_indices.begin(), recurrent_indices.end());
  md.has_initial_state.resize(B);
  for (int64_t i = 0; i < B; ++i) {
    if ((forward_batch.req_pool_indices[i] < 0) != (recurrent_indices[i] < 0))
      throw std::invalid_argument("get_forward_metadata: request " + std::to_string(i) +
                                  " is padded in one of req_pool_indices / recurrent_indices only");
    const bool decode = forward_batch.forward_mode == ForwardMode::DECODE ||
                        forward_batch.forward_mode == ForwardMode::TARGET_VERIFY;
    const bool prefix = !forward_batch.extend_prefix_lens.empty() && forward_batch.extend_prefix_lens[i] > 0;
    md.has_initial_state[i] = (decode || prefix) ? 1 : 0;
  }
  // Snapshots (rows, positions and slot uniqueness checked by validate()): never into a slot of the batch.
  md.snapshots.reserve(forward_batch.state_snapshots.size());
  for (size_t j = 0; j < forward_batch.state_snapshots.size(); ++j) {
    const auto& s = forward_batch.state_snapshots[j];
    for (int64_t i = 0; i < B; ++i) {
      if (recurrent_indices[i] == s.slot)
        throw std::invalid_argument("get_forward_metadata: state snapshot " + std::to_string(j) +
                                    " targets slot " + std::to_string(s.slot) + ", the slot of request " +
                                    std::to_string(i) + " of this batch");
    }
    md.snapshots.push_back({s.row, s.pos, s.slot});
  }
  if (forward_batch.forward_mode == ForwardMode::TARGET_VERIFY) {
    md.output_final_state = false;
    if (!forward_batch.draft_parents.empty()) {
      // Row positions: the last accepted token (position 0) continues the committed state, draft j
      // (position j + 1) its parent's position.
      md.parents.reserve(static_cast<size_t>(total));
      size_t at = 0;
      for (int64_t i = 0; i < B; ++i) {
        md.parents.push_back(-1);
        for (int32_t j = 0; j + 1 < forward_batch.extend_seq_lens[i]; ++j)
          md.parents.push_back(forward_batch.draft_parents[at++] + 1);
      }
    }
  }
  return md;
}

void LinearRecurrentAttnBackend::init_forward_metadata(const ForwardBatch& forward_batch,
                                                       std::span<const int32_t> recurrent_indices) {
  forward_metadata_ = get_forward_metadata(forward_batch, recurrent_indices);
  has_metadata_ = true;
  // Any new batch ends the pending verify: an EXTEND or DECODE moves states the drafts were verified
  // against, and a new verify batch reuses the verify buffer. A new verify batch can be accepted once
  // every layer has run it.
  if (verify_pending_) {
    verify_end_ = VerifyEnd::LaterBatch;
    verify_ended_by_ = forward_batch.forward_mode;
  }
  verify_pending_ = false;
  verify_failed_ = false;
  verify_layers_.clear();
  if (forward_batch.forward_mode == ForwardMode::TARGET_VERIFY) {
    verify_md_ = forward_metadata_;
    verify_req_ = forward_batch.req_pool_indices;
    verify_lens_ = forward_batch.extend_seq_lens;
    verify_parents_ = forward_batch.draft_parents;
  }
}

template <class QkvT>
LinearRecurrentDispatch LinearRecurrentAttnBackend::make_dispatch(
    const RadixLinearAttention& layer, const LinearRecurrentAttnBackendMetadata& md,
    const mem_cache::LinearRecurrentLayerCache& cache, const QkvT* qkv, int64_t qkv_stride, const float* a,
    const bf16_t* a_bf16, int64_t a_stride, const float* beta, float* o) {
  const int64_t qd = layer.q_dim(), kd = layer.k_dim();
  LinearRecurrentDispatch d;
  d.layer = &layer;
  d.metadata = &md;
  if constexpr (std::is_same_v<QkvT, bf16_t>) {
    d.q_bf16 = qkv;
    d.k_bf16 = qkv + qd;
    d.v_bf16 = qkv + qd + kd;
  } else {
    d.q = qkv;
    d.k = qkv + qd;
    d.v = qkv + qd + kd;
  }
  d.qkv_stride = qkv_stride;
  d.a = a;
  d.a_bf16 = a_bf16;
  d.a_stride = a_stride;
  d.beta = beta;
  d.cache = cache;
  d.o = o;
  return d;
}
template LinearRecurrentDispatch LinearRecurrentAttnBackend::make_dispatch<float>(
    const RadixLinearAttention&, const LinearRecurrentAttnBackendMetadata&,
    const mem_cache::LinearRecurrentLayerCache&, const float*, int64_t, const float*, const bf16_t*, int64_t,
    const float*, float*);
template LinearRecurrentDispatch LinearRecurrentAttnBackend::make_dispatch<bf16_t>(
    const RadixLinearAttention&, const LinearRecurrentAttnBackendMetadata&,
    const mem_cache::LinearRecurrentLayerCache&, const bf16_t*, int64_t, const float*, const bf16_t*, int64_t,
    const float*, float*);

// Row stride of the conv output, in elements of elem_bytes: the channels padded by one cache line when
// the row would be a multiple of 4 KB, as q|k|v of the model (3 x 4096 channels) is. Rows 4 KB apart
// share L1 sets, and the kernels read each head's column slice row after row.
int64_t LinearRecurrentAttnBackend::conv_out_stride(const RadixLinearAttention& layer, int64_t elem_bytes) {
  const int64_t c = layer.conv_dim();
  return (c * elem_bytes) % 4096 == 0 ? c + 64 / elem_bytes : c;
}

void LinearRecurrentAttnBackend::reserve(const RadixLinearAttention& layer, int64_t T) {
  if (T <= 0) return;
  // forward's sizes for a prefill: bf16 rows in the bf16 mode, fp32 rows in the fp32 one (a decode batch's
  // few fp32 rows are left to the first decode).
  if (layer.params().bf16_activations)
    grow(conv_out_bf16_, T * conv_out_stride(layer, sizeof(bf16_t)));
  else
    grow(conv_out_, T * conv_out_stride(layer, sizeof(float)));
  grow(beta_, T * layer.params().num_v_heads);
}

void LinearRecurrentAttnBackend::compute_beta(const RadixLinearAttention& layer, const LinearAttnInputs& in,
                                              int64_t T) {
  const auto& p = layer.params();
  const int64_t H = p.num_v_heads;
  beta_.resize(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = t * in.b_stride + h;
      float bt = in.b_bf16 != nullptr ? bf16_to_f32(in.b_bf16[i]) : in.b[i];
      if (p.bf16_activations) bt = round_bf16(bt);  // the bf16 mode's rounding point of W_b x
      beta_[t * H + h] = 1.0f / (1.0f + std::exp(-bt));
    }
  }
}

void LinearRecurrentAttnBackend::run_conv(const RadixLinearAttention& layer, const LinearAttnInputs& in,
                                          int64_t T, const mem_cache::LinearRecurrentLayerCache& cache,
                                          bool decode, bool bf16_out) {
  const auto& p = layer.params();
  const auto& md = forward_metadata_;
  auto fill = [&](auto& args) {
    args.x = in.mixed_qkv;
    args.x_bf16 = in.mixed_qkv_bf16;
    args.x_stride = in.qkv_stride;
    args.T = T;
    args.C = layer.conv_dim();
    args.weight = p.conv_weights;
    args.W = p.conv_kernel;
    args.cu_seqlens = md.cu_q_lens.data();
    args.N = static_cast<int64_t>(md.recurrent_indices.size());
    args.indices = md.recurrent_indices.data();
    args.num_slots = cache.num_slots;
    args.has_initial_state = md.has_initial_state.data();
    args.round_input_bf16 = p.bf16_activations;
    args.round_output_bf16 = p.bf16_activations;
    if (bf16_out) {
      args.y_bf16 = conv_out_bf16_.data();
      args.y_stride = conv_out_stride(layer, sizeof(bf16_t));
    } else {
      args.y = conv_out_.data();
      args.y_stride = conv_out_stride(layer, sizeof(float));
    }
  };
  if (cache.conv_f32) {
    kernels::ShortConvArgs<float> args;
    fill(args);
    args.state = cache.conv_f32;
    decode ? kernels::short_conv_decode(args) : kernels::short_conv_extend(args);
  } else {
    kernels::ShortConvArgs<bf16_t> args;
    fill(args);
    args.state = cache.conv_bf16;
    decode ? kernels::short_conv_decode(args) : kernels::short_conv_extend(args);
  }
}

namespace {

// Slot `dst` of one layer's conv buffer [slots, W-1, C] <- the conv state after the first `pos` tokens of
// a segment starting at token row `bos` of x (row stride ld): its last W-1 raw inputs, oldest first, the
// rows before the segment from slot `src` (zeros when has_init is false). What short_conv_extend leaves
// in a slot after a segment of pos tokens, bit for bit (the same rounding, the same conversion).
template <class StateT, class InT>
void conv_state_at(StateT* conv, int64_t C, int W, const InT* x, int64_t ld, int64_t bos, int64_t pos,
                   int32_t src, bool has_init, int32_t dst, bool round) {
  const int64_t Hn = W - 1;
  StateT* out = conv + static_cast<int64_t>(dst) * Hn * C;
  const StateT* old = conv + static_cast<int64_t>(src) * Hn * C;
  for (int64_t r = 0; r < Hn; ++r) {
    const int64_t q = pos + r;  // position in (old history ++ segment)
    StateT* o = out + r * C;
    if (q < Hn) {
      if (has_init) {
        std::memcpy(o, old + q * C, sizeof(StateT) * C);
      } else {
        std::fill(o, o + C, StateT{0});
      }
      continue;
    }
    const InT* row = x + (bos + q - Hn) * ld;
    for (int64_t c = 0; c < C; ++c) {
      float v;
      if constexpr (std::is_same_v<InT, bf16_t>) {
        v = bf16_to_f32(row[c]);
      } else {
        v = row[c];
      }
      if (round) v = round_bf16(v);
      if constexpr (std::is_same_v<StateT, bf16_t>) {
        o[c] = f32_to_bf16(v);
      } else {
        o[c] = v;
      }
    }
  }
}

}  // namespace

void LinearRecurrentAttnBackend::write_conv_snapshots(
    const RadixLinearAttention& layer, const LinearAttnInputs& in,
    const mem_cache::LinearRecurrentLayerCache& cache) const {
  const auto& p = layer.params();
  const auto& md = forward_metadata_;
  const int64_t C = layer.conv_dim();
  for (const kernels::KdaSnapshot& s : md.snapshots) {
    const int64_t bos = md.cu_q_lens[s.seq];
    const int32_t src = md.recurrent_indices[s.seq];
    const bool init = md.has_initial_state[s.seq] != 0;
    const auto go = [&](auto* conv) {
      if (in.mixed_qkv_bf16 != nullptr) {
        conv_state_at(conv, C, p.conv_kernel, in.mixed_qkv_bf16, in.qkv_stride, bos, s.pos, src, init, s.slot,
                      p.bf16_activations);
      } else {
        conv_state_at(conv, C, p.conv_kernel, in.mixed_qkv, in.qkv_stride, bos, s.pos, src, init, s.slot,
                      p.bf16_activations);
      }
    };
    if (cache.conv_f32 != nullptr) {
      go(cache.conv_f32);
    } else {
      go(cache.conv_bf16);
    }
  }
}

void LinearRecurrentAttnBackend::forward(const RadixLinearAttention& layer, const ForwardBatch& forward_batch,
                                         const LinearAttnInputs& in,
                                         mem_cache::RecurrentStatePool& recurrent_state_pool, float* o) {
  if (!has_metadata_ || forward_metadata_.forward_mode != ForwardMode::TARGET_VERIFY) {
    forward_checked(layer, forward_batch, in, recurrent_state_pool, o);
    return;
  }
  // A verify batch that failed in one layer cannot be accepted: the layers after it would replay
  // nothing (or what an earlier batch kept).
  try {
    forward_checked(layer, forward_batch, in, recurrent_state_pool, o);
  } catch (...) {
    verify_failed_ = true;
    if (verify_pending_) {
      verify_pending_ = false;
      verify_end_ = VerifyEnd::LayerFailed;
    }
    throw;
  }
}

void LinearRecurrentAttnBackend::forward_checked(const RadixLinearAttention& layer,
                                                 const ForwardBatch& forward_batch,
                                                 const LinearAttnInputs& in,
                                                 mem_cache::RecurrentStatePool& recurrent_state_pool,
                                                 float* o) {
  if (!has_metadata_)
    throw std::logic_error("LinearRecurrentAttnBackend::forward before init_forward_metadata for this batch");
  const auto& md = forward_metadata_;
  const ForwardMode mode = forward_batch.forward_mode;
  if (mode != md.forward_mode)
    throw std::invalid_argument(std::string("forward mode ") + model_executor::to_string(mode) +
                                " differs from the batch metadata's " +
                                model_executor::to_string(md.forward_mode));
  check_mode_supported(mode);
  const int64_t T = md.num_tokens();
  if (forward_batch.num_tokens() != T)
    throw std::invalid_argument("forward batch has " + std::to_string(forward_batch.num_tokens()) +
                                " tokens but its metadata " + std::to_string(T));
  const auto& p = layer.params();
  const int64_t H = p.num_v_heads, K = p.head_k_dim, V = p.head_v_dim;

  if (mode == ForwardMode::IDLE || mode == ForwardMode::DUMMY_FIRST) {
    if (T > 0) std::memset(o, 0, sizeof(float) * T * H * V);
    return;
  }
  if (in.qkv_stride < layer.conv_dim() || in.a_stride < H * K || in.b_stride < H)
    throw std::invalid_argument("LinearRecurrentAttnBackend::forward: row strides smaller than the widths");
  const auto one_of = [&](const void* f32, const void* b16, const char* name) {
    if ((f32 != nullptr) == (b16 != nullptr))
      throw std::invalid_argument(std::string("LinearRecurrentAttnBackend::forward: ") + name + " needs " +
                                  (f32 != nullptr ? "fp32 or bf16 rows, not both" : "its fp32 or bf16 rows"));
  };
  if (T > 0) {
    one_of(in.mixed_qkv, in.mixed_qkv_bf16, "mixed_qkv");
    one_of(in.a, in.a_bf16, "the forget gate a");
    one_of(in.b, in.b_bf16, "the beta logits b");
  }

  mem_cache::LinearRecurrentLayerCache cache =
      recurrent_state_pool.get_linear_recurrent_layer_cache(layer.layer_id());
  if (cache.recurrent_slot_elems != H * K * V ||
      cache.conv_slot_elems != static_cast<int64_t>(p.conv_kernel - 1) * layer.conv_dim())
    throw std::invalid_argument("state pool layer " + std::to_string(layer.layer_id()) +
                                " has a slot shape unlike the layer's (heads, dims or conv width differ)");
  // Every slot is checked before any state is touched, so a bad index leaves the pool as it was.
  seen_.assign(static_cast<size_t>(cache.num_slots), 0);
  for (size_t i = 0; i < md.recurrent_indices.size(); ++i) {
    const int32_t s = md.recurrent_indices[i];
    if (s == -1) continue;
    if (s < 0 || s >= cache.num_slots)
      throw std::invalid_argument("recurrent index " + std::to_string(s) + " of request " +
                                  std::to_string(i) + " is outside the pool's " +
                                  std::to_string(cache.num_slots) + " slots");
    if (seen_[s]++)
      throw std::invalid_argument("recurrent slot " + std::to_string(s) + " appears twice in one batch");
  }
  // Snapshot slots: allocated in this pool (so in range), none of the batch's own. (One slot twice, rows
  // and positions: ForwardBatch::validate, through get_forward_metadata.)
  if (!md.snapshots.empty() && mode != ForwardMode::EXTEND)
    throw std::invalid_argument("state snapshots are for EXTEND batches only");
  for (size_t j = 0; j < md.snapshots.size(); ++j) {
    const int32_t s = md.snapshots[j].slot;
    if (!recurrent_state_pool.is_allocated(s) || s >= cache.num_slots)
      throw std::invalid_argument("state snapshot " + std::to_string(j) + ": slot " + std::to_string(s) +
                                  " is not an allocated slot of the state pool");
    if (seen_[s])
      throw std::invalid_argument("state snapshot " + std::to_string(j) + ": slot " + std::to_string(s) +
                                  " is one of the batch's own slots");
  }

  if (mode == ForwardMode::TARGET_VERIFY) {
    forward_verify(layer, in, cache, recurrent_state_pool, o);
    return;
  }
  // Every slot checked: from here on the batch's slots (and snapshot slots) are written; a pending
  // verify of another backend on any of them can no longer be accepted.
  recurrent_state_pool.mark_written(md.recurrent_indices);
  for (const kernels::KdaSnapshot& s : md.snapshots)
    recurrent_state_pool.mark_written(std::span<const int32_t>(&s.slot, 1));
  const bool decode = mode == ForwardMode::DECODE;
  // The bf16 mode's conv output is bf16 values (the spec rounds it there): in EXTEND it is stored as
  // bf16, half the bytes written by the conv and read by chunk_kda. DECODE keeps fp32 rows (a batch of
  // single tokens; fused_recurrent_kda reads fp32).
  const bool bf16_out = p.bf16_activations && !decode;
  const int64_t ys = conv_out_stride(layer, bf16_out ? sizeof(bf16_t) : sizeof(float));
  if (bf16_out) {
    conv_out_bf16_.resize(static_cast<size_t>(T * ys));
  } else {
    conv_out_.resize(static_cast<size_t>(T * ys));
  }
  if (!md.snapshots.empty()) write_conv_snapshots(layer, in, cache);
  run_conv(layer, in, T, cache, decode, bf16_out);

  // q, k and v are read in place as column slices of the conv output, and the gate as a slice of the
  // caller's projection output: the kernels take row strides, so nothing is copied.
  compute_beta(layer, in, T);

  const LinearRecurrentDispatch d = bf16_out ? make_dispatch(layer, md, cache, conv_out_bf16_.data(), ys,
                                                             in.a, in.a_bf16, in.a_stride, beta_.data(), o)
                                             : make_dispatch(layer, md, cache, conv_out_.data(), ys, in.a,
                                                             in.a_bf16, in.a_stride, beta_.data(), o);
  decode ? dispatch_recurrent(d) : dispatch_chunk(d);
}

kernels::KdaArgs KDAAttnBackend::kernel_args(const LinearRecurrentDispatch& d) const {
  const auto& p = d.layer->params();
  const auto& md = *d.metadata;
  kernels::KdaArgs a;
  a.q = d.q;
  a.k = d.k;
  a.v = d.v;
  a.q_bf16 = d.q_bf16;
  a.k_bf16 = d.k_bf16;
  a.v_bf16 = d.v_bf16;
  a.q_stride = a.k_stride = a.v_stride = d.qkv_stride;
  a.g = d.a;
  a.g_bf16 = d.a_bf16;
  a.g_stride = d.a_stride;
  a.beta = d.beta;
  a.T = md.num_tokens();
  a.H = p.num_v_heads;
  a.K = p.head_k_dim;
  a.V = p.head_v_dim;
  a.cu_seqlens = md.cu_q_lens.data();
  a.N = static_cast<int64_t>(md.recurrent_indices.size());
  a.scale = 0.0f;  // K^-0.5
  a.use_qk_l2norm_in_kernel = true;
  a.use_gate_in_kernel = true;
  a.A_log = p.A_log;
  a.dt_bias = p.dt_bias;
  a.state = d.cache.recurrent;
  a.state_indices = md.recurrent_indices.data();
  a.num_state_slots = d.cache.num_slots;
  a.has_initial_state = md.has_initial_state.data();
  a.output_final_state = md.output_final_state;
  a.parents = md.parents.empty() ? nullptr : md.parents.data();
  a.snapshots = md.snapshots.data();
  a.num_snapshots = static_cast<int64_t>(md.snapshots.size());
  a.snapshot_state = d.snapshot_state != nullptr ? d.snapshot_state : d.cache.recurrent;
  a.num_snapshot_slots = d.snapshot_state != nullptr ? d.num_snapshot_slots : d.cache.num_slots;
  a.o = d.o;
  // Between two steps on a request's slot the layer streams its projection weights (tens of MB at
  // the checkpoint's shapes, more than a last-level cache) and other layers run: the states come from
  // memory, however few the call touches.
  a.state_locality = kernels::KdaArgs::StateLocality::Memory;
  return a;
}

void KDAAttnBackend::dispatch_chunk(const LinearRecurrentDispatch& d) {
  kernels::chunk_kda(kernel_args(d), kernel_);
}

void KDAAttnBackend::dispatch_recurrent(const LinearRecurrentDispatch& d) {
  kernels::fused_recurrent_kda(kernel_args(d), kernel_);
}

}  // namespace kda::layers::attention::linear
