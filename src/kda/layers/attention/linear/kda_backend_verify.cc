// Speculative decoding in the linear-recurrent backend: the TARGET_VERIFY forward of one layer (each
// token's conv window from its ancestors, the recurrence over the drafts, what accept needs kept) and
// accept (the accepted path's replay, computed for every layer first and then committed).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kda/common/aligned_scratch.h"
#include "kda/common/bf16.h"
#include "kda/common/parallel_spans.h"
#include "kda/kernels/short_conv.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/layers/radix_linear_attention.h"

namespace kda::layers::attention::linear {

using detail::WindowRow;
using model_executor::ForwardBatch;
using model_executor::ForwardMode;

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

// A conv window [W-1, C] into dst: the last W-1 rows of (the committed window `old` ++ the raw rows
// `path`, oldest first), as rows to copy (copy_window_rows).
template <class StateT>
void window_rows(StateT* dst, const StateT* old, int64_t Hn, int64_t C, const std::vector<const float*>& path,
                 std::vector<WindowRow>& rows) {
  const int64_t n = static_cast<int64_t>(path.size());
  for (int64_t r = 0; r < Hn; ++r) {
    const int64_t q = n + r;  // position in (old ++ path)
    rows.push_back(q < Hn ? WindowRow{dst + r * C, old + q * C, nullptr}
                          : WindowRow{dst + r * C, nullptr, path[q - Hn]});
  }
}

template <class StateT>
void copy_window_rows(const std::vector<WindowRow>& rows, int64_t C) {
  parallel_spans(static_cast<int64_t>(rows.size()), C, [&](int64_t r, int64_t c0, int64_t c1) {
    const WindowRow& w = rows[static_cast<size_t>(r)];
    StateT* dst = static_cast<StateT*>(w.dst);
    if (w.old != nullptr) {
      std::memcpy(dst + c0, static_cast<const StateT*>(w.old) + c0, sizeof(StateT) * (c1 - c0));
      return;
    }
    for (int64_t c = c0; c < c1; ++c) {
      if constexpr (std::is_same_v<StateT, bf16_t>) {
        dst[c] = f32_to_bf16(w.raw[c]);
      } else {
        dst[c] = w.raw[c];
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

float* LinearRecurrentAttnBackend::kept_row(size_t li, int64_t i, int64_t j) {
  return verify_kept_.data() + ((static_cast<int64_t>(li) * kept_rows_ + i) * kept_tokens_ + j) * kept_elems_;
}

// TARGET_VERIFY in one layer: checks the verify buffer, then per token its conv window (its ancestors'
// raw inputs reaching into the committed conv state) and the decode conv over all tokens at once, the
// kept inputs, and the recurrence over the rows (parents for trees) without writing the committed states.
void LinearRecurrentAttnBackend::forward_verify(const RadixLinearAttention& layer, const LinearAttnInputs& in,
                                                const mem_cache::LinearRecurrentLayerCache& cache,
                                                const mem_cache::RecurrentStatePool& recurrent_state_pool,
                                                float* o) {
  const auto& p = layer.params();
  const auto& md = forward_metadata_;
  const int64_t B = static_cast<int64_t>(md.recurrent_indices.size()), T = md.num_tokens();
  const int64_t H = p.num_v_heads, K = p.head_k_dim, C = layer.conv_dim(), Hn = p.conv_kernel - 1;
  if (cache.verify_tokens == 0)
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
  if (!verify_layers_.empty() && verify_pool_ != &recurrent_state_pool)
    throw std::invalid_argument("TARGET_VERIFY: layer " + std::to_string(layer.layer_id()) +
                                " runs on another state pool than the verify batch's earlier layers");
  if (verify_layers_.empty()) {
    // The batch's first layer: the buffer sized once for the pool's limits (every layer, every row), so
    // that it is all there from the first verify step; the slots' generations to check at accept.
    verify_pool_ = &recurrent_state_pool;
    kept_rows_ = cache.verify_rows;
    kept_tokens_ = cache.verify_tokens;
    kept_elems_ = cache.verify_token_elems;
    const auto need =
        static_cast<size_t>(recurrent_state_pool.num_layers() * kept_rows_ * kept_tokens_ * kept_elems_);
    if (verify_kept_.size() < need) verify_kept_.resize(need);
    verify_gen_.assign(static_cast<size_t>(B), 0);
    for (int64_t i = 0; i < B; ++i)
      if (md.recurrent_indices[i] >= 0)
        verify_gen_[i] = recurrent_state_pool.slot_generation(md.recurrent_indices[i]);
  }
  // The layer's place in the verify buffer: by layer id, in the order the batch's layers first ran.
  size_t li = 0;
  while (li < verify_layers_.size() && verify_layers_[li]->layer_id() != layer.layer_id()) ++li;
  if (li == verify_layers_.size()) verify_layers_.push_back(&layer);
  verify_layers_[li] = &layer;
  if (!verify_failed_) verify_pending_ = true;
  if (T == 0) return;

  // Kept per token: raw conv input | conv output | gate | beta.
  tok_slot_.assign(static_cast<size_t>(T), -1);
  tok_kept_.resize(static_cast<size_t>(T));  // each token's kept row
  for (int64_t i = 0; i < B; ++i)
    for (int64_t j = 0; j < md.cu_q_lens[i + 1] - md.cu_q_lens[i]; ++j)
      tok_kept_[md.cu_q_lens[i] + j] = kept_row(li, i, j);
  parallel_spans(T, C, [&](int64_t t, int64_t c0, int64_t c1) {
    raw_input_row(in, t, c0, c1, p.bf16_activations, tok_kept_[t]);
  });
  // Each token's window before it, in a scratch conv pool of one slot per token.
  const auto windows = [&](auto* scratch, const auto* conv) {
    using StateT = std::remove_cv_t<std::remove_pointer_t<decltype(conv)>>;
    win_rows_.clear();
    for (int64_t i = 0; i < B; ++i) {
      const int32_t slot = md.recurrent_indices[i];
      if (slot < 0) continue;
      const int64_t bos = md.cu_q_lens[i];
      for (int64_t j = 0; j < md.cu_q_lens[i + 1] - bos; ++j) {
        path_to(md.parents, bos, j, path_);
        anc_.clear();
        for (size_t r = 0; r + 1 < path_.size(); ++r) anc_.push_back(kept_row(li, i, path_[r]));
        window_rows(scratch + (bos + j) * Hn * C, conv + static_cast<int64_t>(slot) * Hn * C, Hn, C, anc_,
                    win_rows_);
        tok_slot_[bos + j] = static_cast<int32_t>(bos + j);
      }
    }
    copy_window_rows<StateT>(win_rows_, C);
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
    args.indices = tok_slot_.data();
    args.num_slots = T;
    args.round_input_bf16 = p.bf16_activations;
    args.round_output_bf16 = p.bf16_activations;
    args.y = conv_out_.data();
    args.y_stride = ys;
  };
  if (cache.conv_f32 != nullptr) {
    verify_conv_f32_.resize(std::max(verify_conv_f32_.size(), static_cast<size_t>(T_cap * Hn * C)));
    windows(verify_conv_f32_.data(), cache.conv_f32);
    kernels::ShortConvArgs<float> args;
    fill(args);
    args.state = verify_conv_f32_.data();
    kernels::short_conv_decode(args);
  } else {
    verify_conv_bf16_.resize(std::max(verify_conv_bf16_.size(), static_cast<size_t>(T_cap * Hn * C)));
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
    float* k = tok_kept_[t] + C;
    for (int64_t c = c0; c < std::min(c1, C); ++c) k[c] = conv_out[t * ys + c];
    for (int64_t c = std::max(c0, C); c < std::min(c1, C + H * K); ++c)
      k[c] = in.a_bf16 != nullptr ? bf16_to_f32(in.a_bf16[t * in.a_stride + c - C])
                                  : in.a[t * in.a_stride + c - C];
    for (int64_t c = std::max(c0, C + H * K); c < c1; ++c) k[c] = beta[t * H + c - C - H * K];
  });

  dispatch_recurrent(
      make_dispatch(layer, md, cache, conv_out_.data(), ys, in.a, in.a_bf16, in.a_stride, beta_.data(), o));
}

void LinearRecurrentAttnBackend::check_accept(
    const ForwardBatch& batch, std::span<const int32_t> accepted,
    const mem_cache::RecurrentStatePool& recurrent_state_pool) const {
  if (!verify_pending_) {
    std::string why = "none ran, or it was accepted";
    if (verify_end_ == VerifyEnd::LaterBatch)
      why = std::string("the verify batch was ended by a later ") +
            model_executor::to_string(verify_ended_by_) + " batch on this backend";
    if (verify_end_ == VerifyEnd::LayerFailed) why = "a layer of the verify batch failed";
    throw std::invalid_argument("accept: no TARGET_VERIFY batch is pending (" + why + ")");
  }
  if (batch.forward_mode != ForwardMode::TARGET_VERIFY || batch.req_pool_indices != verify_req_ ||
      batch.extend_seq_lens != verify_lens_ || batch.draft_parents != verify_parents_)
    throw std::invalid_argument(
        "accept: the batch is not the pending TARGET_VERIFY batch (rows, lengths or "
        "parents differ)");
  if (&recurrent_state_pool != verify_pool_)
    throw std::invalid_argument("accept: the state pool is not the one the TARGET_VERIFY batch ran on");
  if (static_cast<int>(verify_layers_.size()) != recurrent_state_pool.num_layers())
    throw std::invalid_argument("accept: the TARGET_VERIFY batch ran " +
                                std::to_string(verify_layers_.size()) + " of the state pool's " +
                                std::to_string(recurrent_state_pool.num_layers()) +
                                " KDA layers; accepting it would leave the others behind");
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
    const int32_t slot = md.recurrent_indices[i];
    if (slot >= 0 && recurrent_state_pool.slot_generation(slot) != verify_gen_[i])
      throw std::invalid_argument("accept: slot " + std::to_string(slot) + " (row " + std::to_string(i) +
                                  ") was written after the TARGET_VERIFY batch (by another batch or a "
                                  "pool operation): its drafts were verified against a state that is gone");
  }
}

// Accept's first phase for one layer: each row's new conv window and recurrent state into the scratch
// (accept_win_*, accept_state_ at [li, row]); the pool is only read.
void LinearRecurrentAttnBackend::replay_layer(size_t li, const mem_cache::LinearRecurrentLayerCache& cache) {
  const RadixLinearAttention& layer = *verify_layers_[li];
  const auto& md = verify_md_;
  const auto& p = layer.params();
  const int64_t B = static_cast<int64_t>(md.recurrent_indices.size());
  const int64_t H = p.num_v_heads, K = p.head_k_dim, V = p.head_v_dim, C = layer.conv_dim();
  const int64_t Hn = p.conv_kernel - 1, E = kept_elems_, Tp = replay_md_.num_tokens();
  const auto path = [&](int64_t i) {
    return std::span<const int64_t>(paths_.data() + path_off_[i], paths_.data() + path_off_[i + 1]);
  };
  // The conv state: the path's last W-1 raw inputs after the committed window.
  const auto conv = [&](auto* scratch, const auto* pool_conv) {
    using StateT = std::remove_cv_t<std::remove_pointer_t<decltype(pool_conv)>>;
    win_rows_.clear();
    for (int64_t i = 0; i < B; ++i) {
      const int32_t slot = md.recurrent_indices[i];
      if (slot < 0) continue;
      rows_.clear();
      for (const int64_t j : path(i)) rows_.push_back(kept_row(li, i, j));
      window_rows(scratch + (static_cast<int64_t>(li) * B + i) * Hn * C,
                  pool_conv + static_cast<int64_t>(slot) * Hn * C, Hn, C, rows_, win_rows_);
    }
    copy_window_rows<StateT>(win_rows_, C);
  };
  if (Hn > 0) {
    if (cache.conv_f32 != nullptr) {
      conv(accept_win_f32_.data(), cache.conv_f32);
    } else {
      conv(accept_win_bf16_.data(), cache.conv_bf16);
    }
  }
  if (Tp == 0) return;
  // The accepted tokens' kept rows, in replay order: read in place where they already lie one after the
  // other (a single request's chain: its rows 0..a of the verify buffer), else copied together.
  rows_.clear();
  for (int64_t i = 0; i < B; ++i)
    for (const int64_t j : path(i)) rows_.push_back(kept_row(li, i, j));
  bool in_place = true;
  for (int64_t t = 1; t < Tp && in_place; ++t) in_place = rows_[static_cast<size_t>(t)] == rows_[0] + t * E;
  const float* acc_rows = in_place ? rows_[0] : accept_rows_.data();
  if (!in_place) {
    float* const dst = accept_rows_.data();
    parallel_spans(Tp, E, [&](int64_t t, int64_t c0, int64_t c1) {
      std::memcpy(dst + t * E + c0, rows_[static_cast<size_t>(t)] + c0, sizeof(float) * (c1 - c0));
    });
  }
  for (int64_t t = 0; t < Tp; ++t)
    std::memcpy(accept_beta_.data() + t * H, rows_[static_cast<size_t>(t)] + 2 * C + H * K,
                sizeof(float) * H);
  // The recurrent state: the committed one advanced by the path, written as the snapshot at the path's
  // end into the scratch (output_final_state is false: the slot is only read).
  LinearRecurrentDispatch d = make_dispatch(layer, replay_md_, cache, acc_rows + C, E, acc_rows + 2 * C,
                                            nullptr, E, accept_beta_.data(), accept_o_.data());
  d.snapshot_state = accept_state_.data() + static_cast<int64_t>(li) * B * H * K * V;
  d.num_snapshot_slots = B;
  dispatch_recurrent(d);
}

void LinearRecurrentAttnBackend::accept(const ForwardBatch& batch, std::span<const int32_t> accepted,
                                        mem_cache::RecurrentStatePool& recurrent_state_pool) {
  // Everything is checked, and the scratch sized, before any state is written.
  check_accept(batch, accepted, recurrent_state_pool);
  const auto& md = verify_md_;
  const int64_t B = static_cast<int64_t>(md.recurrent_indices.size());
  const size_t L = verify_layers_.size();
  accept_caches_.clear();
  for (const RadixLinearAttention* layer : verify_layers_)
    accept_caches_.push_back(recurrent_state_pool.get_linear_recurrent_layer_cache(layer->layer_id()));

  // The accepted paths (row positions from position 0 to the last accepted token), and the replay as a
  // decode batch of those paths whose final states are snapshots at each path's end.
  replay_md_.forward_mode = ForwardMode::DECODE;
  replay_md_.recurrent_indices = md.recurrent_indices;
  replay_md_.has_initial_state.assign(static_cast<size_t>(B), 1);
  replay_md_.output_final_state = false;
  replay_md_.parents.clear();
  replay_md_.cu_q_lens.assign(1, 0);
  replay_md_.snapshots.clear();
  paths_.clear();
  path_off_.assign(1, 0);
  for (int64_t i = 0; i < B; ++i) {
    if (md.recurrent_indices[i] >= 0) {
      path_to(md.parents, md.cu_q_lens[i], accepted[i], path_);
      paths_.insert(paths_.end(), path_.begin(), path_.end());
      replay_md_.snapshots.push_back(
          {static_cast<int32_t>(i), static_cast<int32_t>(path_.size()), static_cast<int32_t>(i)});
    }
    path_off_.push_back(static_cast<int64_t>(paths_.size()));
    replay_md_.cu_q_lens.push_back(static_cast<int32_t>(paths_.size()));
  }
  const int64_t Tp = replay_md_.num_tokens();
  const auto& c0 = accept_caches_[0];
  const int64_t E = kept_elems_, S = c0.recurrent_slot_elems, W = c0.conv_slot_elems;
  const int64_t HV = verify_layers_[0]->params().num_v_heads * verify_layers_[0]->params().head_v_dim;
  const int64_t H = verify_layers_[0]->params().num_v_heads;
  // Sized for the verify buffer's most tokens (see forward_verify); the states for this batch's rows.
  const int64_t Tcap = std::max<int64_t>(Tp, kept_rows_ * kept_tokens_);
  grow(accept_rows_, Tcap * E);
  grow(accept_beta_, Tcap * H);
  grow(accept_o_, Tcap * HV);
  grow(accept_state_, static_cast<int64_t>(L) * B * S);
  if (c0.conv_f32 != nullptr) {
    grow(accept_win_f32_, static_cast<int64_t>(L) * B * W);
  } else {
    grow(accept_win_bf16_, static_cast<int64_t>(L) * B * W);
  }

  // Phase one: every layer's new states into the scratch. An error here changes no slot, and the
  // verify stays pending.
  for (size_t li = 0; li < L; ++li) replay_layer(li, accept_caches_[li]);

  // Phase two: the commit, copies only.
  const int64_t rows = static_cast<int64_t>(L) * B;
  parallel_spans(rows, S + W, [&](int64_t r, int64_t e0, int64_t e1) {
    const int64_t li = r / B, i = r % B;
    const int32_t slot = md.recurrent_indices[i];
    if (slot < 0) return;
    const auto& cache = accept_caches_[static_cast<size_t>(li)];
    const int64_t s1 = std::min(e1, S);
    if (e0 < s1)
      std::memcpy(cache.recurrent + slot * S + e0, accept_state_.data() + r * S + e0,
                  sizeof(float) * (s1 - e0));
    const int64_t w0 = std::max(e0, S) - S, w1 = e1 - S;
    if (w0 >= w1) return;
    if (cache.conv_f32 != nullptr) {
      std::memcpy(cache.conv_f32 + slot * W + w0, accept_win_f32_.data() + r * W + w0,
                  sizeof(float) * (w1 - w0));
    } else {
      std::memcpy(cache.conv_bf16 + slot * W + w0, accept_win_bf16_.data() + r * W + w0,
                  sizeof(bf16_t) * (w1 - w0));
    }
  });
  recurrent_state_pool.mark_written(md.recurrent_indices);
  verify_pending_ = false;
  verify_end_ = VerifyEnd::Accepted;
}

}  // namespace kda::layers::attention::linear
