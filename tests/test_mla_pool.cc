// The MLA token-level KV pool (MLATokenToKVPool) and the request -> token slots mapping of
// HybridReqToTokenPool / MemoryPools: allocation, exhaustion (a clear error, nothing changed), free and
// reuse, reference counts (shared rows), share_tokens, fork by reference, truncate, and the rows' fp32 /
// bf16 storage.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/mem_cache/mla_token_pool.h"
#include "support/test_support.h"

namespace kda {
namespace {

using mem_cache::HybridReqToTokenPool;
using mem_cache::MemoryPools;
using mem_cache::MLATokenToKVPool;
using mem_cache::MLATokenToKVPoolConfig;
using mem_cache::RecurrentStatePool;
using mem_cache::RecurrentStatePoolConfig;
using testing::expect_throw_with;

constexpr int kR = 8, kRope = 4;

MLATokenToKVPoolConfig kv_config(int64_t size, Precision dtype = Precision::FP32) {
  return {.layer_ids = {3, 7}, .size = size, .kv_lora_rank = kR, .qk_rope_head_dim = kRope, .dtype = dtype};
}

RecurrentStatePoolConfig rec_config(int64_t size) {
  return {.layer_ids = {0},
          .size = size,
          .num_heads = 1,
          .head_k_dim = 2,
          .head_v_dim = 2,
          .conv_kernel = 4,
          .conv_dim = 3};
}

// Writes a row per slot whose values encode (layer, slot).
void fill(MLATokenToKVPool& p, int layer, std::span<const int32_t> slots, float base) {
  std::vector<float> ckv(slots.size() * kR), kpe(slots.size() * kRope);
  for (size_t i = 0; i < slots.size(); ++i) {
    for (int j = 0; j < kR; ++j) ckv[i * kR + j] = base + static_cast<float>(slots[i]) + 0.01f * j;
    for (int j = 0; j < kRope; ++j) kpe[i * kRope + j] = -base - static_cast<float>(slots[i]) - 0.01f * j;
  }
  p.set_kv(layer, slots, ckv.data(), kpe.data());
}

std::vector<float> row(const MLATokenToKVPool& p, int layer, int32_t slot) {
  std::vector<float> r(kR + kRope);
  const int32_t s[] = {slot};
  p.read_kv(layer, s, r.data(), r.data() + kR);
  return r;
}

TEST(MLATokenToKVPool, AllocFreeReuseAndSizes) {
  MLATokenToKVPool p(kv_config(6));
  EXPECT_EQ(p.size(), 6);
  EXPECT_EQ(p.available(), 6);
  EXPECT_EQ(p.bytes(), size_t{2} * 7 * (kR + kRope) * sizeof(float));
  EXPECT_EQ(p.bytes_per_token(), 2 * (kR + kRope) * 4);
  EXPECT_EQ(MLATokenToKVPool(kv_config(6, Precision::BF16)).bytes_per_token(), 2 * (kR + kRope) * 2);
  const auto a = p.alloc(4);
  EXPECT_EQ(a, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_TRUE(p.is_allocated(3));
  EXPECT_FALSE(p.is_allocated(0));
  EXPECT_FALSE(p.is_allocated(5));
  // Exhaustion: a clear error, nothing taken.
  expect_throw_with<std::runtime_error>([&] { p.alloc(3); }, "MLA KV pool exhausted");
  EXPECT_EQ(p.available(), 2);
  // Bad frees change nothing.
  expect_throw_with<std::invalid_argument>([&] { p.free(std::vector<int32_t>{1, 0}); }, "reserved");
  expect_throw_with<std::invalid_argument>([&] { p.free(std::vector<int32_t>{1, 5}); }, "not allocated");
  expect_throw_with<std::invalid_argument>([&] { p.free(std::vector<int32_t>{1, 9}); }, "out of range");
  expect_throw_with<std::invalid_argument>([&] { p.free(std::vector<int32_t>{2, 2}); }, "listed twice");
  EXPECT_EQ(p.available(), 2);
  EXPECT_TRUE(p.is_allocated(1));
  p.free(std::vector<int32_t>{2, 3});
  EXPECT_EQ(p.available(), 4);
  EXPECT_EQ(p.alloc(2), (std::vector<int32_t>{2, 3}));  // reused in the order freed
  expect_throw_with<std::invalid_argument>([&] { p.get_kv_buffer(4); }, "MLA layer ids: 3, 7");
  expect_throw_with<std::invalid_argument>([&] { MLATokenToKVPool bad(kv_config(0)); }, "size");
  auto dup = kv_config(4);
  dup.layer_ids = {3, 3};
  expect_throw_with<std::invalid_argument>([&] { MLATokenToKVPool bad(dup); }, "twice");
}

TEST(MLATokenToKVPool, RowsRoundTripAndCopy) {
  for (const Precision dt : {Precision::FP32, Precision::BF16}) {
    MLATokenToKVPool p(kv_config(8, dt));
    const auto s = p.alloc(4);
    fill(p, 3, s, 0.3f);
    fill(p, 7, s, 100.7f);
    for (const int32_t slot : s) {
      const auto r = row(p, 7, slot);
      for (int j = 0; j < kR; ++j) {
        const float want = 100.7f + static_cast<float>(slot) + 0.01f * j;
        EXPECT_EQ(r[j], dt == Precision::BF16 ? round_bf16(want) : want);
      }
    }
    const auto view = p.get_kv_buffer(3);
    EXPECT_EQ(view.num_slots, 9);
    EXPECT_EQ(view.row_elems, kR + kRope);
    EXPECT_EQ(view.kv_f32 != nullptr, dt == Precision::FP32);
    EXPECT_EQ(view.kv_bf16 != nullptr, dt == Precision::BF16);
    // copy_tokens copies every layer; a destination that is also a source is an error.
    expect_throw_with<std::invalid_argument>(
        [&] {
          p.copy_tokens(std::vector<int32_t>{s[0], s[1]}, std::vector<int32_t>{s[1], s[2]});
        },
        "also a source");
    p.copy_tokens(std::vector<int32_t>{s[0], s[1]}, std::vector<int32_t>{s[2], s[3]});
    EXPECT_EQ(row(p, 3, s[2]), row(p, 3, s[0]));
    EXPECT_EQ(row(p, 7, s[3]), row(p, 7, s[1]));
    expect_throw_with<std::invalid_argument>([&] { fill(p, 3, std::vector<int32_t>{6}, 0.0f); },
                                             "not allocated");
  }
}

TEST(HybridReqToTokenPool, TokenSlotsFollowTheRequest) {
  MemoryPools pools(rec_config(4), 4, kv_config(10));
  auto& rtp = pools.req_to_token_pool;
  ASSERT_NE(rtp.token_to_kv_pool(), nullptr);
  MLATokenToKVPool& kv = *pools.token_to_kv_pool;
  const auto reqs = rtp.alloc(3);
  rtp.alloc_tokens(std::vector<int32_t>{reqs[0], -1, reqs[1]}, std::vector<int32_t>{3, 7, 2});
  EXPECT_EQ(rtp.seq_len(reqs[0]), 3);
  EXPECT_EQ(rtp.seq_len(reqs[1]), 2);
  EXPECT_EQ(rtp.req_to_token(reqs[0]).size(), 3u);
  EXPECT_EQ(kv.available(), 5);
  // All or nothing over the batch: 6 asked, 5 free.
  expect_throw_with<std::runtime_error>(
      [&] {
        rtp.alloc_tokens(std::vector<int32_t>{reqs[0], reqs[2]}, std::vector<int32_t>{3, 3});
      },
      "needs 6 token slots, 5 of 10 free");
  EXPECT_EQ(kv.available(), 5);
  EXPECT_EQ(rtp.seq_len(reqs[0]), 3);
  EXPECT_EQ(rtp.seq_len(reqs[2]), 0);
  expect_throw_with<std::invalid_argument>(
      [&] {
        rtp.alloc_tokens(std::vector<int32_t>{reqs[0], reqs[0]}, std::vector<int32_t>{1, 1});
      },
      "twice");
  // Fork: the parent's slots by reference (its rows before the fork point are never written again).
  const auto parent = rtp.req_to_token(reqs[0]);
  const std::vector<int32_t> parent_slots(parent.begin(), parent.end());
  const int32_t child = rtp.fork(reqs[0]);
  EXPECT_EQ(rtp.seq_len(child), 3);
  const auto ct = rtp.req_to_token(child);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ct[i], parent_slots[i]);
    EXPECT_EQ(kv.ref_count(ct[i]), 2);
  }
  EXPECT_EQ(kv.available(), 5);
  // A fork the request pool cannot hold changes nothing (no reference taken, the recurrent slots stay).
  const int64_t rec_free = pools.recurrent_state_pool.available();
  expect_throw_with<std::runtime_error>([&] { rtp.fork(reqs[0]); }, "request pool exhausted");
  EXPECT_EQ(pools.recurrent_state_pool.available(), rec_free);
  for (const int32_t s : parent_slots) EXPECT_EQ(kv.ref_count(s), 2);
  // Truncate drops the child's references past the length; the parent keeps its rows.
  const int32_t kept = rtp.req_to_token(child)[0];
  rtp.truncate_tokens(child, 1);
  EXPECT_EQ(rtp.seq_len(child), 1);
  EXPECT_EQ(rtp.req_to_token(child)[0], kept);
  EXPECT_EQ(kv.ref_count(parent_slots[1]), 1);
  EXPECT_EQ(kv.ref_count(parent_slots[2]), 1);
  EXPECT_EQ(kv.available(), 5);
  expect_throw_with<std::invalid_argument>([&] { rtp.truncate_tokens(child, 2); }, "outside [0, 1]");
  // accept_tokens keeps a path of a verify row's slots, in the path's order, and frees the rest.
  rtp.alloc_tokens(std::vector<int32_t>{child}, std::vector<int32_t>{3});  // positions 1, 2, 3 of the child
  const std::vector<int32_t> row(rtp.req_to_token(child).begin() + 1, rtp.req_to_token(child).end());
  expect_throw_with<std::invalid_argument>(
      [&] {
        rtp.accept_tokens(child, 1, std::vector<int32_t>{0, 3});
      },
      "outside the 3 tokens");
  expect_throw_with<std::invalid_argument>(
      [&] {
        rtp.accept_tokens(child, 1, std::vector<int32_t>{2, 2});
      },
      "listed twice");
  EXPECT_EQ(rtp.seq_len(child), 4);
  rtp.accept_tokens(child, 1, std::vector<int32_t>{2, 0});
  EXPECT_EQ(rtp.seq_len(child), 3);
  EXPECT_EQ(rtp.req_to_token(child)[0], kept);
  EXPECT_EQ(rtp.req_to_token(child)[1], row[2]);
  EXPECT_EQ(rtp.req_to_token(child)[2], row[0]);
  EXPECT_FALSE(kv.is_allocated(row[1]));
  EXPECT_EQ(kv.available(), 3);
  // Free drops every reference of the requests (parent and child share slot `kept`: freed once both go).
  rtp.free(std::vector<int32_t>{reqs[0], child});
  EXPECT_EQ(kv.available(), 8);
  expect_throw_with<std::invalid_argument>([&] { rtp.seq_len(reqs[0]); }, "not allocated");
  rtp.free(std::vector<int32_t>{reqs[1], reqs[2]});
  EXPECT_EQ(kv.available(), 10);
}

TEST(MLATokenToKVPool, ReferenceCountsKeepSharedRows) {
  MLATokenToKVPool p(kv_config(4));
  const auto s = p.alloc(2);
  EXPECT_EQ(p.ref_count(s[0]), 1);
  p.inc_ref(s);
  EXPECT_EQ(p.ref_count(s[0]), 2);
  fill(p, 3, s, 5.0f);
  const auto before = row(p, 3, s[1]);
  // One holder lets go: the rows stay, nobody else can be handed the slot.
  p.free(s);
  EXPECT_EQ(p.ref_count(s[1]), 1);
  EXPECT_EQ(p.available(), 2);
  const auto other = p.alloc(2);
  for (const int32_t o : other) EXPECT_TRUE(o != s[0] && o != s[1]);
  EXPECT_EQ(row(p, 3, s[1]), before);
  // Errors before any change: a free, reserved, out-of-range or repeated slot.
  p.free(other);
  expect_throw_with<std::invalid_argument>(
      [&] {
        p.inc_ref(std::vector<int32_t>{s[0], other[0]});
      },
      "is not allocated");
  expect_throw_with<std::invalid_argument>(
      [&] {
        p.inc_ref(std::vector<int32_t>{s[0], s[0]});
      },
      "listed twice");
  expect_throw_with<std::invalid_argument>([&] { p.inc_ref(std::vector<int32_t>{0}); }, "reserved");
  expect_throw_with<std::invalid_argument>([&] { p.ref_count(5); }, "out of range");
  EXPECT_EQ(p.ref_count(s[0]), 1);
  EXPECT_EQ(p.ref_count(other[0]), 0);
  // The last reference returns the slot.
  p.free(s);
  EXPECT_EQ(p.available(), 4);
  EXPECT_FALSE(p.is_allocated(s[0]));
  expect_throw_with<std::invalid_argument>([&] { p.free(std::vector<int32_t>{s[0]}); }, "not allocated");
}

TEST(HybridReqToTokenPool, ShareTokensStartsARequestOnCachedRows) {
  MemoryPools pools(rec_config(4), 4, kv_config(10));
  auto& rtp = pools.req_to_token_pool;
  MLATokenToKVPool& kv = *pools.token_to_kv_pool;
  const auto reqs = rtp.alloc(3);
  rtp.alloc_tokens(std::vector<int32_t>{reqs[0]}, std::vector<int32_t>{4});
  const std::vector<int32_t> prefix(rtp.req_to_token(reqs[0]).begin(), rtp.req_to_token(reqs[0]).begin() + 3);
  rtp.share_tokens(reqs[1], prefix);
  EXPECT_EQ(rtp.seq_len(reqs[1]), 3);
  for (const int32_t s : prefix) EXPECT_EQ(kv.ref_count(s), 2);
  // Its own tokens get fresh slots after the shared ones.
  rtp.alloc_tokens(std::vector<int32_t>{reqs[1]}, std::vector<int32_t>{2});
  EXPECT_EQ(rtp.seq_len(reqs[1]), 5);
  EXPECT_EQ(kv.available(), 4);
  // Errors leave everything as it was: a request with tokens, a free slot, a slot listed twice.
  expect_throw_with<std::invalid_argument>([&] { rtp.share_tokens(reqs[1], prefix); }, "already holds");
  const int32_t free_slot = kv.alloc(1)[0];
  kv.free(std::vector<int32_t>{free_slot});
  expect_throw_with<std::invalid_argument>(
      [&] {
        rtp.share_tokens(reqs[2], std::vector<int32_t>{prefix[0], free_slot});
      },
      "not allocated");
  expect_throw_with<std::invalid_argument>(
      [&] {
        rtp.share_tokens(reqs[2], std::vector<int32_t>{prefix[0], prefix[0]});
      },
      "listed twice");
  EXPECT_EQ(rtp.seq_len(reqs[2]), 0);
  EXPECT_EQ(kv.ref_count(prefix[0]), 2);
  // The first holder finishing leaves the shared rows to the second.
  rtp.free(std::vector<int32_t>{reqs[0]});
  for (const int32_t s : prefix) EXPECT_EQ(kv.ref_count(s), 1);
  EXPECT_EQ(kv.available(), 5);
  rtp.free(std::vector<int32_t>{reqs[1], reqs[2]});
  EXPECT_EQ(kv.available(), 10);
  // Without a KV pool there is nothing to share.
  RecurrentStatePool rec(rec_config(2));
  HybridReqToTokenPool kda_only(2, rec);
  const auto r = kda_only.alloc(1);
  expect_throw_with<std::invalid_argument>([&] { kda_only.share_tokens(r[0], std::vector<int32_t>{}); },
                                           "no MLA KV pool");
}

TEST(HybridReqToTokenPool, WithoutAKvPoolOnlyLengthsMove) {
  RecurrentStatePool rec(rec_config(2));
  HybridReqToTokenPool rtp(2, rec);
  EXPECT_EQ(rtp.token_to_kv_pool(), nullptr);
  const auto r = rtp.alloc(1);
  rtp.alloc_tokens(r, std::vector<int32_t>{5});
  EXPECT_EQ(rtp.seq_len(r[0]), 5);
  EXPECT_TRUE(rtp.req_to_token(r[0]).empty());
  rtp.truncate_tokens(r[0], 2);
  EXPECT_EQ(rtp.seq_len(r[0]), 2);
  EXPECT_EQ(rtp.seq_len(rtp.fork(r[0])), 2);
  MemoryPools kda_only(rec_config(2), 2);
  EXPECT_EQ(kda_only.token_to_kv_pool, nullptr);
}

}  // namespace
}  // namespace kda
