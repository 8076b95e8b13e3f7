// `kda bench --only spec`, its serving rows: speculative decoding against plain decoding through the
// serving engine (serve(), as `kda simulate` drives it) on one model in one process, in turns. A verify step
// of d + 1 tokens on a MoE model reads the union of the experts its tokens select, so whether speculation
// pays depends on the expert count: the rows run the first 4 decoder layers of the 48B config with
// --experts routed experts (top-8), batch 1, replay drafts at accept rates 0.5 / 0.7 / 0.9 and ngram drafts
// on a random prompt (nothing to match), each at d = 1, 2, 4, fixed and adaptive depth (draft_depth.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/bench/rows.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/simulate.h"
#include "kda/serving/simulate_plan.h"
#include "kda/serving/trace.h"
#include "kda/serving/workload_driver.h"

namespace kda::bench {

namespace {

constexpr int kLayers = 4, kPrompt = 32, kOutput = 96, kRounds = 2, kMaxDepth = 4;

struct Pass {
  serving::SpeculativeOptions spec;  // algorithm kNone: plain decoding
  double best_tok_s = 0.0;
  serving::ServeResult last;  // the last round's, for its depth and acceptance
};

// Decode tokens per second of one pass: the tokens the decode and verify steps emitted over the time
// after the prefill step (drafting, scheduling and verification included).
double decode_tok_s(const serving::ServeResult& r) {
  if (r.step_ms.empty() || r.decode_tokens == 0) throw std::logic_error("spec bench: a pass decoded nothing");
  return static_cast<double>(r.decode_tokens) / (r.wall_s - r.step_ms.front() / 1e3);
}

Weights spec_weights(const std::string& w) {
  if (w == "all") return Weights::Int4;  // 256 experts in bf16 would not fit the development machine
  for (const Weights x : {Weights::BF16, Weights::Int8, Weights::Int4})
    if (w == to_string(x)) return x;
  throw std::invalid_argument("--weights '" + w + "'");
}

}  // namespace

void bench_spec_serve(const RowOptions& o, nlohmann::json& j, const Say& say) {
  serving::SimulateOptions so;
  so.layers = kLayers;
  so.num_experts = o.experts;  // 0: kDefaultExperts
  so.weights = spec_weights(o.weights);
  so.precision = Precision::BF16;
  so.seed = 7;
  so.requests = serving::make_workload(1, {kPrompt, kPrompt}, kOutput, 7);
  so.spec.algorithm = serving::SpecAlgorithm::kReplay;  // sizes the verify buffer for the deepest pass
  so.spec.draft_tokens = kMaxDepth;
  so.server_args.speculative_algorithm = "replay";
  const serving::Plan p = serving::make_plan(so);

  const auto model = models::KimiLinearForCausalLM::synthetic(p.cfg, serving::model_options(p, so), so.seed);
  serving::ModelRunner runner(*model, p.slots + p.cache_slots, p.kv_tokens, p.kernel, p.verify_tokens,
                              p.verify_rows);
  serving::ServeOptions base;
  base.scheduler = p.sched;
  base.seed = so.seed;

  // replay's true continuation: the request served with verify-shaped decode steps (simulate.cc says why).
  std::vector<std::vector<int32_t>> truth;
  {
    serving::ServeOptions pre = base;
    pre.probe_decode = true;
    auto r0 = serving::serve(runner, so.requests, pre);
    for (auto& q : r0.outputs) truth.push_back(std::move(q.tokens));
  }

  // Plain decoding first and between the drafters' groups, so that every group meets a plain pass of
  // its own moment of a shared machine; each ratio is over the best plain pass.
  std::vector<Pass> passes;
  std::vector<std::vector<size_t>> order;  // per group: plain, then its passes
  auto add = [&](serving::SpecAlgorithm a, double rate, int32_t d, serving::DraftDepthMode m) {
    Pass q;
    q.spec.algorithm = a;
    q.spec.accept_rate = rate;
    q.spec.draft_tokens = d;
    q.spec.depth_mode = m;
    passes.push_back(q);
    order.back().push_back(passes.size() - 1);
  };
  passes.emplace_back();  // index 0: plain
  const std::vector<double> rates{0.5, 0.7, 0.9};
  const std::vector<int32_t> depths{1, 2, 4};
  for (const double rate : rates) {
    order.push_back({0});
    for (const int32_t d : depths)
      for (const auto m : {serving::DraftDepthMode::kFixed, serving::DraftDepthMode::kAdaptive})
        add(serving::SpecAlgorithm::kReplay, rate, d, m);
  }
  order.push_back({0});
  for (const int32_t d : depths)
    for (const auto m : {serving::DraftDepthMode::kFixed, serving::DraftDepthMode::kAdaptive})
      add(serving::SpecAlgorithm::kNgram, 0.0, d, m);

  const auto t0 = std::chrono::steady_clock::now();
  for (int round = 0; round < kRounds; ++round) {
    say("  spec serving rows: round %d of %d at %.0f s\n", round + 1, kRounds,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    for (const auto& group : order)
      for (const size_t i : group) {
        serving::ServeOptions opt = base;
        opt.spec = passes[i].spec;
        if (opt.spec.algorithm == serving::SpecAlgorithm::kReplay) opt.replay_truth = &truth;
        passes[i].last = serving::serve(runner, so.requests, opt);
        passes[i].best_tok_s = std::max(passes[i].best_tok_s, decode_tok_s(passes[i].last));
      }
  }

  const int experts = p.num_experts;
  const double plain = passes[0].best_tok_s;
  j["spec_serve_plain_tok_s"] = plain;
  j["spec_serve"] = nlohmann::json::array();
  say("\nspeculation against plain decoding through the serving loop (%d layers, top-%d of %d experts, %s "
      "weights, vocab %lld, batch 1, %d-token prompt, %d tokens, best of %d rounds): plain %.2f tokens/s\n",
      p.layers, p.cfg.num_experts_per_token, experts, to_string(so.weights), static_cast<long long>(p.vocab),
      kPrompt, kOutput, kRounds, plain);
  say("%-8s %7s %3s %12s %12s %14s %14s\n", "drafter", "accept", "d", "fixed/plain", "adapt/plain",
      "adapt. depth", "adapt. accept");
  for (size_t i = 1; i + 1 < passes.size(); i += 2) {
    const Pass& f = passes[i];
    const Pass& a = passes[i + 1];
    const auto& s = a.last;
    const double depth = s.spec_depth_rows > 0
                             ? static_cast<double>(s.spec_depth_sum) / static_cast<double>(s.spec_depth_rows)
                             : 0.0;
    const double accepted = s.spec_draft_tokens > 0 ? static_cast<double>(s.spec_accepted_tokens) /
                                                          static_cast<double>(s.spec_draft_tokens)
                                                    : 0.0;
    const bool replay = f.spec.algorithm == serving::SpecAlgorithm::kReplay;
    char rate[16];
    std::snprintf(rate, sizeof rate, "%.1f", f.spec.accept_rate);
    j["spec_serve"].push_back(
        {{"experts", experts},
         {"drafter", to_string(f.spec.algorithm)},
         {"accept_rate", replay ? nlohmann::json(f.spec.accept_rate) : nlohmann::json()},
         {"draft_tokens", f.spec.draft_tokens},
         {"fixed_tok_s", f.best_tok_s},
         {"adaptive_tok_s", a.best_tok_s},
         {"fixed_over_plain", f.best_tok_s / plain},
         {"adaptive_over_plain", a.best_tok_s / plain},
         {"adaptive_mean_depth", depth},
         {"adaptive_accept_rate", accepted}});
    say("%-8s %7s %3d %11.2fx %11.2fx %14.2f %14.2f\n", to_string(f.spec.algorithm), replay ? rate : "-",
        f.spec.draft_tokens, f.best_tok_s / plain, a.best_tok_s / plain, depth, accepted);
  }
}

}  // namespace kda::bench
