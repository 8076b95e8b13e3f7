// `kda bench --only cache`: the hybrid prefix cache (MLA KV by reference + KDA state snapshots) on the whole
// model, the same workload served with the cache off and on, side by side in one process. The model is the
// synthetic Kimi-Linear's first kLayers decoder layers at the real widths (3 KDA + 1 MLA, the default
// routed experts, bf16), each run through serving::run_simulation (its own model build, not timed: the
// figures are the serving loop's). Three workloads, kOutputLen + 1 generated tokens per request:
//   - multi-turn: kConversations conversations of kTurns turns on one kSystemPrompt-token system prompt,
//     kUserTokens new user tokens per turn. The fraction of the prompt tokens computed with the cache, and
//     the TTFT p50 of turns 2 and on, off over on (turn 1 cannot hit on its history).
//   - shared prefix: kSharedRequests requests of one kSharedPrompt-token prompt (the same system prompt,
//     one token of their own), all arriving at once: TTFT p50, off over on.
//   - no hits: kNoHitRequests prompts of seeded random tokens (no shared prefix): the serving wall time,
//     on over off, what the cache's bookkeeping and snapshots cost when nothing hits. That pair runs
//     kNoHitRounds times in turns and each side keeps its best, the machine being shared.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/bench/rows.h"
#include "kda/serving/simulate.h"
#include "kda/serving/trace.h"

namespace kda::bench {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kLayers = 4;
constexpr int32_t kOutputLen = 8;
constexpr int64_t kConversations = 8;
constexpr int64_t kTurns = 4;
constexpr int32_t kSystemPrompt = 1024;
constexpr int32_t kUserTokens = 64;
constexpr int64_t kSharedRequests = 16;
constexpr int32_t kSharedPrompt = 2048;
constexpr int64_t kNoHitRequests = 16;
constexpr int32_t kNoHitPrompt = 512;
constexpr int kNoHitRounds = 2;

serving::SimulateResult serve_once(const std::vector<serving::RequestSpec>& reqs, bool cache,
                                   const std::string& label, const Say& say) {
  serving::SimulateOptions o;
  o.layers = kLayers;
  o.requests = reqs;
  o.workload = label;
  o.server_args.disable_radix_cache = !cache;
  auto r = serving::run_simulation(o);
  if (!r.ok())
    throw std::runtime_error("kda bench --only cache: the " + label + " run failed its accounting");
  const auto& s = r.serve;
  say("  %-13s cache %-3s  %6lld prompt tokens, %6lld computed, wall %6.2f s, TTFT p50 %8.1f ms",
      label.c_str(), cache ? "on" : "off", static_cast<long long>(s.prefill_tokens),
      static_cast<long long>(s.prefill_tokens_computed), s.wall_s, r.ttft_ms_p50);
  if (!s.ttft_later_turns_ms.empty()) say(", turns 2+ %8.1f ms", r.ttft_ms_p50_later_turns);
  say("\n");
  return r;
}

serving::WorkloadOptions workload(serving::WorkloadKind kind, int64_t vocab) {
  serving::WorkloadOptions w;
  w.kind = kind;
  w.output_len = kOutputLen;
  w.vocab = vocab;
  w.seed = 1;
  return w;
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

}  // namespace

void bench_cache(nlohmann::json& j, const Say& say) {
  const auto t0 = Clock::now();
  const int64_t vocab = serving::resolve_vocab("", 0);
  say("prefix cache on the whole model: %d layers (3 KDA + 1 MLA), %d experts, bf16, %lld generated tokens "
      "per "
      "request; each line one serving run (the model build not counted)\n",
      kLayers, serving::kDefaultExperts, static_cast<long long>(kOutputLen + 1));

  auto mt = workload(serving::WorkloadKind::kMultiTurn, vocab);
  mt.requests = kConversations;
  mt.turns = kTurns;
  mt.shared_prefix_len = kSystemPrompt;
  mt.prompt = {kUserTokens, kUserTokens};
  const auto mt_reqs = serving::make_workload(mt);
  const auto mt_off = serve_once(mt_reqs, false, "multi-turn", say);
  const auto mt_on = serve_once(mt_reqs, true, "multi-turn", say);

  auto sp = workload(serving::WorkloadKind::kSharedPrefix, vocab);
  sp.requests = kSharedRequests;
  sp.shared_prefix_len = kSharedPrompt - 1;
  sp.prompt = {1, 1};
  const auto sp_reqs = serving::make_workload(sp);
  const auto sp_off = serve_once(sp_reqs, false, "shared-prefix", say);
  const auto sp_on = serve_once(sp_reqs, true, "shared-prefix", say);

  auto nh = workload(serving::WorkloadKind::kRandom, vocab);
  nh.requests = kNoHitRequests;
  nh.prompt = {kNoHitPrompt, kNoHitPrompt};
  const auto nh_reqs = serving::make_workload(nh);
  double wall_off = 0.0, wall_on = 0.0;
  int64_t nohit_hits = 0;
  for (int round = 0; round < kNoHitRounds; ++round) {
    const auto off = serve_once(nh_reqs, false, "no hits", say);
    const auto on = serve_once(nh_reqs, true, "no hits", say);
    wall_off = round == 0 ? off.serve.wall_s : std::min(wall_off, off.serve.wall_s);
    wall_on = round == 0 ? on.serve.wall_s : std::min(wall_on, on.serve.wall_s);
    nohit_hits += on.serve.prefix_cache_hit_tokens;
  }

  const double computed_frac = ratio(static_cast<double>(mt_on.serve.prefill_tokens_computed),
                                     static_cast<double>(mt_on.serve.prefill_tokens));
  const double mt_ttft = ratio(mt_off.ttft_ms_p50_later_turns, mt_on.ttft_ms_p50_later_turns);
  const double sp_ttft = ratio(sp_off.ttft_ms_p50, sp_on.ttft_ms_p50);
  const double nohit = ratio(wall_on, wall_off);
  const double total_s = std::chrono::duration<double>(Clock::now() - t0).count();
  say("  multi-turn (%lld x %lld turns, %d-token system prompt): %.3f of the prompt tokens computed; TTFT "
      "p50 of "
      "turns 2+ off / on %.2fx\n",
      static_cast<long long>(kConversations), static_cast<long long>(kTurns), kSystemPrompt, computed_frac,
      mt_ttft);
  say("  shared prefix (%lld x one %d-token prompt): TTFT p50 off / on %.2fx\n",
      static_cast<long long>(kSharedRequests), kSharedPrompt, sp_ttft);
  say("  no hits (%lld random %d-token prompts, best of %d): serving wall on / off %.3f (%lld hit tokens)\n",
      static_cast<long long>(kNoHitRequests), kNoHitPrompt, kNoHitRounds, nohit,
      static_cast<long long>(nohit_hits));
  say("  (the section took %.0f s)\n", total_s);

  j["cache"] = {
      {"layers", kLayers},
      {"experts", serving::kDefaultExperts},
      {"output_len", kOutputLen},
      {"cache_multiturn_prefill_computed_frac", computed_frac},
      {"cache_multiturn_prompt_tokens", mt_on.serve.prefill_tokens},
      {"cache_multiturn_ttft_later_turns_ms_off", mt_off.ttft_ms_p50_later_turns},
      {"cache_multiturn_ttft_later_turns_ms_on", mt_on.ttft_ms_p50_later_turns},
      {"cache_multiturn_ttft_later_turns_off_over_on", mt_ttft},
      {"cache_shared_prefix_ttft_ms_off", sp_off.ttft_ms_p50},
      {"cache_shared_prefix_ttft_ms_on", sp_on.ttft_ms_p50},
      {"cache_shared_prefix_ttft_off_over_on", sp_ttft},
      {"cache_nohit_wall_s_off", wall_off},
      {"cache_nohit_wall_s_on", wall_on},
      {"cache_nohit_hit_tokens", nohit_hits},
      {"cache_nohit_wall_on_over_off", nohit},
      {"seconds", total_s},
  };
}

}  // namespace kda::bench
