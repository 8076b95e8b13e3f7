// The serving scheduler's slot accounting: the slots promised to a request's forks come before its own
// prefix-cache snapshots, and a step whose forks cannot get their slots is refused before anything changes.
// And the soak's resident-memory bound, reached through the library alone.
#include <gtest/gtest.h>

#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "kda/mem_cache/memory_pool.h"
#include "kda/mem_cache/radix_cache.h"
#include "kda/serving/scheduler.h"
#include "kda/serving/simulate.h"
#include "kda/serving/trace.h"
#include "support/test_support.h"

namespace kda::serving {
namespace {

mem_cache::RecurrentStatePoolConfig tiny_pool(int64_t slots) {
  mem_cache::RecurrentStatePoolConfig c;
  c.layer_ids = {0};
  c.size = slots;
  c.num_heads = 1;
  c.head_k_dim = 4;
  c.head_v_dim = 4;
  c.conv_kernel = 4;
  c.conv_dim = 4;
  return c;
}

RequestSpec request(int32_t prompt_len, int32_t output_len) {
  RequestSpec r;
  r.prompt_len = prompt_len;
  r.output_len = output_len;
  return r;
}

std::vector<int32_t> iota_tokens(int32_t n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 1);
  return t;
}

// Runs the scheduler to the end with no model: every batch "ran".
void drain(Scheduler& s) {
  for (int step = 0; step < 10000 && !s.done(); ++step) {
    const auto b = s.schedule();
    if (b.empty()) {
      ASSERT_TRUE(s.skip_to_next_arrival());
      continue;
    }
    s.complete(b);
  }
  ASSERT_TRUE(s.done());
}

// A request with 2 samples on a pool of 3 slots: one for itself, one reserved for its fork, so its
// prefill may write one snapshot, never two (the second would take the fork's slot).
TEST(SchedulerSlots, ARequestsSnapshotsNeverTakeTheSlotItsForkNeeds) {
  mem_cache::MemoryPools pools(tiny_pool(3), 3);
  auto& rec = pools.recurrent_state_pool;
  mem_cache::RadixCache cache(rec, 8 * rec.bytes_per_slot());
  SchedulerOptions so;
  so.token_budget = 50;
  so.parallel_samples = 2;
  so.cache = &cache;
  so.cache_interval = 64;  // snapshots at 64, 128, 192 and 199 wanted
  Scheduler s({request(200, 2)}, so, pools.req_to_token_pool);
  s.set_prompt(0, iota_tokens(200));

  const auto b = s.schedule();
  ASSERT_EQ(b.rows.size(), 1u);
  EXPECT_EQ(cache.pending_snapshots(), 1);
  EXPECT_EQ(rec.available(), 1) << "the fork's slot went to a snapshot";
  s.complete(b);
  drain(s);
  cache.check_invariants();
  EXPECT_EQ(rec.available() + cache.snapshots(), rec.size());
}

// Slots taken behind the scheduler's back (an embedder's misuse): the step that forks is refused with a
// clear error, and nothing of the step is applied, so the step can be completed once the slots are back.
TEST(SchedulerSlots, AStepWhoseForksCannotGetSlotsChangesNothing) {
  for (const bool with_cache : {false, true}) {
    SCOPED_TRACE(with_cache ? "with a prefix cache" : "without a prefix cache");
    mem_cache::MemoryPools pools(tiny_pool(3), 3);
    auto& rec = pools.recurrent_state_pool;
    mem_cache::RadixCache cache(rec, with_cache ? 4 * rec.bytes_per_slot() : 0);
    SchedulerOptions so;
    so.parallel_samples = 2;
    so.cache = &cache;
    Scheduler s({request(10, 2), request(6, 1)}, so, pools.req_to_token_pool);
    s.set_prompt(0, iota_tokens(10));
    s.set_prompt(1, iota_tokens(6));

    const auto b = s.schedule();
    ASSERT_EQ(b.rows.size(), 1u);  // the second request waits: one slot is reserved for the fork
    const int64_t free_before = rec.available(), reqs_before = pools.req_to_token_pool.available();
    const int64_t snaps_before = cache.snapshots(), pending_before = cache.pending_snapshots();
    const auto stolen = rec.alloc(free_before);
    try {
      s.complete(b);
      ADD_FAILURE() << "complete() forked with no slot to fork into";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("forks 1 sequence"), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.sequences()[0].processed, 0);
    EXPECT_EQ(s.sequences()[0].phase, SeqPhase::kPrefill);
    EXPECT_EQ(s.sequences()[1].phase, SeqPhase::kForkPending);
    EXPECT_EQ(s.step(), 0);
    EXPECT_EQ(cache.snapshots(), snaps_before);
    EXPECT_EQ(cache.pending_snapshots(), pending_before);
    EXPECT_EQ(pools.req_to_token_pool.available(), reqs_before);

    rec.free(stolen);
    const auto ev = s.complete(b);
    ASSERT_EQ(ev.forks.size(), 1u);
    EXPECT_EQ(s.sequences()[0].processed, 10);
    drain(s);
    if (with_cache) cache.check_invariants();
    EXPECT_EQ(rec.available() + cache.snapshots(), rec.size());
  }
}

// scripts/soak.sh's workload, shortened, through run_simulation: no main() and its settings here, so the
// flat resident memory after warm-up (soak.sh's bound: the last sample within 5% of the one at the end of
// the first tenth of the steps) is the library's own.
TEST(SchedulerSoak, ResidentMemoryStaysFlatThroughTheLibraryAlone) {
  if (testing::kSanitizedMalloc) GTEST_SKIP() << "resident memory under a sanitizer is its bookkeeping";
  WorkloadOptions w;
  w.kind = WorkloadKind::kSharedPrefix;
  w.requests = 200;
  w.prompt = {8, 32};
  w.output_len = 6;
  w.prefix_groups = 2;
  w.shared_prefix_len = 64;
  w.vocab = 64;
  w.seed = 3;
  SimulateOptions o;
  o.layers = 1;
  o.precision = Precision::FP32;
  o.seed = 3;
  o.vocab = 64;
  o.requests = make_workload(w);
  o.state_memory = int64_t{20} << 20;
  o.prefix_cache_memory = int64_t{16} << 20;
  o.cache_interval = 64;
  o.server_args.disable_radix_cache = false;
  o.server_args.enable_mixed_chunk = true;
  o.max_batch = 8;
  o.spec.algorithm = SpecAlgorithm::kNgram;
  o.spec.topk = 2;
  o.server_args.speculative_algorithm = to_string(o.spec.algorithm);
  o.parallel_samples = 2;
  const auto r = run_simulation(o);
  ASSERT_EQ(r.serve.requests_completed, 200);
  EXPECT_TRUE(r.accounting_ok()) << r.accounting_error;
  EXPECT_GT(r.serve.prefix_cache_evictions, 0);
  ASSERT_GE(r.rss_bytes.size(), 100u);
  std::printf("resident memory growth after warm-up: %.2f%% over %zu steps\n", 100.0 * r.rss_growth(),
              r.rss_bytes.size());
  RecordProperty("rss_growth_percent", std::to_string(100.0 * r.rss_growth()));
  EXPECT_LE(r.rss_growth(), 0.05);
}

}  // namespace
}  // namespace kda::serving
