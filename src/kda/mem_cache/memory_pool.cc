#include "kda/mem_cache/memory_pool.h"

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

// ---------------------------------------------------------------------------------------------------------
// RecurrentStatePool

RecurrentStatePool::RecurrentStatePool(const RecurrentStatePoolConfig& cfg) : cfg_(cfg) {
  configure_allocator();  // resident memory stays flat over a long run (common/allocator.h)
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0) {
      throw std::invalid_argument(std::string("RecurrentStatePoolConfig.") + field + " must be > 0, got " +
                                  str(v));
    }
  };
  positive(cfg.size, "size");
  if (cfg.size >= INT32_MAX) {  // slots are int32 indices
    throw std::invalid_argument("RecurrentStatePoolConfig.size must be < 2^31 - 1, got " + str(cfg.size));
  }
  positive(cfg.num_heads, "num_heads");
  positive(cfg.head_k_dim, "head_k_dim");
  positive(cfg.head_v_dim, "head_v_dim");
  positive(cfg.conv_dim, "conv_dim");
  if (cfg.conv_kernel < 1) {
    throw std::invalid_argument("RecurrentStatePoolConfig.conv_kernel must be >= 1, got " +
                                str(cfg.conv_kernel));
  }
  if (cfg.layer_ids.empty())
    throw std::invalid_argument("RecurrentStatePoolConfig.layer_ids must not be empty");
  for (size_t i = 0; i < cfg.layer_ids.size(); ++i) {
    const int id = cfg.layer_ids[i];
    if (id < 0)
      throw std::invalid_argument("RecurrentStatePoolConfig.layer_ids has a negative id " + str(id));
    for (size_t j = 0; j < i; ++j) {
      if (cfg.layer_ids[j] == id) {
        throw std::invalid_argument("RecurrentStatePoolConfig.layer_ids lists layer " + str(id) + " twice");
      }
    }
  }

  rec_slot_ = static_cast<int64_t>(cfg.num_heads) * cfg.head_k_dim * cfg.head_v_dim;
  conv_slot_ = static_cast<int64_t>(cfg.conv_kernel - 1) * cfg.conv_dim;
  const int64_t rows = static_cast<int64_t>(cfg.layer_ids.size()) * (cfg.size + 1);
  recurrent_.assign(rows * rec_slot_, 0.0f);
  if (cfg.conv_dtype == Precision::BF16) {
    conv_bf16_.assign(rows * conv_slot_, bf16_t{0});
  } else {
    conv_f32_.assign(rows * conv_slot_, 0.0f);
  }
  if (cfg.max_verify_tokens < 0 || cfg.verify_rows < 0)
    throw std::invalid_argument(
        "RecurrentStatePoolConfig.max_verify_tokens and verify_rows must be >= 0, got " +
        str(cfg.max_verify_tokens) + " and " + str(cfg.verify_rows));
  if (cfg.max_verify_tokens > 0) {
    verify_rows_ = cfg.verify_rows > 0 ? cfg.verify_rows : cfg.size;
    verify_token_ = verify_token_elems(cfg.conv_dim, cfg.num_heads, cfg.head_k_dim);
  }
  allocated_.assign(cfg.size + 1, 0);
  generation_.assign(cfg.size + 1, 0);
  // Pushed high to low so that the first allocations hand out 1, 2, 3, ...
  free_slots_.reserve(cfg.size);
  for (int64_t s = cfg.size; s >= 1; --s) free_slots_.push_back(static_cast<int32_t>(s));
}

size_t RecurrentStatePool::bytes() const {
  return recurrent_.size() * sizeof(float) + conv_f32_.size() * sizeof(float) +
         conv_bf16_.size() * sizeof(bf16_t);
}

size_t RecurrentStatePool::spec_state_bytes() const {
  return static_cast<size_t>(num_layers()) * static_cast<size_t>(verify_rows_) *
         static_cast<size_t>(cfg_.max_verify_tokens) * static_cast<size_t>(verify_token_) * sizeof(float);
}

size_t RecurrentStatePool::bytes_per_slot() const {
  const size_t conv_elem = cfg_.conv_dtype == Precision::BF16 ? sizeof(bf16_t) : sizeof(float);
  return static_cast<size_t>(num_layers()) * (rec_slot_ * sizeof(float) + conv_slot_ * conv_elem);
}

std::vector<int32_t> RecurrentStatePool::alloc(int64_t n) {
  if (n < 0) throw std::invalid_argument("RecurrentStatePool::alloc: n must be >= 0, got " + str(n));
  if (n > available()) {
    throw std::runtime_error("recurrent state pool exhausted: asked for " + str(n) + " slots, " +
                             str(available()) + " of " + str(cfg_.size) + " free");
  }
  std::vector<int32_t> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = free_slots_.back();
    free_slots_.pop_back();
    allocated_[s] = 1;
    clear_slot(s);  // a reused slot must not leak its previous request's state
    out.push_back(s);
  }
  return out;
}

void RecurrentStatePool::free(std::span<const int32_t> slots) {
  for (const int32_t s : slots) check_slot(s, "RecurrentStatePool::free");
  check_unique(slots, "RecurrentStatePool::free: slot");
  // Pushed in reverse so that a following alloc(slots.size()) hands them back in the same order.
  for (auto it = slots.rbegin(); it != slots.rend(); ++it) {
    allocated_[*it] = 0;
    bump(*it);
    free_slots_.push_back(*it);
  }
}

bool RecurrentStatePool::is_allocated(int32_t slot) const {
  return slot >= 1 && slot <= cfg_.size && allocated_[slot] != 0;
}

void RecurrentStatePool::check_slot(int32_t slot, const char* what) const {
  if (slot == 0) throw std::invalid_argument(std::string(what) + ": slot 0 is reserved");
  if (slot < 0 || slot > cfg_.size) {
    throw std::invalid_argument(std::string(what) + ": slot " + str(slot) + " is out of range [1, " +
                                str(cfg_.size) + "]");
  }
  if (!allocated_[slot])
    throw std::invalid_argument(std::string(what) + ": slot " + str(slot) + " is not allocated");
}

void RecurrentStatePool::clear_slot(int32_t slot) {
  bump(slot);
  const int64_t rows = cfg_.size + 1;
  for (int64_t l = 0; l < num_layers(); ++l) {
    const int64_t row = l * rows + slot;
    std::fill_n(recurrent_.begin() + row * rec_slot_, rec_slot_, 0.0f);
    if (!conv_f32_.empty()) std::fill_n(conv_f32_.begin() + row * conv_slot_, conv_slot_, 0.0f);
    if (!conv_bf16_.empty()) std::fill_n(conv_bf16_.begin() + row * conv_slot_, conv_slot_, bf16_t{0});
  }
}

void RecurrentStatePool::copy_slot(int32_t src, int32_t dst) {
  check_slot(src, "RecurrentStatePool::copy_slot (src)");
  check_slot(dst, "RecurrentStatePool::copy_slot (dst)");
  if (src == dst)
    throw std::invalid_argument("RecurrentStatePool::copy_slot: src and dst are both slot " + str(src));
  bump(dst);
  const int64_t rows = cfg_.size + 1;
  for (int64_t l = 0; l < num_layers(); ++l) {
    const int64_t s = l * rows + src, d = l * rows + dst;
    std::copy_n(recurrent_.begin() + s * rec_slot_, rec_slot_, recurrent_.begin() + d * rec_slot_);
    if (!conv_f32_.empty())
      std::copy_n(conv_f32_.begin() + s * conv_slot_, conv_slot_, conv_f32_.begin() + d * conv_slot_);
    if (!conv_bf16_.empty()) {
      std::copy_n(conv_bf16_.begin() + s * conv_slot_, conv_slot_, conv_bf16_.begin() + d * conv_slot_);
    }
  }
}

uint64_t RecurrentStatePool::slot_generation(int32_t slot) const {
  if (slot < 0 || slot > cfg_.size)
    throw std::invalid_argument("RecurrentStatePool::slot_generation: slot " + str(slot) +
                                " is out of range [0, " + str(cfg_.size) + "]");
  return generation_[static_cast<size_t>(slot)];
}

void RecurrentStatePool::mark_written(std::span<const int32_t> slots) {
  for (const int32_t s : slots)
    if (s >= 0 && s <= cfg_.size) bump(s);
}

int RecurrentStatePool::layer_index(int layer_id) const {
  for (size_t i = 0; i < cfg_.layer_ids.size(); ++i) {
    if (cfg_.layer_ids[i] == layer_id) return static_cast<int>(i);
  }
  std::string ids;
  for (const int id : cfg_.layer_ids) ids += (ids.empty() ? "" : ", ") + str(id);
  throw std::invalid_argument("RecurrentStatePool: layer " + str(layer_id) +
                              " has no recurrent state (KDA layer ids: " + ids + ")");
}

LinearRecurrentLayerCache RecurrentStatePool::get_linear_recurrent_layer_cache(int layer_id) {
  const int64_t l = layer_index(layer_id);
  const int64_t rows = cfg_.size + 1;
  LinearRecurrentLayerCache c;
  c.layer_id = layer_id;
  c.recurrent = recurrent_.data() + l * rows * rec_slot_;
  if (!conv_f32_.empty()) c.conv_f32 = conv_f32_.data() + l * rows * conv_slot_;
  if (!conv_bf16_.empty()) c.conv_bf16 = conv_bf16_.data() + l * rows * conv_slot_;
  c.num_slots = rows;
  c.recurrent_slot_elems = rec_slot_;
  c.conv_slot_elems = conv_slot_;
  if (cfg_.max_verify_tokens > 0) {
    c.verify_rows = verify_rows_;
    c.verify_tokens = cfg_.max_verify_tokens;
    c.verify_token_elems = verify_token_;
  }
  return c;
}

void RecurrentStatePool::set_linear_recurrent_layer_cache(int layer_id, std::span<const int32_t> slots,
                                                          const float* recurrent, const float* conv) {
  const int64_t l = layer_index(layer_id);
  for (const int32_t s : slots) check_slot(s, "RecurrentStatePool::set_linear_recurrent_layer_cache");
  check_unique(slots, "RecurrentStatePool::set_linear_recurrent_layer_cache: slot");
  const int64_t rows = cfg_.size + 1;
  for (size_t i = 0; i < slots.size(); ++i) {
    bump(slots[i]);
    const int64_t row = l * rows + slots[i];
    if (recurrent) std::copy_n(recurrent + i * rec_slot_, rec_slot_, recurrent_.begin() + row * rec_slot_);
    if (!conv) continue;
    if (!conv_f32_.empty())
      std::copy_n(conv + i * conv_slot_, conv_slot_, conv_f32_.begin() + row * conv_slot_);
    if (!conv_bf16_.empty())
      f32_to_bf16_array(conv + i * conv_slot_, conv_bf16_.data() + row * conv_slot_, conv_slot_);
  }
}

void RecurrentStatePool::read_linear_recurrent_layer_cache(int layer_id, std::span<const int32_t> slots,
                                                           float* recurrent, float* conv) const {
  const int64_t l = layer_index(layer_id);
  for (const int32_t s : slots) check_slot(s, "RecurrentStatePool::read_linear_recurrent_layer_cache");
  const int64_t rows = cfg_.size + 1;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t row = l * rows + slots[i];
    if (recurrent) std::copy_n(recurrent_.begin() + row * rec_slot_, rec_slot_, recurrent + i * rec_slot_);
    if (!conv) continue;
    if (!conv_f32_.empty())
      std::copy_n(conv_f32_.begin() + row * conv_slot_, conv_slot_, conv + i * conv_slot_);
    if (!conv_bf16_.empty())
      bf16_to_f32_array(conv_bf16_.data() + row * conv_slot_, conv + i * conv_slot_, conv_slot_);
  }
}

// ---------------------------------------------------------------------------------------------------------
// HybridReqToTokenPool

HybridReqToTokenPool::HybridReqToTokenPool(int64_t max_requests, RecurrentStatePool& recurrent_pool,
                                           MLATokenToKVPool* token_to_kv_pool)
    : max_requests_(max_requests), rec_(&recurrent_pool), kv_(token_to_kv_pool) {
  if (max_requests <= 0) {
    throw std::invalid_argument("HybridReqToTokenPool: max_requests must be > 0, got " + str(max_requests));
  }
  req_to_slot_.assign(max_requests, -1);
  req_to_token_.resize(static_cast<size_t>(max_requests));
  seq_len_.assign(static_cast<size_t>(max_requests), 0);
  // Pushed high to low so that the first allocations hand out 0, 1, 2, ...
  free_reqs_.reserve(max_requests);
  for (int64_t r = max_requests - 1; r >= 0; --r) free_reqs_.push_back(static_cast<int32_t>(r));
}

std::vector<int32_t> HybridReqToTokenPool::alloc(int64_t n) {
  if (n < 0) throw std::invalid_argument("HybridReqToTokenPool::alloc: n must be >= 0, got " + str(n));
  if (n > available()) {
    throw std::runtime_error("request pool exhausted: asked for " + str(n) + " requests, " +
                             str(available()) + " of " + str(max_requests_) + " free");
  }
  // The request indices are checked above and the slot alloc is all or nothing itself, so either both
  // pools hand out n or neither changes.
  std::vector<int32_t> slots = rec_->alloc(n);
  std::vector<int32_t> reqs;
  reqs.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = free_reqs_.back();
    free_reqs_.pop_back();
    req_to_slot_[r] = slots[i];
    req_to_token_[r].clear();
    seq_len_[r] = 0;
    reqs.push_back(r);
  }
  return reqs;
}

void HybridReqToTokenPool::free(std::span<const int32_t> req_pool_indices) {
  for (const int32_t r : req_pool_indices) check_req(r);
  check_unique(req_pool_indices, "HybridReqToTokenPool::free: request");
  std::vector<int32_t> slots;
  slots.reserve(req_pool_indices.size());
  for (const int32_t r : req_pool_indices) {
    slots.push_back(req_to_slot_[r]);
    // Checked here, before the token slots go back, so that a bad recurrent slot changes nothing.
    if (!rec_->is_allocated(req_to_slot_[r]))
      throw std::invalid_argument("HybridReqToTokenPool::free: request " + str(r) + "'s recurrent slot " +
                                  str(req_to_slot_[r]) + " is not allocated");
  }
  if (kv_) {
    // Requests may share slots (a fork, a prefix-cache hit): every slot must hold at least as many
    // references as the listed requests drop, checked before any goes.
    std::vector<int32_t> tokens;
    for (const int32_t r : req_pool_indices)
      tokens.insert(tokens.end(), req_to_token_[r].begin(), req_to_token_[r].end());
    std::sort(tokens.begin(), tokens.end());
    for (size_t i = 0; i < tokens.size();) {
      size_t j = i;
      while (j < tokens.size() && tokens[j] == tokens[i]) ++j;
      if (!kv_->is_allocated(tokens[i]) || kv_->ref_count(tokens[i]) < static_cast<int32_t>(j - i))
        throw std::invalid_argument("HybridReqToTokenPool::free: token slot " + str(tokens[i]) + " holds " +
                                    str(kv_->is_allocated(tokens[i]) ? kv_->ref_count(tokens[i]) : 0) +
                                    " references, the requests drop " + str(static_cast<int64_t>(j - i)));
      i = j;
    }
    for (const int32_t r : req_pool_indices) kv_->free(req_to_token_[r]);
  }
  rec_->free(slots);
  for (auto it = req_pool_indices.rbegin(); it != req_pool_indices.rend(); ++it) {
    req_to_slot_[*it] = -1;
    req_to_token_[*it].clear();
    seq_len_[*it] = 0;
    free_reqs_.push_back(*it);
  }
}

int32_t HybridReqToTokenPool::fork(int32_t parent_req_pool_index) {
  check_req(parent_req_pool_index);
  const int32_t child = alloc(1)[0];
  rec_->copy_slot(req_to_slot_[parent_req_pool_index], req_to_slot_[child]);
  if (kv_) {
    const std::vector<int32_t>& parent_tokens = req_to_token_[parent_req_pool_index];
    kv_->inc_ref(parent_tokens);
    req_to_token_[child] = parent_tokens;
  }
  seq_len_[child] = seq_len_[parent_req_pool_index];
  return child;
}

void HybridReqToTokenPool::share_tokens(int32_t req_pool_index, std::span<const int32_t> slots) {
  check_req(req_pool_index);
  if (!kv_)
    throw std::invalid_argument("HybridReqToTokenPool::share_tokens: no MLA KV pool to share token slots of");
  if (seq_len_[req_pool_index] != 0)
    throw std::invalid_argument("HybridReqToTokenPool::share_tokens: request " + str(req_pool_index) +
                                " already holds " + str(seq_len_[req_pool_index]) + " tokens");
  kv_->inc_ref(slots);  // validates every slot (allocated, listed once) before adding any reference
  req_to_token_[req_pool_index].assign(slots.begin(), slots.end());
  seq_len_[req_pool_index] = static_cast<int64_t>(slots.size());
}

std::vector<int32_t> HybridReqToTokenPool::get_recurrent_indices(
    std::span<const int32_t> req_pool_indices) const {
  std::vector<int32_t> out;
  out.reserve(req_pool_indices.size());
  for (const int32_t r : req_pool_indices) out.push_back(slot_of(r));
  return out;
}

int32_t HybridReqToTokenPool::slot_of(int32_t req_pool_index) const {
  if (req_pool_index == -1) return -1;
  check_req(req_pool_index);
  return req_to_slot_[req_pool_index];
}

std::span<const int32_t> HybridReqToTokenPool::req_to_token(int32_t req_pool_index) const {
  check_req(req_pool_index);
  return req_to_token_[req_pool_index];
}

int64_t HybridReqToTokenPool::seq_len(int32_t req_pool_index) const {
  check_req(req_pool_index);
  return seq_len_[req_pool_index];
}

void HybridReqToTokenPool::alloc_tokens(std::span<const int32_t> reqs, std::span<const int32_t> lens) {
  if (reqs.size() != lens.size())
    throw std::invalid_argument(
        "HybridReqToTokenPool::alloc_tokens: " + str(static_cast<int64_t>(reqs.size())) + " requests and " +
        str(static_cast<int64_t>(lens.size())) + " lengths");
  int64_t total = 0;
  std::vector<int32_t> listed;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i] == -1) continue;
    check_req(reqs[i]);
    if (lens[i] < 0)
      throw std::invalid_argument("HybridReqToTokenPool::alloc_tokens: request " + str(reqs[i]) +
                                  " asks for a negative length " + str(lens[i]));
    listed.push_back(reqs[i]);
    total += lens[i];
  }
  check_unique(listed, "HybridReqToTokenPool::alloc_tokens: request");
  if (kv_ && total > kv_->available())
    throw std::runtime_error("MLA KV pool exhausted: the step needs " + str(total) + " token slots, " +
                             str(kv_->available()) + " of " + str(kv_->size()) + " free");
  std::vector<int32_t> fresh = kv_ ? kv_->alloc(total) : std::vector<int32_t>{};
  size_t next = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i] == -1) continue;
    if (kv_) {
      auto& toks = req_to_token_[reqs[i]];
      toks.insert(toks.end(), fresh.begin() + static_cast<std::ptrdiff_t>(next),
                  fresh.begin() + static_cast<std::ptrdiff_t>(next + lens[i]));
      next += static_cast<size_t>(lens[i]);
    }
    seq_len_[reqs[i]] += lens[i];
  }
}

void HybridReqToTokenPool::truncate_tokens(int32_t req_pool_index, int64_t len) {
  check_req(req_pool_index);
  if (len < 0 || len > seq_len_[req_pool_index])
    throw std::invalid_argument("HybridReqToTokenPool::truncate_tokens: length " + str(len) +
                                " outside [0, " + str(seq_len_[req_pool_index]) + "] for request " +
                                str(req_pool_index));
  if (kv_) {
    auto& toks = req_to_token_[req_pool_index];
    kv_->free(std::span<const int32_t>(toks).subspan(static_cast<size_t>(len)));
    toks.resize(static_cast<size_t>(len));
  }
  seq_len_[req_pool_index] = len;
}

void HybridReqToTokenPool::accept_tokens(int32_t req_pool_index, int64_t committed,
                                         std::span<const int32_t> kept) {
  check_req(req_pool_index);
  const int64_t len = seq_len_[req_pool_index];
  if (committed < 0 || committed > len)
    throw std::invalid_argument("HybridReqToTokenPool::accept_tokens: committed length " + str(committed) +
                                " outside [0, " + str(len) + "] for request " + str(req_pool_index));
  const int64_t row = len - committed;
  for (const int32_t k : kept)
    if (k < 0 || k >= row)
      throw std::invalid_argument("HybridReqToTokenPool::accept_tokens: offset " + str(k) + " outside the " +
                                  str(row) + " tokens past the committed " + str(committed) + " of request " +
                                  str(req_pool_index));
  check_unique(kept, "HybridReqToTokenPool::accept_tokens: offset");
  if (kv_) {
    auto& toks = req_to_token_[req_pool_index];
    std::vector<uint8_t> keep(static_cast<size_t>(row), 0);
    std::vector<int32_t> path, dropped;
    for (const int32_t k : kept) {
      keep[static_cast<size_t>(k)] = 1;
      path.push_back(toks[static_cast<size_t>(committed + k)]);
    }
    for (int64_t m = 0; m < row; ++m)
      if (!keep[static_cast<size_t>(m)]) dropped.push_back(toks[static_cast<size_t>(committed + m)]);
    kv_->free(dropped);
    toks.resize(static_cast<size_t>(committed));
    toks.insert(toks.end(), path.begin(), path.end());
  }
  seq_len_[req_pool_index] = committed + static_cast<int64_t>(kept.size());
}

void HybridReqToTokenPool::check_req(int32_t r) const {
  if (r < 0 || r >= max_requests_) {
    throw std::invalid_argument("HybridReqToTokenPool: request index " + str(r) + " is out of range [0, " +
                                str(max_requests_) + ")");
  }
  if (req_to_slot_[r] < 0)
    throw std::invalid_argument("HybridReqToTokenPool: request index " + str(r) + " is not allocated");
}

}  // namespace kda::mem_cache
