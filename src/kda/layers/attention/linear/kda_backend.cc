#include "kda/layers/attention/linear/kda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

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
  if (forward_batch.forward_mode == ForwardMode::TARGET_VERIFY) {
    // A new verify batch: the previous one can no longer be accepted (the verify buffer is reused); this
    // one can once a layer has run it.
    verify_pending_ = false;
    verify_md_ = forward_metadata_;
    verify_req_ = forward_batch.req_pool_indices;
    verify_lens_ = forward_batch.extend_seq_lens;
    verify_parents_ = forward_batch.draft_parents;
    verify_layers_.clear();
  }
}

// Row stride of the conv output, in elements of elem_bytes: the channels padded by one cache line when
// the row would be a multiple of 4 KB, as q|k|v of the model (3 x 4096 channels) is. Rows 4 KB apart
// share L1 sets, and the kernels read each head's column slice row after row.
int64_t LinearRecurrentAttnBackend::conv_out_stride(const RadixLinearAttention& layer, int64_t elem_bytes) {
  const int64_t c = layer.conv_dim();
  return (c * elem_bytes) % 4096 == 0 ? c + 64 / elem_bytes : c;
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
  const int64_t qd = layer.q_dim(), kd = layer.k_dim();

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
    forward_verify(layer, in, cache, o);
    return;
  }
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

  LinearRecurrentDispatch d;
  d.layer = &layer;
  d.metadata = &md;
  if (bf16_out) {
    d.q_bf16 = conv_out_bf16_.data();
    d.k_bf16 = conv_out_bf16_.data() + qd;
    d.v_bf16 = conv_out_bf16_.data() + qd + kd;
  } else {
    d.q = conv_out_.data();
    d.k = conv_out_.data() + qd;
    d.v = conv_out_.data() + qd + kd;
  }
  d.qkv_stride = ys;
  d.a = in.a;
  d.a_bf16 = in.a_bf16;
  d.a_stride = in.a_stride;
  d.beta = beta_.data();
  d.cache = cache;
  d.o = o;
  decode ? dispatch_recurrent(d) : dispatch_chunk(d);
}

namespace {

// Values [c0, c1) of token t's raw conv input (fp32 or bf16 rows), as a conv state keeps it: rounded to
// bf16 in the bf16 mode (then exactly representable in a bf16 state), into dst [C] fp32.
void raw_input_row(const LinearAttnInputs& in, int64_t t, int64_t c0, int64_t c1, bool round, float* dst) {
  for (int64_t c = c0; c < c1; ++c) {
    float v = in.mixed_qkv_bf16 != nullptr ? bf16_to_f32(in.mixed_qkv_bf16[t * in.qkv_stride + c])
                                           : in.mixed_qkv[t * in.qkv_stride + c];
    dst[c] = round ? round_bf16(v) : v;
  }
}

// One row of a conv window and where it comes from: a row of a committed window, or a raw input row.
template <class StateT>
struct WindowRow {
  StateT* dst;
  const StateT* old;  // or
  const float* raw;
};

// A conv window [W-1, C] into dst: the last W-1 rows of (the committed window `old` ++ the raw rows
// `path`, oldest first), as rows to copy (copy_window_rows).
template <class StateT>
void window_rows(StateT* dst, const StateT* old, int64_t Hn, int64_t C, const std::vector<const float*>& path,
                 std::vector<WindowRow<StateT>>& rows) {
  const int64_t n = static_cast<int64_t>(path.size());
  for (int64_t r = 0; r < Hn; ++r) {
    const int64_t q = n + r;  // position in (old ++ path)
    rows.push_back(q < Hn ? WindowRow<StateT>{dst + r * C, old + q * C, nullptr}
                          : WindowRow<StateT>{dst + r * C, nullptr, path[q - Hn]});
  }
}

template <class StateT>
void copy_window_rows(const std::vector<WindowRow<StateT>>& rows, int64_t C) {
  parallel_spans(static_cast<int64_t>(rows.size()), C, [&](int64_t r, int64_t c0, int64_t c1) {
    const WindowRow<StateT>& w = rows[static_cast<size_t>(r)];
    if (w.old != nullptr) {
      std::memcpy(w.dst + c0, w.old + c0, sizeof(StateT) * (c1 - c0));
      return;
    }
    for (int64_t c = c0; c < c1; ++c) {
      if constexpr (std::is_same_v<StateT, bf16_t>) {
        w.dst[c] = f32_to_bf16(w.raw[c]);
      } else {
        w.dst[c] = w.raw[c];
      }
    }
  });
}

// Row-local positions from the row's first token to position j, following parents (empty: a chain).
void path_to(const std::vector<int32_t>& parents, int64_t bos, int64_t j, std::vector<int64_t>& path) {
  path.clear();
  for (int64_t t = j; t >= 0; t = parents.empty() ? t - 1 : parents[bos + t]) path.push_back(t);
  std::reverse(path.begin(), path.end());
}

}  // namespace

// TARGET_VERIFY in one layer: checks the verify buffer, then per token its conv window (its ancestors'
// raw inputs reaching into the committed conv state) and the decode conv over all tokens at once, the
// kept inputs, and the recurrence over the rows (parents for trees) without writing the committed states.
void LinearRecurrentAttnBackend::forward_verify(const RadixLinearAttention& layer, const LinearAttnInputs& in,
                                                const mem_cache::LinearRecurrentLayerCache& cache, float* o) {
  const auto& p = layer.params();
  const auto& md = forward_metadata_;
  const int64_t B = static_cast<int64_t>(md.recurrent_indices.size()), T = md.num_tokens();
  const int64_t H = p.num_v_heads, K = p.head_k_dim, C = layer.conv_dim(), Hn = p.conv_kernel - 1;
  if (cache.verify == nullptr)
    throw std::invalid_argument(
        "TARGET_VERIFY: the state pool has no verify buffer "
        "(RecurrentStatePoolConfig::max_verify_tokens is 0)");
  if (B > cache.verify_rows)
    throw std::invalid_argument("TARGET_VERIFY: " + std::to_string(B) +
                                " rows, more than the verify buffer's " + std::to_string(cache.verify_rows));
  for (int64_t i = 0; i < B; ++i) {
    const int64_t len = md.cu_q_lens[i + 1] - md.cu_q_lens[i];
    if (len > cache.verify_tokens)
      throw std::invalid_argument("TARGET_VERIFY: row " + std::to_string(i) + " has " +
                                  std::to_string(len - 1) +
                                  " drafts, more than the verify buffer holds (max_verify_tokens " +
                                  std::to_string(cache.verify_tokens) + " = 1 + " +
                                  std::to_string(cache.verify_tokens - 1) + " drafts)");
  }
  if (std::find(verify_layers_.begin(), verify_layers_.end(), &layer) == verify_layers_.end())
    verify_layers_.push_back(&layer);
  verify_pending_ = true;
  if (T == 0) return;

  // Kept per token: raw conv input | conv output | gate | beta.
  const int64_t E = cache.verify_token_elems;
  const auto kept = [&](int64_t i, int64_t j) { return cache.verify + (i * cache.verify_tokens + j) * E; };
  std::vector<int32_t> tok_slot(static_cast<size_t>(T), -1);
  std::vector<float*> tok_kept(static_cast<size_t>(T));  // each token's kept row
  for (int64_t i = 0; i < B; ++i)
    for (int64_t j = 0; j < md.cu_q_lens[i + 1] - md.cu_q_lens[i]; ++j)
      tok_kept[md.cu_q_lens[i] + j] = kept(i, j);
  std::vector<const float*> anc;
  std::vector<int64_t> path;
  parallel_spans(T, C, [&](int64_t t, int64_t c0, int64_t c1) {
    raw_input_row(in, t, c0, c1, p.bf16_activations, tok_kept[t]);
  });
  // Each token's window before it, in a scratch conv pool of one slot per token.
  const auto windows = [&](auto* scratch, const auto* conv) {
    using StateT = std::remove_cv_t<std::remove_pointer_t<decltype(conv)>>;
    std::vector<WindowRow<StateT>> rows;
    for (int64_t i = 0; i < B; ++i) {
      const int32_t slot = md.recurrent_indices[i];
      if (slot < 0) continue;
      const int64_t bos = md.cu_q_lens[i];
      for (int64_t j = 0; j < md.cu_q_lens[i + 1] - bos; ++j) {
        path_to(md.parents, bos, j, path);
        anc.clear();
        for (size_t r = 0; r + 1 < path.size(); ++r) anc.push_back(kept(i, path[r]));
        window_rows(scratch + (bos + j) * Hn * C, conv + static_cast<int64_t>(slot) * Hn * C, Hn, C, anc,
                    rows);
        tok_slot[bos + j] = static_cast<int32_t>(bos + j);
      }
    }
    copy_window_rows(rows, C);
  };
  // Scratch sized for the verify buffer's most tokens (rows x tokens), not this batch's T: grown to a
  // new high-water mark whenever a batch happened to be larger, it made resident memory creep up late in a
  // long serving run (scripts/soak.sh); sized once, it is all there from the first verify step.
  const int64_t T_cap = std::max(T, cache.verify_rows * cache.verify_tokens);
  const int64_t ys = conv_out_stride(layer, sizeof(float));
  conv_out_.resize(std::max(conv_out_.size(), static_cast<size_t>(T_cap * ys)));
  auto fill = [&](auto& args) {
    args.x = in.mixed_qkv;
    args.x_bf16 = in.mixed_qkv_bf16;
    args.x_stride = in.qkv_stride;
    args.T = T;
    args.C = C;
    args.weight = p.conv_weights;
    args.W = p.conv_kernel;
    args.N = T;
    args.indices = tok_slot.data();
    args.num_slots = T;
    args.round_input_bf16 = p.bf16_activations;
    args.round_output_bf16 = p.bf16_activations;
    args.y = conv_out_.data();
    args.y_stride = ys;
  };
  if (cache.conv_f32 != nullptr) {
    verify_conv_f32_.resize(static_cast<size_t>(T_cap * Hn * C));
    windows(verify_conv_f32_.data(), cache.conv_f32);
    kernels::ShortConvArgs<float> args;
    fill(args);
    args.state = verify_conv_f32_.data();
    kernels::short_conv_decode(args);
  } else {
    verify_conv_bf16_.resize(static_cast<size_t>(T_cap * Hn * C));
    windows(verify_conv_bf16_.data(), cache.conv_bf16);
    kernels::ShortConvArgs<bf16_t> args;
    fill(args);
    args.state = verify_conv_bf16_.data();
    kernels::short_conv_decode(args);
  }

  compute_beta(layer, in, T);
  // Kept after the raw input: conv output [C] | gate [H * K] | beta [H].
  const float* conv_out = conv_out_.data();
  const float* beta = beta_.data();
  parallel_spans(T, C + H * K + H, [&](int64_t t, int64_t c0, int64_t c1) {
    float* k = tok_kept[t] + C;
    for (int64_t c = c0; c < std::min(c1, C); ++c) k[c] = conv_out[t * ys + c];
    for (int64_t c = std::max(c0, C); c < std::min(c1, C + H * K); ++c)
      k[c] = in.a_bf16 != nullptr ? bf16_to_f32(in.a_bf16[t * in.a_stride + c - C])
                                  : in.a[t * in.a_stride + c - C];
    for (int64_t c = std::max(c0, C + H * K); c < c1; ++c) k[c] = beta[t * H + c - C - H * K];
  });

  LinearRecurrentDispatch d;
  d.layer = &layer;
  d.metadata = &md;
  d.q = conv_out_.data();
  d.k = conv_out_.data() + layer.q_dim();
  d.v = conv_out_.data() + layer.q_dim() + layer.k_dim();
  d.qkv_stride = ys;
  d.a = in.a;
  d.a_bf16 = in.a_bf16;
  d.a_stride = in.a_stride;
  d.beta = beta_.data();
  d.cache = cache;
  d.o = o;
  dispatch_recurrent(d);
}

void LinearRecurrentAttnBackend::accept(const ForwardBatch& batch, std::span<const int32_t> accepted,
                                        mem_cache::RecurrentStatePool& recurrent_state_pool) {
  // Everything is checked before any state is written.
  if (!verify_pending_)
    throw std::invalid_argument("accept: no TARGET_VERIFY batch is pending (none ran, or it was accepted)");
  if (batch.forward_mode != ForwardMode::TARGET_VERIFY || batch.req_pool_indices != verify_req_ ||
      batch.extend_seq_lens != verify_lens_ || batch.draft_parents != verify_parents_)
    throw std::invalid_argument(
        "accept: the batch is not the pending TARGET_VERIFY batch (rows, lengths or "
        "parents differ)");
  const auto& md = verify_md_;
  const int64_t B = static_cast<int64_t>(md.recurrent_indices.size());
  if (static_cast<int64_t>(accepted.size()) != B)
    throw std::invalid_argument("accept: " + std::to_string(accepted.size()) + " accepted positions for " +
                                std::to_string(B) + " rows");
  for (int64_t i = 0; i < B; ++i) {
    const int32_t d = md.cu_q_lens[i + 1] - md.cu_q_lens[i] - 1;
    if (accepted[i] < 0 || accepted[i] > d)
      throw std::invalid_argument("accept: row " + std::to_string(i) + " accepts position " +
                                  std::to_string(accepted[i]) + " of its " + std::to_string(d) +
                                  " drafts (must be in [0, " + std::to_string(d) + "])");
  }
  std::vector<mem_cache::LinearRecurrentLayerCache> caches;
  for (const RadixLinearAttention* layer : verify_layers_) {
    caches.push_back(recurrent_state_pool.get_linear_recurrent_layer_cache(layer->layer_id()));
    if (caches.back().verify == nullptr)
      throw std::invalid_argument("accept: layer " + std::to_string(layer->layer_id()) +
                                  " of the state pool has no verify buffer");
  }

  // The accepted paths: for each row, the row positions from the last accepted token back to position 0.
  LinearRecurrentAttnBackendMetadata rmd;
  rmd.forward_mode = ForwardMode::DECODE;
  rmd.recurrent_indices = md.recurrent_indices;
  rmd.has_initial_state.assign(static_cast<size_t>(B), 1);
  rmd.cu_q_lens.assign(1, 0);
  std::vector<std::vector<int64_t>> paths(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) {
    if (md.recurrent_indices[i] >= 0) path_to(md.parents, md.cu_q_lens[i], accepted[i], paths[i]);
    rmd.cu_q_lens.push_back(rmd.cu_q_lens.back() + static_cast<int32_t>(paths[i].size()));
  }
  const int64_t Tp = rmd.cu_q_lens.back();
  verify_pending_ = false;  // accepted once, whatever happens below

  std::vector<const float*> rows;
  for (size_t l = 0; l < verify_layers_.size(); ++l) {
    const RadixLinearAttention& layer = *verify_layers_[l];
    const auto& cache = caches[l];
    const auto& p = layer.params();
    const int64_t H = p.num_v_heads, K = p.head_k_dim, V = p.head_v_dim, C = layer.conv_dim();
    const int64_t Hn = p.conv_kernel - 1, E = cache.verify_token_elems;
    const auto kept = [&](int64_t i, int64_t j) { return cache.verify + (i * cache.verify_tokens + j) * E; };
    // The accepted tokens' kept inputs, contiguous.
    // Sized for the verify buffer's most tokens (see forward_verify).
    const int64_t Tcap = std::max<int64_t>(Tp, cache.verify_rows * cache.verify_tokens);
    accept_rows_.resize(static_cast<size_t>(Tcap * E));
    accept_beta_.resize(static_cast<size_t>(Tcap * H));
    accept_o_.resize(static_cast<size_t>(Tcap * H * V));
    rows.clear();  // each accepted token's kept row, in replay order
    for (int64_t i = 0; i < B; ++i)
      for (const int64_t j : paths[i]) rows.push_back(kept(i, j));
    // Read in place where they already lie one after the other (a single request's chain: its rows
    // 0..a of the verify buffer), else copied together.
    bool in_place = true;
    for (int64_t t = 1; t < Tp && in_place; ++t) in_place = rows[static_cast<size_t>(t)] == rows[0] + t * E;
    const float* acc_rows = Tp > 0 && in_place ? rows[0] : accept_rows_.data();
    if (acc_rows == accept_rows_.data()) {
      float* const dst = accept_rows_.data();
      parallel_spans(Tp, E, [&](int64_t t, int64_t c0, int64_t c1) {
        std::memcpy(dst + t * E + c0, rows[static_cast<size_t>(t)] + c0, sizeof(float) * (c1 - c0));
      });
    }
    for (int64_t t = 0; t < Tp; ++t)
      std::memcpy(accept_beta_.data() + t * H, rows[static_cast<size_t>(t)] + 2 * C + H * K,
                  sizeof(float) * H);
    // The conv state: the path's last W-1 raw inputs after the committed window (computed before the
    // recurrent replay, which does not touch it, and written row by row: rows own distinct slots).
    const auto conv = [&](auto* pool_conv) {
      using StateT = std::remove_pointer_t<decltype(pool_conv)>;
      if (Hn == 0) return;
      // Each row's new window into `win`, then copied over its slot's (a window reads its old rows).
      std::vector<StateT> win(static_cast<size_t>(B * Hn * C));
      std::vector<WindowRow<StateT>> build, back;
      for (int64_t i = 0; i < B; ++i) {
        const int32_t slot = md.recurrent_indices[i];
        if (slot < 0) continue;
        rows.clear();
        for (const int64_t j : paths[i]) rows.push_back(kept(i, j));
        StateT* st = pool_conv + static_cast<int64_t>(slot) * Hn * C;
        window_rows(win.data() + i * Hn * C, st, Hn, C, rows, build);
        for (int64_t r = 0; r < Hn; ++r) back.push_back({st + r * C, win.data() + (i * Hn + r) * C, nullptr});
      }
      copy_window_rows(build, C);
      copy_window_rows(back, C);
    };
    if (cache.conv_f32 != nullptr) {
      conv(cache.conv_f32);
    } else {
      conv(cache.conv_bf16);
    }
    if (Tp == 0) continue;
    LinearRecurrentDispatch d;
    d.layer = &layer;
    d.metadata = &rmd;
    d.q = acc_rows + C;
    d.k = d.q + layer.q_dim();
    d.v = d.k + layer.k_dim();
    d.qkv_stride = E;
    d.a = acc_rows + 2 * C;
    d.a_stride = E;
    d.beta = accept_beta_.data();
    d.cache = cache;
    d.o = accept_o_.data();
    dispatch_recurrent(d);
  }
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
  a.snapshot_state = d.cache.recurrent;
  a.num_snapshot_slots = d.cache.num_slots;
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
