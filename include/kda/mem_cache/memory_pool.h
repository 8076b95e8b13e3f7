// Recurrent state memory (the RFC's RFC-0015 part): per-request slots holding every KDA layer's
// recurrent state and conv state, the request -> slot mapping, and the slot lifecycle.
//
//   recurrent buffer  fp32            [L, N+1, H, K, V]
//   conv buffer       fp32 or bf16    [L, N+1, W-1, C]   (C = 3P: raw pre-conv q||k||v inputs)
//
// Speculative decoding (TARGET_VERIFY) keeps, per KDA layer, for each of up to R batch rows and
// Tv = max_verify_tokens (d_max + 1) tokens, the token's raw conv input (C, as the conv state keeps it),
// its conv output q||k||v (C), its raw forget gate (H*K) and beta (H): the inputs of the recurrence,
// which accept replays for the accepted tokens only (see KDAAttnBackend::accept for why inputs and not
// the d_max + 1 per-position states). That verify buffer [L, R, Tv, 2C + H*K + H] fp32 belongs to the
// backend that ran the verify batch, not to the pool, so that backends verifying disjoint slots of one
// pool cannot overwrite each other's kept inputs; the pool's config sets its limits (R, Tv) and
// spec_state_bytes() what one backend's buffer takes.
//
// Slot 0 is reserved (never handed out: a padded row or a dummy request may point at it), so a pool of
// `size` usable slots has size + 1 rows. Every error is a std::invalid_argument / std::runtime_error
// naming what is wrong, thrown before anything changes.
//
// Each slot has a generation: a counter that moves whenever the slot's state may change (alloc, free,
// copy_slot into it, set_linear_recurrent_layer_cache, and every forward that writes it, through
// mark_written). A backend's pending verify records its slots' generations and its accept refuses a
// slot whose generation moved since: the drafts were verified against a state that is gone.
//
// Thread safety: not thread-safe, like a serving engine's scheduler that owns them. alloc, free, fork,
// copy_slot and set_linear_recurrent_layer_cache change the pools and must not overlap any other call on
// the same pools or a forward that uses them; the const queries may run together (and beside forwards,
// on other slots than theirs). Layer forwards (and kernels) on disjoint slots of one pool may run at
// once: they touch only their batch's slots (mark_written and slot_generation included).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/precision.h"
#include "kda/mem_cache/mla_token_pool.h"

namespace kda::mem_cache {

struct RecurrentStatePoolConfig {
  std::vector<int> layer_ids;              // decoder layer ids (0-based) of the KDA layers, in pool order
  int64_t size = 0;                        // usable slots N (rows 1..N)
  int num_heads = 0;                       // H (per rank under TP)
  int head_k_dim = 0;                      // K
  int head_v_dim = 0;                      // V
  int conv_kernel = 4;                     // W
  int64_t conv_dim = 0;                    // C = channels of the conv state (3P per rank)
  Precision conv_dtype = Precision::FP32;  // fp32 mode: fp32 conv state; bf16 mode: bf16
  // Speculative decoding (TARGET_VERIFY): tokens one verify row may hold (the last accepted token and up to
  // max_verify_tokens - 1 drafts; 0: no verify buffer, TARGET_VERIFY is an error), and rows of a verify
  // batch (0: `size`, one per request slot). The limits of each backend's verify buffer.
  int max_verify_tokens = 0;
  int64_t verify_rows = 0;
};

// One layer's view of the pool: raw pointers into the pool buffers, valid while the pool lives.
struct LinearRecurrentLayerCache {
  int layer_id = 0;
  float* recurrent = nullptr;        // [N+1, H, K, V]
  float* conv_f32 = nullptr;         // [N+1, W-1, C] when the conv dtype is fp32, else null
  bf16_t* conv_bf16 = nullptr;       // [N+1, W-1, C] when the conv dtype is bf16, else null
  int64_t num_slots = 0;             // N+1 rows, slot 0 included
  int64_t recurrent_slot_elems = 0;  // H*K*V
  int64_t conv_slot_elems = 0;       // (W-1)*C
  // The limits of a backend's verify buffer for this layer: [verify_rows, verify_tokens,
  // verify_token_elems] fp32 (verify_tokens 0: TARGET_VERIFY is an error).
  int64_t verify_rows = 0;
  int64_t verify_tokens = 0;
  int64_t verify_token_elems = 0;  // 2C + H*K + H: raw conv input | conv output | gate | beta
};

class RecurrentStatePool {
 public:
  // Also fixes the C library's mmap threshold, once per process (kda/common/allocator.h).
  explicit RecurrentStatePool(const RecurrentStatePoolConfig& cfg);

  const RecurrentStatePoolConfig& config() const { return cfg_; }
  int64_t size() const { return cfg_.size; }
  int64_t available() const { return static_cast<int64_t>(free_slots_.size()); }
  int num_layers() const { return static_cast<int>(cfg_.layer_ids.size()); }
  size_t bytes() const;  // the recurrent and conv buffers
  // A backend's verify buffer (speculative decoding) for every layer of this pool: what admission adds
  // for TARGET_VERIFY, per backend that verifies on the pool.
  size_t spec_state_bytes() const;
  size_t total_bytes() const { return bytes() + spec_state_bytes(); }
  // fp32 elements the verify buffer keeps per token and layer: 2C + H*K + H.
  static int64_t verify_token_elems(int64_t conv_dim, int64_t num_heads, int64_t head_k_dim) {
    return 2 * conv_dim + num_heads * head_k_dim + num_heads;
  }
  // One slot's state in every layer (recurrent + conv): what a request or a cached snapshot costs.
  size_t bytes_per_slot() const;

  // All or nothing: n slots, each cleared (recurrent and conv state zero in every layer), or
  // std::runtime_error "recurrent state pool exhausted ..." with nothing taken.
  std::vector<int32_t> alloc(int64_t n);
  // Returns slots to the free list. Unknown, reserved or already-free slots: error, nothing freed.
  void free(std::span<const int32_t> slots);
  bool is_allocated(int32_t slot) const;

  // Copies every layer's recurrent and conv state of `src` into `dst` (forking a request).
  void copy_slot(int32_t src, int32_t dst);

  // The slot's generation (see above); slot in [0, N].
  uint64_t slot_generation(int32_t slot) const;
  // A forward is about to write these slots' states (-1, a padded row, is skipped; every other slot was
  // range-checked by the caller). Disjoint slots may be marked from several threads at once.
  void mark_written(std::span<const int32_t> slots);

  // Per-layer views, by decoder layer id (unknown id: error).
  LinearRecurrentLayerCache get_linear_recurrent_layer_cache(int layer_id);
  // Writes states into the given slots of one layer: recurrent [n, H, K, V] and conv [n, W-1, C]
  // fp32 (rounded to bf16 when the conv buffer is bf16); either may be null to leave it as it is.
  void set_linear_recurrent_layer_cache(int layer_id, std::span<const int32_t> slots, const float* recurrent,
                                        const float* conv);
  // Reads one layer's states of the given slots into fp32 arrays of the same shapes (either may be
  // null).
  void read_linear_recurrent_layer_cache(int layer_id, std::span<const int32_t> slots, float* recurrent,
                                         float* conv) const;

 private:
  int layer_index(int layer_id) const;
  void check_slot(int32_t slot, const char* what) const;
  void clear_slot(int32_t slot);
  void bump(int32_t slot) { ++generation_[static_cast<size_t>(slot)]; }

  RecurrentStatePoolConfig cfg_;
  int64_t rec_slot_ = 0, conv_slot_ = 0;  // elements per slot
  std::vector<float> recurrent_;
  std::vector<float> conv_f32_;
  std::vector<bf16_t> conv_bf16_;
  int64_t verify_rows_ = 0, verify_token_ = 0;  // a verify buffer's rows per layer, elements per token
  std::vector<uint64_t> generation_;            // [N+1]
  std::vector<int32_t> free_slots_;             // LIFO free list
  std::vector<uint8_t> allocated_;              // [N+1]
};

// Request index -> recurrent slot, and (with an MLA KV pool) -> the request's token slots in position order.
// A request keeps its recurrent slot from alloc until free, across every chunked-prefill and decode step in
// between; its token slots grow with alloc_tokens (one per token a step adds) and shrink with
// truncate_tokens (speculative reject, a failed step's rollback). Without a KV pool (KDA-only models) only
// the sequence lengths are kept.
class HybridReqToTokenPool {
 public:
  HybridReqToTokenPool(int64_t max_requests, RecurrentStatePool& recurrent_pool,
                       MLATokenToKVPool* token_to_kv_pool = nullptr);

  int64_t size() const { return max_requests_; }
  int64_t available() const { return static_cast<int64_t>(free_reqs_.size()); }

  // n request indices, each bound to a fresh cleared slot and no token slots; all or nothing.
  std::vector<int32_t> alloc(int64_t n);
  // Frees the requests, their recurrent slots and their token slots; unknown index: error, nothing freed.
  void free(std::span<const int32_t> req_pool_indices);
  // A new request whose state is a copy of `parent`'s (parallel sampling): a copy of its recurrent slot
  // and the parent's token slots shared by reference (inc_ref: the rows before the fork point are never
  // written again, so both read the same rows and each writes only slots it allocates later). All or
  // nothing: an error when a request or a recurrent slot is short.
  int32_t fork(int32_t parent_req_pool_index);
  // A fresh request (no tokens yet) starts with `slots` as its positions [0, n) by reference (inc_ref
  // each; a prefix-cache hit's KV); its length becomes n. A request that holds tokens already, a slot the
  // pool has not handed out or listed twice, or no KV pool (alloc_tokens moves a KDA-only request's
  // length): error, nothing changed.
  void share_tokens(int32_t req_pool_index, std::span<const int32_t> slots);

  // The RFC's get_recurrent_indices: slot per request index; -1 stays -1 (padded row).
  std::vector<int32_t> get_recurrent_indices(std::span<const int32_t> req_pool_indices) const;
  int32_t slot_of(int32_t req_pool_index) const;

  // The request's token slots in position order (empty without a KV pool); its length in tokens.
  std::span<const int32_t> req_to_token(int32_t req_pool_index) const;
  int64_t seq_len(int32_t req_pool_index) const;
  // Appends lens[i] token slots to request reqs[i] (-1 rows skipped) -- all or nothing over the whole
  // batch: a too-small KV pool is a std::runtime_error naming the need and what is free, nothing taken.
  // Without a KV pool only the lengths move.
  void alloc_tokens(std::span<const int32_t> reqs, std::span<const int32_t> lens);
  // Frees the request's token slots past position len (0 <= len <= seq_len) and sets its length to len.
  void truncate_tokens(int32_t req_pool_index, int64_t len);
  // Speculative accept (a tree's accepted path): of the request's tokens past position `committed` (a
  // verify row's), keeps those at offsets kept[0], kept[1], ... (in that order: they become positions
  // committed, committed + 1, ...) and frees the rest; the length becomes committed + kept.size(). An
  // offset outside the row or listed twice: error, nothing changed. A chain's accept is truncate_tokens.
  void accept_tokens(int32_t req_pool_index, int64_t committed, std::span<const int32_t> kept);

  RecurrentStatePool& recurrent_pool() { return *rec_; }
  MLATokenToKVPool* token_to_kv_pool() { return kv_; }
  const MLATokenToKVPool* token_to_kv_pool() const { return kv_; }

 private:
  void check_req(int32_t r) const;
  int64_t max_requests_;
  RecurrentStatePool* rec_;
  MLATokenToKVPool* kv_;
  std::vector<int32_t> req_to_slot_;                // -1 when free
  std::vector<std::vector<int32_t>> req_to_token_;  // token slots per request (with a KV pool)
  std::vector<int64_t> seq_len_;
  std::vector<int32_t> free_reqs_;
};

// The pools a model runner holds (the RFC's memory_pool argument): the KDA layers' recurrent states and
// (when the model has MLA layers and kv.size > 0) the MLA layers' token-level KV cache.
struct MemoryPools {
  RecurrentStatePool recurrent_state_pool;
  std::unique_ptr<MLATokenToKVPool> token_to_kv_pool;  // null when kv.size == 0 or no MLA layer
  HybridReqToTokenPool req_to_token_pool;

  MemoryPools(const RecurrentStatePoolConfig& cfg, int64_t max_requests,
              const MLATokenToKVPoolConfig& kv = {})
      : recurrent_state_pool(cfg),
        token_to_kv_pool(kv.size > 0 && !kv.layer_ids.empty() ? std::make_unique<MLATokenToKVPool>(kv)
                                                              : nullptr),
        req_to_token_pool(max_requests, recurrent_state_pool, token_to_kv_pool.get()) {}
  MemoryPools(const MemoryPools&) = delete;
  MemoryPools& operator=(const MemoryPools&) = delete;
};

}  // namespace kda::mem_cache
