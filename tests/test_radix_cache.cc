// Prefix cache of recurrent state: matching, two-phase snapshots, edge splits, LRU eviction under the byte
// budget, locks, the pool accounting shared with requests, and the snapshot data itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kda/mem_cache/radix_cache.h"
#include "support/test_support.h"

// Allocation failure injection for this binary: when armed with n > 0, the n-th operator new from then on
// throws std::bad_alloc (once). Single-threaded tests only arm it. Every unaligned form of new and delete
// is replaced, each through malloc / free, so that no pair mixes this file's with a sanitizer's.
namespace {
thread_local int64_t g_fail_allocation = 0;

void* allocate(std::size_t n) {
  if (g_fail_allocation > 0 && --g_fail_allocation == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* allocate_or_null(std::size_t n) noexcept {
  try {
    return allocate(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
}  // namespace

void* operator new(std::size_t n) { return allocate(n); }
void* operator new[](std::size_t n) { return allocate(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate_or_null(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate_or_null(n); }
// Out of line: GCC, seeing free() inlined where new-expressions are, would warn of a mismatch that these
// pairs do not have.
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete[](void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace kda::mem_cache {
namespace {

using kda::testing::expect_throw_with;

using Tokens = std::vector<int32_t>;

RecurrentStatePoolConfig small_config(int64_t size, std::vector<int> layers = {0}) {
  RecurrentStatePoolConfig c;
  c.layer_ids = std::move(layers);
  c.size = size;
  c.num_heads = 2;
  c.head_k_dim = 8;
  c.head_v_dim = 8;
  c.conv_kernel = 4;
  c.conv_dim = 6;
  return c;
}

struct Fixture {
  RecurrentStatePool pool;
  RadixCache cache;
  Fixture(int64_t pool_size, int64_t max_snapshots)
      : pool(small_config(pool_size)), cache(pool, max_snapshots * pool.bytes_per_slot()) {}
  // Reserve + commit; the snapshot must be created.
  Snapshot put(const Tokens& t, int64_t len) {
    const Snapshot s = cache.reserve(t, len);
    EXPECT_TRUE(s.created) << "len " << len;
    if (s.created) cache.commit(s.node);
    return s;
  }
  // Nothing leaks: every slot is free, a snapshot, or one of the `requests` slots the test holds.
  void check(int64_t requests = 0) const {
    cache.check_invariants();
    EXPECT_EQ(pool.available() + cache.snapshots() + requests, pool.size());
    EXPECT_LE(cache.bytes(), cache.budget_bytes());
  }
};

// One slot's state in every layer (recurrent then conv per layer), derived from `seed`.
std::vector<float> pattern(const RecurrentStatePoolConfig& cfg, uint64_t seed) {
  const int64_t rec = int64_t{cfg.num_heads} * cfg.head_k_dim * cfg.head_v_dim;
  const int64_t conv = int64_t{cfg.conv_kernel - 1} * cfg.conv_dim;
  std::vector<float> out;
  for (size_t l = 0; l < cfg.layer_ids.size(); ++l) {
    const auto r = kda::testing::random_normal(rec, seed++), c = kda::testing::random_normal(conv, seed++);
    out.insert(out.end(), r.begin(), r.end());
    out.insert(out.end(), c.begin(), c.end());
  }
  return out;
}

// Writes pattern(seed) into one slot, through the pool's accessors.
void write_pattern(RecurrentStatePool& pool, int32_t slot, uint64_t seed) {
  const auto& cfg = pool.config();
  const int64_t rec = int64_t{cfg.num_heads} * cfg.head_k_dim * cfg.head_v_dim;
  const std::vector<float> v = pattern(cfg, seed);
  const float* p = v.data();
  for (const int id : cfg.layer_ids) {
    pool.set_linear_recurrent_layer_cache(id, {&slot, 1}, p, p + rec);
    p += rec + int64_t{cfg.conv_kernel - 1} * cfg.conv_dim;
  }
}

std::vector<float> read_slot(const RecurrentStatePool& pool, int32_t slot) {
  const auto& cfg = pool.config();
  const int64_t rec = int64_t{cfg.num_heads} * cfg.head_k_dim * cfg.head_v_dim;
  const int64_t conv = int64_t{cfg.conv_kernel - 1} * cfg.conv_dim;
  std::vector<float> out;
  for (const int id : cfg.layer_ids) {
    std::vector<float> r(rec), c(conv);
    pool.read_linear_recurrent_layer_cache(id, {&slot, 1}, r.data(), c.data());
    out.insert(out.end(), r.begin(), r.end());
    out.insert(out.end(), c.begin(), c.end());
  }
  return out;
}

TEST(RadixCache, EmptyTreeMatchesNothing) {
  Fixture f(4, 2);
  for (const Tokens& t : {Tokens{}, Tokens{1, 2, 3}}) {
    const MatchResult m = f.cache.match_prefix(t);
    EXPECT_FALSE(m.hit);
    EXPECT_FALSE(m.pending);
    EXPECT_EQ(m.matched_len, 0);
  }
  EXPECT_TRUE(f.cache.enabled());
  EXPECT_EQ(f.cache.max_snapshots(), 2);
  EXPECT_EQ(f.cache.total_size(), 0);
  f.check();
}

TEST(RadixCache, InsertThenMatchExactShorterLonger) {
  Fixture f(4, 2);
  const Tokens a{1, 2, 3, 4, 5, 6, 7, 8};
  const Snapshot s = f.cache.reserve(a, 8);
  ASSERT_TRUE(s.created);
  EXPECT_EQ(s.state, SnapshotState::Pending);
  EXPECT_EQ(s.len, 8);
  EXPECT_TRUE(f.pool.is_allocated(s.slot));
  EXPECT_EQ(f.cache.snapshots(), 1);
  EXPECT_EQ(f.cache.bytes(), f.pool.bytes_per_slot());
  f.check();

  // Pending: not a hit, but reported so the request can wait for it.
  MatchResult m = f.cache.match_prefix(a);
  EXPECT_FALSE(m.hit);
  EXPECT_EQ(m.pending.node, s.node);
  EXPECT_EQ(m.pending.len, 8);
  EXPECT_EQ(m.matched_len, 8);

  f.cache.commit(s.node);
  EXPECT_EQ(f.cache.state(s.node), SnapshotState::Ready);
  m = f.cache.match_prefix(a);
  EXPECT_EQ(m.hit.node, s.node);
  EXPECT_EQ(m.hit.slot, s.slot);
  EXPECT_EQ(m.hit.len, 8);
  EXPECT_FALSE(m.pending);

  m = f.cache.match_prefix(Tokens(a.begin(), a.begin() + 5));  // shorter: tokens known, no snapshot
  EXPECT_FALSE(m.hit);
  EXPECT_EQ(m.matched_len, 5);
  Tokens longer = a;
  longer.insert(longer.end(), {9, 10});
  m = f.cache.match_prefix(longer);
  EXPECT_EQ(m.hit.len, 8);
  EXPECT_EQ(m.matched_len, 8);
  m = f.cache.match_prefix(Tokens{1, 2, 99});
  EXPECT_FALSE(m.hit);
  EXPECT_EQ(m.matched_len, 2);
  m = f.cache.match_prefix(Tokens{7, 1});
  EXPECT_EQ(m.matched_len, 0);
  f.check();
}

TEST(RadixCache, ReservingAnExistingSnapshotReturnsIt) {
  Fixture f(4, 3);
  const Tokens a{5, 6, 7};
  const Snapshot s = f.cache.reserve(a, 3);
  Snapshot again = f.cache.reserve(a, 3);
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.node, s.node);
  EXPECT_EQ(again.slot, s.slot);
  EXPECT_EQ(again.state, SnapshotState::Pending);
  f.cache.commit(s.node);
  again = f.cache.reserve(Tokens{5, 6, 7, 8}, 3);  // the length decides, not the tokens after it
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.state, SnapshotState::Ready);
  EXPECT_EQ(f.cache.snapshots(), 1);
  f.check();
}

// Every allocation reserve makes, failed in turn: each failure leaves the tree, its counters and the pool
// as they were, and the reserve that finally gets all its memory makes the snapshot. The paths: a split
// and a new leaf, a split alone (the path ends inside an edge), a leaf alone.
TEST(RadixCache, AReserveThatRunsOutOfMemoryLeavesTreeAndPoolAsTheyWere) {
  const Tokens a = {1, 2, 3, 4, 5, 6};
  for (const Tokens& target : {Tokens{1, 2, 3, 7, 8}, Tokens{1, 2}, Tokens{1, 2, 3, 4, 5, 6, 9}}) {
    bool made = false;
    for (int64_t k = 1; k < 100 && !made; ++k) {
      Fixture f(8, 8);
      f.put(a, 6);
      const auto state = [&] {
        return std::tuple(f.cache.node_count(), f.cache.total_size(), f.cache.snapshots(),
                          f.cache.pending_snapshots(), f.cache.evictions(), f.pool.available());
      };
      const auto before = state();
      Snapshot s;
      bool threw = false;
      g_fail_allocation = k;
      try {
        s = f.cache.reserve(target, static_cast<int64_t>(target.size()));
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      g_fail_allocation = 0;
      SCOPED_TRACE("allocation " + std::to_string(k) + " of a reserve of " + std::to_string(target.size()));
      f.check();
      if (threw) {
        EXPECT_TRUE(state() == before);
        const auto m = f.cache.match_prefix(a);
        EXPECT_EQ(m.hit.len, 6);
        continue;
      }
      made = true;
      EXPECT_TRUE(s.created);
      EXPECT_EQ(f.cache.pending_snapshots(), 1);
    }
    EXPECT_TRUE(made);
  }
}

TEST(RadixCache, SplitAtABranchInsideAnEdge) {
  Fixture f(8, 4);
  const Tokens a{1, 2, 3, 4, 5, 6}, b{1, 2, 3, 7, 8};
  const Snapshot sa = f.put(a, 6);
  MatchResult m = f.cache.match_prefix(b);
  EXPECT_FALSE(m.hit);
  EXPECT_EQ(m.matched_len, 3);  // the branch point: b's prefill writes a snapshot there
  const Snapshot branch = f.put(b, m.matched_len);
  const Snapshot sb = f.put(b, 5);
  EXPECT_EQ(f.cache.node_count(), 3);
  EXPECT_EQ(f.cache.total_size(), 8);  // 1 2 3 | 4 5 6 | 7 8
  f.check();

  m = f.cache.match_prefix(a);  // the split kept a's node, slot and snapshot
  EXPECT_EQ(m.hit.node, sa.node);
  EXPECT_EQ(m.hit.slot, sa.slot);
  EXPECT_EQ(m.hit.len, 6);
  m = f.cache.match_prefix(b);
  EXPECT_EQ(m.hit.node, sb.node);
  EXPECT_EQ(m.hit.len, 5);
  m = f.cache.match_prefix(Tokens{1, 2, 3, 9});  // the next request with that prefix hits exactly
  EXPECT_EQ(m.hit.node, branch.node);
  EXPECT_EQ(m.hit.len, 3);
  m = f.cache.match_prefix(Tokens{1, 2});
  EXPECT_FALSE(m.hit);
  EXPECT_EQ(m.matched_len, 2);
  f.check();
}

TEST(RadixCache, DeepestReadySnapshotIsChosenAndDeeperPendingReported) {
  Fixture f(8, 4);
  const Tokens t{1, 2, 3, 4, 5, 6, 7};
  f.put(t, 2);
  const Snapshot s4 = f.put(t, 4);
  const Snapshot s6 = f.cache.reserve(t, 6);
  MatchResult m = f.cache.match_prefix(t);
  EXPECT_EQ(m.hit.node, s4.node);
  EXPECT_EQ(m.pending.node, s6.node);
  EXPECT_EQ(m.matched_len, 7 - 1);  // the path is stored up to 6
  f.cache.commit(s6.node);
  m = f.cache.match_prefix(t);
  EXPECT_EQ(m.hit.node, s6.node);
  EXPECT_FALSE(m.pending);
  // A pending snapshot above the hit is of no use to the request: not reported.
  const Snapshot s1 = f.cache.reserve(t, 1);
  m = f.cache.match_prefix(t);
  EXPECT_EQ(m.hit.node, s6.node);
  EXPECT_FALSE(m.pending);
  f.cache.abort(s1.node);
  f.check();
}

TEST(RadixCache, CommitAndAbort) {
  Fixture f(4, 4);
  const Tokens a{1, 2, 3, 4}, b{1, 2, 9};
  const Snapshot deep = f.put(a, 4);
  const Snapshot s = f.cache.reserve(b, 3);
  const int64_t free_before = f.pool.available();
  f.cache.abort(s.node);
  EXPECT_FALSE(f.cache.contains(s.node));
  EXPECT_EQ(f.pool.available(), free_before + 1);
  EXPECT_EQ(f.cache.snapshots(), 1);
  EXPECT_EQ(f.cache.node_count(), 1);  // the branch node went with it; a's edge is whole again
  EXPECT_EQ(f.cache.match_prefix(a).hit.node, deep.node);
  f.check();

  // An aborted interior snapshot leaves the tokens of the deeper one in place.
  const Snapshot mid = f.cache.reserve(a, 2);
  f.cache.abort(mid.node);
  EXPECT_EQ(f.cache.total_size(), 4);
  EXPECT_EQ(f.cache.match_prefix(a).hit.len, 4);

  expect_throw_with<std::logic_error>([&] { f.cache.commit(deep.node); }, "is not pending (it is ready)");
  expect_throw_with<std::logic_error>([&] { f.cache.abort(deep.node); }, "is not pending");
  expect_throw_with<std::invalid_argument>([&] { f.cache.commit(s.node); }, "is not in the tree");
  expect_throw_with<std::invalid_argument>([&] { f.cache.abort(12345); }, "node 12345 is not in the tree");
  f.check();
}

TEST(RadixCache, LruEvictionOrderFollowsUse) {
  Fixture f(8, 3);
  const Tokens a{1, 1}, b{2, 2}, c{3, 3}, d{4, 4};
  const Snapshot sa = f.put(a, 2), sb = f.put(b, 2), sc = f.put(c, 2);
  EXPECT_EQ(f.cache.evictable_snapshots(), 3);
  EXPECT_EQ(f.cache.evictable_size(), 3 * f.pool.bytes_per_slot());
  f.cache.match_prefix(a);  // a becomes the most recent: b is now the oldest
  const Snapshot sd = f.put(d, 2);
  EXPECT_TRUE(sd.created);
  EXPECT_FALSE(f.cache.contains(sb.node));
  EXPECT_EQ(f.cache.evictions(), 1);
  EXPECT_FALSE(f.cache.match_prefix(b).hit);
  EXPECT_EQ(f.cache.snapshots(), 3);
  f.check();
  EXPECT_EQ(f.cache.evict(1), 1);  // c next, then a, then d
  EXPECT_FALSE(f.cache.contains(sc.node));
  EXPECT_EQ(f.cache.evict_bytes(1), f.pool.bytes_per_slot());  // rounded up to whole snapshots
  EXPECT_FALSE(f.cache.contains(sa.node));
  EXPECT_TRUE(f.cache.contains(sd.node));
  EXPECT_EQ(f.cache.evict(10), 1);
  EXPECT_EQ(f.cache.evictions(), 4);
  EXPECT_EQ(f.cache.node_count(), 0);
  EXPECT_EQ(f.cache.total_size(), 0);
  f.check();
}

TEST(RadixCache, LockedAndPendingSnapshotsSurviveEvictionPressure) {
  Fixture f(8, 2);
  const Tokens a{1}, b{2}, c{3}, d{4};
  const Snapshot sa = f.put(a, 1), sb = f.put(b, 1);
  f.cache.inc_lock_ref(sa.node);
  f.cache.inc_lock_ref(sa.node);  // nested
  EXPECT_EQ(f.cache.lock_ref(sa.node), 2);
  EXPECT_EQ(f.cache.evictable_snapshots(), 1);
  f.cache.match_prefix(b);  // b is the most recent, yet the only evictable one
  const Snapshot sc = f.cache.reserve(c, 1);
  ASSERT_TRUE(sc.created);
  EXPECT_FALSE(f.cache.contains(sb.node));
  // a locked, c pending: nothing to evict, so no snapshot (not an error), nothing changes.
  EXPECT_FALSE(f.cache.reserve(d, 1));
  EXPECT_FALSE(f.cache.ensure_free_slots(f.pool.available() + 1));
  EXPECT_EQ(f.cache.evict(5), 0);
  EXPECT_TRUE(f.cache.contains(sa.node));
  f.check();
  // A waiter locks the pending snapshot: it stays after the commit too, until unlocked.
  f.cache.inc_lock_ref(sc.node);
  f.cache.commit(sc.node);
  EXPECT_EQ(f.cache.evictable_snapshots(), 0);
  EXPECT_FALSE(f.cache.reserve(d, 1));
  f.cache.dec_lock_ref(sc.node);
  f.cache.dec_lock_ref(sa.node);
  EXPECT_EQ(f.cache.evictable_snapshots(), 1);  // a still holds one lock
  EXPECT_TRUE(f.cache.reserve(d, 1).created);
  EXPECT_FALSE(f.cache.contains(sc.node));
  EXPECT_TRUE(f.cache.contains(sa.node));
  f.cache.dec_lock_ref(sa.node);
  expect_throw_with<std::logic_error>([&] { f.cache.dec_lock_ref(sa.node); }, "is not locked");
  f.check();
}

TEST(RadixCache, AbortedSnapshotWithWaitersStaysUntilTheLastUnlock) {
  Fixture f(4, 2);
  const Tokens a{1, 2, 3};
  const Snapshot s = f.cache.reserve(a, 3);
  f.cache.inc_lock_ref(s.node);  // a request waiting for it
  f.cache.abort(s.node);         // the writer was cancelled
  EXPECT_TRUE(f.cache.contains(s.node));
  EXPECT_EQ(f.cache.state(s.node), SnapshotState::None);
  EXPECT_EQ(f.cache.snapshots(), 0);
  expect_throw_with<std::logic_error>([&] { f.cache.inc_lock_ref(s.node); }, "has no snapshot");
  f.check();
  f.cache.dec_lock_ref(s.node);  // the waiter sees None, unlocks, and matches again
  EXPECT_FALSE(f.cache.contains(s.node));
  EXPECT_EQ(f.cache.node_count(), 0);
  f.check();
}

TEST(RadixCache, InteriorSnapshotEvictedWhileDescendantsKeepMatching) {
  Fixture f(8, 4);
  const Tokens t{1, 2, 3, 4, 5, 6}, u{1, 2, 3, 9};
  const Snapshot s3 = f.put(t, 3), s6 = f.put(t, 6), su = f.put(u, 4);
  f.cache.match_prefix(t);  // touches s6 only: the interior s3 ages
  f.cache.match_prefix(u);
  EXPECT_EQ(f.cache.evict(1), 1);
  // The node stays as the branch between t and u, without a snapshot.
  EXPECT_EQ(f.cache.state(s3.node), SnapshotState::None);
  EXPECT_EQ(f.cache.snapshots(), 2);
  EXPECT_EQ(f.cache.match_prefix(t).hit.node, s6.node);
  EXPECT_EQ(f.cache.match_prefix(u).hit.node, su.node);
  // Its tokens stay (they lead to the deeper snapshots): a branch there is still seen.
  const MatchResult m = f.cache.match_prefix(Tokens{1, 2, 3, 7});
  EXPECT_FALSE(m.hit);
  EXPECT_EQ(m.matched_len, 3);
  EXPECT_EQ(f.cache.total_size(), 7);
  f.check();
  // A linear path: the emptied interior node merges into its child.
  Fixture g(8, 4);
  const Snapshot g2 = g.put(t, 2);
  g.put(t, 5);
  EXPECT_EQ(g.cache.node_count(), 2);
  g.cache.match_prefix(t);
  g.cache.evict(1);
  EXPECT_FALSE(g.cache.contains(g2.node));
  EXPECT_EQ(g.cache.node_count(), 1);
  EXPECT_EQ(g.cache.total_size(), 5);
  EXPECT_EQ(g.cache.match_prefix(t).hit.len, 5);
  EXPECT_TRUE(g.put(t, 2).created);  // and can be cut again
  g.check();
}

TEST(RadixCache, SnapshotDataIsWhatACopyGives) {
  RecurrentStatePool pool(small_config(6, {0, 2, 3}));
  RadixCache cache(pool, 4 * pool.bytes_per_slot());
  const Tokens t{10, 11, 12, 13, 14};
  // Written by a forward pass into a reserved slot.
  const Snapshot s = cache.reserve(t, 3);
  write_pattern(pool, s.slot, 7);
  const std::vector<float> written = read_slot(pool, s.slot);
  cache.commit(s.node);
  // Copied from a finished request's slot.
  const int32_t finished = pool.alloc(1)[0];
  write_pattern(pool, finished, 100);
  const std::vector<float> final_state = read_slot(pool, finished);
  const Snapshot fin = cache.insert(t, 5, finished);
  ASSERT_TRUE(fin.created);
  EXPECT_EQ(fin.state, SnapshotState::Ready);
  write_pattern(pool, finished, 200);  // the request's slot moves on; the snapshot does not
  pool.free({&finished, 1});

  const int32_t req = pool.alloc(1)[0];
  MatchResult m = cache.match_prefix(Tokens{10, 11, 12, 99});
  ASSERT_EQ(m.hit.node, s.node);
  pool.copy_slot(m.hit.slot, req);
  EXPECT_EQ(read_slot(pool, req), written);
  m = cache.match_prefix(t);
  ASSERT_EQ(m.hit.node, fin.node);
  pool.copy_slot(m.hit.slot, req);
  EXPECT_EQ(read_slot(pool, req), final_state);
  // insert where a snapshot exists: returned as it is, not overwritten.
  const int32_t other = pool.alloc(1)[0];
  write_pattern(pool, other, 300);
  EXPECT_FALSE(cache.insert(t, 5, other).created);
  EXPECT_EQ(read_slot(pool, fin.slot), final_state);
  pool.free(std::vector<int32_t>{req, other});
  EXPECT_EQ(pool.available() + cache.snapshots(), pool.size());
  cache.check_invariants();
}

TEST(RadixCache, SharesThePoolWithRequests) {
  Fixture f(4, 10);  // the budget allows more snapshots than the pool has slots
  std::vector<int32_t> reqs = f.pool.alloc(2);
  f.put(Tokens{1}, 1);
  f.put(Tokens{2}, 1);
  EXPECT_EQ(f.pool.available(), 0);
  // Pool full: a new snapshot replaces the oldest one.
  const Snapshot s3 = f.put(Tokens{3}, 1);
  EXPECT_TRUE(s3.created);
  EXPECT_EQ(f.cache.evictions(), 1);
  f.check(2);
  // Admission: a request's slot comes from evicting a snapshot.
  EXPECT_TRUE(f.cache.ensure_free_slots(2));
  EXPECT_EQ(f.pool.available(), 2);
  EXPECT_EQ(f.cache.snapshots(), 0);
  EXPECT_FALSE(f.cache.ensure_free_slots(3));  // never reachable: evicts nothing
  const auto more = f.pool.alloc(2);
  reqs.insert(reqs.end(), more.begin(), more.end());
  EXPECT_FALSE(f.cache.reserve(Tokens{4}, 1));  // no slot anywhere: no snapshot
  f.check(4);
  f.pool.free(reqs);
  f.check();
}

TEST(RadixCache, DisabledBudgetAndBadInput) {
  RecurrentStatePool pool(small_config(4));
  RadixCache off(pool, 0);
  EXPECT_FALSE(off.enabled());
  EXPECT_FALSE(off.reserve(Tokens{1, 2}, 2));
  EXPECT_FALSE(off.match_prefix(Tokens{1, 2}).hit);
  EXPECT_EQ(off.node_count(), 0);
  EXPECT_EQ(pool.available(), 4);
  expect_throw_with<std::invalid_argument>([&] { RadixCache c(pool, pool.bytes_per_slot() - 1); },
                                           "smaller than one snapshot");

  RadixCache cache(pool, 2 * pool.bytes_per_slot() + 1);  // floor: 2 snapshots
  EXPECT_EQ(cache.max_snapshots(), 2);
  const Tokens t{1, 2, 3};
  expect_throw_with<std::invalid_argument>([&] { cache.reserve(t, 4); }, "len 4 is outside [1, 3]");
  expect_throw_with<std::invalid_argument>([&] { cache.reserve(t, 0); }, "len 0");
  expect_throw_with<std::invalid_argument>([&] { cache.insert(t, 4, 1); }, "len 4");
  expect_throw_with<std::invalid_argument>([&] { cache.insert(t, 2, 1); }, "source slot 1 is not allocated");
  const Snapshot s = cache.reserve(t, 2);
  expect_throw_with<std::invalid_argument>([&] { cache.insert(t, 3, s.slot); }, "is a cached snapshot");
  expect_throw_with<std::invalid_argument>([&] { cache.inc_lock_ref(999); }, "inc_lock_ref: node 999");
  expect_throw_with<std::invalid_argument>([&] { cache.dec_lock_ref(0); }, "node 0 is not in the tree");
  expect_throw_with<std::invalid_argument>([&] { cache.state(kNoNode); }, "not in the tree");
  expect_throw_with<std::invalid_argument>([&] { cache.evict(-1); }, "n_snapshots must be >= 0");
  expect_throw_with<std::invalid_argument>([&] { cache.ensure_free_slots(-1); }, "n must be >= 0");
  EXPECT_EQ(cache.snapshots(), 1);  // nothing changed
  EXPECT_EQ(cache.node_count(), 1);
  cache.check_invariants();

  cache.reset();  // every slot back, every handle stale
  EXPECT_EQ(pool.available(), 4);
  EXPECT_FALSE(cache.contains(s.node));
  expect_throw_with<std::invalid_argument>([&] { cache.commit(s.node); }, "not in the tree");
  EXPECT_EQ(cache.total_size(), 0);
  const int32_t req = pool.alloc(1)[0];
  {
    RadixCache scoped(pool, 4 * pool.bytes_per_slot());
    scoped.reserve(t, 3);
    scoped.insert(Tokens{4}, 1, req);
    EXPECT_EQ(pool.available(), 1);
  }
  EXPECT_EQ(pool.available(), 3);  // the destructor gave its slots back
  pool.free({&req, 1});
}

// Thousands of random operations (small vocabulary: many shared prefixes, splits and merges) against a
// model of the snapshots the test made; after each: the invariants, the budget, the pool accounting, and
// that a hit is the deepest live snapshot on the path and holds that prefix's data.
TEST(RadixCache, RandomOperationsKeepEveryInvariant) {
  RecurrentStatePool pool(small_config(12));
  RadixCache cache(pool, 5 * pool.bytes_per_slot() + pool.bytes_per_slot() / 2);
  std::mt19937_64 rng(1234);
  auto uniform = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  auto random_tokens = [&] {
    Tokens t(1 + uniform(10));
    for (auto& x : t) x = static_cast<int32_t>(uniform(3));
    return t;
  };
  auto prefix_seed = [](const Tokens& t, int64_t len) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < len; ++i) h = (h ^ static_cast<uint64_t>(t[i] + 1)) * 1099511628211ull;
    return h;
  };
  std::map<Tokens, NodeId> model;  // prefix -> node of a snapshot the test reserved
  std::vector<NodeId> pending, locks;
  std::vector<int32_t> requests;
  int64_t hits = 0, branch_points = 0;

  for (int step = 0; step < 10000; ++step) {
    const int64_t op = uniform(100);
    const Tokens t = random_tokens();
    if (op < 30) {  // a request arrives: match, and lock + copy a hit into its slot
      const MatchResult m = cache.match_prefix(t);
      int64_t expect_len = 0;
      for (const auto& [p, id] : model) {
        if (p.size() <= t.size() && std::equal(p.begin(), p.end(), t.begin()) && cache.contains(id) &&
            cache.state(id) == SnapshotState::Ready)
          expect_len = std::max<int64_t>(expect_len, static_cast<int64_t>(p.size()));
      }
      ASSERT_EQ(m.hit.len, expect_len) << "step " << step;
      ASSERT_GE(m.matched_len, m.hit.len);
      if (m.hit) {
        ++hits;
        // The data of a snapshot is the one written for that prefix, and a copy gives it to the request.
        const std::vector<float> expect = pattern(pool.config(), prefix_seed(t, m.hit.len));
        ASSERT_EQ(read_slot(pool, m.hit.slot), expect) << "step " << step;
        if (!requests.empty()) {
          pool.copy_slot(m.hit.slot, requests[0]);
          ASSERT_EQ(read_slot(pool, requests[0]), expect) << "step " << step;
        }
        if (uniform(2)) {
          cache.inc_lock_ref(m.hit.node);
          locks.push_back(m.hit.node);
        }
      }
      if (m.pending) {
        ASSERT_EQ(cache.state(m.pending.node), SnapshotState::Pending);
        ASSERT_GT(m.pending.len, m.hit.len);
        ASSERT_LE(m.pending.len, m.matched_len);
      }
      if (m.pending && uniform(2)) {  // wait for the in-flight prefix
        cache.inc_lock_ref(m.pending.node);
        locks.push_back(m.pending.node);
      }
      if (m.matched_len > m.hit.len) ++branch_points;
    } else if (op < 55) {  // a prefill reserves a snapshot (end of prompt / interval / branch point)
      const int64_t len = 1 + uniform(static_cast<int64_t>(t.size()));
      const Snapshot s = cache.reserve(t, len);
      if (s.created) {
        write_pattern(pool, s.slot, prefix_seed(t, len));
        pending.push_back(s.node);
        model[Tokens(t.begin(), t.begin() + len)] = s.node;
      }
    } else if (op < 70 && !pending.empty()) {  // the forward pass ran: commit, or cancelled: abort
      const size_t i = uniform(static_cast<int64_t>(pending.size()));
      if (uniform(5)) {
        cache.commit(pending[i]);
      } else {
        cache.abort(pending[i]);
      }
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 80 && !locks.empty()) {
      const size_t i = uniform(static_cast<int64_t>(locks.size()));
      cache.dec_lock_ref(locks[i]);
      locks.erase(locks.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 87) {  // admission: a slot for a request, evicting snapshots if needed
      if (cache.ensure_free_slots(1)) requests.push_back(pool.alloc(1)[0]);
    } else if (op < 95 && !requests.empty()) {  // a request finishes: its last state is cached
      const int32_t r = requests.back();
      requests.pop_back();
      const int64_t len = 1 + uniform(static_cast<int64_t>(t.size()));
      write_pattern(pool, r, prefix_seed(t, len));
      const Snapshot s = cache.insert(t, len, r);
      if (s.created) model[Tokens(t.begin(), t.begin() + len)] = s.node;
      pool.free({&r, 1});
    } else if (op < 99) {
      cache.evict(uniform(3));
    } else {  // flush: every handle goes stale
      cache.reset();
      model.clear();
      pending.clear();
      locks.clear();
    }
    // Drop model entries that are gone.
    for (auto it = model.begin(); it != model.end();) {
      it = cache.contains(it->second) && cache.state(it->second) != SnapshotState::None ? std::next(it)
                                                                                        : model.erase(it);
    }
    // Locked nodes are never evicted (an aborted one stays, empty, until unlocked); pending ones neither.
    for (const NodeId id : locks) ASSERT_TRUE(cache.contains(id)) << "step " << step;
    for (const NodeId id : pending) ASSERT_EQ(cache.state(id), SnapshotState::Pending) << "step " << step;
    ASSERT_NO_THROW(cache.check_invariants()) << "step " << step;
    ASSERT_LE(cache.bytes(), cache.budget_bytes());
    ASSERT_LE(cache.snapshots(), 5);
    ASSERT_EQ(pool.available() + cache.snapshots() + static_cast<int64_t>(requests.size()), pool.size())
        << "step " << step;
  }
  // The sequence exercises every path often enough to mean something.
  EXPECT_GT(hits, 100);
  EXPECT_GT(branch_points, 50);
  EXPECT_GT(cache.evictions(), 50);
  std::printf("hits %lld, branch points %lld, evictions %lld\n", static_cast<long long>(hits),
              static_cast<long long>(branch_points), static_cast<long long>(cache.evictions()));
  for (const NodeId id : locks) cache.dec_lock_ref(id);
  for (const NodeId id : pending) cache.abort(id);
  pool.free(requests);
  cache.check_invariants();
  EXPECT_EQ(pool.available() + cache.snapshots(), pool.size());
}

// Hybrid models: the cache attached to an MLA token KV pool holds every edge token's KV slot.
struct KvFixture {
  RecurrentStatePool pool;
  MLATokenToKVPool kv;
  RadixCache cache;
  KvFixture(int64_t kv_size, size_t budget)
      : pool(small_config(8)),
        kv(MLATokenToKVPoolConfig{
            .layer_ids = {1}, .size = kv_size, .kv_lora_rank = 4, .qk_rope_head_dim = 2}),
        cache(pool, budget, &kv) {}
  // A request's token slots for `n` tokens: the shared ones first, then fresh ones.
  Tokens slots(int64_t n, const Tokens& shared = {}) {
    Tokens out = shared;
    kv.inc_ref(shared);
    const auto fresh = kv.alloc(n - static_cast<int64_t>(shared.size()));
    out.insert(out.end(), fresh.begin(), fresh.end());
    return out;
  }
};

TEST(RadixCacheKv, CommitFillsThePathAndMatchReturnsItsSlots) {
  KvFixture f(32, 8 * 1024);
  const Tokens a = {1, 2, 3, 4, 5, 6};
  const Tokens a_kv = f.slots(6);
  const Snapshot s = f.cache.reserve(a, 6);
  ASSERT_TRUE(s.created);
  f.cache.check_invariants();  // -1 on the path of a Pending node is fine
  EXPECT_EQ(f.cache.kv_tokens(), 0);
  // Too few slots, or a free one: an error, the node stays pending and nothing is referenced.
  expect_throw_with<std::invalid_argument>(
      [&] { f.cache.commit(s.node, Tokens(a_kv.begin(), a_kv.end() - 1)); }, "6 tokens deep but 5 KV slots");
  Tokens bad = a_kv;
  bad[2] = f.kv.alloc(1)[0];
  f.kv.free(Tokens{bad[2]});
  expect_throw_with<std::invalid_argument>([&] { f.cache.commit(s.node, bad); }, "not allocated");
  EXPECT_EQ(f.cache.state(s.node), SnapshotState::Pending);
  for (const int32_t k : a_kv) EXPECT_EQ(f.kv.ref_count(k), 1);
  f.cache.commit(s.node, a_kv);
  EXPECT_EQ(f.cache.kv_tokens(), 6);
  for (const int32_t k : a_kv) EXPECT_EQ(f.kv.ref_count(k), 2);
  EXPECT_EQ(f.cache.bytes(), f.pool.bytes_per_slot() + 6 * f.cache.kv_bytes_per_token());
  f.cache.check_invariants();

  // A prompt that branches off inside the edge: the hit is none (no snapshot at 4), the split keeps the
  // slots.
  const Tokens b = {1, 2, 3, 4, 9, 9, 9};
  auto m = f.cache.match_prefix(Tokens(b.begin(), b.end() - 1));
  EXPECT_FALSE(m.hit);
  EXPECT_TRUE(m.kv_slots.empty());
  EXPECT_EQ(m.matched_len, 4);
  const Snapshot sb = f.cache.reserve(b, 7);
  ASSERT_TRUE(sb.created);
  // b's own prefill computed its first 4 tokens into fresh slots: the tree keeps the ones it has.
  const Tokens b_kv = f.slots(7);
  f.cache.commit(sb.node, b_kv);
  EXPECT_EQ(f.cache.kv_tokens(), 9);
  EXPECT_EQ(f.kv.ref_count(b_kv[0]), 1);  // not taken: position 0 already held a's slot
  EXPECT_EQ(f.kv.ref_count(b_kv[5]), 2);
  m = f.cache.match_prefix(b);
  ASSERT_TRUE(m.hit);
  EXPECT_EQ(m.hit.len, 7);
  EXPECT_EQ(m.kv_slots, (Tokens{a_kv[0], a_kv[1], a_kv[2], a_kv[3], b_kv[4], b_kv[5], b_kv[6]}));
  m = f.cache.match_prefix(a);
  EXPECT_EQ(m.kv_slots, a_kv);
  f.cache.check_invariants();

  // The requests finish: the tree's references keep the rows; reset returns every slot.
  f.kv.free(a_kv);
  f.kv.free(b_kv);
  EXPECT_EQ(f.kv.available(), 32 - 9);
  f.cache.check_invariants();
  f.cache.reset();
  EXPECT_EQ(f.kv.available(), 32);
}

TEST(RadixCacheKv, InsertAndEvictionReleaseKvOnlyWhenNobodyHoldsIt) {
  KvFixture f(16, 8 * 1024);
  const Tokens a = {1, 2, 3, 4};
  const Tokens a_kv = f.slots(4);
  const int32_t req = f.pool.alloc(1)[0];
  const Snapshot s = f.cache.insert(a, 4, req, a_kv);
  ASSERT_TRUE(s.created);
  EXPECT_EQ(f.cache.state(s.node), SnapshotState::Ready);
  // A second request shares the hit's KV (as share_tokens does), then the first finishes.
  const auto m = f.cache.match_prefix(Tokens{1, 2, 3, 4, 5});
  ASSERT_EQ(m.kv_slots, a_kv);
  f.kv.inc_ref(m.kv_slots);
  f.kv.free(a_kv);
  // Eviction prunes the leaf and drops the tree's references; the second request still holds the rows.
  EXPECT_EQ(f.cache.evictable_kv_tokens(), 0);  // all four are the request's too
  EXPECT_EQ(f.cache.kv_tokens_held_alone(), 0);
  f.kv.free(Tokens(m.kv_slots.begin(), m.kv_slots.begin() + 1));  // the request lets its first token go
  EXPECT_EQ(f.cache.kv_tokens_held_alone(), 1);
  f.kv.inc_ref(Tokens(m.kv_slots.begin(), m.kv_slots.begin() + 1));
  EXPECT_EQ(f.cache.evict(1), 1);
  EXPECT_EQ(f.cache.kv_tokens(), 0);
  for (const int32_t k : a_kv) EXPECT_EQ(f.kv.ref_count(k), 1);
  EXPECT_EQ(f.kv.available(), 12);
  f.kv.free(a_kv);
  EXPECT_EQ(f.kv.available(), 16);
  f.cache.check_invariants();
  // insert checks its KV slots first.
  expect_throw_with<std::invalid_argument>([&] { f.cache.insert(a, 4, req, Tokens{1, 2, 3}); }, "3 KV slots");
  expect_throw_with<std::invalid_argument>(
      [&] {
        f.cache.insert(a, 4, req, Tokens{1, 2, 3, 4});
      },
      "not allocated");
  EXPECT_EQ(f.cache.snapshots(), 0);
  f.pool.free(Tokens{req});
}

TEST(RadixCacheKv, OneBudgetForSnapshotsAndTokens) {
  RecurrentStatePool probe(small_config(1));
  const size_t slot = probe.bytes_per_slot(), tok = 6 * sizeof(float);
  // Two snapshots and ten tokens.
  KvFixture f(64, 2 * slot + 10 * tok);
  const int32_t req = f.pool.alloc(1)[0];
  const Tokens a = {1, 2, 3, 4, 5, 6}, b = {7, 8, 9, 10};
  Tokens a_kv = f.slots(6), b_kv = f.slots(4);
  ASSERT_TRUE(f.cache.insert(a, 6, req, a_kv).created);
  ASSERT_TRUE(f.cache.insert(b, 4, req, b_kv).created);
  EXPECT_EQ(f.cache.bytes(), 2 * slot + 10 * tok);
  f.cache.check_invariants();
  // A third path of one token needs a snapshot and a token more: the least recently used (a) goes.
  const Tokens c = {11};
  Tokens c_kv = f.slots(1);
  ASSERT_TRUE(f.cache.insert(c, 1, req, c_kv).created);
  EXPECT_EQ(f.cache.evictions(), 1);
  EXPECT_FALSE(f.cache.match_prefix(a).hit);
  EXPECT_TRUE(f.cache.match_prefix(b).hit);
  EXPECT_LE(f.cache.bytes(), f.cache.budget_bytes());
  // A path longer than the whole budget's tokens gives no snapshot, after evicting what it could.
  const auto n = static_cast<int64_t>((slot + 10 * tok) / tok) + 1;  // one snapshot + n tokens > the budget
  const Tokens d(static_cast<size_t>(n), 5);
  Tokens d_kv = f.slots(n);
  EXPECT_FALSE(f.cache.insert(d, n, req, d_kv));
  EXPECT_EQ(f.cache.snapshots(), 0);
  f.cache.check_invariants();
  for (Tokens* v : {&a_kv, &b_kv, &c_kv, &d_kv}) f.kv.free(*v);
  f.cache.reset();
  EXPECT_EQ(f.kv.available(), 64);
  f.pool.free(Tokens{req});
}

TEST(RadixCacheKv, EnsureFreeKvTokensEvictsOnlyWhatCanReachTheTarget) {
  KvFixture f(12, 64 * 1024);
  const int32_t req = f.pool.alloc(1)[0];
  const Tokens a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
  Tokens a_kv = f.slots(4), b_kv = f.slots(4);
  f.cache.insert(a, 4, req, a_kv);
  f.cache.insert(b, 4, req, b_kv);
  f.kv.free(a_kv);
  f.kv.free(b_kv);  // the cache alone holds 8 of 12
  EXPECT_EQ(f.kv.available(), 4);
  EXPECT_EQ(f.cache.evictable_kv_tokens(), 8);
  // A lock protects a's snapshot and its path's tokens.
  const auto ma = f.cache.match_prefix(a);
  f.cache.inc_lock_ref(ma.hit.node);
  EXPECT_EQ(f.cache.evictable_kv_tokens(), 4);
  EXPECT_FALSE(f.cache.ensure_free_kv_tokens(9));  // 4 free + 4 evictable: nothing evicted
  EXPECT_EQ(f.cache.evictions(), 0);
  EXPECT_TRUE(f.cache.ensure_free_kv_tokens(4));
  EXPECT_EQ(f.cache.evictions(), 0);
  EXPECT_TRUE(f.cache.ensure_free_kv_tokens(8));
  EXPECT_EQ(f.cache.evictions(), 1);
  EXPECT_EQ(f.kv.available(), 8);
  EXPECT_TRUE(f.cache.match_prefix(a).hit);
  f.cache.dec_lock_ref(ma.hit.node);
  EXPECT_TRUE(f.cache.ensure_free_kv_tokens(12));
  EXPECT_EQ(f.kv.available(), 12);
  expect_throw_with<std::invalid_argument>([&] { f.cache.ensure_free_kv_tokens(-1); }, ">= 0");
  f.cache.check_invariants();
  f.pool.free(Tokens{req});
}

TEST(RadixCacheKv, InvariantsCatchABrokenKvReference) {
  KvFixture f(8, 8 * 1024);
  const int32_t req = f.pool.alloc(1)[0];
  const Tokens a = {1, 2, 3};
  const Tokens a_kv = f.slots(3);
  f.cache.insert(a, 3, req, a_kv);
  f.kv.free(a_kv);
  f.cache.check_invariants();
  // Someone drops the tree's reference behind its back: the slot is free while the tree holds it.
  f.kv.free(Tokens{a_kv[1]});
  expect_throw_with<std::logic_error>([&] { f.cache.check_invariants(); }, "which is free");
  EXPECT_EQ(f.kv.alloc(1)[0], a_kv[1]);  // the reference back (LIFO), so that the cache can let it go
  f.pool.free(Tokens{req});
}

}  // namespace
}  // namespace kda::mem_cache
