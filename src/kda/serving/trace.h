// The workload of a simulation: a JSON trace file, or requests generated from a seed.
//
// Trace format: a JSON list of request objects, other keys ignored:
//   "prompt_len": int >= 1      the prompt's length (its tokens: seeded random ids), or
//   "prompt": [int, ...]        the prompt's token ids (each in [0, vocab)); with both, they must agree
//   "output_len": int >= 0      decode steps (output_len + 1 tokens generated)
//   "arrival_step": int >= 0    the step the scheduler first sees it
//   "session": int >= 0, "turn": int >= 0    (optional, together) a turn of a multi-turn session
// The entries of one session are its turns 0, 1, 2, ... in list order. Turn 0 is an ordinary request.
// Turn k > 0 continues turn k - 1: its prompt is turn k - 1's whole prompt + the output_len + 1 tokens
// turn k - 1 generated + its own "prompt" ids (or "prompt_len" >= 0 seeded ones; neither: none), and it
// arrives "arrival_step" (optional, default 0) steps after turn k - 1 finished. Every error
// (std::invalid_argument) names the file, the entry and the field, and is raised before any work.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kda/serving/request.h"

namespace kda::serving {

// Bounds of a workload, a trace's or a generated one, checked before anything is allocated for its
// requests: a request's prompt_len + output_len (the model's context is a million tokens), and the sum
// of that over the requests (a CPU serves far fewer in a run; more is a typo, and the prompts would
// take that many int32 ids).
inline constexpr int64_t kMaxRequestTokens = int64_t{1} << 20;
inline constexpr int64_t kMaxWorkloadTokens = int64_t{1} << 32;

// vocab > 0: token ids must be below it (else not checked here; validate_workload checks them).
std::vector<RequestSpec> parse_trace(const std::string& json_text, const std::string& what,
                                     int64_t vocab = 0);
std::vector<RequestSpec> load_trace(const std::filesystem::path& path, int64_t vocab = 0);

struct LenRange {
  int32_t min = 1, max = 1;
};
// "MIN:MAX" (or "N" for MIN = MAX = N), 1 <= MIN <= MAX.
LenRange parse_len_range(const std::string& text, const std::string& option);

enum class WorkloadKind { kRandom, kSharedPrefix, kMultiTurn };
WorkloadKind parse_workload_kind(const std::string& text);  // random | shared-prefix | multi-turn
const char* to_string(WorkloadKind k);

// A generated workload (--workload). Lengths are drawn from `seed` in workload index order, uniform in
// [prompt.min, prompt.max]; every request arrives at step 0 unless it is a later turn.
//   random         `requests` requests, prompts of seeded random tokens.
//   shared-prefix  request i = shared system prompt i % prefix_groups (shared_prefix_len seeded
//                  tokens of that group) + a prompt-len of its own tokens.
//   multi-turn     `requests` conversations of `turns` turns, request i = c * turns + k (conversation c,
//                  turn k): turn 0's prompt = shared_prefix_len tokens of system prompt c % prefix_groups
//                  (none when 0) + a prompt-len of its own; turn k + 1's = turn k's prompt + its
//                  output_len + 1 generated tokens + a prompt-len of new user tokens, arriving when turn k
//                  finishes.
struct WorkloadOptions {
  WorkloadKind kind = WorkloadKind::kRandom;
  int64_t requests = 32;
  LenRange prompt{8, 48};
  int32_t output_len = 16;
  int64_t prefix_groups = 1;
  int32_t shared_prefix_len = 0;
  int64_t turns = 1;
  int64_t vocab = 8192;
  uint64_t seed = 0;
};
std::vector<RequestSpec> make_workload(const WorkloadOptions& w);
// The random workload.
std::vector<RequestSpec> make_workload(int64_t requests, LenRange prompt, int32_t output_len, uint64_t seed);

// Checks a workload (from any source): non-empty, ids unique and >= 0, lengths in range (the bounds
// above included), sessions
// consistent (a previous turn before its next one, prompt lengths adding up), token ids in [0, vocab)
// (vocab > 0). Throws std::invalid_argument naming the request and the field.
void validate_workload(const std::vector<RequestSpec>& reqs, int64_t vocab = 0);

}  // namespace kda::serving
