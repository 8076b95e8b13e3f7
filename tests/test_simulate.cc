// kda simulate: the serving scheduler over the whole Kimi-Linear decoder. Outputs must not depend on
// batching, slot assignment, slot reuse or forking (each request's tokens equal the request run alone), the
// pools must make requests wait when full, and bad workloads and options must fail before any work.
// Small synthetic models keep the suite fast: hidden 256, KDA 2 heads x 128, a dense MLP then MoE layers of
// top-2 of 4 experts; small_config() has 3 KDA layers only (the prefix cache and speculative decoding
// serve it), hybrid_config() the real pattern's shape in little (KDA, KDA, MLA, KDA).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <thread>

#include "kda/distributed/in_process.h"
#include "kda/io/npy.h"
#include "kda/io/safetensors.h"
#include "kda/mem_cache/radix_cache.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/scheduler.h"
#include "kda/serving/self_check.h"
#include "kda/serving/simulate.h"
#include "kda/serving/simulate_plan.h"
#include "kda/serving/speculative.h"
#include "kda/serving/trace.h"
#include "support/cache_compare.h"
#include "support/small_model_config.h"
#include "support/test_support.h"

namespace kda::serving {
namespace {

// bf16 rows independent of their batch for this binary, as `kda simulate` asks whenever its bf16
// self-check runs (layers/onednn_isa.h): on a CPU with AMX the self-check's loose bound would not see a
// corrupted restore.
[[maybe_unused]] ::testing::Environment* const kBatchInvariance = kda::testing::ask_batch_invariance();

using ::testing::HasSubstr;

// The model fields at small widths (tests/support/small_model_config.h), vocab 8192.
io::KimiLinearConfig small_config() { return kda::testing::small_model_config({1, 2, 3}, {}, 8192); }
// Decoder layer 2 (0-based) is an MLA layer, as in the real pattern's first four layers' shape.
io::KimiLinearConfig hybrid_config() { return kda::testing::small_model_config({1, 2, 4}, {3}, 8192); }

SimulateOptions small_options(std::vector<RequestSpec> reqs) {
  return kda::testing::simulate_test_options(small_config(), std::move(reqs));
}

// One request slot's bytes over the 3 KDA layers (both configs): recurrent fp32 + conv state.
int64_t slot_bytes(Precision p = Precision::FP32) {
  return 3 * (2 * 128 * 128 * 4 + 3 * 3 * 2 * 128 * (p == Precision::BF16 ? 2 : 4));
}

// The self-check ran and passed; the value it reached is printed beside its bound (the headroom shows in
// the test log).
void expect_check_passes(const SimulateResult& r) {
  ASSERT_TRUE(r.check.has_value());
  std::printf("  self-check %s %s: worst %.3g, bound %.3g\n", to_string(r.precision), r.check->metric.c_str(),
              r.check->worst, r.check->bound);
  EXPECT_TRUE(r.check->ok) << r.check->metric << " " << r.check->worst << " > " << r.check->bound;
}

RequestSpec request(int64_t id, int32_t prompt_len, int32_t output_len, int64_t arrival_step) {
  RequestSpec r;
  r.id = id;
  r.prompt_len = prompt_len;
  r.output_len = output_len;
  r.arrival_step = arrival_step;
  return r;
}

std::map<std::string, std::vector<float>> outputs_by_key(const SimulateResult& r) {
  std::map<std::string, std::vector<float>> m;
  for (const auto& s : r.serve.outputs) m[output_key(s, r.parallel_samples)] = s.rows;
  return m;
}

// Worst fp32 error ratio (spec: |a - b| <= 1e-5 + 1e-5 |b|) between two runs' outputs, every key of
// `ref` present in `got` with the same size.
double worst_ratio(const std::map<std::string, std::vector<float>>& got,
                   const std::map<std::string, std::vector<float>>& ref) {
  double worst = 0.0;
  for (const auto& [key, b] : ref) {
    const auto it = got.find(key);
    if (it == got.end() || it->second.size() != b.size() || b.empty()) {
      ADD_FAILURE() << key << ": missing or of another size";
      return INFINITY;
    }
    worst = std::max(worst, testing::max_error_ratio(it->second.data(), b.data(), b.size(), 1e-5, 1e-5));
  }
  return worst;
}

std::vector<RequestSpec> varied_workload() {
  auto reqs = make_workload(8, {5, 150}, 6, 11);
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].arrival_step = static_cast<int64_t>(i % 3) * 2;
  reqs[3].output_len = 0;  // a prefill-only request
  return reqs;
}

TEST(Simulate, OutputsDoNotDependOnBatching) {
  auto big = small_options(varied_workload());
  big.server_args.chunked_prefill_size = 4096;
  big.server_args.enable_mixed_chunk = true;
  const auto a = run_simulation(big);

  auto small = small_options(varied_workload());
  small.server_args.chunked_prefill_size = 97;
  small.max_batch = 3;
  small.state_memory = 4 * slot_bytes();  // 4 slots: other slots, reused
  const auto b = run_simulation(small);

  ASSERT_EQ(a.serve.requests_completed, 8);
  ASSERT_EQ(b.serve.requests_completed, 8);
  EXPECT_GT(a.serve.mixed_steps, 0);
  EXPECT_EQ(b.serve.mixed_steps, 0);
  EXPECT_GT(b.serve.steps, a.serve.steps);
  EXPECT_EQ(b.pool_slots, 4);
  EXPECT_GT(b.serve.slot_reuses, 0);
  EXPECT_EQ(a.serve.prefill_tokens, b.serve.prefill_tokens);
  EXPECT_EQ(a.serve.decode_tokens, 7 * 6);
  const auto ka = outputs_by_key(a), kb = outputs_by_key(b);
  ASSERT_EQ(ka.size(), 8u);
  for (const auto& r : varied_workload())
    EXPECT_EQ(ka.at("req_" + std::to_string(r.id)).size(),
              static_cast<size_t>((r.prompt_len + r.output_len) * 256));
  EXPECT_LE(worst_ratio(kb, ka), 1.0);
}

TEST(Simulate, ReusedSlotsLeakNoStateAndTheSelfCheckPasses) {
  auto o = small_options(make_workload(6, {3, 40}, 5, 3));
  o.state_memory = 2 * slot_bytes();
  o.check = 6;  // every request re-run alone on a fresh pool
  const auto r = run_simulation(o);
  EXPECT_EQ(r.serve.requests_completed, 6);
  EXPECT_EQ(r.pool_slots, 2);
  EXPECT_EQ(r.serve.peak_slots, 2);
  EXPECT_EQ(r.serve.slot_reuses, 4);
  expect_check_passes(r);
  EXPECT_EQ(r.check->request_ids.size(), 6u);

  // And independently of the check: request 4 alone in a simulation of its own.
  auto alone = small_options({o.requests[4]});
  const auto ra = run_simulation(alone);
  EXPECT_LE(worst_ratio(outputs_by_key(r), outputs_by_key(ra)), 1.0);
}

TEST(Simulate, ForkedContinuationsEqualFreshRuns) {
  auto o = small_options(make_workload(2, {20, 70}, 4, 5));
  o.parallel_samples = 3;
  o.state_memory = 4 * slot_bytes();  // one request and its forks at a time (+1)
  o.server_args.chunked_prefill_size = 32;
  const auto r = run_simulation(o);
  EXPECT_EQ(r.serve.requests_completed, 2);
  EXPECT_EQ(r.serve.decode_tokens, 2 * 3 * 4);
  const auto k = outputs_by_key(r);
  ASSERT_EQ(k.size(), 6u);
  for (const auto& req : o.requests) {
    const std::string base = "req_" + std::to_string(req.id);
    const size_t prompt = static_cast<size_t>(req.prompt_len) * 256;
    // The continuations share the prompt and, decoding greedily, generate the same tokens.
    EXPECT_TRUE(std::equal(k.at(base + "_s0").begin(), k.at(base + "_s0").begin() + prompt,
                           k.at(base + "_s2").begin()));
    const auto& o0 = r.serve.outputs[req.id * 3];
    EXPECT_EQ(o0.tokens.size(), 5u);
    EXPECT_EQ(o0.tokens, r.serve.outputs[req.id * 3 + 1].tokens);
    EXPECT_EQ(o0.tokens, r.serve.outputs[req.id * 3 + 2].tokens);
    for (int32_t j = 0; j < 3; ++j) {
      RequestSpec fresh = req;
      fresh.sample_base = j;  // the parent's prompt, then continuation j, with no fork
      const auto f = run_simulation(small_options({fresh}));
      const auto fk = outputs_by_key(f);
      ASSERT_EQ(fk.count(base), 1u);
      const std::string key = base + "_s" + std::to_string(j);
      EXPECT_LE(worst_ratio({{key, k.at(key)}}, {{key, fk.at(base)}}), 1.0) << key;
    }
  }
}

TEST(Simulate, FullPoolMakesRequestsWaitAndAllComplete) {
  auto reqs = make_workload(7, {2, 30}, 3, 9);
  reqs[5].arrival_step = 40;  // arrives after an idle gap
  auto o = small_options(reqs);
  o.state_memory = slot_bytes() + slot_bytes() / 2;  // one slot
  o.server_args.enable_mixed_chunk = true;
  o.check = 2;
  const auto r = run_simulation(o);
  EXPECT_EQ(r.serve.requests_completed, 7);
  EXPECT_EQ(r.pool_slots, 1);
  EXPECT_EQ(r.serve.peak_slots, 1);
  EXPECT_EQ(r.serve.slot_reuses, 6);
  expect_check_passes(r);
}

TEST(Simulate, StopsAfterTheCurrentStepWhenAsked) {
  auto o = small_options(make_workload(4, {10, 20}, 8, 1));
  o.max_batch = 1;
  o.check = 2;
  std::atomic<bool> stop{false};
  int64_t steps_seen = 0;
  o.stop = &stop;
  o.progress = [&](const ProgressInfo& p) {
    steps_seen = p.steps;
    if (p.steps == 3) stop = true;
  };
  const auto r = run_simulation(o);
  EXPECT_TRUE(r.serve.interrupted);
  EXPECT_EQ(r.serve.steps, 3);
  EXPECT_EQ(steps_seen, 3);
  EXPECT_LT(r.serve.requests_completed, 4);
  EXPECT_FALSE(r.check.has_value());  // skipped
  EXPECT_EQ(to_json(r)["interrupted"], true);
}

TEST(Simulate, DecodesAreNotStarvedByAStreamOfPrompts) {
  // One request decodes while long prompts keep coming: without --mixed, at most 4 prefill steps run
  // in a row while it waits.
  std::vector<RequestSpec> reqs = {request(0, 4, 6, 0)};
  for (int i = 1; i <= 6; ++i) reqs.push_back(request(i, 200, 1, 1));
  auto o = small_options(reqs);
  o.server_args.chunked_prefill_size = 50;
  const auto r = run_simulation(o);
  EXPECT_EQ(r.serve.requests_completed, 7);
  EXPECT_GT(r.serve.decode_steps, 0);

  // The scheduler itself: request 0 finishes its 6 decodes within the first 6 * 5 + 1 steps.
  models::ModelOptions mo;
  mo.num_layers = 1;
  auto pools = models::KimiLinearForCausalLM::synthetic(small_config(), mo, 1)->make_pools(8, 0);
  SchedulerOptions so;
  so.token_budget = 50;
  Scheduler s(reqs, so, pools->req_to_token_pool);
  int64_t finished_at = -1;
  for (int step = 0; step < 200 && !s.done(); ++step) {
    const auto b = s.schedule();
    ASSERT_FALSE(b.empty());
    for (const auto seq : s.complete(b).finished)
      if (seq == 0) finished_at = step;
  }
  EXPECT_TRUE(s.done());
  EXPECT_GE(finished_at, 0);
  EXPECT_LE(finished_at, 6 * 5 + 1);
}

TEST(Simulate, OutputsArchiveHoldsEveryRequest) {
  const auto dir = testing::make_temp_dir("simulate_outputs");
  auto o = small_options(make_workload(3, {4, 9}, 2, 2));
  o.parallel_samples = 2;
  o.keep_outputs = false;
  o.outputs_path = (dir / "out.npz").string();
  const auto r = run_simulation(o);
  const auto npz = io::read_npz(dir / "out.npz");
  ASSERT_EQ(npz.size(), 12u);  // req_ and tokens_ per continuation
  for (const auto& req : o.requests)
    for (int j = 0; j < 2; ++j) {
      const auto& a = npz.at("req_" + std::to_string(req.id) + "_s" + std::to_string(j));
      EXPECT_EQ(a.shape, (std::vector<int64_t>{req.prompt_len + 2, 256}));
      const auto& t = npz.at("tokens_" + std::to_string(req.id) + "_s" + std::to_string(j));
      EXPECT_EQ(t.dtype, io::NpyDType::I32);
      EXPECT_EQ(t.shape, (std::vector<int64_t>{3}));  // output_len + 1 generated tokens
    }
  EXPECT_EQ(r.serve.requests_completed, 3);
}

// --- token workloads ---------------------------------------------------------------------------------

WorkloadOptions small_workload(WorkloadKind kind) {
  WorkloadOptions w;
  w.kind = kind;
  w.requests = 4;
  w.prompt = {3, 9};
  w.output_len = 3;
  w.seed = 5;
  return w;
}

const SequenceOutput& out_of(const SimulateResult& r, int64_t id) {
  for (const auto& q : r.serve.outputs)
    if (q.request_id == id && q.sample == 0) return q;
  throw std::runtime_error("no output of request " + std::to_string(id));
}

TEST(SimulateTokens, RandomWorkloadTokensAreDeterministicAndSelfCheckPasses) {
  for (const Precision p : {Precision::FP32, Precision::BF16}) {
    auto o = small_options(make_workload(small_workload(WorkloadKind::kRandom)));
    o.precision = p;
    o.check = 4;
    o.server_args.chunked_prefill_size = 7;  // prompts in chunks, batched decodes
    const auto a = run_simulation(o);
    const auto b = run_simulation(o);
    ASSERT_EQ(a.serve.requests_completed, 4);
    expect_check_passes(a);
    EXPECT_EQ(a.check->tokens_total, 4 * 4);
    if (p == Precision::FP32) {
      EXPECT_TRUE(a.check->tokens_all_matched());
    }
    for (const auto& req : o.requests) {
      const auto& qa = out_of(a, req.id);
      EXPECT_EQ(qa.tokens.size(), 4u);  // output_len + 1
      EXPECT_EQ(qa.prompt.size(), static_cast<size_t>(req.prompt_len));
      EXPECT_EQ(qa.tokens, out_of(b, req.id).tokens);
      EXPECT_EQ(qa.prompt, out_of(b, req.id).prompt);
      for (const int32_t t : qa.tokens) EXPECT_TRUE(t >= 0 && t < a.vocab);
    }
    const auto j = to_json(a);
    EXPECT_EQ(j["prefill_tokens_computed"], j["prefill_tokens"]);
    int64_t prompt_tokens = 0;
    for (const auto& req : o.requests) prompt_tokens += req.prompt_len;
    EXPECT_EQ(j["prefill_tokens_computed"].get<int64_t>(), prompt_tokens);
    EXPECT_GT(j["ttft_ms_p50"].get<double>(), 0.0);
    EXPECT_LE(j["ttft_ms_p50"].get<double>(), j["ttft_ms_p99"].get<double>());
    EXPECT_EQ(a.serve.ttft_ms.size(), 4u);
    EXPECT_TRUE(j.contains("check_argmax_matched"));
  }
}

TEST(SimulateTokens, BatchingDoesNotChangeTheTokens) {
  auto big = small_options(make_workload(small_workload(WorkloadKind::kRandom)));
  big.server_args.enable_mixed_chunk = true;
  auto small = big;
  small.server_args.enable_mixed_chunk = false;
  small.server_args.chunked_prefill_size = 5;
  small.max_batch = 1;
  small.state_memory = 2 * slot_bytes();
  const auto a = run_simulation(big), b = run_simulation(small);
  for (const auto& req : big.requests) EXPECT_EQ(out_of(a, req.id).tokens, out_of(b, req.id).tokens);
}

// A request that starts from a prefix another request computed is re-run alone after that prefix, computed
// the way the batched run did: inside a longer prompt. With MLA layers too the re-run is exact: the
// absorbed form's head groups do not depend on the rest of the batch (they did, and the turn's MLA rows
// rounded otherwise alone than beside the batch's other turns).
TEST(SimulateTokens, ARequestOnAnotherRequestsPrefixIsReRunBitForBit) {
  for (const bool hybrid : {false, true}) {
    SCOPED_TRACE(hybrid ? "KDA + MLA" : "KDA");
    auto w = small_workload(WorkloadKind::kSharedPrefix);
    w.requests = 4;
    w.shared_prefix_len = 128;  // two chunks of 64: a cache-interval snapshot ends the second
    w.prompt = {5, 20};
    auto o = kda::testing::cache_test_options(hybrid ? hybrid_config() : small_config(), make_workload(w),
                                              true, int64_t{256} << 20);
    o.server_args.chunked_prefill_size = 4096;  // each prompt in one piece
    o.check = 4;
    const auto r = run_simulation(o);
    ASSERT_EQ(r.serve.requests_completed, 4);
    EXPECT_GT(r.serve.prefix_cache_hit_tokens, 0);
    expect_check_passes(r);
    EXPECT_EQ(r.check->worst, 0.0) << "the re-run alone differs from the batched run";
  }
}

// Multi-turn conversations on one system prompt that is not a multiple of the chunk: the second
// conversation starts from the cache-interval snapshot at 64 and takes the branch point's snapshot at 100
// for the others inside its chunk [64, 128). Snapshots leave a request's chunk grid as it is (the state
// inside a chunk comes from a side chunk), so each re-run alone is the batched run bit for bit, with and
// without MLA layers, for every turn of every conversation. Every request reports its hit, its rows kept
// or not: the self-check starts a later turn's session from the first turn's hit.
TEST(SimulateTokens, MultiTurnOnASharedSystemPromptIsReRunBitForBit) {
  for (const auto& [hybrid, check] : {std::pair{false, 12}, {true, 12}, {true, 2}}) {
    SCOPED_TRACE((hybrid ? "KDA + MLA, " : "KDA, ") + std::to_string(check) + " checked");
    auto w = small_workload(WorkloadKind::kMultiTurn);
    w.requests = 4;
    w.turns = 3;
    w.shared_prefix_len = 100;
    w.prompt = {16, 48};
    w.output_len = 16;
    auto o = kda::testing::cache_test_options(hybrid ? hybrid_config() : small_config(), make_workload(w),
                                              true, int64_t{256} << 20);
    o.server_args.chunked_prefill_size = 4096;  // each prompt in one piece
    o.check = check;
    const auto r = run_simulation(o);
    ASSERT_EQ(r.serve.requests_completed, 12);
    expect_check_passes(r);
    EXPECT_EQ(r.check->worst, 0.0) << "the re-run alone differs from the batched run";
    int64_t hits = 0;
    for (int64_t i = 0; i < 12; ++i) {
      const SequenceOutput& q = out_of(r, i);
      if (!q.rows.empty()) {
        EXPECT_EQ(q.cached_tokens, q.rows_from) << i;
      }
      EXPECT_LT(q.cached_tokens, static_cast<int32_t>(q.prompt.size())) << i;
      hits += q.cached_tokens;
      if (i % 3 == 0 && i > 0) {
        EXPECT_GE(q.cached_tokens, 64) << "a first turn after the first conversation's";
      }
    }
    EXPECT_EQ(hits, r.serve.prefix_cache_hit_tokens);
  }
}

TEST(SimulateTokens, SharedPrefixRequestsShareTheirGroupsFirstTokens) {
  auto w = small_workload(WorkloadKind::kSharedPrefix);
  w.requests = 6;
  w.prefix_groups = 2;
  w.shared_prefix_len = 10;
  auto o = small_options(make_workload(w));
  o.check = 2;
  const auto r = run_simulation(o);
  ASSERT_EQ(r.serve.requests_completed, 6);
  expect_check_passes(r);
  for (int64_t i = 0; i < 6; ++i) {
    const auto& p = out_of(r, i).prompt;
    ASSERT_GE(p.size(), 10u + 3u);
    const auto& same = out_of(r, (i + 2) % 6).prompt;  // the same group (i % 2)
    const auto& other = out_of(r, (i + 1) % 6).prompt;
    EXPECT_TRUE(std::equal(p.begin(), p.begin() + 10, same.begin())) << i;
    EXPECT_FALSE(std::equal(p.begin(), p.begin() + 10, other.begin())) << i;
    EXPECT_FALSE(std::equal(p.begin() + 10, p.begin() + 13, same.begin() + 10)) << i;  // own tokens
  }
  EXPECT_EQ(to_json(r)["prefill_tokens_computed"].get<int64_t>(), r.serve.prefill_tokens);
}

TEST(SimulateTokens, MultiTurnPromptsCarryTheConversation) {
  auto w = small_workload(WorkloadKind::kMultiTurn);
  w.requests = 2;
  w.turns = 3;
  w.shared_prefix_len = 4;
  const auto reqs = make_workload(w);
  ASSERT_EQ(reqs.size(), 6u);
  auto o = small_options(reqs);
  o.check = 6;
  o.state_memory = 2 * slot_bytes();
  const auto r = run_simulation(o);
  ASSERT_EQ(r.serve.requests_completed, 6);
  expect_check_passes(r);
  EXPECT_TRUE(r.check->tokens_all_matched());
  int64_t prompt_tokens = 0;
  for (int64_t c = 0; c < 2; ++c)
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t i = c * 3 + k;
      const auto& q = out_of(r, i);
      prompt_tokens += static_cast<int64_t>(q.prompt.size());
      EXPECT_EQ(q.prompt.size(), static_cast<size_t>(reqs[i].prompt_len));
      EXPECT_EQ(q.tokens.size(), 4u);
      // Every conversation starts with the one system prompt.
      EXPECT_TRUE(std::equal(q.prompt.begin(), q.prompt.begin() + 4, out_of(r, 0).prompt.begin()));
      if (k == 0) continue;
      // Turn k's prompt = turn k-1's prompt + its generated tokens + new user tokens.
      std::vector<int32_t> history = out_of(r, i - 1).prompt;
      history.insert(history.end(), out_of(r, i - 1).tokens.begin(), out_of(r, i - 1).tokens.end());
      ASSERT_GT(q.prompt.size(), history.size());
      EXPECT_TRUE(std::equal(history.begin(), history.end(), q.prompt.begin())) << i;
      EXPECT_EQ(reqs[i].after, i - 1);
    }
  EXPECT_EQ(r.serve.prefill_tokens_computed, prompt_tokens);
  // The same workload again: the same tokens.
  const auto r2 = run_simulation(o);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(out_of(r, i).tokens, out_of(r2, i).tokens);
}

TEST(SimulateTokens, LaterTurnsTtftCountsTurnsTwoAndOnOnly) {
  auto w = small_workload(WorkloadKind::kMultiTurn);
  w.requests = 3;
  w.turns = 3;
  w.shared_prefix_len = 4;
  const auto reqs = make_workload(w);
  const auto r = run_simulation(small_options(reqs));
  ASSERT_EQ(r.serve.requests_completed, 9);
  ASSERT_EQ(r.serve.ttft_ms.size(), 9u);
  // Turns 2 and 3 of each conversation: the first turns are left out.
  ASSERT_EQ(r.serve.ttft_later_turns_ms.size(), 6u);
  // Each later turn's sample is its entry among all requests' (both are recorded at its first token).
  auto it = r.serve.ttft_ms.begin();
  for (const double ms : r.serve.ttft_later_turns_ms) {
    it = std::find(it, r.serve.ttft_ms.end(), ms);
    ASSERT_NE(it, r.serve.ttft_ms.end()) << ms;
    ++it;
  }
  EXPECT_EQ(r.ttft_ms_p50_later_turns, percentile(r.serve.ttft_later_turns_ms, 50));
  EXPECT_EQ(r.ttft_ms_p99_later_turns, percentile(r.serve.ttft_later_turns_ms, 99));
  EXPECT_GT(r.ttft_ms_p50_later_turns, 0.0);
  const auto j = to_json(r);
  EXPECT_EQ(j["later_turns"], 6);
  EXPECT_EQ(j["ttft_ms_p50_later_turns"].get<double>(), r.ttft_ms_p50_later_turns);
  EXPECT_EQ(j["ttft_ms_p99_later_turns"].get<double>(), r.ttft_ms_p99_later_turns);

  // No sessions: no later turns, and the figures say 0 rather than repeat the overall TTFT.
  const auto rr = run_simulation(small_options(make_workload(small_workload(WorkloadKind::kRandom))));
  EXPECT_EQ(rr.serve.ttft_ms.size(), 4u);
  EXPECT_TRUE(rr.serve.ttft_later_turns_ms.empty());
  EXPECT_EQ(to_json(rr)["later_turns"], 0);
  EXPECT_EQ(rr.ttft_ms_p50_later_turns, 0.0);
}

TEST(SimulateTokens, TraceWithPromptsAndSessions) {
  const auto reqs = parse_trace(
      "[{\"prompt\": [5, 6, 7], \"output_len\": 2, \"arrival_step\": 0, \"session\": 9, \"turn\": 0},"
      " {\"prompt_len\": 4, \"output_len\": 1, \"arrival_step\": 1},"
      " {\"prompt\": [1, 2], \"output_len\": 2, \"session\": 9, \"turn\": 1},"
      " {\"output_len\": 0, \"session\": 9, \"turn\": 2, \"arrival_step\": 3}]",
      "t.json", 100);
  ASSERT_EQ(reqs.size(), 4u);
  EXPECT_EQ(reqs[0].prompt, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(reqs[0].prompt_len, 3);
  EXPECT_EQ(reqs[1].after, -1);
  EXPECT_EQ(reqs[2].after, 0);
  EXPECT_EQ(reqs[2].prompt_len, 3 + 3 + 2);
  EXPECT_EQ(reqs[3].after, 2);
  EXPECT_EQ(reqs[3].prompt_len, 8 + 3 + 0);
  EXPECT_EQ(reqs[3].arrival_step, 3);
  auto o = small_options(reqs);
  o.vocab = 100;
  o.check = 4;
  const auto r = run_simulation(o);
  ASSERT_EQ(r.serve.requests_completed, 4);
  EXPECT_EQ(r.vocab, 100);
  expect_check_passes(r);
  const auto& t1 = out_of(r, 2);
  std::vector<int32_t> want = {5, 6, 7};
  want.insert(want.end(), out_of(r, 0).tokens.begin(), out_of(r, 0).tokens.end());
  want.push_back(1);
  want.push_back(2);
  EXPECT_EQ(t1.prompt, want);
  EXPECT_EQ(out_of(r, 3).tokens.size(), 1u);  // output_len 0: the prompt's first token only
}

// With and without the prefix cache: every rank runs the same schedule over its shards, so every rank
// keeps the same tree, and TP 2 with the cache gives TP 1's tokens and hits.
TEST(SimulateTokens, TensorParallelTwoGivesTheTokensOfOne) {
  for (const bool cache : {false, true}) {
    SCOPED_TRACE(cache ? "prefix cache on" : "prefix cache off");
    auto w = small_workload(WorkloadKind::kMultiTurn);
    w.requests = 2;
    w.turns = 2;
    auto o = small_options(make_workload(w));
    o.check = 1;
    o.server_args.disable_radix_cache = !cache;
    const auto one = run_simulation(o);
    if (cache) {
      EXPECT_GT(one.serve.prefix_cache_hit_tokens, 0);
    }
    distributed::InProcessGroup group(2);
    std::vector<SimulateResult> res(2);
    ASSERT_NO_THROW(group.run([&](int rank, distributed::Communicator& comm) {
      auto ot = o;
      ot.tp = {rank, 2, &comm};
      res[rank] = run_simulation(ot);
    }));
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_EQ(res[rank].serve.requests_completed, 4);
      expect_check_passes(res[rank]);
      for (int64_t i = 0; i < 4; ++i) {
        EXPECT_EQ(out_of(res[rank], i).tokens, out_of(one, i).tokens) << "rank " << rank << " request " << i;
        EXPECT_EQ(out_of(res[rank], i).prompt, out_of(one, i).prompt);
        EXPECT_EQ(out_of(res[rank], i).rows_from, out_of(one, i).rows_from);
      }
      EXPECT_EQ(res[rank].serve.prefix_cache_hit_tokens, one.serve.prefix_cache_hit_tokens);
    }
    EXPECT_LE(worst_ratio(outputs_by_key(res[0]), outputs_by_key(one)), 1.0);
  }
}

TEST(SimulateTokens, DataParallelKeepsConversationsInOneGroup) {
  auto w = small_workload(WorkloadKind::kMultiTurn);
  w.requests = 3;
  w.turns = 2;
  // With the prefix cache too: a cache per group, the hits (and rows_from) gathered with the outputs.
  for (const bool cache : {false, true}) {
    SCOPED_TRACE(cache ? "prefix cache on" : "prefix cache off");
    auto o = small_options(make_workload(w));
    o.server_args.disable_radix_cache = !cache;
    const auto one = run_simulation(o);
    distributed::InProcessGroup world(2);
    std::vector<SimulateResult> res(2);
    ASSERT_NO_THROW(world.run([&](int rank, distributed::Communicator& comm) {
      auto od = o;
      od.dp = 2;
      od.dp_rank = rank;
      od.world = &comm;
      res[rank] = run_simulation(od);
    }));
    ASSERT_EQ(res[0].serve.requests_completed, 6);
    for (int64_t i = 0; i < 6; ++i) {
      EXPECT_EQ(out_of(res[0], i).tokens, out_of(one, i).tokens) << i;
      EXPECT_EQ(out_of(res[0], i).prompt, out_of(one, i).prompt) << i;
      EXPECT_EQ(out_of(res[0], i).rows_from, out_of(one, i).rows_from) << i;
      EXPECT_EQ(out_of(res[0], i).rows.size(), out_of(one, i).rows.size()) << i;
    }
    EXPECT_EQ(res[0].serve.prefix_cache_hit_tokens, one.serve.prefix_cache_hit_tokens);
    if (cache) {
      EXPECT_GT(res[0].serve.prefix_cache_hit_tokens, 0);
    }
  }
}

// --- errors before any work --------------------------------------------------------------------------

void expect_invalid(const std::function<void()>& f, const std::string& substr) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << substr << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr(substr));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
  }
}

// Prefix cache. A run with the cache must generate the tokens of a run without it, and every
// row it computed must match the cold run's row at the same position (a hit's rows start at rows_from).
SimulateOptions cache_options(std::vector<RequestSpec> reqs, bool cache) {
  return kda::testing::cache_test_options(small_config(), std::move(reqs), cache, 64 * slot_bytes());
}

using kda::testing::expect_same_as_cold;

WorkloadOptions cache_workload(WorkloadKind kind) {
  auto w = small_workload(kind);
  w.requests = 6;
  w.prompt = {20, 90};
  w.shared_prefix_len = kind == WorkloadKind::kRandom ? 0 : 100;
  w.prefix_groups = kind == WorkloadKind::kSharedPrefix ? 2 : 1;
  if (kind == WorkloadKind::kMultiTurn) {
    w.requests = 2;
    w.turns = 3;
  }
  return w;
}

TEST(PrefixCache, OnAndOffGiveTheSameTokensAndOutputsOnEveryWorkload) {
  for (const auto kind : {WorkloadKind::kRandom, WorkloadKind::kSharedPrefix, WorkloadKind::kMultiTurn}) {
    SCOPED_TRACE(to_string(kind));
    auto reqs = make_workload(cache_workload(kind));
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i].after < 0) reqs[i].arrival_step = static_cast<int64_t>(i) * 3;  // one after another
    const auto cold = run_simulation(cache_options(reqs, false));
    auto o = cache_options(reqs, true);
    o.check = 2;
    const auto hot = run_simulation(o);
    ASSERT_EQ(hot.serve.requests_completed, cold.serve.requests_completed);
    expect_same_as_cold(hot, cold);
    expect_check_passes(hot);
    EXPECT_EQ(cold.serve.prefix_cache_hit_tokens, 0);
    EXPECT_EQ(hot.serve.prefill_tokens, cold.serve.prefill_tokens);
    EXPECT_EQ(hot.serve.prefill_tokens_computed + hot.serve.prefix_cache_hit_tokens,
              hot.serve.prefill_tokens);
    if (kind != WorkloadKind::kRandom) {
      EXPECT_GT(hot.serve.prefix_cache_hit_tokens, 0);
      EXPECT_LT(hot.serve.prefill_tokens_computed, cold.serve.prefill_tokens_computed);
    }
    const auto j = to_json(hot);
    EXPECT_EQ(j["radix_cache_disabled"], false);
    EXPECT_EQ(j["prefix_cache_hit_tokens"].get<int64_t>(), hot.serve.prefix_cache_hit_tokens);
    EXPECT_GT(j["prefix_cache_snapshots"].get<int64_t>(), 0);
    EXPECT_EQ(j["prefix_cache_bytes"].get<int64_t>(), hot.serve.prefix_cache_snapshots * slot_bytes());
    EXPECT_NEAR(j["prefix_cache_hit_rate"].get<double>(),
                static_cast<double>(hot.serve.prefix_cache_hit_tokens) / hot.serve.prefill_tokens, 1e-12);
  }
}

TEST(PrefixCache, MixedBatchesAndParallelSamplesWithTheCache) {
  for (const auto kind : {WorkloadKind::kSharedPrefix, WorkloadKind::kMultiTurn}) {
    SCOPED_TRACE(to_string(kind));
    const auto reqs = make_workload(cache_workload(kind));
    auto off = cache_options(reqs, false), on = cache_options(reqs, true);
    for (auto* o : {&off, &on}) {
      o->server_args.enable_mixed_chunk = true;
      o->parallel_samples = 2;
      o->state_memory = 5 * slot_bytes();  // forks, requests and snapshots share a small pool
    }
    const auto cold = run_simulation(off);
    const auto hot = run_simulation(on);
    ASSERT_EQ(hot.serve.requests_completed, cold.serve.requests_completed);
    expect_same_as_cold(hot, cold);
    EXPECT_GT(hot.serve.prefix_cache_hit_tokens, 0);
  }
}

TEST(PrefixCache, ATinyBudgetEvictsAllTheTimeAndChangesNothingButSpeed) {
  for (const auto kind : {WorkloadKind::kSharedPrefix, WorkloadKind::kMultiTurn}) {
    SCOPED_TRACE(to_string(kind));
    auto reqs = make_workload(cache_workload(kind));
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i].after < 0) reqs[i].arrival_step = static_cast<int64_t>(i) * 3;
    const auto cold = run_simulation(cache_options(reqs, false));
    auto o = cache_options(reqs, true);
    o.prefix_cache_memory = 2 * slot_bytes();
    o.state_memory = 3 * slot_bytes();  // requests and snapshots compete for a small pool too
    const auto hot = run_simulation(o);
    ASSERT_EQ(hot.serve.requests_completed, cold.serve.requests_completed);
    expect_same_as_cold(hot, cold);
    EXPECT_GT(hot.serve.prefix_cache_evictions, 0);
    EXPECT_LE(hot.serve.prefix_cache_snapshots, 2);
  }
}

TEST(PrefixCache, Bf16SelfCheckPassesWithTheCache) {
  auto w = cache_workload(WorkloadKind::kMultiTurn);
  auto o = cache_options(make_workload(w), true);
  o.precision = Precision::BF16;
  o.prefix_cache_memory = 64 * slot_bytes(Precision::BF16);
  o.check = 6;
  const auto r = run_simulation(o);
  ASSERT_EQ(r.serve.requests_completed, 6);
  EXPECT_GT(r.serve.prefix_cache_hit_tokens, 0);
  expect_check_passes(r);
  // Reached 1.2e-3 (1.4e-4 with the KDA layers alone, before the MLPs): snapshot positions end chunks the
  // re-run does not.
  EXPECT_LE(r.check->worst, 3.5e-3);
}

// A later turn's history restored from the cache, computed by decode steps, is re-run the same way (the
// session's turns alone with a cache of the re-run's own), so a bf16 multi-turn run passes its check on
// the whole hybrid model; and a restore the batched run got wrong (every slot's state in every KDA layer
// negated once the first turn finished, so the second turn's snapshot restores it) fails it. (One layer's
// alone took the check's worst to 0.097 or to 0.0074 against its 0.012 bound, as a bf16 near-tie in the
// first turn's greedy tokens went one way or the other; every layer's takes it to 0.05-0.11.)
TEST(PrefixCache, Bf16MultiTurnCheckPassesAndFailsOnACorruptedRestore) {
  auto w = cache_workload(WorkloadKind::kMultiTurn);
  w.requests = 1;
  w.turns = 2;
  w.output_len = 6;
  auto o = cache_options(make_workload(w), true);
  o.synthetic_config = hybrid_config();
  o.precision = Precision::BF16;
  o.check = 2;
  const Plan p = make_plan(o);
  ASSERT_GT(p.mla_layers, 0);
  auto model = models::KimiLinearForCausalLM::synthetic(p.cfg, model_options(p, o), o.seed);
  for (const bool corrupt : {false, true}) {
    SCOPED_TRACE(corrupt ? "corrupted restore" : "intact");
    ModelRunner runner(*model, p.slots + p.cache_slots, p.kv_tokens, p.kernel);
    mem_cache::RadixCache cache(runner.pools().recurrent_state_pool, static_cast<size_t>(p.cache_budget),
                                runner.pools().token_to_kv_pool.get());
    ServeOptions so;
    so.scheduler = p.sched;
    so.scheduler.cache = &cache;
    so.seed = o.seed;
    so.keep.assign(o.requests.size(), 1);
    bool corrupted = false;
    so.progress = [&](const ProgressInfo& pi) {
      if (!corrupt || corrupted || pi.requests_done != 1) return;
      for (int id = 0; id < p.layers; ++id) {
        try {
          auto l = runner.pools().recurrent_state_pool.get_linear_recurrent_layer_cache(id);
          for (int64_t i = 0; i < l.num_slots * l.recurrent_slot_elems; ++i) l.recurrent[i] = -l.recurrent[i];
          corrupted = true;
        } catch (const std::exception&) {  // not a KDA layer
        }
      }
    };
    const ServeResult served = serve(runner, o.requests, so);
    ASSERT_EQ(served.requests_completed, 2);
    EXPECT_GT(served.prefix_cache_hit_tokens, 0);
    EXPECT_EQ(corrupted, corrupt);
    bool interrupted = false;
    const CheckReport rep = self_check(o, p, *model, served, &interrupted);
    ASSERT_FALSE(interrupted);
    std::printf("  self-check bf16 %s: worst %.3g, bound %.3g\n", rep.metric.c_str(), rep.worst, rep.bound);
    EXPECT_EQ(rep.ok, !corrupt) << rep.worst << " vs bound " << rep.bound;
  }
}

// Requests arriving together with one long prefix: the first writes the prefix's snapshots, the others
// wait at the queue head for them (Pending -> Ready) and then hit instead of recomputing.
TEST(PrefixCache, RequestsArrivingTogetherWaitForTheSharedPrefixAndHit) {
  auto w = cache_workload(WorkloadKind::kSharedPrefix);
  w.requests = 4;
  w.prefix_groups = 1;
  w.shared_prefix_len = 200;
  const auto reqs = make_workload(w);  // every one arrives at step 0
  auto off = cache_options(reqs, false), on = cache_options(reqs, true);
  // One step could prefill them all: without the wait none would hit.
  off.server_args.chunked_prefill_size = on.server_args.chunked_prefill_size = 4096;
  const auto cold = run_simulation(off);
  const auto hot = run_simulation(on);
  expect_same_as_cold(hot, cold);
  EXPECT_EQ(cold.serve.extend_steps, 1);
  // Request 0 alone (writing 64, 128, 192); request 1 from 192, writing the branch point 200; 2 and 3
  // wait for that one and start from 200.
  EXPECT_EQ(hot.serve.extend_steps, 3);
  EXPECT_EQ(hot.serve.prefix_cache_hit_tokens, 192 + 200 + 200);
  EXPECT_LT(hot.serve.prefill_tokens_computed, cold.serve.prefill_tokens_computed);
}

// The engine with a cache of its own: after the run the tree is consistent, nothing is left Pending or
// locked, and every slot of the pool is either free or a snapshot's (the requests freed theirs).
TEST(PrefixCache, AfterServingTheTreeIsConsistentAndEverySlotIsAccountedFor) {
  const auto reqs = make_workload(cache_workload(WorkloadKind::kMultiTurn));
  auto model = models::KimiLinearForCausalLM::synthetic(small_config(), {}, 7);
  ModelRunner runner(*model, 6, 0, kernels::KernelImpl::Auto);
  auto& pool = runner.pools().recurrent_state_pool;
  mem_cache::RadixCache cache(pool, 3 * pool.bytes_per_slot());
  ServeOptions so;
  so.scheduler.token_budget = 48;
  so.scheduler.cache = &cache;
  so.scheduler.cache_interval = 64;
  so.seed = 5;
  const auto r = serve(runner, reqs, so);
  EXPECT_EQ(r.requests_completed, static_cast<int64_t>(reqs.size()));
  EXPECT_GT(r.prefix_cache_hit_tokens, 0);
  EXPECT_NO_THROW(cache.check_invariants());
  EXPECT_EQ(cache.pending_snapshots(), 0);
  EXPECT_EQ(cache.evictable_snapshots(), cache.snapshots());  // none locked
  EXPECT_EQ(pool.available() + cache.snapshots(), pool.size());
  EXPECT_EQ(r.prefix_cache_snapshots, cache.snapshots());
  EXPECT_EQ(r.prefix_cache_evictions, cache.evictions());
}

TEST(PrefixCache, BadCacheOptionsAreClearErrors) {
  auto o = cache_options(make_workload(cache_workload(WorkloadKind::kRandom)), true);
  o.cache_interval = 100;
  expect_invalid([&] { run_simulation(o); }, "--cache-interval must be a positive multiple of 64");
  o.cache_interval = 64;
  o.prefix_cache_memory = slot_bytes() - 1;
  expect_invalid([&] { run_simulation(o); }, "--prefix-cache-memory");
}

// --- the whole model with an MLA layer (hybrid_config) --------------------------------------------------

SimulateOptions hybrid_options(std::vector<RequestSpec> reqs) {
  auto o = small_options(std::move(reqs));
  o.synthetic_config = hybrid_config();
  return o;
}

// MLA KV bytes per token of hybrid_config's one MLA layer (kv_lora 64 + rope 16 values) in fp32.
constexpr int64_t kHybridKvTokenBytes = (64 + 16) * 4;

// Batching, chunking and slot reuse change nothing with an MLA layer either; every request's KV token
// slots are freed with it (the run's accounting), and the self-check passes.
TEST(WholeModel, OutputsDoNotDependOnBatchingAndKvIsFreedWithRequests) {
  auto big = hybrid_options(varied_workload());
  big.server_args.chunked_prefill_size = 4096;
  big.server_args.enable_mixed_chunk = true;
  const auto a = run_simulation(big);

  auto small = hybrid_options(varied_workload());
  small.server_args.chunked_prefill_size = 97;
  small.max_batch = 3;
  small.state_memory = 4 * slot_bytes();
  small.check = 3;
  const auto b = run_simulation(small);

  for (const auto* r : {&a, &b}) {
    ASSERT_EQ(r->serve.requests_completed, 8);
    EXPECT_EQ(r->layers, 4);
    EXPECT_EQ(r->kda_layers, 3);
    EXPECT_EQ(r->mla_layers, 1);
    EXPECT_EQ(r->moe_layers, 3);
    EXPECT_EQ(r->num_experts, 4);
    EXPECT_EQ(r->experts_per_token, 2);
    EXPECT_EQ(r->kv_token_bytes, kHybridKvTokenBytes);
    EXPECT_GT(r->serve.peak_kv_tokens, 0);
    EXPECT_LE(r->serve.peak_kv_tokens, r->kv_tokens);
    EXPECT_EQ(r->leaked_kv_tokens, 0);
    EXPECT_TRUE(r->accounting_ok()) << r->accounting_error;
    EXPECT_GT(r->active_params, 0);
    EXPECT_GT(r->model_weight_bytes, r->active_weight_bytes);  // 2 of 4 experts read per token
  }
  int64_t kv_total = 0;
  for (const auto& r : varied_workload()) kv_total += r.prompt_len + r.output_len;
  EXPECT_EQ(a.kv_tokens, kv_total);
  EXPECT_EQ(a.kv_bytes, (kv_total + 1) * kHybridKvTokenBytes);  // row 0 is reserved
  EXPECT_GT(b.serve.slot_reuses, 0);
  expect_check_passes(b);
  const auto ka = outputs_by_key(a), kb = outputs_by_key(b);
  ASSERT_EQ(ka.size(), 8u);
  EXPECT_LE(worst_ratio(kb, ka), 1.0);
  for (size_t i = 0; i < a.serve.outputs.size(); ++i)
    EXPECT_EQ(a.serve.outputs[i].tokens, b.serve.outputs[i].tokens) << "sequence " << i;
}

// A KV pool that holds one request's tokens at a time: the others wait at admission (never a failed
// alloc mid-step), every request completes, and the outputs are those of a roomy pool. The freed token
// slots are reused by the next request, whose rows must not see the previous one's.
TEST(WholeModel, ASmallKvPoolMakesRequestsWaitAndChangesNothing) {
  auto reqs = make_workload(5, {10, 60}, 4, 21);
  int64_t most = 0;
  for (const auto& r : reqs) most = std::max<int64_t>(most, r.prompt_len + r.output_len);
  auto roomy = hybrid_options(reqs);
  const auto a = run_simulation(roomy);
  auto tight = hybrid_options(reqs);
  tight.kv_memory = most * kHybridKvTokenBytes;
  tight.check = 2;
  const auto b = run_simulation(tight);
  EXPECT_EQ(b.kv_tokens, most);
  EXPECT_LE(b.serve.peak_kv_tokens, most);
  EXPECT_LT(b.serve.peak_slots, a.serve.peak_slots);  // the KV pool, not the state pool, made them wait
  ASSERT_EQ(b.serve.requests_completed, 5);
  EXPECT_EQ(b.leaked_kv_tokens, 0);
  expect_check_passes(b);
  EXPECT_LE(worst_ratio(outputs_by_key(b), outputs_by_key(a)), 1.0);
  for (size_t i = 0; i < a.serve.outputs.size(); ++i)
    EXPECT_EQ(a.serve.outputs[i].tokens, b.serve.outputs[i].tokens) << "sequence " << i;
}

// A KV pool too small for one request is a clear error before any work (the plan), and so is a scheduler
// handed such a pool; a prefix cache on a model with MLA layers must hold the prefix's MLA KV rows too
// (attached to the KV pool), else the scheduler refuses it; the plan serves with it.
TEST(WholeModel, KvPoolTooSmallAndADetachedPrefixCacheAreClearErrors) {
  auto reqs = make_workload(3, {10, 30}, 4, 2);
  bool built = false;
  auto o = hybrid_options(reqs);
  o.log = [&](const std::string&) { built = true; };
  int64_t most = 0;
  for (const auto& r : reqs) most = std::max<int64_t>(most, r.prompt_len + r.output_len);
  o.kv_memory = (most - 1) * kHybridKvTokenBytes;
  expect_invalid([&] { run_simulation(o); }, "but a request needs " + std::to_string(most));
  o.kv_memory = 0;
  expect_invalid([&] { run_simulation(o); }, "--kv-memory must be positive");
  EXPECT_FALSE(built);

  auto model = models::KimiLinearForCausalLM::synthetic(hybrid_config(), {}, 3);
  auto pools = model->make_pools(4, most - 1);
  SchedulerOptions so;
  expect_invalid([&] { Scheduler(reqs, so, pools->req_to_token_pool); }, "MLA KV token slots");
  auto roomy = model->make_pools(4, 1000);
  mem_cache::RadixCache cache(roomy->recurrent_state_pool, roomy->recurrent_state_pool.bytes_per_slot());
  so.cache = &cache;
  expect_invalid([&] { Scheduler(reqs, so, roomy->req_to_token_pool); }, "not attached to its MLA KV pool");

  auto c = hybrid_options(reqs);
  c.server_args.disable_radix_cache = false;
  const auto r = run_simulation(c);
  EXPECT_FALSE(r.radix_cache_disabled);
  EXPECT_EQ(r.serve.requests_completed, 3);
  EXPECT_EQ(r.leaked_kv_tokens, 0);
}

// Forked continuations share the parent's prompt KV rows: each equals a fresh run of its own.
TEST(WholeModel, ForkedContinuationsShareThePromptsKvRows) {
  auto o = hybrid_options(make_workload(2, {20, 70}, 4, 5));
  o.parallel_samples = 3;
  o.server_args.chunked_prefill_size = 32;
  const auto r = run_simulation(o);
  EXPECT_EQ(r.serve.requests_completed, 2);
  EXPECT_EQ(r.leaked_kv_tokens, 0);
  const auto k = outputs_by_key(r);
  for (const auto& req : o.requests) {
    const std::string base = "req_" + std::to_string(req.id);
    for (int32_t j = 0; j < 3; ++j) {
      RequestSpec fresh = req;
      fresh.sample_base = j;
      const auto fk = outputs_by_key(run_simulation(hybrid_options({fresh})));
      const std::string key = base + "_s" + std::to_string(j);
      EXPECT_LE(worst_ratio({{key, k.at(key)}}, {{key, fk.at(base)}}), 1.0) << key;
    }
  }
}

// bf16 and int8 weights serve the hybrid model with the self-check passing; tensor parallelism over 2
// ranks gives the tokens of one.
TEST(WholeModel, Bf16Int8AndTensorParallelKeepWorking) {
  const auto reqs = make_workload(4, {8, 40}, 4, 13);
  for (const Weights w : {Weights::BF16, Weights::Int8}) {
    auto o = hybrid_options(reqs);
    o.precision = Precision::BF16;
    o.weights = w;
    o.check = 2;
    const auto r = run_simulation(o);
    EXPECT_EQ(r.serve.requests_completed, 4) << to_string(w);
    expect_check_passes(r);
  }
  auto o = hybrid_options(reqs);
  o.check = 1;
  const auto one = run_simulation(o);
  distributed::InProcessGroup group(2);
  std::vector<SimulateResult> res(2);
  ASSERT_NO_THROW(group.run([&](int rank, distributed::Communicator& comm) {
    auto ot = o;
    ot.tp = {rank, 2, &comm};
    res[rank] = run_simulation(ot);
  }));
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(res[rank].serve.requests_completed, 4);
    expect_check_passes(res[rank]);
    EXPECT_EQ(res[rank].leaked_kv_tokens, 0);
    for (size_t i = 0; i < one.serve.outputs.size(); ++i)
      EXPECT_EQ(res[rank].serve.outputs[i].tokens, one.serve.outputs[i].tokens) << "rank " << rank;
  }
  EXPECT_LE(worst_ratio(outputs_by_key(res[0]), outputs_by_key(one)), 1.0);
}

TEST(Simulate, BadTracesAreClearErrors) {
  expect_invalid([] { parse_trace("[{\"prompt_len\": 3,", "t.json"); }, "t.json: not valid JSON");
  expect_invalid([] { parse_trace("{\"prompt_len\": 3}", "t.json"); }, "must be a JSON list");
  expect_invalid([] { parse_trace("[]", "t.json"); }, "holds no requests");
  expect_invalid([] { parse_trace("[{\"prompt_len\": 3, \"arrival_step\": 0}]", "t.json"); },
                 "request 0: missing field 'output_len'");
  expect_invalid(
      [] {
        parse_trace(
            "[{\"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0},"
            " {\"prompt_len\": 3, \"output_len\": -2, \"arrival_step\": 0}]",
            "t.json");
      },
      "request 1: field 'output_len' must be >= 0, got -2");
  expect_invalid(
      [] { parse_trace("[{\"prompt_len\": 0, \"output_len\": 1, \"arrival_step\": 0}]", "t.json"); },
      "field 'prompt_len' must be >= 1, got 0");
  expect_invalid(
      [] { parse_trace("[{\"prompt_len\": 2.5, \"output_len\": 1, \"arrival_step\": 0}]", "t.json"); },
      "'prompt_len' must be an integer");
  expect_invalid(
      [] { parse_trace("[{\"prompt_len\": 2, \"output_len\": 1, \"arrival_step\": -1}]", "t.json"); },
      "'arrival_step' must be >= 0");
  expect_invalid([] { parse_trace("[3]", "t.json"); }, "request 0 is not an object");
  expect_invalid([] { load_trace("/nonexistent/trace.json"); }, "/nonexistent/trace.json: cannot open");
  // Tokens and sessions.
  expect_invalid(
      [] {
        parse_trace("[{\"prompt\": [1, 9000], \"output_len\": 1, \"arrival_step\": 0}]", "t.json", 8192);
      },
      "t.json: request 0: field 'prompt': token id 9000 at position 1 is >= the vocabulary size 8192");
  expect_invalid(
      [] { parse_trace("[{\"prompt\": [1, -2], \"output_len\": 1, \"arrival_step\": 0}]", "t.json"); },
      "token id -2 at position 1 is negative");
  expect_invalid(
      [] { parse_trace("[{\"prompt\": [1, \"a\"], \"output_len\": 1, \"arrival_step\": 0}]", "t.json"); },
      "is not an integer token id");
  expect_invalid(
      [] {
        parse_trace("[{\"prompt\": [1, 2], \"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0}]",
                    "t.json");
      },
      "field 'prompt_len' 3 is not the 2 ids of 'prompt'");
  expect_invalid(
      [] {
        parse_trace(
            "[{\"prompt_len\": 3, \"output_len\": 1, \"session\": 1, \"turn\": 1},"
            " {\"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0, \"session\": 1, \"turn\": 0}]",
            "t.json");
      },
      "request 0: session 1 turn 1 comes before its predecessor (turn 0, request 1)");
  expect_invalid(
      [] {
        parse_trace(
            "[{\"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0, \"session\": 1, \"turn\": 0},"
            " {\"prompt_len\": 3, \"output_len\": 1, \"session\": 1, \"turn\": 2}]",
            "t.json");
      },
      "request 1: session 1 turn 2: the session has no turn 1");
  expect_invalid(
      [] {
        parse_trace(
            "[{\"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0, \"session\": 1, \"turn\": 0},"
            " {\"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0, \"session\": 1, \"turn\": 0}]",
            "t.json");
      },
      "request 1: session 1 turn 0 is listed after turn 0 (request 0)");
  expect_invalid(
      [] {
        parse_trace("[{\"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0, \"turn\": 0}]", "t.json");
      },
      "field 'turn' needs a 'session'");
  expect_invalid(
      [] {
        parse_trace("[{\"prompt_len\": 3, \"output_len\": 1, \"arrival_step\": 0, \"session\": 0}]",
                    "t.json");
      },
      "missing field 'turn'");
  const auto dir = testing::make_temp_dir("simulate_trace");
  std::ofstream(dir / "ok.json")
      << "[{\"prompt_len\": 3, \"output_len\": 0, \"arrival_step\": 5, \"note\": 1},"
         " {\"prompt_len\": 9, \"output_len\": 4, \"arrival_step\": 0}]";
  const auto ok = load_trace(dir / "ok.json");
  ASSERT_EQ(ok.size(), 2u);
  EXPECT_EQ(ok[0].arrival_step, 5);
  EXPECT_EQ(ok[1].id, 1);
  EXPECT_EQ(ok[1].prompt_len, 9);
  EXPECT_EQ(ok[1].output_len, 4);
}

TEST(Simulate, BadOptionsAreClearErrorsBeforeAnyWork) {
  expect_invalid([] { parse_len_range("64:16", "--prompt-len"); }, "MIN 64 > MAX 16");
  expect_invalid([] { parse_len_range("0:16", "--prompt-len"); }, "must be >= 1");
  expect_invalid([] { parse_len_range("a:16", "--prompt-len"); }, "not an integer");
  EXPECT_EQ(parse_len_range("7", "--prompt-len").max, 7);
  expect_invalid([] { parse_byte_size("2XB", "--state-memory"); }, "unknown unit 'XB'");
  expect_invalid([] { parse_byte_size("-5", "--state-memory"); }, "--state-memory");
  EXPECT_EQ(parse_byte_size("2GiB", "--state-memory"), int64_t{2} << 30);
  EXPECT_EQ(parse_byte_size("512M", "--state-memory"), int64_t{512} << 20);
  expect_invalid([] { make_workload(0, {1, 2}, 1, 0); }, "--requests must be >= 1");

  // The default (real-shape) model would take seconds to build: every error below must come first,
  // before the "building" line is logged.
  bool built = false;
  auto opts = [&] {
    SimulateOptions o;
    o.requests = make_workload(2, {4, 8}, 2, 0);
    o.log = [&](const std::string&) { built = true; };
    return o;
  };
  auto run = [&](SimulateOptions o) { return [o] { run_simulation(o); }; };
  auto o = opts();
  o.layers = 28;
  expect_invalid(run(o), "--layers 28: must be in 0..27");
  o = opts();
  o.num_experts = -1;
  expect_invalid(run(o), "--experts must be in 1..");
  o = opts();
  o.num_experts = 300;
  expect_invalid(run(o), "--experts 300: the config has 256 routed experts per MoE layer");
  o = opts();
  o.num_experts = 256;  // the real model's experts: ~90 GB in bf16
  o.tp = {};
  if (static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE) < 80e9)
    expect_invalid(run(o), "--experts 256: the routed experts alone would take");
  o = opts();
  o.kv_memory = 1000;  // the 7 MLA layers' 576 values a token: 8064 bytes in bf16
  expect_invalid(run(o), "--kv-memory 1000 bytes holds 0 MLA KV token slots");
  o = opts();
  o.state_memory = 1 << 20;
  expect_invalid(run(o), "--state-memory 1048576 bytes is too small for one state slot");
  o = opts();
  o.server_args.chunked_prefill_size = 0;
  expect_invalid(run(o), "--token-budget must be >= 1");
  o = opts();
  o.max_batch = 0;
  expect_invalid(run(o), "--max-batch must be >= 1");
  o = opts();
  o.check = 3;
  expect_invalid(run(o), "--check 3");
  o = opts();
  o.parallel_samples = 100;
  expect_invalid(run(o), "parallel samples needs 100");
  o = opts();
  o.requests[1].prompt_len = -3;
  expect_invalid(run(o), "request 1: prompt_len must be >= 1");
  o = opts();
  o.requests.clear();
  expect_invalid(run(o), "no requests");
  o = opts();
  o.server_args.speculative_algorithm = "EAGLE";
  expect_invalid(run(o), "speculative decoding");
  o = opts();
  o.model_dir = "/nonexistent/model";
  expect_invalid(run(o), "/nonexistent/model");
  o = opts();
  o.outputs_path = "/nonexistent/dir/out.npz";
  expect_invalid(run(o), "/nonexistent/dir");
  o = opts();
  o.requests[1].prompt = {1, 2, 3, 163840};
  o.requests[1].prompt_len = 4;
  expect_invalid(run(o), "request 1: prompt: token id 163840 at position 3 is >= the vocabulary size 163840");
  o = opts();
  o.vocab = 100;
  o.requests[0].prompt = {1, 2, 3, 100};
  o.requests[0].prompt_len = 4;
  expect_invalid(run(o), "token id 100 at position 3 is >= the vocabulary size 100");
  o = opts();
  o.requests[0].after = 1;  // a previous turn listed after its next one
  expect_invalid(run(o), "request 0: its previous turn (request 1) must come before it");
  o = opts();
  o.requests[1].after = 0;
  o.requests[1].turn_len = 1;
  expect_invalid(run(o), "is not its previous turn's prompt_len + output_len + 1 + turn_len");
  EXPECT_FALSE(built);
  expect_invalid([] { make_workload(WorkloadOptions{.kind = WorkloadKind::kSharedPrefix}); },
                 "--workload shared-prefix needs --shared-prefix-len >= 1");
  expect_invalid([] { make_workload(WorkloadOptions{.turns = 3}); }, "--turns needs --workload multi-turn");
  expect_invalid([] { make_workload(WorkloadOptions{.prefix_groups = 2}); },
                 "--prefix-groups and --shared-prefix-len need");
  expect_invalid([] { parse_workload_kind("chat"); }, "--workload 'chat'");
}

// --- the binary --------------------------------------------------------------------------------------

struct CliResult {
  int code = -1;
  std::string out;
};

CliResult run_kda(const std::string& args, bool with_stderr) {
  const auto r = testing::run_command(std::string(KDA_BINARY_PATH) + " " + args +
                                      (with_stderr ? " 2>&1" : " 2>/dev/null"));
  return {r.code, r.output};
}

TEST(SimulateCli, OneRealShapeLayerPrintsJson) {
  const auto r = run_kda(
      "simulate --layers 1 --requests 2 --prompt-len 4:8 --output-len 2 --json --precision fp32 --vocab 1024",
      false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key :
       {"requests_completed", "prefill_tokens", "prefill_tokens_computed", "decode_tokens", "prefill_tok_s",
        "decode_tok_s", "step_ms_p50", "step_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "pool_bytes",
        "peak_slots", "slot_reuses", "check_worst_error_ratio", "check_argmax_matched", "vocab"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["requests_completed"], 2);
  EXPECT_EQ(j["decode_tokens"], 4);
  EXPECT_EQ(j["layers"], 1);
  EXPECT_EQ(j["hidden"], 2304);
  EXPECT_EQ(j["radix_cache_disabled"], false);  // kda simulate serves with the prefix cache
  for (const char* key : {"prefix_cache_hit_tokens", "prefix_cache_hit_rate", "prefix_cache_bytes",
                          "prefix_cache_snapshots", "prefix_cache_evictions"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_LE(j["check_worst_error_ratio"].get<double>(), 1.0);
}

TEST(SimulateCli, MultiTurnWorkloadPrintsJson) {
  const auto dir = testing::make_temp_dir("simulate_cli_turns");
  const auto r = run_kda(
      "simulate --layers 1 --workload multi-turn --requests 2 --turns 2 --shared-prefix-len 3 --prompt-len "
      "2:4 "
      "--output-len 2 --vocab 512 --json --precision fp32 --check 4 --outputs " +
          (dir / "o.npz").string(),
      false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["requests_completed"], 4);
  EXPECT_EQ(j["vocab"], 512);
  EXPECT_EQ(j["check_ok"], true);
  EXPECT_EQ(j["check_tokens_total"], 4 * 3);
  // Turn 2 continues from turn 1's finished state: the cache restores it.
  EXPECT_GT(j["prefix_cache_hit_tokens"].get<int64_t>(), 0);
  EXPECT_EQ(j["prefill_tokens_computed"].get<int64_t>() + j["prefix_cache_hit_tokens"].get<int64_t>(),
            j["prefill_tokens"].get<int64_t>());
  EXPECT_GT(j["ttft_ms_p99"].get<double>(), 0.0);
  EXPECT_EQ(j["later_turns"], 2);  // turn 2 of each of the two conversations
  EXPECT_GT(j["ttft_ms_p50_later_turns"].get<double>(), 0.0);
  const auto npz = io::read_npz(dir / "o.npz");
  for (int i = 0; i < 4; ++i) EXPECT_EQ(npz.at("tokens_" + std::to_string(i)).to_i32().size(), 3u);
}

TEST(SimulateCli, BadOptionsFailWithClearMessages) {
  const auto dir = testing::make_temp_dir("simulate_cli");
  auto r = run_kda("simulate --prompt-len 64:16", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("MIN 64 > MAX 16"));
  r = run_kda("simulate --layers 30", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--layers 30"));
  r = run_kda("simulate --state-memory 1MiB", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("too small for one state slot"));
  r = run_kda("simulate --token-budget 0", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--token-budget"));
  std::ofstream(dir / "bad.json") << "[{\"prompt_len\": 4, \"arrival_step\": 0}]";
  r = run_kda("simulate --trace " + (dir / "bad.json").string(), true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("missing field 'output_len'"));
  r = run_kda("simulate --trace " + (dir / "bad.json").string() + " --requests 3", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("excludes"));
  r = run_kda("simulate --turns 3", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--turns needs --workload multi-turn"));
  std::ofstream(dir / "tok.json") << "[{\"prompt\": [1, 600], \"output_len\": 1, \"arrival_step\": 0}]";
  r = run_kda("simulate --vocab 512 --trace " + (dir / "tok.json").string(), true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("token id 600 at position 1 is >= the vocabulary size 512"));
  r = run_kda("simulate --layers 1 --cache-interval 100", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--cache-interval must be a positive multiple of 64, got 100"));
  r = run_kda("simulate --layers 1 --prefix-cache-memory 12XB", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--prefix-cache-memory '12XB'"));
}

// The summary names the cache's state; --no-prefix-cache serves every prompt token.
TEST(SimulateCli, PrefixCacheSummaryAndOffSwitch) {
  const std::string args =
      "simulate --layers 1 --workload shared-prefix --shared-prefix-len 40 --requests 3 --prompt-len 2:4 "
      "--output-len 1 --vocab 512 --precision fp32 --check 1";
  auto r = run_kda(args + " --prefix-cache-memory 64MiB", false);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("radix cache on"));
  EXPECT_THAT(r.out, HasSubstr("prefix cache  "));
  EXPECT_THAT(r.out, HasSubstr("PASS"));
  r = run_kda(args + " --no-prefix-cache --json", false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["radix_cache_disabled"], true);
  EXPECT_EQ(j["prefix_cache_hit_tokens"], 0);
  EXPECT_EQ(j["prefill_tokens_computed"], j["prefill_tokens"]);
}

// --- speculative decoding ------------------------------------------------------------------------------

TEST(Speculative, DraftTriesAndNgramLookup) {
  Draft d;
  d.add_branch(std::vector<int32_t>{5, 6, 7}, 8);
  d.add_branch(std::vector<int32_t>{5, 9}, 8);  // shares 5
  d.add_branch(std::vector<int32_t>{4}, 8);
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{5, 6, 7, 9, 4}));
  EXPECT_EQ(d.parents, (std::vector<int32_t>{-1, 0, 1, 0, -1}));
  Draft capped;
  capped.add_branch(std::vector<int32_t>{1, 2, 3}, 2);
  EXPECT_EQ(capped.size(), 2);

  // ngram: the latest earlier occurrence of the longest suffix (3 tokens) with a match.
  const std::vector<int32_t> h = {1, 2, 3, 10, 11, 7, 2, 3, 20, 21, 22, 1, 2, 3};
  EXPECT_EQ(ngram_draft(h, 2, 1).tokens, (std::vector<int32_t>{10, 11}));
  const std::vector<int32_t> h2 = {9, 2, 3, 20, 8, 2, 3, 30, 31, 5, 2, 3};  // no 3-gram; 2-gram twice
  auto t = ngram_draft(h2, 2, 2);
  EXPECT_EQ(t.tokens, (std::vector<int32_t>{30, 31, 20, 8}));
  EXPECT_EQ(t.parents, (std::vector<int32_t>{-1, 0, -1, 2}));
  EXPECT_EQ(ngram_draft(std::vector<int32_t>{1, 2, 3, 4}, 4, 1).size(), 0);  // no match, no drafts

  // replay: rate 1 drafts the truth, rate 0 never a true token; the draw is a function of its key.
  const std::vector<int32_t> truth = {3, 1, 4, 1, 5};
  EXPECT_EQ(replay_draft(truth, 4, 1, 1.0, 100, 7, 2, 9).tokens, (std::vector<int32_t>{3, 1, 4, 1}));
  const auto zero = replay_draft(truth, 4, 1, 0.0, 100, 7, 2, 9);
  ASSERT_EQ(zero.size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_NE(zero.tokens[i], truth[i]);
  EXPECT_EQ(replay_draft(truth, 4, 3, 0.5, 100, 7, 2, 9).tokens,
            replay_draft(truth, 4, 3, 0.5, 100, 7, 2, 9).tokens);
  EXPECT_EQ(replay_draft(truth, 9, 1, 1.0, 100, 7, 2, 9).size(), 5);  // never past the truth
}

SimulateOptions spec_options(std::vector<RequestSpec> reqs, SpecAlgorithm a, int32_t topk, double rate) {
  auto o = small_options(std::move(reqs));
  o.spec.algorithm = a;
  o.spec.draft_tokens = 4;
  o.spec.topk = topk;
  o.spec.accept_rate = rate;
  // Fixed depth: the tests below count drafts (adaptive depth follows step times; its own tests follow).
  o.spec.depth_mode = DraftDepthMode::kFixed;
  o.server_args.speculative_algorithm = to_string(a);
  return o;
}

// A vocabulary of 64 and prompts of 20-200 tokens: most generated tokens occur earlier in the prompt, so
// prompt lookup drafts on most steps (and a random model's greedy output soon repeats itself).
constexpr int64_t kSpecVocab = 64;
std::vector<RequestSpec> spec_workload() {
  WorkloadOptions w;
  w.requests = 6;
  w.prompt = {20, 200};
  w.output_len = 14;
  w.vocab = kSpecVocab;
  w.seed = 21;
  return make_workload(w);
}

void expect_same_tokens_and_rows(const SimulateResult& spec, const SimulateResult& plain) {
  ASSERT_EQ(spec.serve.requests_completed, plain.serve.requests_completed);
  ASSERT_EQ(spec.serve.outputs.size(), plain.serve.outputs.size());
  for (size_t i = 0; i < plain.serve.outputs.size(); ++i)
    EXPECT_EQ(spec.serve.outputs[i].tokens, plain.serve.outputs[i].tokens) << "sequence " << i;
  EXPECT_LE(worst_ratio(outputs_by_key(spec), outputs_by_key(plain)), 1.0);
  EXPECT_EQ(spec.serve.decode_tokens, plain.serve.decode_tokens);  // generated tokens, drafts not counted
}

// The drafting of one run recounted from its sequences alone: each sequence's decode positions replayed
// with the drafter (a pure function of the history, or of the true continuation for replay), each draft
// verified against the tokens the sequence generated (greedy verification accepts a drafted token
// exactly when it is the target's pick, and the picks on the accepted path are the generated tokens).
struct DraftCount {
  int64_t drafted = 0, accepted = 0;
  int64_t rows_with_drafts = 0, rows = 0;  // decode positions that drafted, and all decode positions
};
DraftCount recount_drafts(const SimulateOptions& o, const SimulateResult& r, const SimulateResult& plain) {
  DraftCount c;
  for (size_t i = 0; i < r.serve.outputs.size(); ++i) {
    const auto& q = r.serve.outputs[i];
    const RequestSpec& spec = *std::find_if(o.requests.begin(), o.requests.end(),
                                            [&](const RequestSpec& x) { return x.id == q.request_id; });
    const auto& gen = q.tokens;  // output_len + 1: the prefill's pick, then one per decode input
    const auto& truth = plain.serve.outputs[i].tokens;
    for (size_t g = 1; g < gen.size();) {  // g tokens generated so far
      const int32_t depth = std::min<int32_t>(o.spec.draft_tokens, spec.output_len - static_cast<int32_t>(g));
      Draft d;
      if (depth >= 1 && o.spec.algorithm == SpecAlgorithm::kNgram) {
        std::vector<int32_t> history = q.prompt;
        history.insert(history.end(), gen.begin(), gen.begin() + static_cast<std::ptrdiff_t>(g));
        d = ngram_draft(history, depth, o.spec.topk);
      } else if (depth >= 1) {
        d = replay_draft(std::span<const int32_t>(truth).subspan(g), depth, o.spec.topk, o.spec.accept_rate,
                         r.vocab, o.seed, q.request_id * 4096 + q.sample, static_cast<int64_t>(g));
      }
      // Walk the tree along the generated tokens.
      int32_t node = -1, taken = 0;
      for (bool more = true; more;) {
        more = false;
        for (int32_t k = 0; k < d.size(); ++k)
          if (d.parents[k] == node && g + taken < gen.size() && d.tokens[k] == gen[g + taken]) {
            node = k;
            ++taken;
            more = true;
            break;
          }
      }
      c.drafted += d.size();
      c.accepted += taken;
      c.rows_with_drafts += d.size() > 0;
      ++c.rows;
      g += static_cast<size_t>(taken) + 1;
    }
  }
  return c;
}

// fp32: speculation never changes the tokens (greedy verification), and every kept row is the row plain
// decoding computes at its position, for both drafters, chains and trees; the self-check passes.
TEST(Speculative, TokensAndRowsEqualPlainGreedyDecodingForEveryDrafter) {
  auto plain_o = small_options(spec_workload());
  plain_o.vocab = kSpecVocab;
  plain_o.server_args.chunked_prefill_size = 23;
  plain_o.max_batch = 4;
  const auto plain = run_simulation(plain_o);
  struct Case {
    SpecAlgorithm a;
    int32_t topk;
    double rate;
  };
  for (const Case c : {Case{SpecAlgorithm::kNgram, 1, 0}, Case{SpecAlgorithm::kNgram, 3, 0},
                       Case{SpecAlgorithm::kReplay, 1, 0.7}, Case{SpecAlgorithm::kReplay, 3, 0.5}}) {
    SCOPED_TRACE(std::string(to_string(c.a)) + " topk " + std::to_string(c.topk));
    auto o = spec_options(spec_workload(), c.a, c.topk, c.rate);
    o.vocab = kSpecVocab;
    o.server_args.chunked_prefill_size = 23;
    o.max_batch = 4;
    o.check = 3;
    const auto r = run_simulation(o);
    expect_same_tokens_and_rows(r, plain);
    expect_check_passes(r);
    EXPECT_GT(r.serve.spec_draft_tokens, 0);
    EXPECT_GT(r.serve.spec_accepted_tokens, 0);
    // Accepted drafts save steps: replay's at its acceptance rate always; ngram's only where they fall on
    // the sequences that decode longest (its acceptances follow the model's tokens).
    if (c.a == SpecAlgorithm::kReplay)
      EXPECT_LT(r.serve.decode_steps, plain.serve.decode_steps);
    else
      EXPECT_LE(r.serve.decode_steps, plain.serve.decode_steps);
    const DraftCount n = recount_drafts(o, r, plain);
    EXPECT_EQ(r.serve.spec_draft_tokens, n.drafted);
    EXPECT_EQ(r.serve.spec_accepted_tokens, n.accepted);
    // Every position that drafted was a verify row; a position without a draft was one when another row
    // of its step drafted, else a plain DECODE row. A verify row emits its accepted drafts and one more.
    EXPECT_GE(r.serve.spec_verify_rows, n.rows_with_drafts);
    EXPECT_LE(r.serve.spec_verify_rows, n.rows);
    EXPECT_EQ(r.serve.spec_emitted_tokens, r.serve.spec_verify_rows + n.accepted);
    EXPECT_EQ(r.serve.decode_tokens, n.rows + n.accepted);
    const auto j = to_json(r);
    EXPECT_EQ(j["speculative"], to_string(c.a));
    EXPECT_DOUBLE_EQ(j["spec_accept_rate"].get<double>(), static_cast<double>(n.accepted) / n.drafted);
    EXPECT_DOUBLE_EQ(j["spec_tokens_per_step"].get<double>(),
                     static_cast<double>(r.serve.spec_verify_rows + n.accepted) / r.serve.spec_verify_rows);
    EXPECT_GT(j["spec_state_bytes"].get<int64_t>(), 0);
  }
}

// With an MLA layer too: the verify step attends each draft to the committed prefix and its ancestors, and
// accept keeps the accepted path's MLA token slots (a tree's need not be the row's first ones), so the
// tokens and rows are plain decoding's, no KV token slot is left behind, and the self-check passes.
TEST(Speculative, WholeModelWithMlaLayersEqualsPlainGreedyDecoding) {
  auto plain_o = hybrid_options(spec_workload());
  plain_o.vocab = kSpecVocab;
  plain_o.server_args.chunked_prefill_size = 23;
  plain_o.max_batch = 4;
  const auto plain = run_simulation(plain_o);
  ASSERT_EQ(plain.mla_layers, 1);
  for (const int32_t topk : {1, 3}) {
    SCOPED_TRACE("replay topk " + std::to_string(topk));
    auto o = spec_options(spec_workload(), SpecAlgorithm::kReplay, topk, 0.6);
    o.synthetic_config = hybrid_config();
    o.vocab = kSpecVocab;
    o.server_args.chunked_prefill_size = 23;
    o.max_batch = 4;
    o.check = 3;
    const auto r = run_simulation(o);
    expect_same_tokens_and_rows(r, plain);
    expect_check_passes(r);
    EXPECT_GT(r.serve.spec_accepted_tokens, 0);
    EXPECT_LT(r.serve.decode_steps, plain.serve.decode_steps);
    EXPECT_EQ(r.leaked_kv_tokens, 0);
    EXPECT_TRUE(r.accounting_ok()) << r.accounting_error;
  }
}

TEST(Speculative, ReplayAtAcceptRateOneAcceptsEveryDraftAtZeroNone) {
  for (const int32_t topk : {1, 2}) {
    auto one = spec_options(make_workload(4, {5, 30}, 9, 4), SpecAlgorithm::kReplay, topk, 1.0);
    const auto r1 = run_simulation(one);
    EXPECT_GT(r1.serve.spec_draft_tokens, 0);
    if (topk == 1) {
      EXPECT_EQ(r1.serve.spec_accepted_tokens, r1.serve.spec_draft_tokens);
    }
    EXPECT_EQ(r1.serve.replay_diverged, 0);  // the speculative pass generated the true continuations
    EXPECT_EQ(to_json(r1)["replay_diverged"], 0);
    // Every verify row took its whole path: 9 decode inputs per request in ceil(9 / 5) = 2 verify steps.
    EXPECT_EQ(r1.serve.spec_verify_rows, 4 * 2);
    auto zero = spec_options(make_workload(4, {5, 30}, 9, 4), SpecAlgorithm::kReplay, topk, 0.0);
    const auto r0 = run_simulation(zero);
    EXPECT_GT(r0.serve.spec_draft_tokens, 0);
    EXPECT_EQ(r0.serve.spec_accepted_tokens, 0);
    // One verify row per decode step but the last (no room for a draft there: a plain DECODE step).
    EXPECT_EQ(r0.serve.spec_verify_rows, 4 * 8);
    EXPECT_EQ(r0.serve.decode_tokens, 4 * 9);
  }
}

// The verify buffer comes out of --state-memory: fewer request slots with it, and its bytes reported.
TEST(Speculative, VerifyBufferIsAccountedInThePoolAndOptionsAreChecked) {
  const int64_t row = int64_t{5} * 3 * 4 * mem_cache::RecurrentStatePool::verify_token_elems(3 * 256, 2, 128);
  auto o = spec_options(make_workload(6, {5, 30}, 5, 4), SpecAlgorithm::kReplay, 1, 0.7);
  o.state_memory = 2 * (slot_bytes() + row) + 2 * slot_bytes() + slot_bytes() / 2;
  o.max_batch = 2;  // two slots with a verify row, the others without
  const auto r = run_simulation(o);
  EXPECT_EQ(r.pool_slots, 4);  // 2 x (slot + row) + 2 slots fit
  EXPECT_EQ(r.serve.spec_state_bytes, 2 * row);
  EXPECT_EQ(r.pool_bytes, (4 + 1) * slot_bytes() + 2 * row);  // slot 0 is reserved
  EXPECT_EQ(r.serve.requests_completed, 6);
  EXPECT_LE(r.serve.peak_slots, 4);

  auto bad = o;
  bad.state_memory = slot_bytes() + row - 1;
  expect_invalid([&] { run_simulation(bad); }, "bytes of verify buffer");
  bad = o;
  bad.spec.draft_tokens = 0;
  expect_invalid([&] { run_simulation(bad); }, "--draft-tokens must be in 1..64");
  bad = o;
  bad.spec.topk = 0;
  expect_invalid([&] { run_simulation(bad); }, "--draft-topk must be in 1..16");
  bad = o;
  bad.spec.accept_rate = 1.5;
  expect_invalid([&] { run_simulation(bad); }, "--accept-rate must be in [0, 1]");
  bad = o;
  bad.server_args.speculative_algorithm = "ngram";
  expect_invalid([&] { run_simulation(bad); }, "speculative_algorithm is 'ngram'");
  bad = small_options(make_workload(2, {5, 9}, 2, 4));
  bad.server_args.speculative_algorithm = "EAGLE";
  expect_invalid([&] { run_simulation(bad); }, "DRAFT_EXTEND");
}

// Mixed batches, parallel samples and the prefix cache: the same tokens as plain decoding.
TEST(Speculative, WorksWithMixedBatchesParallelSamplesAndThePrefixCache) {
  auto w = cache_workload(WorkloadKind::kMultiTurn);
  w.output_len = 8;
  auto plain = cache_options(make_workload(w), true);
  plain.server_args.enable_mixed_chunk = true;
  plain.parallel_samples = 2;
  const auto p = run_simulation(plain);
  auto o = plain;
  o.spec.algorithm = SpecAlgorithm::kReplay;
  o.spec.topk = 2;
  o.spec.depth_mode = DraftDepthMode::kFixed;
  o.server_args.speculative_algorithm = "replay";
  o.check = 2;
  const auto r = run_simulation(o);
  expect_same_tokens_and_rows(r, p);
  EXPECT_GT(r.serve.prefix_cache_hit_tokens, 0);
  EXPECT_EQ(r.serve.prefix_cache_hit_tokens, p.serve.prefix_cache_hit_tokens);
  EXPECT_GT(r.serve.spec_accepted_tokens, 0);
  expect_check_passes(r);
}

TEST(Speculative, TensorAndDataParallelGiveTheTokensOfOneRank) {
  auto o = spec_options(make_workload(4, {5, 30}, 8, 4), SpecAlgorithm::kReplay, 2, 0.6);
  o.check = 1;
  const auto one = run_simulation(o);
  std::vector<SimulateResult> tp(2), dp(2);
  distributed::InProcessGroup tp_group(2), dp_group(2);
  ASSERT_NO_THROW(tp_group.run([&](int rank, distributed::Communicator& comm) {
    auto ot = o;
    ot.tp = {rank, 2, &comm};
    tp[static_cast<size_t>(rank)] = run_simulation(ot);
  }));
  ASSERT_NO_THROW(dp_group.run([&](int rank, distributed::Communicator& comm) {
    auto od = o;
    od.dp = 2;
    od.dp_rank = rank;
    od.world = &comm;
    dp[static_cast<size_t>(rank)] = run_simulation(od);
  }));
  for (const auto* r : {&tp[0], &tp[1], &dp[0]}) {
    ASSERT_EQ(r->serve.requests_completed, 4);
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(out_of(*r, i).tokens, out_of(one, i).tokens) << i;
    EXPECT_EQ(r->serve.spec_accepted_tokens, one.serve.spec_accepted_tokens);
    EXPECT_EQ(r->serve.spec_draft_tokens, one.serve.spec_draft_tokens);
    expect_check_passes(*r);
  }
  EXPECT_LE(worst_ratio(outputs_by_key(tp[0]), outputs_by_key(one)), 1.0);
}

// bf16: the teacher-forced self-check (plain decoding, request alone) passes on the speculative run.
TEST(Speculative, Bf16SelfCheckPasses) {
  for (const auto a : {SpecAlgorithm::kNgram, SpecAlgorithm::kReplay}) {
    auto o = spec_options(spec_workload(), a, a == SpecAlgorithm::kNgram ? 1 : 2, 0.7);
    o.vocab = kSpecVocab;
    o.precision = Precision::BF16;
    o.check = 3;
    const auto r = run_simulation(o);
    expect_check_passes(r);
    EXPECT_GT(r.serve.spec_accepted_tokens, 0) << to_string(a);
  }
}

TEST(SimulateCli, SpeculativeSummaryJsonAndBadOptions) {
  auto r = run_kda(
      "simulate --layers 1 --requests 2 --prompt-len 4:8 --output-len 6 --precision fp32 --vocab 512 "
      "--speculative replay --accept-rate 1 --draft-tokens 3 --draft-depth fixed --json",
      false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["speculative"], "replay");
  EXPECT_EQ(j["draft_tokens"], 3);
  EXPECT_EQ(j["spec_accept_rate"], 1.0);
  EXPECT_EQ(j["decode_tokens"], 12);
  EXPECT_GT(j["spec_state_bytes"].get<int64_t>(), 0);
  EXPECT_LE(j["check_worst_error_ratio"].get<double>(), 1.0);
  r = run_kda(
      "simulate --layers 1 --requests 2 --prompt-len 4:4 --output-len 3 --vocab 512 --speculative ngram",
      false);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("speculative   ngram, 4 draft tokens"));
  r = run_kda("simulate --layers 1 --speculative ngram --accept-rate 0.5", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--accept-rate is for --speculative replay only"));
  r = run_kda("simulate --layers 1 --draft-tokens 3", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--speculative"));
  r = run_kda("simulate --layers 1 --outputs /tmp", true);  // refused before any work
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--outputs /tmp: is a directory"));
  r = run_kda("simulate --layers 1 --speculative eagle", true);
  EXPECT_NE(r.code, 0);
  r = run_kda("simulate --layers 1 --speculative replay --draft-topk 0", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--draft-topk must be in 1..16"));
}

// Adaptive draft depth (draft_depth.h) follows the steps' measured times, so its drafts vary from run to
// run; the tokens never do: greedy verification emits plain decoding's tokens at any depth, on one rank and
// on a TP group (whose ranks draft rank 0's depths: their step times differ).
TEST(Speculative, AdaptiveDepthGivesTheTokensOfFixedDepthAndOfNoSpeculation) {
  auto plain_o = small_options(spec_workload());
  plain_o.vocab = kSpecVocab;
  plain_o.max_batch = 4;
  const auto plain = run_simulation(plain_o);
  for (const auto a : {SpecAlgorithm::kNgram, SpecAlgorithm::kReplay}) {
    SCOPED_TRACE(to_string(a));
    auto o = spec_options(spec_workload(), a, 1, 0.8);
    o.vocab = kSpecVocab;
    o.max_batch = 4;
    o.check = 2;
    const auto fixed = run_simulation(o);
    o.spec.depth_mode = DraftDepthMode::kAdaptive;
    const auto adaptive = run_simulation(o);
    expect_same_tokens_and_rows(adaptive, plain);
    expect_same_tokens_and_rows(fixed, plain);
    expect_check_passes(adaptive);
    EXPECT_EQ(adaptive.serve.decode_tokens, plain.serve.decode_tokens);
    EXPECT_GT(adaptive.serve.spec_depth_rows, 0);
    EXPECT_LE(adaptive.serve.spec_depth_sum, adaptive.serve.spec_depth_rows * o.spec.draft_tokens);
    EXPECT_LE(adaptive.serve.spec_draft_tokens, adaptive.serve.spec_depth_sum);
    const auto j = to_json(adaptive);
    EXPECT_EQ(j["draft_depth"], "adaptive");
    EXPECT_DOUBLE_EQ(j["spec_mean_depth"].get<double>(),
                     static_cast<double>(adaptive.serve.spec_depth_sum) /
                         static_cast<double>(adaptive.serve.spec_depth_rows));
    EXPECT_EQ(to_json(fixed)["draft_depth"], "fixed");
  }
}

TEST(Speculative, AdaptiveDepthUnderTensorParallelDraftsRankZerosDepths) {
  auto o = spec_options(make_workload(4, {5, 30}, 12, 4), SpecAlgorithm::kReplay, 1, 0.8);
  o.spec.depth_mode = DraftDepthMode::kAdaptive;
  const auto one = run_simulation(o);
  std::vector<SimulateResult> tp(2);
  distributed::InProcessGroup tp_group(2);
  ASSERT_NO_THROW(tp_group.run([&](int rank, distributed::Communicator& comm) {
    auto ot = o;
    ot.tp = {rank, 2, &comm};
    tp[static_cast<size_t>(rank)] = run_simulation(ot);
  }));
  for (const auto* r : {&tp[0], &tp[1]}) {
    ASSERT_EQ(r->serve.requests_completed, 4);
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(out_of(*r, i).tokens, out_of(one, i).tokens) << i;
  }
  EXPECT_EQ(tp[0].serve.spec_depth_sum, tp[1].serve.spec_depth_sum);
  EXPECT_EQ(tp[0].serve.spec_draft_tokens, tp[1].serve.spec_draft_tokens);
  EXPECT_EQ(tp[0].serve.spec_accepted_tokens, tp[1].serve.spec_accepted_tokens);
}

TEST(SimulateCli, DraftDepthOption) {
  auto r = run_kda(
      "simulate --layers 1 --requests 2 --prompt-len 4:8 --output-len 6 --precision fp32 --vocab 512 "
      "--speculative replay --draft-tokens 3 --json",
      false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["draft_depth"], "adaptive");  // the default
  EXPECT_GE(j["spec_mean_depth"].get<double>(), 0.0);
  EXPECT_LE(j["spec_mean_depth"].get<double>(), 3.0);
  EXPECT_EQ(j["decode_tokens"], 12);
  r = run_kda("simulate --layers 1 --speculative replay --draft-depth sometimes", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--draft-depth 'sometimes': expected adaptive or fixed"));
  r = run_kda("simulate --layers 1 --draft-depth fixed", true);
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--speculative"));
}

// --- soak under churn, shortened: the accounting and the self-check, not the timing ----------------------

// The soak's mix on the small model: shared-prefix requests, a prefix cache of eight snapshots (each
// request inserts 3-4, evicting), speculation, mixed batches and 2 parallel samples on 5 slots.
SimulateOptions soak_options(int64_t requests, SpecAlgorithm algo, double accept_rate) {
  WorkloadOptions w;
  w.kind = WorkloadKind::kSharedPrefix;
  w.requests = requests;
  w.prompt = {4, 24};
  w.output_len = 5;
  w.prefix_groups = 2;
  w.shared_prefix_len = 70;
  w.vocab = kSpecVocab;
  w.seed = 9;
  auto o = spec_options(make_workload(w), algo, 2, accept_rate);
  o.vocab = kSpecVocab;
  o.state_memory = 5 * slot_bytes();
  o.prefix_cache_memory = 8 * slot_bytes();
  o.server_args.disable_radix_cache = false;
  o.cache_interval = 64;
  o.server_args.enable_mixed_chunk = true;
  o.server_args.chunked_prefill_size = 40;
  o.parallel_samples = 2;
  return o;
}

TEST(Soak, ChurnWithEvictionsSpeculationAndMixedBatchesLeaksNothing) {
  auto o = soak_options(120, SpecAlgorithm::kNgram, 0);
  o.keep_outputs = false;
  o.check = 6;
  const auto r = run_simulation(o);
  EXPECT_EQ(r.serve.requests_completed, 120);
  EXPECT_GT(r.serve.prefix_cache_evictions, 100);
  EXPECT_GT(r.serve.prefix_cache_hit_tokens, 0);
  EXPECT_GT(r.serve.spec_draft_tokens, 0);
  EXPECT_GT(r.serve.mixed_steps, 0);
  EXPECT_GT(r.serve.slot_reuses, 200);
  EXPECT_TRUE(r.accounting_ok()) << r.accounting_error;
  EXPECT_EQ(r.leaked_slots, 0);
  EXPECT_EQ(r.leaked_request_indices, 0);
  EXPECT_TRUE(r.cache_consistent);
  expect_check_passes(r);
  EXPECT_EQ(r.rss_bytes.size(), static_cast<size_t>(r.serve.steps));  // sampled after every step
  const auto j = to_json(r);
  EXPECT_EQ(j["accounting_ok"], true);
  EXPECT_TRUE(j.contains("rss_growth"));
  EXPECT_LE(j["rss_samples"].size(), 101u);
}

// A kept sequence's rows (the self-check's samples, --outputs) are allocated once for all of its positions
// before the first step and never regrown: appended with vector growth as its steps came, each kept request
// raised resident memory whenever it happened to run, late in a long run as early (scripts/soak.sh).
// Speculation's accepted paths, prefix-cache hits, mixed steps and forks all write into the one
// allocation.
TEST(Soak, KeptRowsAreSizedOnceForTheirPositionsBeforeTheFirstStep) {
  // Replay at 0.7 accepts drafts: verify rows that write several positions' rows.
  const auto o = soak_options(12, SpecAlgorithm::kReplay, 0.7);
  const auto r = run_simulation(o);
  ASSERT_EQ(r.serve.requests_completed, 12);
  EXPECT_GT(r.serve.prefix_cache_hit_tokens, 0);
  EXPECT_GT(r.serve.spec_accepted_tokens, 0);
  std::map<int64_t, int64_t> positions;  // request id -> prompt + output tokens
  for (const auto& q : o.requests) positions[q.id] = int64_t{q.prompt_len} + q.output_len;
  const size_t D = static_cast<size_t>(small_config().hidden_size);
  for (const auto& s : r.serve.outputs) {
    SCOPED_TRACE(output_key(s, r.parallel_samples));
    EXPECT_FALSE(s.rows.empty());
    EXPECT_EQ(s.rows.capacity(), static_cast<size_t>(positions.at(s.request_id)) * D);
  }
}

// A slot that held a long request's strong state computes, for the next request admitted into it, exactly
// (bit for bit) what that request computes in a fresh pool: alloc clears the recurrent and conv state.
TEST(Soak, AReusedSlotComputesBitForBitWhatAFreshPoolDoes) {
  auto strong = request(0, 900, 30, 0);  // 930 tokens of state in the one slot
  auto next = request(1, 37, 9, 0);
  auto both = small_options({strong, next});
  both.state_memory = slot_bytes();  // one slot: request 1 waits, then takes request 0's slot
  both.server_args.chunked_prefill_size = 1024;
  const auto reused = run_simulation(both);
  ASSERT_EQ(reused.pool_slots, 1);
  ASSERT_EQ(reused.serve.slot_reuses, 1);
  auto alone = small_options({next});
  alone.server_args.chunked_prefill_size = 1024;
  const auto fresh = run_simulation(alone);
  EXPECT_EQ(out_of(reused, 1).tokens, out_of(fresh, 1).tokens);
  ASSERT_EQ(out_of(reused, 1).rows.size(), out_of(fresh, 1).rows.size());
  EXPECT_TRUE(out_of(reused, 1).rows == out_of(fresh, 1).rows);  // bit for bit
}

// --- the main job's default precision, Ctrl-C, and --model through the binary -------------------------

// simulate's default precision is bf16 (the main job): a small run in it passes its teacher-forced
// self-check against the per-layer bf16 tolerance and exits 0.
TEST(SimulateCli, DefaultBf16RunPassesItsSelfCheck) {
  const auto r = run_kda(
      "simulate --layers 2 --vocab 1024 --requests 3 --prompt-len 4:12 --output-len 3 --check 2 --json",
      false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["precision"], "bf16");
  EXPECT_EQ(j["requests_completed"], 3);
  EXPECT_EQ(j["check_ok"], true);
  EXPECT_EQ(j["check_requests"].size(), 2u);
  EXPECT_EQ(j["check_metric"], "rel_l2");
  ASSERT_TRUE(j.contains("check_worst") && j.contains("check_bound")) << r.out;
  EXPECT_EQ(j["check_bound"].get<double>(), bf16_check_bound(2));
  EXPECT_LE(j["check_worst"].get<double>(), j["check_bound"].get<double>());
  EXPECT_DOUBLE_EQ(j["check_worst_error_ratio"].get<double>(),
                   j["check_worst"].get<double>() / j["check_bound"].get<double>());
  EXPECT_EQ(j["ok"], true);
  // The summary names the value reached and its bound.
  char line[96];
  std::snprintf(line, sizeof(line), "worst rel_l2 = %.3g (bound %.3g)  PASS", j["check_worst"].get<double>(),
                bf16_check_bound(2));
  const auto text = run_kda(
      "simulate --layers 2 --vocab 1024 --requests 3 --prompt-len 4:12 --output-len 3 --check 2", false);
  ASSERT_EQ(text.code, 0) << text.out;
  EXPECT_THAT(text.out, HasSubstr(line));
}

// The kda binary started without a shell, stdout and stderr into one pipe, so that the test can signal it.
struct Child {
  pid_t pid = -1;
  int fd = -1;
  std::string out;  // everything read so far

  explicit Child(const std::vector<std::string>& args) {
    int p[2];
    if (::pipe(p) != 0) return;
    pid = ::fork();
    if (pid == 0) {
      ::dup2(p[1], 1);
      ::dup2(p[1], 2);
      ::close(p[0]);
      ::close(p[1]);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(KDA_BINARY_PATH));
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(KDA_BINARY_PATH, argv.data());
      ::_exit(127);
    }
    ::close(p[1]);
    fd = p[0];
  }
  ~Child() {
    if (pid > 0) {  // still running: the test failed; do not leave it behind
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    if (fd >= 0) ::close(fd);
  }
  // Reads until `needle` is in the output (true), or end of output / `seconds` without it (false).
  bool read_until(const std::string& needle, int seconds) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (needle.empty() || out.find(needle) == std::string::npos) {
      if (std::chrono::steady_clock::now() > end) return false;
      pollfd pf{fd, POLLIN, 0};
      if (::poll(&pf, 1, 500) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n <= 0) return needle.empty();
      out.append(buf, static_cast<size_t>(n));
    }
    return true;
  }
  // The exit code after the output's end; -1 when it did not end in `seconds` or died of a signal.
  int wait(int seconds) {
    if (!read_until("", seconds)) return -1;
    int status = 0;
    ::waitpid(pid, &status, 0);
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
};

// Ctrl-C during serving stops the run after the current step: the summary of what finished, marked
// [INTERRUPTED], the self-check skipped, exit code 130 (128 + SIGINT). The workload (1600 decode steps
// one request at a time) would take far longer than the first progress line.
TEST(SimulateCli, SigintStopsAfterTheCurrentStepWithExitCode130) {
  Child c({"simulate", "--layers", "1", "--vocab", "1024", "--precision", "fp32", "--requests", "4",
           "--prompt-len", "200:200", "--output-len", "400", "--max-batch", "1", "--check", "1",
           "--no-prefix-cache"});
  ASSERT_GT(c.pid, 0);
  ASSERT_TRUE(c.read_until("progress: ", 300)) << c.out;
  ASSERT_EQ(::kill(c.pid, SIGINT), 0);
  const int code = c.wait(120);
  EXPECT_EQ(code, 130) << c.out;
  EXPECT_THAT(c.out, HasSubstr("[INTERRUPTED]"));
  EXPECT_THAT(c.out, HasSubstr("self-check    skipped (interrupted)"));
  EXPECT_THAT(c.out, ::testing::Not(HasSubstr("4 of 4 completed")));
}

// `kda simulate --model DIR` on the vendored tiny checkpoint (4 decoder layers in the real pattern: 3 KDA,
// then MLA; a dense MLP, then MoE; 2 shards + index): the model's own config and vocabulary, the MLA KV
// pool freed with the requests, the self-check passing. A copy with lm_head.weight zeroed makes every
// logit 0, so every pick is token 0 (the lowest id on the tie), which the checkpoint as written does not
// give: the checkpoint's tensors are the ones served.
TEST(SimulateCli, ModelDirServesTheCheckpointsTensors) {
  const auto copy_model = [&](const std::string& tag, bool zero_head) {
    const auto dir = testing::make_temp_dir(tag);
    for (const auto& e : std::filesystem::directory_iterator(testing::model_dumps_dir()))
      if (e.path().extension() != ".npz")
        std::filesystem::copy_file(e.path(), dir / e.path().filename(),
                                   std::filesystem::copy_options::overwrite_existing);
    if (zero_head) {
      const auto shard = dir / "model-00002-of-00002.safetensors";
      std::map<std::string, io::StTensor> t;
      {
        const io::Checkpoint ck(shard);
        for (const auto& name : io::SafetensorsFile(shard).names()) {
          const auto shape = ck.get(name).shape;
          t[name] = {shape, ck.load_f32(name, shape)};
        }
      }
      auto& head = t.at("lm_head.weight").values;
      std::fill(head.begin(), head.end(), 0.0f);
      io::write_safetensors(shard, t);
    }
    std::ofstream(dir / "trace.json")
        << R"([{"prompt": [3, 5, 7, 9, 11, 60], "output_len": 6, "arrival_step": 0},
                                            {"prompt": [1, 2], "output_len": 4, "arrival_step": 1}])";
    return dir;
  };
  const auto run = [&](const std::filesystem::path& dir, const std::string& extra) {
    const auto r =
        run_kda("simulate --model " + dir.string() + " --trace " + (dir / "trace.json").string() +
                    " --precision fp32 --check 2 --json --outputs " + (dir / "o.npz").string() + extra,
                false);
    EXPECT_EQ(r.code, 0) << r.out;
    return std::pair{nlohmann::json::parse(r.out), io::read_npz(dir / "o.npz")};
  };
  const auto all_zero = [](const std::vector<int32_t>& v) {
    return std::all_of(v.begin(), v.end(), [](int32_t x) { return x == 0; });
  };

  const auto dir = copy_model("sim_model", false);
  const auto [j, npz] = run(dir, "");
  EXPECT_EQ(j["vocab"], 512);
  EXPECT_EQ(j["hidden"], 256);
  EXPECT_EQ(j["layers"], 4);
  EXPECT_EQ(j["kda_layers"], 3);
  EXPECT_EQ(j["mla_layers"], 1);
  EXPECT_EQ(j["moe_layers"], 3);
  EXPECT_EQ(j["num_experts"], 8);
  EXPECT_EQ(j["experts_per_token"], 2);
  EXPECT_EQ(j["radix_cache_disabled"], false);       // MLA layers: the hybrid prefix cache
  EXPECT_EQ(j["kv_tokens"], 12 + 6);                 // the two requests' prompt + output tokens
  EXPECT_GT(j["peak_kv_tokens"].get<int64_t>(), 6);  // both held token slots at once
  EXPECT_LE(j["peak_kv_tokens"].get<int64_t>(), 12 + 6);
  EXPECT_EQ(j["leaked_kv_tokens"], 0);
  EXPECT_EQ(j["requests_completed"], 2);
  EXPECT_EQ(j["check_ok"], true);
  EXPECT_EQ(j["check_tokens_total"], 7 + 5);
  const auto tokens0 = npz.at("tokens_0").to_i32();
  ASSERT_EQ(tokens0.size(), 7u);
  for (const int32_t t : tokens0) EXPECT_TRUE(t >= 0 && t < 512) << t;
  EXPECT_FALSE(all_zero(tokens0) && all_zero(npz.at("tokens_1").to_i32()));
  // The first 3 decoder layers are all KDA: no KV pool, and the prefix cache serves them.
  const auto [j3, npz3] = run(dir, " --layers 3");
  EXPECT_EQ(j3["layers"], 3);
  EXPECT_EQ(j3["mla_layers"], 0);
  EXPECT_EQ(j3["kv_tokens"], 0);
  EXPECT_EQ(j3["radix_cache_disabled"], false);
  EXPECT_EQ(j3["check_ok"], true);

  const auto zd = copy_model("sim_model_head", true);
  const auto [jz, z] = run(zd, "");
  EXPECT_TRUE(all_zero(z.at("tokens_0").to_i32()));
  EXPECT_TRUE(all_zero(z.at("tokens_1").to_i32()));
}

}  // namespace
}  // namespace kda::serving
