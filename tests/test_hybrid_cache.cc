// The hybrid prefix cache on a whole model (KDA + MLA layers, fp32): a hit restores the KDA layers' state
// from a snapshot and the MLA layers' KV rows by reference, so serving with the cache gives the tokens and
// rows of serving without it, whatever the workload, the budget, an abort or speculative decoding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "kda/mem_cache/radix_cache.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/scheduler.h"
#include "kda/serving/simulate.h"
#include "kda/serving/speculative.h"
#include "kda/serving/trace.h"
#include "support/cache_compare.h"
#include "support/small_model_config.h"
#include "support/test_support.h"

namespace kda::serving {
namespace {

using model_executor::ForwardBatch;

// KDA, KDA, MLA, KDA: the real pattern's first four layers in little.
io::KimiLinearConfig hybrid_config() { return kda::testing::small_model_config({1, 2, 4}, {3}, 8192); }

// The spec's fp32 bound: |a - b| <= 1e-5 + 1e-5 |b|.
double ratio(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  return kda::testing::max_error_ratio(a.data(), b.data(), a.size(), 1e-5, 1e-5);
}

SimulateOptions options(std::vector<RequestSpec> reqs, bool cache) {
  return kda::testing::cache_test_options(hybrid_config(), std::move(reqs), cache, int64_t{256} << 20);
}

WorkloadOptions workload(WorkloadKind kind) {
  WorkloadOptions w;
  w.kind = kind;
  w.requests = 6;
  w.prompt = {20, 90};
  w.output_len = 4;
  w.seed = 5;
  w.shared_prefix_len = kind == WorkloadKind::kRandom ? 0 : 100;
  w.prefix_groups = kind == WorkloadKind::kSharedPrefix ? 2 : 1;
  if (kind == WorkloadKind::kMultiTurn) {
    w.requests = 2;
    w.turns = 4;
  }
  return w;
}

// The spec's fp32 bound on the final hidden state (before model.norm), which also bounds prefill -> decode
// invariance: a hit computes the rest of the prompt in another chunk grid than the cold run, through KDA, MLA
// and MoE layers. The KDA states and MLA KV rows a hit restores are held to their own 1e-5 bound below.
constexpr double kFinalHiddenTol = 1e-4;

// Same tokens, same prompts, and the rows a hit did not skip within the fp32 bound; nothing leaked.
void expect_same(const SimulateResult& hot, const SimulateResult& cold) {
  kda::testing::expect_same_as_cold(hot, cold, kFinalHiddenTol);
  EXPECT_EQ(hot.leaked_kv_tokens, 0);
  EXPECT_EQ(hot.leaked_slots, 0);
  EXPECT_TRUE(hot.accounting_ok()) << hot.accounting_error;
}

TEST(HybridCache, OnAndOffGiveTheSameTokensOnEveryWorkload) {
  for (const auto kind : {WorkloadKind::kRandom, WorkloadKind::kSharedPrefix, WorkloadKind::kMultiTurn}) {
    SCOPED_TRACE(to_string(kind));
    auto reqs = make_workload(workload(kind));
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i].after < 0) reqs[i].arrival_step = static_cast<int64_t>(i) * 3;  // one after another
    const auto cold = run_simulation(options(reqs, false));
    const auto hot = run_simulation(options(reqs, true));
    ASSERT_EQ(hot.serve.requests_completed, cold.serve.requests_completed);
    EXPECT_FALSE(hot.radix_cache_disabled);
    expect_same(hot, cold);
    if (kind != WorkloadKind::kRandom) {
      EXPECT_GT(hot.serve.prefix_cache_hit_tokens, 0);
      EXPECT_LT(hot.serve.prefill_tokens_computed, cold.serve.prefill_tokens_computed);
    }
  }
}

// Parallel samples fork by reference (the prompt's KV rows shared by every continuation) on top of hits.
TEST(HybridCache, ParallelSamplesWithTheCacheGiveTheSameTokens) {
  auto reqs = make_workload(workload(WorkloadKind::kSharedPrefix));
  auto off = options(reqs, false), on = options(reqs, true);
  off.parallel_samples = on.parallel_samples = 3;
  const auto cold = run_simulation(off);
  const auto hot = run_simulation(on);
  EXPECT_GT(hot.serve.prefix_cache_hit_tokens, 0);
  expect_same(hot, cold);
}

// A budget of a few snapshots and a turn's tokens evicts all the time (snapshots and their tokens' KV
// together): no token changes, nothing leaks.
TEST(HybridCache, EvictionUnderATinyBudgetChangesNoToken) {
  auto reqs = make_workload(workload(WorkloadKind::kMultiTurn));
  const auto cold = run_simulation(options(reqs, false));
  auto o = options(reqs, true);
  const int64_t slot = 3 * (2 * 128 * 128 * 4 + 3 * 3 * 2 * 128 * 4);  // 3 KDA layers, fp32
  o.prefix_cache_memory = 3 * slot + 300 * (64 + 16) * 4;              // three snapshots and 300 tokens' KV
  const auto hot = run_simulation(o);
  EXPECT_GT(hot.serve.prefix_cache_evictions, 0);
  expect_same(hot, cold);
}

// A KV pool that holds little more than one conversation's turn: admission evicts cached tokens' KV to
// keep its promises (the cache's rows count as free), and no token changes.
TEST(HybridCache, ATightKvPoolEvictsCachedKvForAdmission) {
  auto reqs = make_workload(workload(WorkloadKind::kMultiTurn));
  int64_t most = 0;
  for (const auto& r : reqs) most = std::max<int64_t>(most, r.prompt_len + r.output_len);
  const int64_t kv_token = (64 + 16) * 4;  // the MLA layer's row, fp32
  auto off = options(reqs, false), on = options(reqs, true);
  off.kv_memory = on.kv_memory = (most + most / 2) * kv_token;
  const auto cold = run_simulation(off);
  const auto hot = run_simulation(on);
  EXPECT_GT(hot.serve.prefix_cache_hit_tokens, 0);
  EXPECT_GT(hot.serve.prefix_cache_evictions, 0);
  expect_same(hot, cold);
}

// Speculative decoding (ngram drafts, greedy verification) with the cache: the plain run's tokens.
TEST(HybridCache, SpeculativeDecodingWithTheCacheGivesTheSameTokens) {
  WorkloadOptions w = workload(WorkloadKind::kSharedPrefix);
  w.vocab = 64;  // generated tokens recur in the prompt: the ngram drafter drafts on most steps
  w.output_len = 12;
  const auto reqs = make_workload(w);
  auto plain = options(reqs, false);
  plain.vocab = 64;
  const auto cold = run_simulation(plain);
  auto o = options(reqs, true);
  o.vocab = 64;
  o.spec.algorithm = SpecAlgorithm::kNgram;
  o.spec.draft_tokens = 4;
  o.server_args.speculative_algorithm = to_string(SpecAlgorithm::kNgram);
  const auto hot = run_simulation(o);
  EXPECT_GT(hot.serve.prefix_cache_hit_tokens, 0);
  EXPECT_GT(hot.serve.spec_draft_tokens, 0);
  ASSERT_EQ(hot.serve.outputs.size(), cold.serve.outputs.size());
  for (size_t i = 0; i < cold.serve.outputs.size(); ++i)
    EXPECT_EQ(hot.serve.outputs[i].tokens, cold.serve.outputs[i].tokens) << "sequence " << i;
  EXPECT_EQ(hot.leaked_kv_tokens, 0);
}

// --- the pools and the cache driven by hand ---------------------------------------------------------------

struct Rig {
  std::unique_ptr<models::KimiLinearForCausalLM> model;
  std::unique_ptr<ModelRunner> runner;
  int64_t D = 0;
  Rig() {
    models::ModelOptions mo;
    mo.precision = Precision::FP32;
    model = models::KimiLinearForCausalLM::synthetic(hybrid_config(), mo, 3);
    runner = std::make_unique<ModelRunner>(*model, 6, 1024, kernels::KernelImpl::Auto);
    D = model->hidden_size();
  }
  mem_cache::MemoryPools& pools() { return runner->pools(); }
  // Runs tokens[start, start + len) of request `req` (its slot holding the state at `start`).
  std::vector<float> extend(int32_t req, const std::vector<int32_t>& tokens, int32_t start, int32_t len) {
    auto fb = ForwardBatch::extend({req}, {len}, {start});
    std::vector<float> out(static_cast<size_t>(len * D));
    runner->forward(fb, tokens.data() + start, out.data());
    return out;
  }
  // Every KDA layer's recurrent and conv state of the request's slot.
  std::vector<float> state(int32_t req) {
    auto& rec = pools().recurrent_state_pool;
    const auto& c = rec.config();
    const int32_t slot = pools().req_to_token_pool.slot_of(req);
    const size_t r = size_t{1} * c.num_heads * c.head_k_dim * c.head_v_dim,
                 v = size_t{1} * (c.conv_kernel - 1) * c.conv_dim;
    std::vector<float> out;
    for (const int id : c.layer_ids) {
      std::vector<float> a(r), b(v);
      rec.read_linear_recurrent_layer_cache(id, {&slot, 1}, a.data(), b.data());
      out.insert(out.end(), a.begin(), a.end());
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
  // The MLA KV rows of the request's positions [0, n).
  std::vector<float> kv_rows(int32_t req, int64_t n) {
    auto* kv = pools().token_to_kv_pool.get();
    const auto& c = kv->config();
    const auto slots = pools().req_to_token_pool.req_to_token(req).first(static_cast<size_t>(n));
    std::vector<float> out;
    for (const int id : c.layer_ids) {
      std::vector<float> ckv(slots.size() * c.kv_lora_rank), kpe(slots.size() * c.qk_rope_head_dim);
      kv->read_kv(id, slots, ckv.data(), kpe.data());
      out.insert(out.end(), ckv.begin(), ckv.end());
      out.insert(out.end(), kpe.begin(), kpe.end());
    }
    return out;
  }
  // NaN into every free KV slot and every free recurrent slot: a hit that read one would show.
  void poison_free() {
    auto* kv = pools().token_to_kv_pool.get();
    const auto& c = kv->config();
    const auto s = kv->alloc(kv->available());
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> ckv(s.size() * c.kv_lora_rank, nan), kpe(s.size() * c.qk_rope_head_dim, nan);
    for (const int id : c.layer_ids) kv->set_kv(id, s, ckv.data(), kpe.data());
    kv->free(s);
    auto& rec = pools().recurrent_state_pool;
    const auto& rc = rec.config();
    const auto rs = rec.alloc(rec.available());
    std::vector<float> r(rs.size() * rc.num_heads * rc.head_k_dim * rc.head_v_dim, nan),
        v(rs.size() * (rc.conv_kernel - 1) * rc.conv_dim, nan);
    for (const int id : rc.layer_ids) rec.set_linear_recurrent_layer_cache(id, rs, r.data(), v.data());
    rec.free(rs);
  }
};

// A hit at n restores what computing the prefix gives: the KDA state and the MLA KV rows of a cold run
// at n, at the chunk edges (63, 64, 65), one token, a cache interval, and a whole previous turn; the rest
// of the prompt then runs to the cold run's rows.
TEST(HybridCache, AHitRestoresExactlyTheStateOfComputingThePrefix) {
  Rig rig;
  auto& rtp = rig.pools().req_to_token_pool;
  std::vector<int32_t> prompt(200);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % 8192);
  const int32_t L = 200;
  // Cold: the whole prompt in one pass, its state and rows at every n (n tokens, one pass).
  for (const int32_t n : {1, 63, 64, 65, 128, 177}) {
    SCOPED_TRACE("hit at " + std::to_string(n));
    const int32_t cold = rtp.alloc(1)[0];
    rig.extend(cold, prompt, 0, n);
    const auto cold_state = rig.state(cold);
    const auto cold_kv = rig.kv_rows(cold, n);
    const auto cold_rest = rig.extend(cold, prompt, n, L - n);
    rtp.free(std::vector<int32_t>{cold});

    mem_cache::RadixCache cache(rig.pools().recurrent_state_pool, size_t{64} << 20,
                                rig.pools().token_to_kv_pool.get());
    {
      // The writer ran the prefix in chunks of 50 (another chunking than the cold run's) and finished.
      const int32_t w = rtp.alloc(1)[0];
      for (int32_t s = 0; s < n; s += 50) rig.extend(w, prompt, s, std::min(50, n - s));
      const auto snap = cache.insert(prompt, n, rtp.slot_of(w), rtp.req_to_token(w));
      ASSERT_TRUE(snap.created);
      rtp.free(std::vector<int32_t>{w});
    }
    rig.poison_free();
    const auto m = cache.match_prefix(std::span<const int32_t>(prompt).first(L - 1));
    ASSERT_TRUE(m.hit);
    ASSERT_EQ(m.hit.len, n);
    const int32_t hot = rtp.alloc(1)[0];
    rig.pools().recurrent_state_pool.copy_slot(m.hit.slot, rtp.slot_of(hot));
    rtp.share_tokens(hot, m.kv_slots);
    EXPECT_LE(ratio(rig.state(hot), cold_state), 1.0);
    EXPECT_LE(ratio(rig.kv_rows(hot, n), cold_kv), 1.0);
    const auto hot_rest = rig.extend(hot, prompt, n, L - n);
    EXPECT_LE(ratio(hot_rest, cold_rest), 1.0);
    rtp.free(std::vector<int32_t>{hot});
    cache.check_invariants();
  }
}

// The scheduler driven step by step: a request aborted mid-prefill with pending snapshots leaves the cache
// consistent, and the next request's hit is exact; KV rows shared by two requests survive one finishing.
TEST(HybridCache, AbortMidPrefillAndSharedRowsOutlivingAHolder) {
  Rig rig;
  auto& rtp = rig.pools().req_to_token_pool;
  mem_cache::RadixCache cache(rig.pools().recurrent_state_pool, size_t{64} << 20,
                              rig.pools().token_to_kv_pool.get());
  std::vector<int32_t> prompt(160);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 104729 + 5) % 8192);
  // Cold rows of the whole prompt.
  const int32_t c = rtp.alloc(1)[0];
  const auto cold = rig.extend(c, prompt, 0, 160);
  rtp.free(std::vector<int32_t>{c});

  std::vector<RequestSpec> reqs(3);
  for (int i = 0; i < 3; ++i) {
    reqs[i].id = i;
    reqs[i].prompt_len = 160;
    reqs[i].output_len = i == 2 ? 0 : 3;
    reqs[i].arrival_step = i == 0 ? 0 : 1000;  // held back until the test lets them in
  }
  SchedulerOptions so;
  so.token_budget = 64;
  so.cache = &cache;
  so.cache_interval = 64;
  Scheduler sched(reqs, so, rtp);
  for (int i = 0; i < 3; ++i) sched.set_prompt(i, prompt);
  auto run = [&](const ScheduledBatch& b) {
    auto fb = sched.forward_batch(b);
    std::vector<int32_t> ids;
    for (const auto& row : b.rows)
      for (int32_t p = row.start; p < row.start + row.len; ++p) ids.push_back(p < 160 ? prompt[p] : 1);
    std::vector<float> out(ids.size() * static_cast<size_t>(rig.D));
    rig.runner->forward(fb, ids.data(), out.data());
    for (const auto& row : b.rows)
      if (row.decode) sched.add_fed_token(row.seq, 1);
    return out;
  };
  // Request 0: one chunk of 64 (the snapshot at 64 commits), then abort with 128 and 159 pending.
  auto b = sched.schedule();
  ASSERT_EQ(b.prefill_tokens, 64);
  run(b);
  sched.complete(b);
  EXPECT_GE(cache.pending_snapshots(), 1);
  StepEvents ev;
  sched.finish_now(sched.seq_index(0, 0), ev);
  EXPECT_EQ(cache.pending_snapshots(), 0);
  EXPECT_NO_THROW(cache.check_invariants());
  rig.poison_free();
  // Request 1 hits at 64 and computes the rest to the cold rows.
  ASSERT_TRUE(sched.skip_to_next_arrival());
  std::vector<float> rows;
  int64_t hit = -1;
  while (sched.sequences()[sched.seq_index(1, 0)].phase != SeqPhase::kDecode) {
    b = sched.schedule();
    ASSERT_FALSE(b.empty());
    if (hit < 0) hit = b.cached_tokens;
    const auto out = run(b);
    for (size_t i = 0, t = 0; i < b.rows.size(); t += static_cast<size_t>(b.rows[i].len), ++i)
      if (sched.sequences()[b.rows[i].seq].request == 1)
        rows.insert(rows.end(), out.begin() + static_cast<std::ptrdiff_t>(t * rig.D),
                    out.begin() + static_cast<std::ptrdiff_t>((t + b.rows[i].len) * rig.D));
    sched.complete(b);
  }
  EXPECT_EQ(hit, 64);
  ASSERT_EQ(rows.size(), static_cast<size_t>((160 - 64) * rig.D));
  EXPECT_LE(ratio(rows, std::vector<float>(cold.begin() + 64 * rig.D, cold.end())), 1.0);
  // Request 2 (same prompt) hits at 159 and shares those rows with the cache; request 1 still holds its own.
  b = sched.schedule();
  ASSERT_EQ(b.cached_tokens, 159);
  const int32_t r2 = sched.sequences()[sched.seq_index(2, 0)].req_pool_index;
  ASSERT_GE(r2, 0);
  const std::vector<int32_t> shared(rtp.req_to_token(r2).begin(), rtp.req_to_token(r2).end());
  ASSERT_EQ(shared.size(), 159u);
  const auto before = rig.kv_rows(r2, 159);
  // The cache lets go of everything it can (request 2's references keep its rows), then request 1 ends.
  cache.evict(cache.evictable_snapshots());
  sched.finish_now(sched.seq_index(1, 0), ev);
  for (const int32_t s : shared) EXPECT_GE(rig.pools().token_to_kv_pool->ref_count(s), 1);
  rig.poison_free();
  EXPECT_EQ(rig.kv_rows(r2, 159), before);
  while (!b.empty()) {
    run(b);
    sched.complete(b);
    b = sched.schedule();
  }
  EXPECT_TRUE(sched.done());
  EXPECT_NO_THROW(cache.check_invariants());
  auto* kv = rig.pools().token_to_kv_pool.get();
  EXPECT_EQ(kv->size() - kv->available(), cache.kv_tokens());
}

}  // namespace
}  // namespace kda::serving
