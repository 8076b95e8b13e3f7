// The MLA layers' token-level KV cache (sglang's MLATokenToKVPool): one row per token slot and MLA layer
// holding the token's latent cache entry, c_hat (kv_lora_rank values, the normed latent) then k_pe
// (qk_rope_head_dim values, shared by every head): 576 values per token and layer for the 48B model.
//
//   kv buffer   fp32 or bf16   [L, N+1, R + r]
//
// Slot 0 is reserved (as in sglang: a padded row may point at it) and never handed out, so a pool of
// `size` usable slots has size + 1 rows per layer. A request owns one slot per token of its sequence
// (HybridReqToTokenPool maps it); the slots need not be contiguous.
//
// Slots are reference counted, so that requests and the prefix cache (RadixCache) may hold one token's
// KV rows at once: alloc hands a slot out with one reference, inc_ref adds one, free drops one and the
// slot returns to the free list when its count reaches 0. Nobody writes the rows of a slot that another
// holder references (a request writes only the slots it allocated for its own new tokens).
//
// alloc does not clear the rows it hands out: a forward writes a step's new tokens' rows before any read
// of them, so a freed slot's stale data is never attended to (the tests poison freed rows to check it).
//
// Every error is a std::invalid_argument / std::runtime_error naming what is wrong, thrown before anything
// changes. Not thread-safe: alloc, free and copy_tokens must not overlap other calls on the pool; layer
// forwards on disjoint slots may run at once (each writes only its batch's rows).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/precision.h"

namespace kda::mem_cache {

struct MLATokenToKVPoolConfig {
  std::vector<int> layer_ids;         // the MLA decoder layer ids (0-based), in pool order
  int64_t size = 0;                   // usable token slots (rows 1..size; row 0 reserved)
  int kv_lora_rank = 0;               // R
  int qk_rope_head_dim = 0;           // r; a row is R + r values: c_hat then k_pe
  Precision dtype = Precision::FP32;  // fp32 mode: fp32 cache; bf16 mode: bf16 (the spec's rounding point)
};

// One layer's rows: [num_slots, row_elems], slot 0 included; kv_f32 or kv_bf16 is set (the pool's dtype).
struct MLAKVLayerView {
  int layer_id = 0;
  float* kv_f32 = nullptr;
  bf16_t* kv_bf16 = nullptr;
  int64_t num_slots = 0;
  int64_t row_elems = 0;
};

class MLATokenToKVPool {
 public:
  explicit MLATokenToKVPool(const MLATokenToKVPoolConfig& cfg);

  const MLATokenToKVPoolConfig& config() const { return cfg_; }
  int64_t size() const { return cfg_.size; }
  int64_t available() const { return static_cast<int64_t>(free_slots_.size()); }
  int num_layers() const { return static_cast<int>(cfg_.layer_ids.size()); }
  int64_t row_elems() const { return row_; }
  size_t bytes() const;             // the whole buffer
  int64_t bytes_per_token() const;  // one token over every layer

  // All or nothing: n token slots, or std::runtime_error "MLA KV pool exhausted: ..." with nothing taken.
  std::vector<int32_t> alloc(int64_t n);
  // Drops one reference of each slot; a slot whose count reaches 0 returns to the free list. Unknown,
  // reserved, already-free or repeated slots: error, nothing dropped.
  void free(std::span<const int32_t> slots);
  // Adds one reference to each allocated slot (sharing its rows). Unknown, reserved, free or repeated
  // slots: error, nothing added.
  void inc_ref(std::span<const int32_t> slots);
  bool is_allocated(int32_t slot) const;
  int32_t ref_count(int32_t slot) const;  // 0 for a free slot; out of range: error

  // The rows of one layer, by decoder layer id (unknown id: error).
  MLAKVLayerView get_kv_buffer(int layer_id);
  // Writes rows of one layer: ckv [n, R] and kpe [n, r] fp32 (rounded to bf16 in a bf16 pool).
  void set_kv(int layer_id, std::span<const int32_t> slots, const float* ckv, const float* kpe);
  // Reads rows of one layer into fp32 ckv [n, R] and kpe [n, r] (either may be null).
  void read_kv(int layer_id, std::span<const int32_t> slots, float* ckv, float* kpe) const;
  // Copies every layer's row of src[i] into dst[i] (forking a request). Sizes must match; every slot
  // allocated; a dst listed twice or also among the sources is an error.
  void copy_tokens(std::span<const int32_t> src, std::span<const int32_t> dst);

 private:
  int layer_index(int layer_id) const;
  void check_slot(int32_t slot, const char* what) const;

  MLATokenToKVPoolConfig cfg_;
  int64_t row_ = 0;  // R + r
  std::vector<float> kv_f32_;
  std::vector<bf16_t> kv_bf16_;
  std::vector<int32_t> free_slots_;  // LIFO free list
  std::vector<int32_t> refs_;        // [N+1]: references; 0 = free
};

}  // namespace kda::mem_cache
