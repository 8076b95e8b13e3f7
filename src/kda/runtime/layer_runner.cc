#include "kda/runtime/layer_runner.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kda/distributed/shard_layout.h"
#include "kda/layers/attention/linear/kda_backend.h"
#include "kda/mem_cache/memory_pool.h"

namespace kda::runtime {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void expect_shape(const io::NpyArray& a, const std::string& name, const std::vector<int64_t>& want) {
  if (a.shape != want)
    throw std::invalid_argument(name + " has shape " + shape_str(a.shape) + " but " + shape_str(want) +
                                " was expected");
}

}  // namespace

LayerCase LayerCase::from_npz(const io::NpzArchive& npz, const io::KimiLinearConfig& cfg) {
  LayerCase c;
  auto it = npz.find("hidden_states");
  if (it == npz.end()) throw std::invalid_argument("the case has no 'hidden_states' array");
  const auto& hs = it->second;
  if (hs.shape.size() != 2)
    throw std::invalid_argument("hidden_states must be 2-D [T, D], got " + shape_str(hs.shape));
  if (hs.shape[1] != cfg.hidden_size)
    throw std::invalid_argument("hidden_states has width " + std::to_string(hs.shape[1]) +
                                " but the model's hidden_size is " + std::to_string(cfg.hidden_size));
  c.T = hs.shape[0];
  c.D = hs.shape[1];
  c.hidden_states = hs.to_f32();
  if (auto cu = npz.find("cu_seqlens"); cu != npz.end()) {
    if (cu->second.shape.size() != 1 || cu->second.shape[0] < 2)
      throw std::invalid_argument("cu_seqlens must be 1-D with at least 2 entries, got " +
                                  shape_str(cu->second.shape));
    c.cu_seqlens = cu->second.to_i32();
  } else {
    if (c.T > INT32_MAX) throw std::invalid_argument("hidden_states has more than 2^31 rows");
    c.cu_seqlens = {0, static_cast<int32_t>(c.T)};
  }
  c.N = static_cast<int64_t>(c.cu_seqlens.size()) - 1;
  if (c.cu_seqlens[0] != 0)
    throw std::invalid_argument("cu_seqlens must start at 0, got " + std::to_string(c.cu_seqlens[0]));
  for (int64_t i = 0; i < c.N; ++i)
    if (c.cu_seqlens[i + 1] < c.cu_seqlens[i])
      throw std::invalid_argument("cu_seqlens is not monotonic at index " + std::to_string(i + 1) + ": " +
                                  std::to_string(c.cu_seqlens[i]) + " then " +
                                  std::to_string(c.cu_seqlens[i + 1]));
  if (c.cu_seqlens[c.N] != c.T)
    throw std::invalid_argument("cu_seqlens ends at " + std::to_string(c.cu_seqlens[c.N]) +
                                " but hidden_states has " + std::to_string(c.T) + " rows");
  const int64_t H = cfg.num_heads, K = cfg.head_dim, P = cfg.projection_size(),
                W = cfg.short_conv_kernel_size;
  if (auto r = npz.find("initial_recurrent_state"); r != npz.end()) {
    expect_shape(r->second, "initial_recurrent_state", {c.N, H, K, K});
    c.initial_recurrent_state = r->second.to_f32();
  }
  if (auto r = npz.find("initial_conv_state"); r != npz.end()) {
    expect_shape(r->second, "initial_conv_state", {c.N, W - 1, 3 * P});
    c.initial_conv_state = r->second.to_f32();
  }
  return c;
}

mem_cache::RecurrentStatePoolConfig layer_pool_config(const models::KimiDeltaAttention& layer,
                                                      const io::KimiLinearConfig& cfg, int64_t slots) {
  const int K = cfg.head_dim;
  const int Hl = static_cast<int>(layer.local_heads());  // this rank's heads (all without TP)
  mem_cache::RecurrentStatePoolConfig pc;
  pc.layer_ids = {layer.layer_idx()};
  pc.size = slots;
  pc.num_heads = Hl;
  pc.head_k_dim = K;
  pc.head_v_dim = K;
  pc.conv_kernel = cfg.short_conv_kernel_size;
  pc.conv_dim = int64_t{3} * Hl * K;
  pc.conv_dtype = layer.precision();
  return pc;
}

LayerResult run_layer_case(models::KimiDeltaAttention& layer, const io::KimiLinearConfig& cfg,
                           const LayerCase& c, int decode_tail, kernels::KernelImpl kernel) {
  if (decode_tail < 0) throw std::invalid_argument("--decode-tail must be >= 0");
  if (c.D != layer.hidden_size())
    throw std::invalid_argument("hidden_states has width " + std::to_string(c.D) +
                                " but the layer's hidden size is " + std::to_string(layer.hidden_size()));
  const int64_t N = c.N, D = c.D;
  const int K = cfg.head_dim, W = cfg.short_conv_kernel_size;
  const int Hl = static_cast<int>(layer.local_heads());  // this rank's heads (all without TP)
  const int id = layer.layer_idx();
  const auto& tp = layer.tp();
  const distributed::StateDims dims{N, cfg.num_heads, K, K, W - 1};

  // The pool holds this rank's heads and channels only.
  const mem_cache::RecurrentStatePoolConfig pc = layer_pool_config(layer, cfg, std::max<int64_t>(N, 1));
  mem_cache::MemoryPools pools(pc, pc.size);
  auto& pool = pools.recurrent_state_pool;
  const std::vector<int32_t> reqs = pools.req_to_token_pool.alloc(N);
  const std::vector<int32_t> slots = pools.req_to_token_pool.get_recurrent_indices(reqs);
  const bool has_init = !c.initial_recurrent_state.empty() || !c.initial_conv_state.empty();
  if (has_init) {
    std::vector<float> rec = c.initial_recurrent_state, conv = c.initial_conv_state;
    if (tp.size > 1) {
      if (!rec.empty()) rec = distributed::shard_recurrent(rec, dims, tp.rank, tp.size);
      if (!conv.empty()) conv = distributed::shard_conv(conv, dims, tp.rank, tp.size);
    }
    pool.set_linear_recurrent_layer_cache(id, slots, rec.empty() ? nullptr : rec.data(),
                                          conv.empty() ? nullptr : conv.data());
  }

  layers::attention::linear::KDAAttnBackend backend(kernel);
  LayerResult res;
  res.out.assign(static_cast<size_t>(c.T * D), 0.0f);

  // EXTEND of each sequence's first T_i - k_i tokens. A state placed in the slot stands for an earlier
  // prefix, so such requests carry a non-zero prefix length.
  std::vector<int32_t> ext_len(N), tail(N);
  for (int64_t i = 0; i < N; ++i) {
    tail[i] = std::min<int32_t>(decode_tail, c.seq_len(i));
    ext_len[i] = c.seq_len(i) - tail[i];
  }
  {
    std::vector<float> x, y;
    for (int64_t i = 0; i < N; ++i)
      x.insert(x.end(), c.hidden_states.begin() + c.cu_seqlens[i] * D,
               c.hidden_states.begin() + (c.cu_seqlens[i] + ext_len[i]) * D);
    const int64_t Te = static_cast<int64_t>(x.size()) / D;
    y.resize(x.size());
    auto fb = model_executor::ForwardBatch::extend(reqs, ext_len, std::vector<int32_t>(N, has_init ? 1 : 0));
    fb.attn_backend = &backend;
    backend.init_forward_metadata(fb, slots);
    layer.forward(x.data(), Te, fb, pool, y.data());
    int64_t row = 0;
    for (int64_t i = 0; i < N; ++i) {
      if (ext_len[i] > 0)
        std::memcpy(res.out.data() + c.cu_seqlens[i] * D, y.data() + row * D, sizeof(float) * ext_len[i] * D);
      row += ext_len[i];
    }
  }
  // DECODE steps: step j runs token T_i - k_i + j of every sequence with k_i > j.
  const int32_t steps = N ? *std::max_element(tail.begin(), tail.end()) : 0;
  for (int32_t j = 0; j < steps; ++j) {
    std::vector<int32_t> active_reqs, active_slots;
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < N; ++i) {
      if (tail[i] <= j) continue;
      active_reqs.push_back(reqs[i]);
      active_slots.push_back(slots[i]);
      rows.push_back(c.cu_seqlens[i] + ext_len[i] + j);
    }
    const int64_t B = static_cast<int64_t>(rows.size());
    std::vector<float> x(B * D), y(B * D);
    for (int64_t r = 0; r < B; ++r)
      std::memcpy(x.data() + r * D, c.hidden_states.data() + rows[r] * D, sizeof(float) * D);
    auto fb = model_executor::ForwardBatch::decode(active_reqs);
    fb.attn_backend = &backend;
    backend.init_forward_metadata(fb, active_slots);
    layer.forward(x.data(), B, fb, pool, y.data());
    for (int64_t r = 0; r < B; ++r)
      std::memcpy(res.out.data() + rows[r] * D, y.data() + r * D, sizeof(float) * D);
  }

  res.recurrent_state.resize(static_cast<size_t>(N * Hl * K * K));
  res.conv_state.resize(static_cast<size_t>(N * (W - 1) * 3 * Hl * K));
  pool.read_linear_recurrent_layer_cache(id, slots, res.recurrent_state.data(), res.conv_state.data());
  if (tp.size > 1) {  // every rank returns the whole states
    std::vector<float> rec(res.recurrent_state.size() * tp.size), conv(res.conv_state.size() * tp.size);
    tp.comm->allgather(res.recurrent_state.data(), res.recurrent_state.size(), rec.data());
    tp.comm->allgather(res.conv_state.data(), res.conv_state.size(), conv.data());
    res.recurrent_state = distributed::unshard_recurrent(rec, dims, tp.size);
    res.conv_state = distributed::unshard_conv(conv, dims, tp.size);
  }
  return res;
}

}  // namespace kda::runtime
