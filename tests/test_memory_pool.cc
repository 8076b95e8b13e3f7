// Recurrent state pool and request -> slot mapping: slot lifecycle, no stale state, all-or-nothing errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/mem_cache/memory_pool.h"
#include "support/test_support.h"

namespace kda::mem_cache {
namespace {

using kda::testing::expect_throw_with;

using kda::testing::random_normal;

RecurrentStatePoolConfig small_config(Precision conv_dtype = Precision::FP32) {
  RecurrentStatePoolConfig c;
  c.layer_ids = {0, 1, 2, 4, 5};  // decoder layer 3 is not a KDA layer
  c.size = 4;
  c.num_heads = 2;
  c.head_k_dim = 3;
  c.head_v_dim = 4;
  c.conv_kernel = 4;
  c.conv_dim = 6;
  c.conv_dtype = conv_dtype;
  return c;
}

// Every byte of every slot (slot 0 and free slots included) of every layer, through the layer views.
std::vector<uint8_t> snapshot(RecurrentStatePool& pool) {
  std::vector<uint8_t> out;
  for (const int id : pool.config().layer_ids) {
    const LinearRecurrentLayerCache c = pool.get_linear_recurrent_layer_cache(id);
    auto append = [&](const void* p, size_t n) {
      const auto* b = static_cast<const uint8_t*>(p);
      out.insert(out.end(), b, b + n);
    };
    append(c.recurrent, c.num_slots * c.recurrent_slot_elems * sizeof(float));
    if (c.conv_f32) append(c.conv_f32, c.num_slots * c.conv_slot_elems * sizeof(float));
    if (c.conv_bf16) append(c.conv_bf16, c.num_slots * c.conv_slot_elems * sizeof(bf16_t));
  }
  return out;
}

// One slot's state in every layer, as fp32 (recurrent then conv per layer).
std::vector<float> read_slot(const RecurrentStatePool& pool, int32_t slot) {
  const auto& cfg = pool.config();
  const int64_t rec = static_cast<int64_t>(cfg.num_heads) * cfg.head_k_dim * cfg.head_v_dim;
  const int64_t conv = (cfg.conv_kernel - 1) * cfg.conv_dim;
  std::vector<float> out;
  for (const int id : cfg.layer_ids) {
    std::vector<float> r(rec), c(conv);
    pool.read_linear_recurrent_layer_cache(id, {&slot, 1}, r.data(), c.data());
    out.insert(out.end(), r.begin(), r.end());
    out.insert(out.end(), c.begin(), c.end());
  }
  return out;
}

// Random non-zero state into one slot of every layer.
void write_garbage(RecurrentStatePool& pool, int32_t slot, uint64_t seed) {
  const auto& cfg = pool.config();
  const int64_t rec = static_cast<int64_t>(cfg.num_heads) * cfg.head_k_dim * cfg.head_v_dim;
  const int64_t conv = (cfg.conv_kernel - 1) * cfg.conv_dim;
  for (const int id : cfg.layer_ids) {
    const auto r = random_normal(rec, seed++), c = random_normal(conv, seed++);
    pool.set_linear_recurrent_layer_cache(id, {&slot, 1}, r.data(), c.data());
  }
}

bool all_zero(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float f) { return f == 0.0f; });
}

TEST(RecurrentStatePool, ConfigValidationNamesTheField) {
  auto expect_bad = [](auto mutate, const std::string& field) {
    RecurrentStatePoolConfig c = small_config();
    mutate(c);
    expect_throw_with<std::invalid_argument>([&] { RecurrentStatePool p(c); }, field);
  };
  expect_bad([](auto& c) { c.size = 0; }, "size");
  expect_bad([](auto& c) { c.num_heads = -1; }, "num_heads");
  expect_bad([](auto& c) { c.head_k_dim = 0; }, "head_k_dim");
  expect_bad([](auto& c) { c.head_v_dim = 0; }, "head_v_dim");
  expect_bad([](auto& c) { c.conv_dim = 0; }, "conv_dim");
  expect_bad([](auto& c) { c.conv_kernel = 0; }, "conv_kernel");
  expect_bad([](auto& c) { c.layer_ids.clear(); }, "layer_ids");
  expect_bad([](auto& c) { c.layer_ids = {0, 2, 2}; }, "layer_ids");
  expect_bad([](auto& c) { c.layer_ids = {-1}; }, "layer_ids");
}

TEST(RecurrentStatePool, SizesAndBytes) {
  RecurrentStatePool p(small_config());
  EXPECT_EQ(p.size(), 4);
  EXPECT_EQ(p.available(), 4);
  EXPECT_EQ(p.num_layers(), 5);
  EXPECT_EQ(p.bytes(), 5u * 5 * (2 * 3 * 4 + 3 * 6) * sizeof(float));
  RecurrentStatePool b(small_config(Precision::BF16));
  EXPECT_EQ(b.bytes(), 5u * 5 * (2 * 3 * 4 * sizeof(float) + 3 * 6 * sizeof(bf16_t)));
  // 5 layers of one slot; size + 1 rows (slot 0 included) make up the buffers.
  EXPECT_EQ(p.bytes_per_slot(), 5u * (2 * 3 * 4 + 3 * 6) * sizeof(float));
  EXPECT_EQ(b.bytes_per_slot(), 5u * (2 * 3 * 4 * sizeof(float) + 3 * 6 * sizeof(bf16_t)));
  EXPECT_EQ(p.bytes(), p.bytes_per_slot() * 5);
  EXPECT_EQ(b.bytes(), b.bytes_per_slot() * 5);
  const auto view = b.get_linear_recurrent_layer_cache(0);
  EXPECT_EQ(view.num_slots, 5);
  EXPECT_EQ(view.recurrent_slot_elems, 24);
  EXPECT_EQ(view.conv_slot_elems, 18);
}

// The verify buffer's limits: what one backend's buffer takes (every layer, verify_rows rows of
// max_verify_tokens tokens of 2C + H*K + H floats), and the layer views' limits; none without it.
TEST(RecurrentStatePool, VerifyBufferLimits) {
  RecurrentStatePoolConfig c = small_config();
  EXPECT_EQ(RecurrentStatePool(c).spec_state_bytes(), 0u);
  EXPECT_EQ(RecurrentStatePool(c).get_linear_recurrent_layer_cache(0).verify_tokens, 0);
  c.max_verify_tokens = 3;
  RecurrentStatePool all_rows(c);  // verify_rows 0: one per slot
  EXPECT_EQ(all_rows.spec_state_bytes(), 5u * 4 * 3 * (2 * 6 + 2 * 3 + 2) * sizeof(float));
  c.verify_rows = 2;
  RecurrentStatePool p(c);
  EXPECT_EQ(p.spec_state_bytes(), 5u * 2 * 3 * (2 * 6 + 2 * 3 + 2) * sizeof(float));
  EXPECT_EQ(p.total_bytes(), p.bytes() + p.spec_state_bytes());
  const auto view = p.get_linear_recurrent_layer_cache(4);
  EXPECT_EQ(view.verify_rows, 2);
  EXPECT_EQ(view.verify_tokens, 3);
  EXPECT_EQ(view.verify_token_elems, 2 * 6 + 2 * 3 + 2);
}

// A slot's generation moves with every write of its state (alloc, free, copy_slot into it, set, a
// forward's mark_written) and with nothing else (reads, views, another slot's writes).
TEST(RecurrentStatePool, GenerationMovesWithEveryWriteOfTheSlot) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(3);
  const int32_t a = slots[0], b = slots[1], c = slots[2];
  const auto gen = [&] {
    return std::vector<uint64_t>{p.slot_generation(a), p.slot_generation(b), p.slot_generation(c)};
  };
  const auto expect_moved = [&](const std::function<void()>& op, const std::vector<bool>& moved,
                                const std::string& what) {
    const auto g0 = gen();
    op();
    const auto g1 = gen();
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(g1[i] != g0[i], moved[i]) << what << ", slot " << i;
  };
  expect_moved([&] { p.copy_slot(a, b); }, {false, true, false}, "copy_slot");
  expect_moved([&] { write_garbage(p, c, 7); }, {false, false, true}, "set");
  expect_moved([&] { p.mark_written(std::vector<int32_t>{a, -1, c}); }, {true, false, true}, "mark_written");
  expect_moved(
      [&] {
        read_slot(p, a);
        p.get_linear_recurrent_layer_cache(0);
        EXPECT_TRUE(p.is_allocated(b));
      },
      {false, false, false}, "reads");
  expect_moved(
      [&] {
        p.free(std::vector<int32_t>{b});
        EXPECT_EQ(p.alloc(1), std::vector<int32_t>{b});
      },
      {false, true, false}, "free and alloc");
  // A freed slot's generation moves on free, and again when it is handed out.
  const uint64_t g = p.slot_generation(a);
  p.free(std::vector<int32_t>{a});
  EXPECT_NE(p.slot_generation(a), g);
  const uint64_t freed = p.slot_generation(a);
  p.alloc(1);
  EXPECT_NE(p.slot_generation(a), freed);
  expect_throw_with<std::invalid_argument>([&] { p.slot_generation(5); }, "out of range");
}

TEST(RecurrentStatePool, SlotZeroNeverHandedOutThenExhaustion) {
  RecurrentStatePool p(small_config());
  EXPECT_TRUE(p.alloc(0).empty());
  const auto slots = p.alloc(4);
  ASSERT_EQ(slots.size(), 4u);
  const std::set<int32_t> distinct(slots.begin(), slots.end());
  EXPECT_EQ(distinct.size(), 4u);
  EXPECT_EQ(distinct.count(0), 0u);
  for (const int32_t s : slots) EXPECT_TRUE(p.is_allocated(s));
  EXPECT_FALSE(p.is_allocated(0));
  EXPECT_EQ(p.available(), 0);
  expect_throw_with<std::runtime_error>([&] { p.alloc(1); },
                                        "recurrent state pool exhausted: asked for 1 slots, 0 of 4 free");
  expect_throw_with<std::invalid_argument>([&] { p.alloc(-1); }, "n must be >= 0");
}

TEST(RecurrentStatePool, ExhaustionChangesNothing) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(3);
  for (const int32_t s : slots) write_garbage(p, s, 100 + s * 50);
  p.free(std::vector<int32_t>{slots[1]});  // one free slot, holding stale garbage
  const auto before = snapshot(p);
  expect_throw_with<std::runtime_error>([&] { p.alloc(3); }, "asked for 3 slots, 2 of 4 free");
  EXPECT_EQ(p.available(), 2);
  EXPECT_FALSE(p.is_allocated(slots[1]));
  EXPECT_EQ(snapshot(p), before);  // nothing cleared, nothing taken
}

TEST(RecurrentStatePool, AllocClearsAReusedSlot) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(2);
  write_garbage(p, slots[0], 1);
  write_garbage(p, slots[1], 1000);
  // Garbage through the raw views too, as the kernels write it.
  const int32_t victim = slots[0];
  for (const int id : p.config().layer_ids) {
    const auto v = p.get_linear_recurrent_layer_cache(id);
    std::fill_n(v.recurrent + victim * v.recurrent_slot_elems, v.recurrent_slot_elems, 7.0f);
    std::fill_n(v.conv_f32 + victim * v.conv_slot_elems, v.conv_slot_elems, -3.0f);
  }
  const auto other_before = read_slot(p, slots[1]);
  ASSERT_FALSE(all_zero(read_slot(p, victim)));

  p.free(std::vector<int32_t>{victim});
  const auto again = p.alloc(1);
  ASSERT_EQ(again[0], victim);  // LIFO: the freed slot is reused first, so this checks for stale state
  EXPECT_TRUE(all_zero(read_slot(p, victim)));
  EXPECT_EQ(read_slot(p, slots[1]), other_before);
}

TEST(RecurrentStatePool, FreeOrderIsLifo) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(4);
  p.free(std::vector<int32_t>{slots[2], slots[0]});
  EXPECT_EQ(p.alloc(2), (std::vector<int32_t>{slots[2], slots[0]}));
}

TEST(RecurrentStatePool, FreeErrorsChangeNothing) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(3);
  p.free(std::vector<int32_t>{slots[2]});
  const auto before = snapshot(p);
  auto expect_rejected = [&](std::vector<int32_t> list, const std::string& needle) {
    expect_throw_with<std::invalid_argument>([&] { p.free(list); }, needle);
    EXPECT_EQ(p.available(), 2);
    EXPECT_TRUE(p.is_allocated(slots[0]));
    EXPECT_TRUE(p.is_allocated(slots[1]));
    EXPECT_FALSE(p.is_allocated(slots[2]));
  };
  expect_rejected({slots[0], slots[2]},
                  "slot " + std::to_string(slots[2]) + " is not allocated");  // double free
  expect_rejected({slots[0], 0}, "slot 0 is reserved");
  expect_rejected({slots[0], 5}, "slot 5 is out of range");
  expect_rejected({-1}, "slot -1 is out of range");
  expect_rejected({slots[1], slots[1]}, "listed twice");
  EXPECT_EQ(snapshot(p), before);
  p.free(std::vector<int32_t>{slots[0], slots[1]});
  EXPECT_EQ(p.available(), 4);
}

TEST(RecurrentStatePool, CopySlotForksExactly) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(3);
  write_garbage(p, slots[0], 11);
  write_garbage(p, slots[1], 22);
  write_garbage(p, slots[2], 33);
  const auto src = read_slot(p, slots[0]);
  const auto third = read_slot(p, slots[2]);
  p.copy_slot(slots[0], slots[1]);
  EXPECT_EQ(read_slot(p, slots[1]), src);
  EXPECT_EQ(read_slot(p, slots[0]), src);
  EXPECT_EQ(read_slot(p, slots[2]), third);

  const auto before = snapshot(p);
  expect_throw_with<std::invalid_argument>([&] { p.copy_slot(slots[0], slots[0]); }, "both slot");
  expect_throw_with<std::invalid_argument>([&] { p.copy_slot(slots[0], 4); }, "slot 4 is not allocated");
  expect_throw_with<std::invalid_argument>([&] { p.copy_slot(0, slots[1]); }, "slot 0 is reserved");
  EXPECT_EQ(snapshot(p), before);
}

TEST(RecurrentStatePool, Bf16ConvState) {
  RecurrentStatePool p(small_config(Precision::BF16));
  const auto v = p.get_linear_recurrent_layer_cache(2);
  EXPECT_EQ(v.conv_f32, nullptr);
  ASSERT_NE(v.conv_bf16, nullptr);
  const auto slots = p.alloc(2);
  const auto conv = random_normal(3 * 6, 5);
  p.set_linear_recurrent_layer_cache(2, {&slots[1], 1}, nullptr, conv.data());
  for (int64_t i = 0; i < 18; ++i) EXPECT_EQ(v.conv_bf16[slots[1] * 18 + i], f32_to_bf16(conv[i]));
  std::vector<float> back(18);
  p.read_linear_recurrent_layer_cache(2, {&slots[1], 1}, nullptr, back.data());
  for (int64_t i = 0; i < 18; ++i) EXPECT_EQ(back[i], round_bf16(conv[i]));
  // Reuse clears the bf16 buffer too.
  p.free(std::vector<int32_t>{slots[1]});
  EXPECT_EQ(p.alloc(1)[0], slots[1]);
  EXPECT_TRUE(all_zero(read_slot(p, slots[1])));
  // Fork copies the bf16 bits.
  p.set_linear_recurrent_layer_cache(2, {&slots[0], 1}, nullptr, conv.data());
  p.copy_slot(slots[0], slots[1]);
  EXPECT_EQ(std::memcmp(v.conv_bf16 + slots[0] * 18, v.conv_bf16 + slots[1] * 18, 18 * sizeof(bf16_t)), 0);
}

TEST(RecurrentStatePool, LayerViewsByDecoderId) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(1);
  const int32_t s = slots[0];
  const auto base = p.get_linear_recurrent_layer_cache(0);
  const auto v4 = p.get_linear_recurrent_layer_cache(4);  // pool row 3
  EXPECT_EQ(v4.layer_id, 4);
  EXPECT_EQ(v4.recurrent, base.recurrent + 3 * 5 * 24);
  EXPECT_EQ(v4.conv_f32, base.conv_f32 + 3 * 5 * 18);
  v4.recurrent[s * 24 + 7] = 42.0f;
  v4.conv_f32[s * 18 + 2] = -1.5f;
  for (const int id : p.config().layer_ids) {
    std::vector<float> r(24), c(18);
    p.read_linear_recurrent_layer_cache(id, {&s, 1}, r.data(), c.data());
    EXPECT_EQ(r[7], id == 4 ? 42.0f : 0.0f) << "layer " << id;
    EXPECT_EQ(c[2], id == 4 ? -1.5f : 0.0f) << "layer " << id;
  }
  expect_throw_with<std::invalid_argument>([&] { p.get_linear_recurrent_layer_cache(3); }, "layer 3");
  expect_throw_with<std::invalid_argument>(
      [&] { p.read_linear_recurrent_layer_cache(6, {}, nullptr, nullptr); }, "layer 6");
}

TEST(RecurrentStatePool, SetAndReadValidateEverySlotFirst) {
  RecurrentStatePool p(small_config());
  const auto slots = p.alloc(2);
  p.free(std::vector<int32_t>{slots[1]});
  const auto before = snapshot(p);
  const auto rec = random_normal(2 * 24, 9), conv = random_normal(2 * 18, 10);
  const std::vector<int32_t> mixed = {slots[0], slots[1]};
  expect_throw_with<std::invalid_argument>(
      [&] { p.set_linear_recurrent_layer_cache(1, mixed, rec.data(), conv.data()); }, "is not allocated");
  EXPECT_EQ(snapshot(p), before);  // slots[0] was valid but is not written either
  const std::vector<int32_t> twice = {slots[0], slots[0]};
  expect_throw_with<std::invalid_argument>(
      [&] { p.set_linear_recurrent_layer_cache(1, twice, rec.data(), conv.data()); }, "listed twice");
  expect_throw_with<std::invalid_argument>(
      [&] { p.set_linear_recurrent_layer_cache(1, std::vector<int32_t>{0}, rec.data(), nullptr); },
      "reserved");
  EXPECT_EQ(snapshot(p), before);
  std::vector<float> r(2 * 24), c(2 * 18);
  expect_throw_with<std::invalid_argument>(
      [&] { p.read_linear_recurrent_layer_cache(1, mixed, r.data(), c.data()); }, "is not allocated");
}

TEST(RecurrentStatePool, ConvKernelOneHasNoConvState) {
  RecurrentStatePoolConfig cfg = small_config();
  cfg.conv_kernel = 1;
  RecurrentStatePool p(cfg);
  EXPECT_EQ(p.get_linear_recurrent_layer_cache(0).conv_slot_elems, 0);
  const auto slots = p.alloc(2);
  write_garbage(p, slots[0], 3);
  p.copy_slot(slots[0], slots[1]);
  EXPECT_EQ(read_slot(p, slots[1]), read_slot(p, slots[0]));
}

// ---------------------------------------------------------------------------------------------------------

TEST(HybridReqToTokenPool, MappingIsStableAcrossCalls) {
  MemoryPools pools(small_config(), 3);
  auto& req = pools.req_to_token_pool;
  EXPECT_EQ(req.size(), 3);
  const auto reqs = req.alloc(3);
  EXPECT_EQ(reqs, (std::vector<int32_t>{0, 1, 2}));
  const auto first = req.get_recurrent_indices(reqs);
  const std::set<int32_t> distinct(first.begin(), first.end());
  EXPECT_EQ(distinct.size(), 3u);
  EXPECT_EQ(distinct.count(0), 0u);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(req.get_recurrent_indices(reqs), first);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(req.slot_of(reqs[i]), first[i]);
    EXPECT_TRUE(pools.recurrent_state_pool.is_allocated(first[i]));
  }
  EXPECT_EQ(&req.recurrent_pool(), &pools.recurrent_state_pool);
  expect_throw_with<std::invalid_argument>(
      [] {
        RecurrentStatePool rp(small_config());
        HybridReqToTokenPool h(0, rp);
      },
      "max_requests");
}

TEST(HybridReqToTokenPool, AllocAllOrNothingWhenSlotsRunOutFirst) {
  RecurrentStatePoolConfig cfg = small_config();
  cfg.size = 2;
  MemoryPools pools(cfg, 4);
  auto& req = pools.req_to_token_pool;
  expect_throw_with<std::runtime_error>([&] { req.alloc(3); }, "recurrent state pool exhausted");
  EXPECT_EQ(req.available(), 4);
  EXPECT_EQ(pools.recurrent_state_pool.available(), 2);
  const auto reqs = req.alloc(2);
  EXPECT_EQ(reqs.size(), 2u);
  expect_throw_with<std::runtime_error>([&] { req.alloc(1); }, "recurrent state pool exhausted");
  EXPECT_EQ(req.available(), 2);
}

TEST(HybridReqToTokenPool, AllocAllOrNothingWhenRequestsRunOutFirst) {
  MemoryPools pools(small_config(), 2);
  auto& req = pools.req_to_token_pool;
  expect_throw_with<std::runtime_error>([&] { req.alloc(3); }, "request pool exhausted");
  EXPECT_EQ(req.available(), 2);
  EXPECT_EQ(pools.recurrent_state_pool.available(), 4);
  expect_throw_with<std::invalid_argument>([&] { req.alloc(-1); }, "n must be >= 0");
}

TEST(HybridReqToTokenPool, FreeReturnsRequestAndSlot) {
  MemoryPools pools(small_config(), 3);
  auto& req = pools.req_to_token_pool;
  auto& rec = pools.recurrent_state_pool;
  const auto reqs = req.alloc(3);
  const int32_t slot1 = req.slot_of(reqs[1]);
  write_garbage(rec, slot1, 77);
  req.free(std::vector<int32_t>{reqs[1]});
  EXPECT_EQ(req.available(), 1);
  EXPECT_EQ(rec.available(), 2);
  EXPECT_FALSE(rec.is_allocated(slot1));
  expect_throw_with<std::invalid_argument>([&] { req.slot_of(reqs[1]); }, "is not allocated");

  // Errors free nothing: a double free or an unknown index next to a valid one.
  auto expect_rejected = [&](std::vector<int32_t> list, const std::string& needle) {
    expect_throw_with<std::invalid_argument>([&] { req.free(list); }, needle);
    EXPECT_EQ(req.available(), 1);
    EXPECT_EQ(rec.available(), 2);
    EXPECT_NO_THROW(req.slot_of(reqs[0]));
  };
  expect_rejected({reqs[0], reqs[1]}, "request index " + std::to_string(reqs[1]) + " is not allocated");
  expect_rejected({reqs[0], 3}, "out of range");
  expect_rejected({reqs[0], reqs[0]}, "listed twice");
  expect_rejected({-1}, "out of range");

  // The reused request gets the reused slot, cleared.
  const auto again = req.alloc(1);
  EXPECT_EQ(again[0], reqs[1]);
  EXPECT_EQ(req.slot_of(again[0]), slot1);
  EXPECT_TRUE(all_zero(read_slot(rec, slot1)));
  req.free(std::vector<int32_t>{reqs[0], reqs[2], again[0]});
  EXPECT_EQ(req.available(), 3);
  EXPECT_EQ(rec.available(), 4);
}

TEST(HybridReqToTokenPool, ForkCopiesState) {
  MemoryPools pools(small_config(), 3);
  auto& req = pools.req_to_token_pool;
  auto& rec = pools.recurrent_state_pool;
  const auto reqs = req.alloc(2);
  write_garbage(rec, req.slot_of(reqs[0]), 5);
  write_garbage(rec, req.slot_of(reqs[1]), 500);
  const auto parent = read_slot(rec, req.slot_of(reqs[0]));
  const int32_t child = req.fork(reqs[0]);
  EXPECT_NE(child, reqs[0]);
  EXPECT_NE(req.slot_of(child), req.slot_of(reqs[0]));
  EXPECT_EQ(read_slot(rec, req.slot_of(child)), parent);
  EXPECT_EQ(read_slot(rec, req.slot_of(reqs[0])), parent);

  // No request index left: the fork fails and changes nothing.
  const auto before = snapshot(rec);
  expect_throw_with<std::runtime_error>([&] { req.fork(reqs[1]); }, "request pool exhausted");
  EXPECT_EQ(snapshot(rec), before);
  EXPECT_EQ(rec.available(), 1);
  req.free(std::vector<int32_t>{child});
  expect_throw_with<std::invalid_argument>([&] { req.fork(child); }, "is not allocated");
  EXPECT_EQ(req.available(), 1);
}

TEST(HybridReqToTokenPool, RecurrentIndicesKeepPaddedRows) {
  MemoryPools pools(small_config(), 4);
  auto& req = pools.req_to_token_pool;
  const auto reqs = req.alloc(2);
  const std::vector<int32_t> batch = {reqs[1], -1, reqs[0], -1};
  const auto idx = req.get_recurrent_indices(batch);
  EXPECT_EQ(idx, (std::vector<int32_t>{req.slot_of(reqs[1]), -1, req.slot_of(reqs[0]), -1}));
  EXPECT_EQ(req.slot_of(-1), -1);
  expect_throw_with<std::invalid_argument>(
      [&] {
        req.get_recurrent_indices(std::vector<int32_t>{reqs[0], 2});
      },
      "request index 2 is not allocated");
  expect_throw_with<std::invalid_argument>([&] { req.get_recurrent_indices(std::vector<int32_t>{4}); },
                                           "out of range");
  expect_throw_with<std::invalid_argument>([&] { req.slot_of(-2); }, "out of range");
}

}  // namespace
}  // namespace kda::mem_cache
