// kda simulate: the serving scheduler over a stack of KDA layers. Outputs must not depend on batching,
// slot assignment, slot reuse or forking (each request's tokens equal the request run alone), the pool
// must make requests wait when full, and bad workloads and options must fail before any work.
// A small synthetic model (hidden 256, 2 heads x 128, 3 layers, fp32) keeps the suite fast.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "kda/io/npy.h"
#include "kda/serving/kda_stack.h"
#include "kda/serving/scheduler.h"
#include "kda/serving/simulate.h"
#include "kda/serving/trace.h"
#include "support/test_support.h"

namespace kda::serving {
namespace {

using ::testing::HasSubstr;

io::KimiLinearConfig small_config() {
  io::KimiLinearConfig c;
  c.hidden_size = 256;
  c.rms_norm_eps = 1e-5;
  c.num_hidden_layers = 4;
  c.num_heads = 2;
  c.head_dim = 128;
  c.short_conv_kernel_size = 4;
  c.kda_layers = {1, 2, 4};  // decoder layer 2 (0-based) is an attention layer: ids 0, 1, 3
  c.full_attn_layers = {3};
  return c;
}

SimulateOptions small_options(std::vector<RequestSpec> reqs) {
  SimulateOptions o;
  o.synthetic_config = small_config();
  o.precision = Precision::FP32;
  o.seed = 7;
  o.requests = std::move(reqs);
  o.keep_outputs = true;
  o.state_memory = int64_t{1} << 30;
  return o;
}

int64_t slot_bytes() { return KdaStack::slot_bytes(small_config(), 3, Precision::FP32); }

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
  ASSERT_TRUE(r.check.has_value());
  EXPECT_EQ(r.check->request_ids.size(), 6u);
  EXPECT_TRUE(r.check->ok) << r.check->worst_ratio;
  EXPECT_LE(r.check->worst_ratio, 1.0);

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
    // The continuations share the prompt, then differ (their decode noise is seeded per sample).
    EXPECT_TRUE(std::equal(k.at(base + "_s0").begin(), k.at(base + "_s0").begin() + prompt,
                           k.at(base + "_s2").begin()));
    EXPECT_NE(k.at(base + "_s0").back(), k.at(base + "_s1").back());
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
  ASSERT_TRUE(r.check.has_value());
  EXPECT_TRUE(r.check->ok) << r.check->worst_ratio;
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
  std::vector<RequestSpec> reqs = {{0, 4, 6, 0, 0}};
  for (int i = 1; i <= 6; ++i) reqs.push_back({i, 200, 1, 1, 0});
  auto o = small_options(reqs);
  o.server_args.chunked_prefill_size = 50;
  const auto r = run_simulation(o);
  EXPECT_EQ(r.serve.requests_completed, 7);
  EXPECT_GT(r.serve.decode_steps, 0);

  // The scheduler itself: request 0 finishes its 6 decodes within the first 6 * 5 + 1 steps.
  mem_cache::RecurrentStatePoolConfig pc =
      KdaStack::synthetic(small_config(), 1, Precision::FP32, 1)->pool_config(8);
  mem_cache::MemoryPools pools(pc, 8);
  SchedulerOptions so;
  so.token_budget = 50;
  Scheduler s(reqs, so, pools.req_to_token_pool);
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
  ASSERT_EQ(npz.size(), 6u);
  for (const auto& req : o.requests)
    for (int j = 0; j < 2; ++j) {
      const auto& a = npz.at("req_" + std::to_string(req.id) + "_s" + std::to_string(j));
      EXPECT_EQ(a.shape, (std::vector<int64_t>{req.prompt_len + 2, 256}));
    }
  EXPECT_EQ(r.serve.requests_completed, 3);
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
  o.layers = 21;
  expect_invalid(run(o), "--layers 21: the model has 20 KDA layers");
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
  EXPECT_FALSE(built);
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
      "simulate --layers 1 --requests 2 --prompt-len 4:8 --output-len 2 --json --precision fp32", false);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key :
       {"requests_completed", "prefill_tokens", "decode_tokens", "prefill_tok_s", "decode_tok_s",
        "step_ms_p50", "step_ms_p99", "pool_bytes", "peak_slots", "slot_reuses", "check_worst_error_ratio"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["requests_completed"], 2);
  EXPECT_EQ(j["decode_tokens"], 4);
  EXPECT_EQ(j["layers"], 1);
  EXPECT_EQ(j["hidden"], 2304);
  EXPECT_EQ(j["radix_cache_disabled"], true);
  EXPECT_LE(j["check_worst_error_ratio"].get<double>(), 1.0);
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
}

}  // namespace
}  // namespace kda::serving
