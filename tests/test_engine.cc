// The online engine (serving/engine.h): requests submitted while it runs, streamed events, stop / length /
// abort finishes, every slot freed, results equal to serve()'s and to a request run alone.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kda/mem_cache/radix_cache.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/serving/engine.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/workload_driver.h"
#include "support/model_checkpoint.h"
#include "support/small_model_config.h"
#include "support/test_support.h"

namespace kda::serving {
namespace {

constexpr int64_t kVocab = 512;

// Small widths (tests/support/small_model_config.h); decoder layer 0 is the dense MLP, the rest MoE.
io::KimiLinearConfig config(std::vector<int> kda, std::vector<int> mla) {
  return kda::testing::small_model_config(std::move(kda), std::move(mla), kVocab);
}

// KDA, KDA, MLA, KDA (1-based layer ids as the config has them).
models::KimiLinearForCausalLM& hybrid_model() {
  static auto m = models::KimiLinearForCausalLM::synthetic(config({1, 2, 4}, {3}), {}, 11);
  return *m;
}
models::KimiLinearForCausalLM& kda_model() {
  static auto m = models::KimiLinearForCausalLM::synthetic(config({1, 2, 3}, {}), {}, 12);
  return *m;
}

std::vector<int32_t> random_prompt(int32_t len, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = static_cast<int32_t>(g() % kVocab);
  return p;
}

GenerateRequest greedy(std::vector<int32_t> prompt, int32_t max_tokens, int32_t n = 1) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.params.temperature = 0.0f;
  r.params.max_tokens = max_tokens;
  r.n = n;
  return r;
}

// Every event a request got, thread safe (sinks run on the engine's thread, tests read from theirs).
struct Collector {
  std::mutex mu;
  std::map<int64_t, std::vector<TokenEvent>> events;  // by request id
  EventSink sink() {
    return [this](const TokenEvent& e) {
      std::lock_guard<std::mutex> lk(mu);
      events[e.request].push_back(e);
    };
  }
  std::vector<TokenEvent> of(int64_t id) {
    std::lock_guard<std::mutex> lk(mu);
    return events[id];
  }
};

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;  // per continuation, the delivered tokens in order
  std::vector<FinishReason> finish;
  int32_t cached_tokens = -1;
};

// Checks the stream's shape (each continuation's events in order, exactly one finish, last) and returns it.
Outcome check_stream(const std::vector<TokenEvent>& ev, int32_t n, int32_t prompt_len) {
  Outcome o;
  o.tokens.resize(static_cast<size_t>(n));
  o.finish.assign(static_cast<size_t>(n), FinishReason::kNone);
  for (const auto& e : ev) {
    EXPECT_GE(e.index, 0);
    EXPECT_LT(e.index, n);
    if (e.index < 0 || e.index >= n) continue;
    EXPECT_EQ(o.finish[e.index], FinishReason::kNone)
        << "an event after continuation " << e.index << "'s finish";
    EXPECT_EQ(e.prompt_tokens, prompt_len);
    if (o.cached_tokens < 0) o.cached_tokens = e.cached_tokens;
    EXPECT_EQ(e.cached_tokens, o.cached_tokens);
    if (e.token >= 0) o.tokens[e.index].push_back(e.token);
    if (e.token < 0) {
      EXPECT_EQ(e.finish, FinishReason::kAbort) << "only an abort's finish carries no token";
    }
    o.finish[e.index] = e.finish;
  }
  for (int32_t j = 0; j < n; ++j)
    EXPECT_NE(o.finish[j], FinishReason::kNone) << "continuation " << j << " never finished";
  return o;
}

void drain(Engine& e) {
  for (int i = 0; i < 100000 && e.step(); ++i) {
  }
  EXPECT_EQ(e.stats().running, 0);
  EXPECT_EQ(e.stats().waiting, 0);
}

struct PoolCounts {
  int64_t req = 0, rec = 0, kv = 0;
  bool operator==(const PoolCounts&) const = default;
};
PoolCounts counts(ModelRunner& r) {
  auto& p = r.pools().req_to_token_pool;
  return {p.available(), p.recurrent_pool().available(),
          p.token_to_kv_pool() ? p.token_to_kv_pool()->available() : 0};
}

// The top-2 logit gap after prompt + prefix, run alone as one prefill: how near a tie the pick there is.
double top2_gap(models::KimiLinearForCausalLM& model, std::vector<int32_t> tokens) {
  ModelRunner runner(model, 1, static_cast<int64_t>(tokens.size()) + 8, kernels::KernelImpl::Auto);
  const int32_t T = static_cast<int32_t>(tokens.size());
  auto& pool = runner.pools().req_to_token_pool;
  const int32_t idx = pool.alloc(1)[0];
  auto fb = model_executor::ForwardBatch::extend({idx}, {T}, {0});
  std::vector<float> y(static_cast<size_t>(T) * model.hidden_size()), lg(kVocab);
  runner.forward(fb, tokens.data(), y.data());
  runner.logits(y.data() + (T - 1) * model.hidden_size(), 1, lg.data());
  std::sort(lg.begin(), lg.end(), std::greater<float>());
  return static_cast<double>(lg[0]) - lg[1];
}

// `got` equals `alone` except where the alone run's pick was a near tie (top-2 gap < 1e-4), from which
// on the two may differ (a batched run rounds differently).
void expect_same_or_near_tie(models::KimiLinearForCausalLM& model, const std::vector<int32_t>& prompt,
                             const std::vector<int32_t>& got, const std::vector<int32_t>& alone) {
  ASSERT_EQ(got.size(), alone.size());
  for (size_t k = 0; k < got.size(); ++k) {
    if (got[k] == alone[k]) continue;
    std::vector<int32_t> ctx = prompt;
    ctx.insert(ctx.end(), alone.begin(), alone.begin() + static_cast<std::ptrdiff_t>(k));
    EXPECT_LT(top2_gap(model, ctx), 1e-4)
        << "token " << k << " differs (" << got[k] << " vs " << alone[k] << ") without a near tie";
    return;
  }
}

EngineOptions options(int64_t budget = 64, int64_t max_batch = 16) {
  EngineOptions o;
  o.scheduler.token_budget = budget;
  o.scheduler.max_batch = max_batch;
  return o;
}

// One request alone on a fresh engine over the same runner (its pools are all free between runs).
Outcome alone(ModelRunner& runner, EngineOptions o, GenerateRequest req) {
  Engine e(runner, std::move(o));
  Collector c;
  const int32_t n = req.n, len = static_cast<int32_t>(req.prompt.size());
  const int64_t id = e.submit(std::move(req), c.sink());
  drain(e);
  return check_stream(c.of(id), n, len);
}

TEST(Engine, SubmitsFromEightThreadsWhileRunningStreamInOrderAndEqualServeAndAloneRuns) {
  auto& model = hybrid_model();
  ModelRunner runner(model, 8, 4096, kernels::KernelImpl::Auto);
  const PoolCounts start = counts(runner);
  Engine engine(runner, options(48, 6));
  Collector col;
  std::atomic<bool> stop{false};
  std::thread loop([&] { engine.run(stop); });
  struct Sent {
    int64_t id;
    GenerateRequest req;
  };
  std::mutex sent_mu;
  std::vector<Sent> sent;
  std::vector<std::thread> clients;
  for (int t = 0; t < 8; ++t)
    clients.emplace_back([&, t] {
      for (int k = 0; k < 3; ++k) {
        GenerateRequest r = greedy(random_prompt(5 + 13 * ((t + k) % 5), 100 * t + k), 3 + (t * 3 + k) % 9);
        const int64_t id = engine.submit(r, col.sink());
        std::lock_guard<std::mutex> lk(sent_mu);
        sent.push_back({id, std::move(r)});
        std::this_thread::sleep_for(std::chrono::milliseconds(t));
      }
    });
  for (auto& c : clients) c.join();
  for (int i = 0; i < 20000 && (engine.stats().requests_finished < 24); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  stop = true;
  loop.join();
  ASSERT_EQ(engine.stats().requests_finished, 24);
  EXPECT_EQ(counts(runner), start) << "a slot or token slot was not freed";

  std::sort(sent.begin(), sent.end(), [](const Sent& a, const Sent& b) { return a.id < b.id; });
  for (size_t i = 0; i < sent.size(); ++i) EXPECT_EQ(sent[i].id, static_cast<int64_t>(i) + 1);
  // serve() over the same requests (a fixed workload, all at step 0).
  std::vector<RequestSpec> specs;
  for (size_t i = 0; i < sent.size(); ++i) {
    RequestSpec s;
    s.id = static_cast<int64_t>(i);
    s.prompt = sent[i].req.prompt;
    s.prompt_len = static_cast<int32_t>(s.prompt.size());
    s.output_len = sent[i].req.params.max_tokens - 1;
    specs.push_back(s);
  }
  ServeOptions so;
  so.scheduler.token_budget = 48;
  so.scheduler.max_batch = 6;
  const ServeResult served = serve(runner, specs, so);
  for (size_t i = 0; i < sent.size(); ++i) {
    const auto& r = sent[i].req;
    const Outcome got = check_stream(col.of(sent[i].id), 1, static_cast<int32_t>(r.prompt.size()));
    EXPECT_EQ(got.finish[0], FinishReason::kLength);
    ASSERT_EQ(got.tokens[0].size(), static_cast<size_t>(r.params.max_tokens));
    const Outcome one = alone(runner, options(48, 6), r);
    expect_same_or_near_tie(model, r.prompt, got.tokens[0], one.tokens[0]);
    expect_same_or_near_tie(model, r.prompt, served.outputs[i].tokens, one.tokens[0]);
  }
  EXPECT_EQ(counts(runner), start);
}

TEST(Engine, ParallelGreedySamplesEqualOneAndFinishWithLength) {
  auto& model = hybrid_model();
  ModelRunner runner(model, 4, 2048, kernels::KernelImpl::Auto);
  const auto prompt = random_prompt(40, 3);
  const Outcome one = alone(runner, options(16), greedy(prompt, 6));
  const Outcome three = alone(runner, options(16), greedy(prompt, 6, 3));
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(three.tokens[j], one.tokens[0]) << "continuation " << j;
    EXPECT_EQ(three.finish[j], FinishReason::kLength);
  }
  // max_tokens 1: every continuation's only token comes from the prompt's last position.
  const Outcome first = alone(runner, options(16), greedy(prompt, 1, 2));
  for (int j = 0; j < 2; ++j) {
    EXPECT_EQ(first.tokens[j], std::vector<int32_t>{one.tokens[0][0]});
    EXPECT_EQ(first.finish[j], FinishReason::kLength);
  }
}

TEST(Engine, StopIdsEndWithStopAndDeliverTheStopToken) {
  auto& model = hybrid_model();
  ModelRunner runner(model, 4, 2048, kernels::KernelImpl::Auto);
  const PoolCounts start = counts(runner);
  const auto prompt = random_prompt(20, 5);
  const Outcome full = alone(runner, options(), greedy(prompt, 12));
  const auto& t = full.tokens[0];
  const int32_t stop_tok = t[4];
  const size_t first = static_cast<size_t>(std::find(t.begin(), t.end(), stop_tok) - t.begin());
  const std::vector<int32_t> until(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(first) + 1);

  auto req = greedy(prompt, 12);
  req.params.stop_token_ids = {stop_tok};
  Outcome o = alone(runner, options(), req);
  EXPECT_EQ(o.finish[0], FinishReason::kStop);
  EXPECT_EQ(o.tokens[0], until);

  EngineOptions eo = options();
  eo.stop_ids = {stop_tok};  // the model's stop ids
  o = alone(runner, eo, greedy(prompt, 12));
  EXPECT_EQ(o.finish[0], FinishReason::kStop);
  EXPECT_EQ(o.tokens[0], until);
  auto ign = greedy(prompt, 12);
  ign.params.ignore_eos = true;  // the model's stop ids no longer stop it
  o = alone(runner, eo, ign);
  EXPECT_EQ(o.finish[0], FinishReason::kLength);
  EXPECT_EQ(o.tokens[0], t);

  // Not producible: never picked, the same path otherwise up to there.
  EngineOptions mask = options();
  mask.producible.assign(kVocab, 1);
  mask.producible[stop_tok] = 0;
  o = alone(runner, mask, greedy(prompt, 12));
  EXPECT_EQ(std::count(o.tokens[0].begin(), o.tokens[0].end(), stop_tok), 0);
  EXPECT_EQ(
      std::vector<int32_t>(o.tokens[0].begin(), o.tokens[0].begin() + static_cast<std::ptrdiff_t>(first)),
      std::vector<int32_t>(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(first)));
  EXPECT_EQ(counts(runner), start);
}

// Steps until `pred` holds (at most `limit` steps); false if it never did.
template <class P>
bool step_until(Engine& e, P pred, int limit = 1000) {
  for (int i = 0; i < limit; ++i) {
    if (pred()) return true;
    e.step();
  }
  return pred();
}

TEST(Engine, AbortInEveryPhaseFreesEverySlotAndLeavesTheOthersUnchanged) {
  auto& model = hybrid_model();
  ModelRunner runner(model, 4, 4096, kernels::KernelImpl::Auto);
  const PoolCounts start = counts(runner);
  const auto bystander_prompt = random_prompt(30, 77);
  const Outcome bystander_alone = alone(runner, options(16, 8), greedy(bystander_prompt, 24));

  Engine e(runner, options(16, 8));
  Collector c;
  const int64_t by = e.submit(greedy(bystander_prompt, 24), c.sink());
  // Forks pending: 2 samples of a long prompt (16-token chunks), its fork waits for the prompt's end.
  const int64_t fork = e.submit(greedy(random_prompt(90, 2), 8, 2), c.sink());
  // Waiting: needs every slot of the pool, so it waits behind the others.
  const int64_t wait = e.submit(greedy(random_prompt(10, 4), 4, 4), c.sink());
  ASSERT_TRUE(step_until(e, [&] { return e.stats().waiting == 1; }));
  EXPECT_TRUE(c.of(fork).empty());
  e.abort(fork);
  e.abort(wait);
  e.abort(12345);  // unknown: no-op
  e.step();
  EXPECT_EQ(e.stats().waiting, 0);
  // Mid-prefill: a 100-token prompt takes several steps.
  const int64_t pre = e.submit(greedy(random_prompt(100, 1), 8), c.sink());
  ASSERT_TRUE(step_until(e, [&] { return e.stats().waiting == 0 && e.stats().running == 2; }));
  e.step();
  EXPECT_TRUE(c.of(pre).empty());
  e.abort(pre);
  e.step();
  const auto pe = c.of(pre);
  ASSERT_EQ(pe.size(), 1u);
  EXPECT_EQ(pe[0].finish, FinishReason::kAbort);
  EXPECT_EQ(pe[0].token, -1);
  const Outcome w = check_stream(c.of(wait), 4, 10);  // a finish event per continuation, no token
  EXPECT_EQ(w.finish, std::vector<FinishReason>(4, FinishReason::kAbort));
  for (const auto& t : w.tokens) EXPECT_TRUE(t.empty());
  const Outcome f = check_stream(c.of(fork), 2, 90);
  EXPECT_EQ(f.finish, (std::vector<FinishReason>{FinishReason::kAbort, FinishReason::kAbort}));
  e.abort(pre);  // finished: no-op
  // Decode: abort after a few tokens; sinks may call abort on the engine's thread.
  const int64_t dec = e.submit(greedy(random_prompt(12, 5), 30, 2), [&](const TokenEvent& ev) {
    c.sink()(ev);
    if (ev.index == 1 && ev.token >= 0 && c.of(ev.request).size() >= 6) e.abort(ev.request);
  });
  drain(e);
  const Outcome d = check_stream(c.of(dec), 2, 12);
  EXPECT_EQ(d.finish[0], FinishReason::kAbort);
  EXPECT_EQ(d.finish[1], FinishReason::kAbort);
  EXPECT_LT(d.tokens[0].size(), 30u);
  const Outcome b = check_stream(c.of(by), 1, 30);
  EXPECT_EQ(b.finish[0], FinishReason::kLength);
  expect_same_or_near_tie(model, bystander_prompt, b.tokens[0], bystander_alone.tokens[0]);
  EXPECT_EQ(e.stats().requests_aborted, 4);
  EXPECT_EQ(e.stats().requests_finished, 1);
  EXPECT_EQ(counts(runner), start) << "a slot or token slot was not freed";
  EXPECT_EQ(e.stats().slots_used, 0);
  EXPECT_EQ(e.stats().kv_tokens_used, 0);
  // The aborted forks' reserved slots are back: a request that needs the whole pool runs.
  const int64_t all = e.submit(greedy(random_prompt(10, 6), 3, 4), c.sink());
  drain(e);
  EXPECT_EQ(check_stream(c.of(all), 4, 10).finish[3], FinishReason::kLength);
}

TEST(Engine, RunAbortsWhatIsLeftWhenStopped) {
  ModelRunner runner(hybrid_model(), 2, 2048, kernels::KernelImpl::Auto);
  const PoolCounts start = counts(runner);
  Engine e(runner, options(8));
  Collector c;
  std::atomic<bool> stop{true};  // the loop returns at once, aborting both
  const int64_t a = e.submit(greedy(random_prompt(50, 1), 200), c.sink());
  const int64_t b = e.submit(greedy(random_prompt(50, 2), 200), c.sink());
  e.step();
  e.run(stop);
  EXPECT_EQ(check_stream(c.of(a), 1, 50).finish[0], FinishReason::kAbort);
  EXPECT_EQ(check_stream(c.of(b), 1, 50).finish[0], FinishReason::kAbort);
  EXPECT_EQ(counts(runner), start);
}

// Each event's engine step, by request: the engine publishes its stats before it delivers a step's events.
struct StepLog {
  std::mutex mu;
  std::map<int64_t, std::vector<int64_t>> steps;
  EventSink sink(const Engine& e) {
    return [this, &e](const TokenEvent& ev) {
      const int64_t s = e.stats().steps;
      std::lock_guard<std::mutex> lk(mu);
      steps[ev.request].push_back(s);
    };
  }
  std::vector<int64_t> of(int64_t id) {
    std::lock_guard<std::mutex> lk(mu);
    return steps[id];
  }
};

template <class P>
bool wait_for(P pred) {
  for (int i = 0; i < 60000; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return pred();
}

// An engine on the hybrid model (`slots` sequences) with the given admission window, its run() loop on a
// thread of its own from construction until finish() (or destruction).
struct LoopedEngine {
  ModelRunner runner;
  Engine e;
  StepLog log;
  std::atomic<bool> stop{false};
  std::thread loop;
  LoopedEngine(int64_t slots, EngineOptions o, double window_ms)
      : runner(hybrid_model(), slots, 4096, kernels::KernelImpl::Auto),
        e(runner, with_window(std::move(o), window_ms)),
        loop([this] { e.run(stop); }) {}
  LoopedEngine(const LoopedEngine&) = delete;
  LoopedEngine& operator=(const LoopedEngine&) = delete;
  ~LoopedEngine() {
    if (loop.joinable()) finish();
  }
  void finish() {
    stop = true;
    loop.join();
  }
  static EngineOptions with_window(EngineOptions o, double ms) {
    o.admission_window_ms = ms;
    return o;
  }
};

TEST(Engine, ABurstReachingAnIdleEngineWithinTheAdmissionWindowRunsAsOneStep) {
  // The wait ends once the 8th arrives (a full batch), long before the window.
  LoopedEngine le(8, options(4096, 8), 1000.0);
  Engine& e = le.e;
  StepLog& log = le.log;
  std::vector<int64_t> ids = {e.submit(greedy(random_prompt(20, 1), 5), log.sink(e))};
  // The engine wakes to the first request; without the window it would run it alone while the rest come.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  for (int k = 1; k < 8; ++k)
    ids.push_back(e.submit(greedy(random_prompt(10 + 3 * k, 1 + k), 5), log.sink(e)));
  EXPECT_TRUE(wait_for([&] { return e.stats().requests_finished == 8; }));
  le.finish();
  // One prefill step for all eight, then four decode steps.
  for (const int64_t id : ids)
    EXPECT_EQ(log.of(id), (std::vector<int64_t>{1, 2, 3, 4, 5})) << "request " << id;
  EXPECT_EQ(e.stats().steps, 5);
  EXPECT_EQ(e.stats().admission_waits, 1);
  EXPECT_GT(e.stats().admission_wait_s, 0.0);
}

TEST(Engine, EachArrivalRestartsTheAdmissionWindowUpToItsLimit) {
  LoopedEngine le(8, options(4096, 8), 600.0);
  Engine& e = le.e;
  StepLog& log = le.log;
  // Four requests 150 ms apart: 450 ms from the first to the last, less than a window between any two,
  // and a batch of 8 that never fills. Each arrival restarts the window, so all four start in one step.
  std::vector<int64_t> ids;
  for (int k = 0; k < 4; ++k) {
    if (k > 0) std::this_thread::sleep_for(std::chrono::milliseconds(150));
    ids.push_back(e.submit(greedy(random_prompt(10 + 3 * k, 1 + k), 3), log.sink(e)));
  }
  EXPECT_TRUE(wait_for([&] { return e.stats().requests_finished == 4; }));
  le.finish();
  for (const int64_t id : ids) EXPECT_EQ(log.of(id), (std::vector<int64_t>{1, 2, 3})) << "request " << id;
  EXPECT_EQ(e.stats().admission_waits, 1);
  // One window after the last arrival, and never past kAdmissionWindows windows.
  EXPECT_GE(e.stats().admission_wait_s, 0.45 + 0.6 - 0.05);
  EXPECT_LE(e.stats().admission_wait_s, kAdmissionWindows * 0.6 + 0.05);
}

TEST(Engine, AnArrivalWhileRequestsRunIsNotHeldAndAFullFirstStepIsNotHeld) {
  LoopedEngine le(4, options(64, 8), 1000.0);
  Engine& e = le.e;
  StepLog& log = le.log;
  // 64 prompt tokens fill the first step's token budget: nothing to wait for.
  const int64_t a = e.submit(greedy(random_prompt(64, 1), 2000), log.sink(e));
  EXPECT_TRUE(wait_for([&] { return !log.of(a).empty(); }));
  const int64_t b = e.submit(greedy(random_prompt(12, 2), 6), log.sink(e));
  EXPECT_TRUE(wait_for([&] { return log.of(b).size() == 6; }));
  // a goes on after b: a step of a's after b's last (the test thread alone decides when it aborts a; on a
  // loaded machine it could do so before the engine's next step, which is no fault of the engine's).
  EXPECT_TRUE(wait_for([&] { return log.of(a).back() > log.of(b).back(); })) << "a stopped with b";
  e.abort(a);
  EXPECT_TRUE(wait_for([&] { return e.stats().running == 0; }));
  le.finish();
  const auto sa = log.of(a), sb = log.of(b);
  ASSERT_FALSE(sb.empty());
  EXPECT_GT(sa.back(), sb.back()) << "a was running all along b's life";
  EXPECT_EQ(e.stats().admission_waits, 0) << "the engine held a step while requests ran, or a full one";
  EXPECT_EQ(e.stats().admission_wait_s, 0.0);
}

TEST(Engine, AdmissionWindowOutsideZeroToOneSecondIsRefused) {
  ModelRunner runner(hybrid_model(), 2, 256, kernels::KernelImpl::Auto);
  for (const double w :
       {-1.0, 1000.5, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    EngineOptions o = options();
    o.admission_window_ms = w;
    testing::expect_throw_with<std::invalid_argument>([&] { Engine e(runner, o); }, "admission_window_ms");
  }
  // 0: no window; a lone request on an idle engine runs at once.
  EngineOptions o = options();
  o.admission_window_ms = 0.0;
  Engine e(runner, o);
  Collector c;
  std::atomic<bool> stop{false};
  std::thread loop([&] { e.run(stop); });
  const int64_t id = e.submit(greedy(random_prompt(10, 3), 3), c.sink());
  EXPECT_TRUE(wait_for([&] { return e.stats().requests_finished == 1; }));
  stop = true;
  loop.join();
  EXPECT_EQ(check_stream(c.of(id), 1, 10).tokens[0].size(), 3u);
  EXPECT_EQ(e.stats().admission_waits, 0);
}

TEST(Engine, BadSubmitsThrowNamingTheFieldAndChangeNothing) {
  ModelRunner runner(hybrid_model(), 3, 256, kernels::KernelImpl::Auto);
  EngineOptions o = options();
  o.max_context = 100;
  Engine e(runner, o);
  Collector c;
  auto bad = [&](GenerateRequest r, const std::string& needle) {
    testing::expect_throw_with<std::invalid_argument>([&] { e.submit(std::move(r), c.sink()); }, needle);
  };
  bad(greedy({}, 4), "prompt");
  bad(greedy({1, 2, static_cast<int32_t>(kVocab)}, 4), "prompt: token id 512 at position 2");
  bad(greedy({1, -1}, 4), "prompt: token id -1");
  bad(greedy({1, 2}, 4, 4), "n: 4");
  bad(greedy({1, 2}, 4, 0), "n:");
  bad(greedy(random_prompt(90, 1), 20), "max_tokens");             // beyond max_context
  bad(greedy(random_prompt(50, 1), 40, 3), "MLA KV token slots");  // beyond the KV pool
  auto nan = greedy({1, 2}, 4);
  nan.params.temperature = std::numeric_limits<float>::quiet_NaN();
  bad(nan, "temperature");
  auto big_stop = greedy({1, 2}, 4);
  big_stop.params.stop_token_ids = {static_cast<int32_t>(kVocab)};
  bad(big_stop, "stop_token_ids");
  EXPECT_EQ(e.stats().waiting, 0);
  EXPECT_FALSE(e.step());
  // The next good request is request 1 and runs.
  EXPECT_EQ(e.submit(greedy({1, 2, 3}, 3), c.sink()), 1);
  drain(e);
  EXPECT_EQ(check_stream(c.of(1), 1, 3).tokens[0].size(), 3u);
  EXPECT_THROW(Engine(runner,
                      [] {
                        EngineOptions x;
                        x.producible.assign(7, 1);
                        return x;
                      }()),
               std::invalid_argument);
}

GenerateRequest sampled(std::vector<int32_t> prompt, int32_t max_tokens, uint64_t seed, int32_t n = 1) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.params.temperature = 0.9f;
  r.params.top_k = 40;
  r.params.top_p = 0.95f;
  r.params.repetition_penalty = 1.1f;
  r.params.seed = seed;
  r.params.max_tokens = max_tokens;
  r.params.logprobs = 2;
  r.n = n;
  return r;
}

TEST(Engine, SeededSamplingIsTheSameAloneAndBatchedAndContinuationsUseSeedPlusJ) {
  auto& model = hybrid_model();
  ModelRunner runner(model, 8, 4096, kernels::KernelImpl::Auto);
  const PoolCounts start = counts(runner);
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 6; ++i)
    reqs.push_back(i % 3 == 2 ? greedy(random_prompt(8 + 7 * i, 40 + i), 10)
                              : sampled(random_prompt(8 + 7 * i, 40 + i), 10, 1000 + i));
  Engine e(runner, options(32, 8));
  Collector c;
  std::vector<int64_t> ids;
  for (const auto& r : reqs) ids.push_back(e.submit(r, c.sink()));
  drain(e);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto ev = c.of(ids[i]);
    const Outcome batched = check_stream(ev, 1, static_cast<int32_t>(reqs[i].prompt.size()));
    const Outcome one = alone(runner, options(32, 8), reqs[i]);
    ASSERT_EQ(batched.tokens[0].size(), 10u);
    expect_same_or_near_tie(model, reqs[i].prompt, batched.tokens[0], one.tokens[0]);
    for (const auto& x : ev) {  // logprobs when asked: the chosen token's and its top alternatives
      ASSERT_EQ(x.logprob.has_value(), reqs[i].params.logprobs >= 0);
      if (!x.logprob) continue;
      EXPECT_EQ(x.logprob->token, x.token);
      EXPECT_LE(x.logprob->logprob, 0.0f);
      EXPECT_EQ(x.logprob->top.size(), 2u);
    }
  }
  // Sampling does not draw the same tokens for different seeds (a check the test can fail).
  const Outcome s0 = alone(runner, options(), sampled(reqs[0].prompt, 10, 1));
  const Outcome s1 = alone(runner, options(), sampled(reqs[0].prompt, 10, 2));
  EXPECT_NE(s0.tokens[0], s1.tokens[0]);
  // Continuation j of a request seeded s draws as a request seeded s + j.
  const Outcome two = alone(runner, options(), sampled(reqs[0].prompt, 10, 1, 2));
  expect_same_or_near_tie(model, reqs[0].prompt, two.tokens[0], s0.tokens[0]);
  expect_same_or_near_tie(model, reqs[0].prompt, two.tokens[1], s1.tokens[0]);
  EXPECT_EQ(counts(runner), start);
}

// Thousands of short requests: what the engine and scheduler keep per request goes back (or is reused).
TEST(Engine, ResidentMemoryStaysFlatOverThousandsOfRequests) {
  if (testing::kSanitizedMalloc) GTEST_SKIP() << "a sanitizer's allocator measures itself";
  ModelRunner runner(hybrid_model(), 32, 4096, kernels::KernelImpl::Auto);
  Engine e(runner, options(256, 64));
  std::atomic<int64_t> finishes{0};
  auto wave = [&](int requests) {
    for (int i = 0; i < requests; ++i) {
      auto r =
          i % 2 ? greedy(random_prompt(4, i), 2, 1 + i % 2) : sampled(random_prompt(4, i), 2, i, 1 + i % 2);
      e.submit(std::move(r), [&](const TokenEvent& ev) {
        if (ev.finish != FinishReason::kNone) ++finishes;
      });
    }
    drain(e);
  };
  for (int k = 0; k < 3; ++k) wave(100);  // warm: every size of bookkeeping reached once
  const int64_t before = testing::proc_status_kb("VmRSS");
  for (int k = 0; k < 12; ++k) wave(100);
  const int64_t after = testing::proc_status_kb("VmRSS");
  EXPECT_EQ(e.stats().requests_finished, 1500);
  EXPECT_EQ(e.stats().slots_used, 0);
  EXPECT_LT(after - before, 1024) << "resident memory grew by " << after - before << " kB over 1200 requests";
}

TEST(Engine, PrefixCacheHitsReportCachedTokensAndChangeNoToken) {
  auto& model = kda_model();
  ModelRunner runner(model, 6, 0, kernels::KernelImpl::Auto);
  auto& rec = runner.pools().recurrent_state_pool;
  mem_cache::RadixCache cache(rec, 3 * rec.bytes_per_slot());
  EngineOptions o = options(32);
  const auto prompt = random_prompt(70, 9);
  const Outcome cold = alone(runner, o, greedy(prompt, 6));  // no cache
  EXPECT_EQ(cold.cached_tokens, 0);
  o.scheduler.cache = &cache;
  o.scheduler.cache_interval = 32;
  Engine e(runner, o);
  Collector c;
  const int64_t a = e.submit(greedy(prompt, 6), c.sink());
  drain(e);
  const int64_t b = e.submit(greedy(prompt, 6), c.sink());
  // Aborted mid-prefill with its snapshots pending: the tree stays consistent.
  const int64_t ab = e.submit(greedy(random_prompt(120, 10), 4), c.sink());
  e.step();
  e.abort(ab);
  drain(e);
  const Outcome hit = check_stream(c.of(b), 1, 70);
  EXPECT_EQ(check_stream(c.of(a), 1, 70).cached_tokens, 0);
  EXPECT_EQ(hit.cached_tokens, 69);
  expect_same_or_near_tie(model, prompt, hit.tokens[0], cold.tokens[0]);
  EXPECT_EQ(e.stats().cached_tokens, 69);
  EXPECT_GT(e.stats().prefix_cache_bytes, 0);
  EXPECT_NO_THROW(cache.check_invariants());
  EXPECT_EQ(cache.pending_snapshots(), 0);
  EXPECT_EQ(rec.available() + cache.snapshots(), rec.size());
}

}  // namespace
}  // namespace kda::serving

namespace kda::serving {
namespace {

// The hybrid checkpoint of seed 5, with token `nan_token`'s embedding row NaN (none when -1): a row whose
// input is that token has NaN logits; the rows before it are as in the clean model (the LM head is not
// tied to the embedding).
std::unique_ptr<models::KimiLinearForCausalLM> model_with_nan_token(int32_t nan_token) {
  const auto cfg = config({1, 2, 4}, {3});
  auto w = testing::random_model_weights(cfg, 5, io::StDType::F32);
  auto& emb = w.at("model.embed_tokens.weight");
  const int64_t D = emb.shape.at(1);
  if (nan_token >= 0)
    std::fill(emb.values.begin() + nan_token * D, emb.values.begin() + (nan_token + 1) * D,
              std::numeric_limits<float>::quiet_NaN());
  const auto dir = testing::make_temp_dir("engine_nan");
  testing::write_model_checkpoint(dir, cfg, w);
  auto model = models::KimiLinearForCausalLM::from_pretrained(dir);
  std::filesystem::remove_all(dir);
  return model;
}

// A request whose logits are NaN (token 7's embedding row is NaN in this checkpoint) has its row refused,
// by the sampler (temperature 1) or by the plain greedy pick (no sampler): that request alone finishes with
// kAbort and gives its slots back; a request batched with it finishes as it does alone.
void expect_nan_request_aborted_alone(bool plain_greedy) {
  SCOPED_TRACE(plain_greedy ? "plain greedy" : "sampler");
  auto model = model_with_nan_token(7);
  ModelRunner runner(*model, 4, 1024, kernels::KernelImpl::Auto);
  const PoolCounts start = counts(runner);

  GenerateRequest bad = greedy({1, 7, 3}, 4);
  if (!plain_greedy) {
    bad.params.temperature = 1.0f;
    bad.params.seed = 3;
  }
  GenerateRequest good = greedy(random_prompt(9, 2), 4);
  const Outcome solo = alone(runner, options(), good);

  Engine e(runner, options());
  Collector c;
  const int64_t bad_id = e.submit(bad, c.sink());
  const int64_t good_id = e.submit(good, c.sink());
  drain(e);
  const Outcome b = check_stream(c.of(bad_id), 1, 3);
  EXPECT_EQ(b.finish[0], FinishReason::kAbort);
  EXPECT_TRUE(b.tokens[0].empty());
  const Outcome g = check_stream(c.of(good_id), 1, 9);
  EXPECT_EQ(g.finish[0], FinishReason::kLength);
  expect_same_or_near_tie(*model, good.prompt, g.tokens[0], solo.tokens[0]);
  EXPECT_EQ(counts(runner), start);
  EXPECT_EQ(e.stats().requests_aborted, 1);
}

TEST(Engine, ARequestWhoseRowIsRefusedIsAbortedAloneAndTheOthersGoOn) {
  expect_nan_request_aborted_alone(false);
  expect_nan_request_aborted_alone(true);
}

// --- Speculative decoding (EngineOptions::spec): ngram drafts verified in TARGET_VERIFY steps. ---

// The synthetic model's greedy text is close to random over its vocabulary, so that ngram drafts from it
// would almost never be right. These tests let the model produce only kNarrow ids (EngineOptions::
// producible, the same with and without speculation) and draw prompts from them: the history repeats
// short n-grams, and drafts are accepted often enough to exercise every path of verification.
constexpr int32_t kNarrow = 5;

// A prompt of `reps` copies of a random `period`-token pattern of producible ids.
std::vector<int32_t> repeating_prompt(int32_t period, int32_t reps, uint64_t seed) {
  auto unit = random_prompt(period, seed);
  for (auto& t : unit) t %= kNarrow;
  std::vector<int32_t> p;
  for (int32_t r = 0; r < reps; ++r) p.insert(p.end(), unit.begin(), unit.end());
  return p;
}

EngineOptions narrow(EngineOptions o) {
  o.producible.assign(kVocab, 0);
  std::fill(o.producible.begin(), o.producible.begin() + kNarrow, 1);
  return o;
}

EngineOptions spec_options(int32_t draft_tokens, int32_t topk = 1, int64_t max_batch = 8) {
  EngineOptions o = narrow(options(64, max_batch));
  o.spec.algorithm = SpecAlgorithm::kNgram;
  o.spec.draft_tokens = draft_tokens;
  o.spec.topk = topk;
  o.spec.depth_mode = DraftDepthMode::kFixed;  // every row drafts as deep as ngram reaches
  return o;
}

// A runner whose verify buffer holds rows of up to 1 + 4 * 2 tokens (chains of 4, trees of 2 x 4).
std::unique_ptr<ModelRunner> spec_runner(int64_t slots = 8) {
  return std::make_unique<ModelRunner>(hybrid_model(), slots, 4096, kernels::KernelImpl::Auto, 9, slots);
}

// Every request's outcome, all submitted at once and run to the end.
std::vector<Outcome> run_batch(Engine& e, const std::vector<GenerateRequest>& reqs) {
  Collector c;
  std::vector<int64_t> ids;
  for (const auto& r : reqs) ids.push_back(e.submit(r, c.sink()));
  drain(e);
  std::vector<Outcome> out;
  for (size_t i = 0; i < reqs.size(); ++i)
    out.push_back(check_stream(c.of(ids[i]), reqs[i].n, static_cast<int32_t>(reqs[i].prompt.size())));
  return out;
}

std::vector<GenerateRequest> greedy_spec_workload() {
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back(greedy(repeating_prompt(5 + i, 6, 300 + i), 24));
  reqs.push_back(greedy(random_prompt(20, 310), 20));  // ids the model may not produce: nothing to match
  GenerateRequest lp = greedy(repeating_prompt(7, 4, 311), 16);
  lp.params.logprobs = 1;  // greedy through the sampler (not the plain argmax path)
  reqs.push_back(lp);
  reqs.push_back(greedy(repeating_prompt(4, 8, 312), 12, 2));  // parallel samples
  return reqs;
}

TEST(EngineSpeculative, GreedyTokensEqualPlainDecodingForChainsAndTrees) {
  auto runner = spec_runner();
  const PoolCounts start = counts(*runner);
  const auto reqs = greedy_spec_workload();
  std::vector<Outcome> plain;
  {
    Engine e(*runner, narrow(options(64, 8)));
    plain = run_batch(e, reqs);
  }
  for (const int32_t topk : {1, 2}) {
    Engine e(*runner, spec_options(4, topk));
    const auto got = run_batch(e, reqs);
    const EngineStats st = e.stats();
    EXPECT_GT(st.spec_draft_tokens, 0);
    EXPECT_GT(st.spec_accepted_tokens, 0) << "no draft accepted: the test would not see verification";
    EXPECT_LE(st.spec_accepted_tokens, st.spec_draft_tokens);
    for (size_t i = 0; i < reqs.size(); ++i)
      for (int32_t j = 0; j < reqs[i].n; ++j) {
        EXPECT_EQ(got[i].finish[j], plain[i].finish[j]);
        expect_same_or_near_tie(hybrid_model(), reqs[i].prompt, got[i].tokens[j], plain[i].tokens[j]);
      }
    EXPECT_EQ(counts(*runner), start);
  }
}

// After a run in which drafts were rejected, the same slots continue a conversation exactly as plain
// decoding does: the rejected tokens left nothing in any KDA state or MLA token slot.
TEST(EngineSpeculative, RejectedDraftsLeaveNoTrace) {
  auto runner = spec_runner(4);
  const PoolCounts start = counts(*runner);
  Engine spec(*runner, spec_options(4));
  const auto reqs = greedy_spec_workload();
  const auto first = run_batch(spec, {reqs[0], reqs[1], reqs[4]});
  EXPECT_LT(spec.stats().spec_accepted_tokens, spec.stats().spec_draft_tokens) << "no draft was rejected";
  // The next turn: prompt + answer + more, on the slots the speculative run used.
  auto next = reqs[0];
  next.prompt.insert(next.prompt.end(), first[0].tokens[0].begin(), first[0].tokens[0].end());
  next.prompt.insert(next.prompt.end(), reqs[1].prompt.begin(), reqs[1].prompt.begin() + 9);
  const auto after_spec = run_batch(spec, {next});
  Engine plain(*runner, narrow(options(64, 8)));
  const auto after_plain = run_batch(plain, {next});
  expect_same_or_near_tie(hybrid_model(), next.prompt, after_spec[0].tokens[0], after_plain[0].tokens[0]);
  EXPECT_EQ(counts(*runner), start);
}

TEST(EngineSpeculative, SeededSamplingIsReproducibleAndTheSameAloneAndBatched) {
  auto runner = spec_runner();
  const PoolCounts start = counts(*runner);
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    GenerateRequest r = sampled(repeating_prompt(5 + i, 6, 400 + i), 20, 7000 + i);
    // Sharp enough that drafts are accepted; penalties on in some (they see the tokens accepted before).
    r.params.temperature = 0.3f + 0.3f * static_cast<float>(i);
    if (i % 2 == 0) r.params.repetition_penalty = 1.0f;
    reqs.push_back(r);
  }
  reqs.push_back(greedy(repeating_prompt(6, 5, 410), 20));
  int64_t accepted = 0;
  std::vector<Outcome> batched;
  {
    Engine e(*runner, spec_options(4));
    batched = run_batch(e, reqs);
    accepted = e.stats().spec_accepted_tokens;
    const auto again = run_batch(e, reqs);  // the same engine, slots reused: the same tokens
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(again[i].tokens, batched[i].tokens) << "request " << i;
  }
  EXPECT_GT(accepted, 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    Engine e(*runner, spec_options(4));
    const auto one = run_batch(e, {reqs[i]});
    ASSERT_EQ(batched[i].tokens[0].size(), 20u);
    expect_same_or_near_tie(hybrid_model(), reqs[i].prompt, batched[i].tokens[0], one[0].tokens[0]);
  }
  // Different seeds draw different tokens (a check the test can fail).
  Engine e(*runner, spec_options(4));
  auto other = reqs[0];
  other.params.seed = 1;
  EXPECT_NE(run_batch(e, {other})[0].tokens, batched[0].tokens);
  EXPECT_EQ(counts(*runner), start);
}

// A stop id or max_tokens that falls on an accepted draft ends the continuation exactly there.
TEST(EngineSpeculative, StopIdAndMaxTokensInsideAnAcceptedPathEndThere) {
  auto runner = spec_runner(2);
  const PoolCounts start = counts(*runner);
  // Step by step: which emitted tokens were not the last of their step (accepted drafts); the first
  // prompt among a few whose run has one.
  GenerateRequest base;
  std::vector<int32_t> full;
  std::vector<size_t> inside;  // indices into full
  for (uint64_t seed = 500; seed < 516 && inside.empty(); ++seed) {
    base = greedy(repeating_prompt(5 + static_cast<int32_t>(seed % 3), 8, seed), 30);
    inside.clear();
    Engine e(*runner, spec_options(4));
    Collector c;
    const int64_t id = e.submit(base, c.sink());
    size_t seen = 0;
    while (e.step()) {
      const auto ev = c.of(id);
      for (size_t k = seen; k + 1 < ev.size(); ++k)
        if (ev[k].token >= 0) inside.push_back(k);
      seen = ev.size();
    }
    full = check_stream(c.of(id), 1, static_cast<int32_t>(base.prompt.size())).tokens[0];
  }
  ASSERT_EQ(full.size(), 30u);
  // The first accepted draft whose token did not come before (a stop there is the first stop).
  size_t cut = full.size();
  for (const size_t k : inside)
    if (k + 1 < full.size() && std::find(full.begin(), full.begin() + k, full[k]) == full.begin() + k) {
      cut = k;
      break;
    }
  ASSERT_LT(cut, full.size()) << "no accepted draft: the workload does not exercise the cut";
  const std::vector<int32_t> want(full.begin(), full.begin() + cut + 1);
  {
    Engine e(*runner, spec_options(4));
    GenerateRequest r = base;
    r.params.stop_token_ids = {full[cut]};
    const auto o = run_batch(e, {r});
    EXPECT_EQ(o[0].tokens[0], want);
    EXPECT_EQ(o[0].finish[0], FinishReason::kStop);
    EXPECT_EQ(e.stats().generation_tokens, static_cast<int64_t>(want.size()));
  }
  {
    Engine e(*runner, spec_options(4));
    GenerateRequest r = base;
    r.params.max_tokens = static_cast<int32_t>(cut) + 1;
    const auto o = run_batch(e, {r});
    EXPECT_EQ(o[0].tokens[0], want);
    EXPECT_EQ(o[0].finish[0], FinishReason::kLength);
  }
  EXPECT_EQ(counts(*runner), start);
}

TEST(EngineSpeculative, AbortMidSpeculationFreesEverySlotAndKvToken) {
  auto runner = spec_runner(4);
  const PoolCounts start = counts(*runner);
  Engine e(*runner, spec_options(4, 2));
  Collector c;
  std::vector<int64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(e.submit(greedy(repeating_prompt(5, 6, 600 + i), 40), c.sink()));
  ASSERT_TRUE(step_until(e, [&] { return e.stats().spec_accepted_tokens > 0; }));
  EXPECT_GT(e.stats().kv_tokens_used, 0);
  for (const int64_t id : ids) e.abort(id);
  e.step();
  for (const int64_t id : ids) {
    const auto ev = c.of(id);
    ASSERT_FALSE(ev.empty());
    EXPECT_EQ(ev.back().finish, FinishReason::kAbort);
  }
  EXPECT_EQ(e.stats().running, 0);
  EXPECT_EQ(e.stats().slots_used, 0);
  EXPECT_EQ(e.stats().kv_tokens_used, 0);
  EXPECT_EQ(counts(*runner), start) << "a slot or MLA token slot was not freed";
}

// A verify row that meets NaN logits: replay drafts feed each request its own greedy continuation, and
// the "bad" request's continuation holds a token whose embedding row is NaN in the checkpoint. The step
// that feeds it refuses that row at the NaN position, by the plain greedy pick, by the same pick agreed
// across ranks (tensor parallelism's path, here with one rank) or by the sampler (greedy with logprobs):
// the request ends with kAbort and the tokens of its steps before, nothing of the refused step's
// accepted path; the request batched with it finishes as alone, and every slot and KV token is free.
TEST(EngineSpeculative, AVerifyRowWithNaNLogitsIsAbortedAloneAndTheOthersGoOn) {
  const GenerateRequest bad_clean = greedy(random_prompt(6, 700), 10),
                        good = greedy(random_prompt(9, 701), 10);
  std::vector<int32_t> truth_bad, truth_good;
  int32_t cut = -1;  // the first generated token (after the first two) that the prompt and earlier ones lack
  {
    auto clean = model_with_nan_token(-1);
    ModelRunner runner(*clean, 2, 1024, kernels::KernelImpl::Auto);
    truth_bad = alone(runner, options(), bad_clean).tokens[0];
    truth_good = alone(runner, options(), good).tokens[0];
    for (size_t k = 2; k < truth_bad.size() && cut < 0; ++k) {
      const int32_t t = truth_bad[k];
      if (std::count(bad_clean.prompt.begin(), bad_clean.prompt.end(), t) == 0 &&
          std::count(truth_bad.begin(), truth_bad.begin() + static_cast<std::ptrdiff_t>(k), t) == 0 &&
          std::count(good.prompt.begin(), good.prompt.end(), t) == 0 &&
          std::count(truth_good.begin(), truth_good.end(), t) == 0)
        cut = static_cast<int32_t>(k);
    }
  }
  ASSERT_GE(cut, 0) << "no generated token of its own in the bad request's continuation";
  auto model = model_with_nan_token(truth_bad[static_cast<size_t>(cut)]);
  ModelRunner runner(*model, 4, 1024, kernels::KernelImpl::Auto, 5, 4);
  const PoolCounts start = counts(runner);
  for (const char* mode : {"plain greedy", "agreed greedy", "sampler greedy"}) {
    SCOPED_TRACE(mode);
    const std::string m = mode;
    GenerateRequest bad = bad_clean;
    if (m == "sampler greedy") bad.params.logprobs = 1;  // greedy through the sampler
    EngineOptions o = options();
    o.spec.algorithm = SpecAlgorithm::kReplay;
    o.spec.draft_tokens = 4;
    o.spec.depth_mode = DraftDepthMode::kFixed;
    int64_t bad_id = -1;
    o.hooks.drafter = [&](int64_t id, int32_t, std::span<const int32_t> generated, int32_t depth) {
      const std::span<const int32_t> truth = id == bad_id ? truth_bad : truth_good;
      const size_t from = std::min(generated.size(), truth.size());
      return replay_draft(truth.subspan(from), depth, 1, 1.0, kVocab, 0, id,
                          static_cast<int64_t>(generated.size()));  // accept rate 1: the truth itself
    };
    if (m == "agreed greedy") o.hooks.agree_tokens = [](std::vector<int32_t>&) {};
    Engine e(runner, o);
    Collector c;
    bad_id = e.submit(bad, c.sink());
    const int64_t good_id = e.submit(good, c.sink());
    drain(e);
    const Outcome b = check_stream(c.of(bad_id), 1, 6);
    EXPECT_EQ(b.finish[0], FinishReason::kAbort);
    // Tokens up to the refused step's first row position; that step's accepted drafts are dropped.
    ASSERT_LE(b.tokens[0].size(), static_cast<size_t>(cut));
    EXPECT_TRUE(std::equal(b.tokens[0].begin(), b.tokens[0].end(), truth_bad.begin()));
    const Outcome g = check_stream(c.of(good_id), 1, 9);
    EXPECT_EQ(g.finish[0], FinishReason::kLength);
    expect_same_or_near_tie(*model, good.prompt, g.tokens[0], truth_good);
    EXPECT_EQ(e.stats().requests_aborted, 1);
    EXPECT_GT(e.stats().spec_accepted_tokens, 0) << "no draft accepted: the test would not see verification";
    EXPECT_EQ(counts(runner), start);
  }
}

// Adaptive depth (the default): greedy tokens are still plain decoding's, and a seeded sampled request
// drafts at the fixed depth, so its tokens do not depend on the measured step times.
TEST(EngineSpeculative, AdaptiveDepthKeepsGreedyTokensAndSeededSamplesReproducible) {
  auto runner = spec_runner();
  const PoolCounts start = counts(*runner);
  auto reqs = greedy_spec_workload();
  reqs.resize(4);
  GenerateRequest seeded = sampled(repeating_prompt(6, 5, 700), 20, 4242);
  seeded.params.temperature = 0.5f;
  reqs.push_back(seeded);
  std::vector<Outcome> plain, fixed;
  {
    Engine e(*runner, narrow(options(64, 8)));
    plain = run_batch(e, reqs);
  }
  {
    Engine e(*runner, spec_options(4));
    fixed = run_batch(e, reqs);
  }
  EngineOptions o = spec_options(4);
  o.spec.depth_mode = DraftDepthMode::kAdaptive;
  Engine e(*runner, o);
  const auto got = run_batch(e, reqs);
  EXPECT_GT(e.stats().spec_draft_tokens, 0);
  for (size_t i = 0; i + 1 < reqs.size(); ++i)
    expect_same_or_near_tie(hybrid_model(), reqs[i].prompt, got[i].tokens[0], plain[i].tokens[0]);
  EXPECT_EQ(got.back().tokens, fixed.back().tokens);
  EXPECT_EQ(counts(*runner), start);
}

TEST(EngineSpeculative, OptionsItCannotServeAreRefused) {
  ModelRunner no_buffer(hybrid_model(), 2, 1024, kernels::KernelImpl::Auto);
  EXPECT_THROW(Engine(no_buffer, spec_options(4)), std::invalid_argument);
  auto runner = spec_runner(2);
  EXPECT_THROW(Engine(*runner, spec_options(5, 2)), std::invalid_argument);  // rows of 9 tokens at most
  EngineOptions replay = spec_options(4);
  replay.spec.algorithm = SpecAlgorithm::kReplay;
  EXPECT_THROW(Engine(*runner, replay), std::invalid_argument);
  EngineOptions bad = spec_options(0);
  EXPECT_THROW(Engine(*runner, bad), std::invalid_argument);
  // A drafter is replay's; probe steps verify placeholders, so not beside speculation, and need a buffer.
  EngineOptions drafter = spec_options(4);
  drafter.hooks.drafter = [](int64_t, int32_t, std::span<const int32_t>, int32_t) { return Draft{}; };
  testing::expect_throw_with<std::invalid_argument>([&] { Engine e(*runner, drafter); }, "hooks.drafter");
  EngineOptions probe = spec_options(4);
  probe.hooks.probe_decode = true;
  testing::expect_throw_with<std::invalid_argument>([&] { Engine e(*runner, probe); }, "hooks.probe_decode");
  EngineOptions probe_alone = options();
  probe_alone.hooks.probe_decode = true;
  testing::expect_throw_with<std::invalid_argument>([&] { Engine e(no_buffer, probe_alone); },
                                                    "max_verify_tokens");
}

TEST(Engine, TeacherForcingAndKeptRowsAreCheckedAtSubmit) {
  ModelRunner runner(hybrid_model(), 3, 256, kernels::KernelImpl::Auto);
  Engine e(runner, options());
  Collector c;
  auto bad = [&](GenerateRequest r, const std::string& needle) {
    testing::expect_throw_with<std::invalid_argument>([&] { e.submit(std::move(r), c.sink()); }, needle);
  };
  auto two_lists = greedy({1, 2}, 4);
  two_lists.forced = {{1, 2, 3}, {1, 2, 3}};
  bad(two_lists, "forced: 2 lists for n = 1");
  auto short_list = greedy({1, 2}, 4);
  short_list.forced = {{1, 2}};
  bad(short_list, "forced: 2 ids for max_tokens 4");
  auto outside = greedy({1, 2}, 4);
  outside.forced = {{1, static_cast<int32_t>(kVocab), 3}};
  bad(outside, "forced: token id 512");
  auto rows = greedy({1, 2}, 4);
  rows.keep_rows = true;
  bad(rows, "keep_rows");
  EXPECT_FALSE(e.step());

  auto runner2 = spec_runner(2);
  Engine spec(*runner2, spec_options(4));
  auto forced = greedy({1, 2}, 4);
  forced.forced = {{1, 2, 3}};
  testing::expect_throw_with<std::invalid_argument>(
      [&] { spec.submit(std::move(forced), c.sink()); },
      "forced: teacher forcing is not for speculative decoding");
}

// A teacher-forced continuation feeds the forced ids and still streams its own picks: fed the tokens a
// free run generated, it generates them again; fed other ids, its later picks follow those, as a run of
// the prompt extended by them does; kept rows cover every position it processed.
TEST(Engine, TeacherForcedInputsAreFedAndRowsAreKept) {
  auto& model = hybrid_model();
  ModelRunner runner(model, 3, 512, kernels::KernelImpl::Auto);
  const auto prompt = random_prompt(20, 5);
  const Outcome free_run = alone(runner, options(), greedy(prompt, 6));
  std::vector<std::vector<float>> rows(1);
  std::vector<int32_t> positions;
  EngineOptions o = options();
  o.hooks.rows = [&](int64_t, int32_t j, int32_t pos, const float* r, int32_t count) {
    EXPECT_LE(j, 0);
    for (int32_t k = 0; k < count; ++k) positions.push_back(pos + k);
    rows[0].insert(rows[0].end(), r, r + int64_t{count} * model.hidden_size());
  };
  auto same = greedy(prompt, 6);
  same.forced = {free_run.tokens[0]};
  same.keep_rows = true;
  EXPECT_EQ(alone(runner, o, same).tokens[0], free_run.tokens[0]);
  std::vector<int32_t> expect_pos(25);
  std::iota(expect_pos.begin(), expect_pos.end(), 0);
  EXPECT_EQ(positions, expect_pos) << "20 prompt positions, then the 5 decode inputs";
  EXPECT_EQ(rows[0].size(), static_cast<size_t>(25 * model.hidden_size()));

  std::vector<int32_t> other = random_prompt(5, 77);
  auto forced = greedy(prompt, 6);
  forced.forced = {other};
  const Outcome got = alone(runner, options(), forced);
  std::vector<int32_t> extended = prompt;
  extended.insert(extended.end(), other.begin(), other.end());
  const Outcome tail = alone(runner, options(), greedy(extended, 1));
  expect_same_or_near_tie(model, extended, std::vector<int32_t>{got.tokens[0].back()}, tail.tokens[0]);
}

}  // namespace
}  // namespace kda::serving
