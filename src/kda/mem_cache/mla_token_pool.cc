#include "kda/mem_cache/mla_token_pool.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kda/common/allocator.h"
#include "kda/mem_cache/slot_checks.h"

namespace kda::mem_cache {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

MLATokenToKVPool::MLATokenToKVPool(const MLATokenToKVPoolConfig& cfg) : cfg_(cfg) {
  configure_allocator();
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0)
      throw std::invalid_argument(std::string("MLATokenToKVPoolConfig.") + field + " must be > 0, got " +
                                  str(v));
  };
  positive(cfg.size, "size");
  if (cfg.size >= INT32_MAX)  // slots are int32 indices
    throw std::invalid_argument("MLATokenToKVPoolConfig.size must be < 2^31 - 1, got " + str(cfg.size));
  positive(cfg.kv_lora_rank, "kv_lora_rank");
  positive(cfg.qk_rope_head_dim, "qk_rope_head_dim");
  if (cfg.layer_ids.empty())
    throw std::invalid_argument("MLATokenToKVPoolConfig.layer_ids must not be empty");
  for (size_t i = 0; i < cfg.layer_ids.size(); ++i) {
    if (cfg.layer_ids[i] < 0)
      throw std::invalid_argument("MLATokenToKVPoolConfig.layer_ids has a negative id " +
                                  str(cfg.layer_ids[i]));
    for (size_t j = 0; j < i; ++j)
      if (cfg.layer_ids[j] == cfg.layer_ids[i])
        throw std::invalid_argument("MLATokenToKVPoolConfig.layer_ids lists layer " + str(cfg.layer_ids[i]) +
                                    " twice");
  }
  row_ = static_cast<int64_t>(cfg.kv_lora_rank) + cfg.qk_rope_head_dim;
  const int64_t elems = static_cast<int64_t>(cfg.layer_ids.size()) * (cfg.size + 1) * row_;
  if (cfg.dtype == Precision::BF16)
    kv_bf16_.assign(static_cast<size_t>(elems), bf16_t{0});
  else
    kv_f32_.assign(static_cast<size_t>(elems), 0.0f);
  refs_.assign(static_cast<size_t>(cfg.size + 1), 0);
  // Pushed high to low so that the first allocations hand out 1, 2, 3, ...
  free_slots_.reserve(static_cast<size_t>(cfg.size));
  for (int64_t s = cfg.size; s >= 1; --s) free_slots_.push_back(static_cast<int32_t>(s));
}

size_t MLATokenToKVPool::bytes() const {
  return kv_f32_.size() * sizeof(float) + kv_bf16_.size() * sizeof(bf16_t);
}

int64_t MLATokenToKVPool::bytes_per_token() const {
  const int64_t elem = cfg_.dtype == Precision::BF16 ? sizeof(bf16_t) : sizeof(float);
  return num_layers() * row_ * elem;
}

std::vector<int32_t> MLATokenToKVPool::alloc(int64_t n) {
  if (n < 0) throw std::invalid_argument("MLATokenToKVPool::alloc: n must be >= 0, got " + str(n));
  if (n > available())
    throw std::runtime_error("MLA KV pool exhausted: asked for " + str(n) + " token slots, " +
                             str(available()) + " of " + str(cfg_.size) + " free");
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = free_slots_.back();
    free_slots_.pop_back();
    refs_[static_cast<size_t>(s)] = 1;
    out.push_back(s);
  }
  return out;
}

void MLATokenToKVPool::free(std::span<const int32_t> slots) {
  for (const int32_t s : slots) check_slot(s, "MLATokenToKVPool::free");
  check_unique(slots, "MLATokenToKVPool::free: slot");
  // Pushed in reverse so that a following alloc(slots.size()) hands them back in the same order.
  for (auto it = slots.rbegin(); it != slots.rend(); ++it)
    if (--refs_[static_cast<size_t>(*it)] == 0) free_slots_.push_back(*it);
}

void MLATokenToKVPool::inc_ref(std::span<const int32_t> slots) {
  for (const int32_t s : slots) check_slot(s, "MLATokenToKVPool::inc_ref");
  check_unique(slots, "MLATokenToKVPool::inc_ref: slot");
  for (const int32_t s : slots) ++refs_[static_cast<size_t>(s)];
}

bool MLATokenToKVPool::is_allocated(int32_t slot) const {
  return slot >= 1 && slot <= cfg_.size && refs_[static_cast<size_t>(slot)] != 0;
}

int32_t MLATokenToKVPool::ref_count(int32_t slot) const {
  if (slot < 0 || slot > cfg_.size)
    throw std::invalid_argument("MLATokenToKVPool::ref_count: token slot " + str(slot) +
                                " is out of range [0, " + str(cfg_.size) + "]");
  return refs_[static_cast<size_t>(slot)];
}

void MLATokenToKVPool::check_slot(int32_t slot, const char* what) const {
  if (slot == 0) throw std::invalid_argument(std::string(what) + ": token slot 0 is reserved");
  if (slot < 0 || slot > cfg_.size)
    throw std::invalid_argument(std::string(what) + ": token slot " + str(slot) + " is out of range [1, " +
                                str(cfg_.size) + "]");
  if (refs_[static_cast<size_t>(slot)] == 0)
    throw std::invalid_argument(std::string(what) + ": token slot " + str(slot) + " is not allocated");
}

int MLATokenToKVPool::layer_index(int layer_id) const {
  for (size_t i = 0; i < cfg_.layer_ids.size(); ++i)
    if (cfg_.layer_ids[i] == layer_id) return static_cast<int>(i);
  std::string ids;
  for (const int id : cfg_.layer_ids) ids += (ids.empty() ? "" : ", ") + str(id);
  throw std::invalid_argument("MLATokenToKVPool: layer " + str(layer_id) +
                              " has no KV cache (MLA layer ids: " + ids + ")");
}

MLAKVLayerView MLATokenToKVPool::get_kv_buffer(int layer_id) {
  const int64_t l = layer_index(layer_id);
  const int64_t off = l * (cfg_.size + 1) * row_;
  MLAKVLayerView v;
  v.layer_id = layer_id;
  if (!kv_f32_.empty()) v.kv_f32 = kv_f32_.data() + off;
  if (!kv_bf16_.empty()) v.kv_bf16 = kv_bf16_.data() + off;
  v.num_slots = cfg_.size + 1;
  v.row_elems = row_;
  return v;
}

void MLATokenToKVPool::set_kv(int layer_id, std::span<const int32_t> slots, const float* ckv,
                              const float* kpe) {
  const int64_t l = layer_index(layer_id);
  for (const int32_t s : slots) check_slot(s, "MLATokenToKVPool::set_kv");
  check_unique(slots, "MLATokenToKVPool::set_kv: slot");
  if (!slots.empty() && (!ckv || !kpe))
    throw std::invalid_argument("MLATokenToKVPool::set_kv: null ckv or kpe");
  const int64_t R = cfg_.kv_lora_rank, r = cfg_.qk_rope_head_dim;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t off = (l * (cfg_.size + 1) + slots[i]) * row_;
    if (!kv_f32_.empty()) {
      std::copy_n(ckv + i * R, R, kv_f32_.begin() + off);
      std::copy_n(kpe + i * r, r, kv_f32_.begin() + off + R);
    } else {
      f32_to_bf16_array(ckv + i * R, kv_bf16_.data() + off, static_cast<size_t>(R));
      f32_to_bf16_array(kpe + i * r, kv_bf16_.data() + off + R, static_cast<size_t>(r));
    }
  }
}

void MLATokenToKVPool::read_kv(int layer_id, std::span<const int32_t> slots, float* ckv, float* kpe) const {
  const int64_t l = layer_index(layer_id);
  for (const int32_t s : slots) check_slot(s, "MLATokenToKVPool::read_kv");
  const int64_t R = cfg_.kv_lora_rank, r = cfg_.qk_rope_head_dim;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t off = (l * (cfg_.size + 1) + slots[i]) * row_;
    if (!kv_f32_.empty()) {
      if (ckv) std::copy_n(kv_f32_.begin() + off, R, ckv + i * R);
      if (kpe) std::copy_n(kv_f32_.begin() + off + R, r, kpe + i * r);
    } else {
      if (ckv) bf16_to_f32_array(kv_bf16_.data() + off, ckv + i * R, static_cast<size_t>(R));
      if (kpe) bf16_to_f32_array(kv_bf16_.data() + off + R, kpe + i * r, static_cast<size_t>(r));
    }
  }
}

void MLATokenToKVPool::copy_tokens(std::span<const int32_t> src, std::span<const int32_t> dst) {
  if (src.size() != dst.size())
    throw std::invalid_argument("MLATokenToKVPool::copy_tokens: " + str(static_cast<int64_t>(src.size())) +
                                " source slots for " + str(static_cast<int64_t>(dst.size())) +
                                " destinations");
  for (const int32_t s : src) check_slot(s, "MLATokenToKVPool::copy_tokens (src)");
  for (const int32_t s : dst) check_slot(s, "MLATokenToKVPool::copy_tokens (dst)");
  check_unique(dst, "MLATokenToKVPool::copy_tokens: destination slot");
  std::vector<int32_t> both(src.begin(), src.end());
  both.insert(both.end(), dst.begin(), dst.end());
  std::sort(both.begin(), both.end());
  both.erase(std::unique(both.begin(), both.end()), both.end());
  std::vector<int32_t> src_sorted(src.begin(), src.end());
  std::sort(src_sorted.begin(), src_sorted.end());
  src_sorted.erase(std::unique(src_sorted.begin(), src_sorted.end()), src_sorted.end());
  if (both.size() != src_sorted.size() + dst.size())
    throw std::invalid_argument("MLATokenToKVPool::copy_tokens: a destination slot is also a source");
  const int64_t rows = cfg_.size + 1;
  for (int64_t l = 0; l < num_layers(); ++l) {
    for (size_t i = 0; i < src.size(); ++i) {
      const int64_t s = (l * rows + src[i]) * row_, d = (l * rows + dst[i]) * row_;
      if (!kv_f32_.empty()) std::copy_n(kv_f32_.begin() + s, row_, kv_f32_.begin() + d);
      if (!kv_bf16_.empty()) std::copy_n(kv_bf16_.begin() + s, row_, kv_bf16_.begin() + d);
    }
  }
}

}  // namespace kda::mem_cache
