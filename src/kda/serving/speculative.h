// Speculative decoding in the serving loop: who proposes the drafts. The Engine verifies them (engine.h).
//
// A decode step of a sequence becomes a TARGET_VERIFY row: its last generated token (the one a plain
// decode step would feed) followed by drafted tokens, a chain or a tree (each draft names its parent).
// The target model's argmax at every row position then decides (greedy verification): walking from the
// row's first position, a draft is accepted when it is a child of the current position whose token is the
// target's argmax there; the first position with no such child ends the path, and the target's argmax
// there is one more token (the "bonus"). So a step emits accepted + 1 tokens, and the generated tokens are
// exactly those of plain greedy decoding: every emitted token is the target's own argmax after a prefix
// the target itself chose.
//
// Drafters (both from outside the model, so no DRAFT_EXTEND):
//   ngram   prompt-lookup decoding (as vLLM's ngram proposer and sglang's NGRAM): the tokens that followed
//           the latest earlier occurrence of the sequence's last n tokens in its own prompt and output,
//           for the longest n in [kNgramMin, kNgramMax] that has one; a tree takes up to topk such
//           occurrences with different next tokens, latest first, as its branches. No match, no drafts
//           (a plain decode row).
//   replay  a simulation aid: the sequence's true continuation (the tokens a non-speculative run of the
//           same workload generated) with each drafted token replaced by a random other token with
//           probability 1 - accept_rate; a tree's branches are topk such copies, drawn independently.
//
// Shapes: a chain has up to draft_tokens drafts; a tree has up to topk branches of up to draft_tokens
// each, merged where they share a prefix (a trie), so at most topk * draft_tokens drafts. A row never
// drafts past the sequence's end: at most (decode steps left - 1) tokens deep.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kda::serving {

enum class SpecAlgorithm { kNone, kNgram, kReplay };
// How deep each row drafts: fixed (draft_tokens, as far as the drafter reaches) or adaptive (per sequence,
// from its measured acceptance and the measured cost of verify steps: draft_depth.h; at most draft_tokens).
enum class DraftDepthMode { kAdaptive, kFixed };

SpecAlgorithm parse_spec_algorithm(const std::string& name);  // "" | none | ngram | replay
const char* to_string(SpecAlgorithm a);
DraftDepthMode parse_draft_depth_mode(const std::string& name);  // adaptive | fixed
const char* to_string(DraftDepthMode m);

struct SpeculativeOptions {
  SpecAlgorithm algorithm = SpecAlgorithm::kNone;
  int32_t draft_tokens = 4;  // drafts per branch (the chain's length)
  int32_t topk = 1;          // branches of a tree (1: chains)
  double accept_rate = 0.7;  // replay only: the probability a drafted token is the true one
  DraftDepthMode depth_mode = DraftDepthMode::kAdaptive;
  bool enabled() const { return algorithm != SpecAlgorithm::kNone; }
  // The most tokens one verify row holds: the last generated token and every draft.
  int32_t max_verify_tokens() const { return enabled() ? 1 + draft_tokens * topk : 0; }
  void validate() const;  // std::invalid_argument naming the option
};

// A row's drafts: tokens[j] is draft j, parents[j] its parent (an earlier draft's index, or -1 for the
// row's first token). Drafts are in trie order (a parent before its children, siblings distinct).
struct Draft {
  std::vector<int32_t> tokens;
  std::vector<int32_t> parents;
  int32_t size() const { return static_cast<int32_t>(tokens.size()); }
  // Adds a branch (a token sequence from the row's first token), sharing the prefix it has with the
  // branches already there; stops at `max_size` drafts.
  void add_branch(std::span<const int32_t> branch, int32_t max_size);
};

inline constexpr int32_t kNgramMin = 1, kNgramMax = 3;

// Prompt-lookup drafts from a sequence's tokens so far (prompt + generated, the last one being the token
// the row feeds first): up to topk branches of up to `depth` tokens.
// A draft's depth: its longest branch (a chain's size).
int32_t draft_depth(const Draft& d);

Draft ngram_draft(std::span<const int32_t> history, int32_t depth, int32_t topk);

// Replay drafts: truth[0..] are the true next tokens (what follows the row's first token); each drafted
// token is replaced, with probability 1 - accept_rate, by a uniform other token in [0, vocab); `key`
// (seed, sequence, position) makes the draw a function of the step alone.
Draft replay_draft(std::span<const int32_t> truth, int32_t depth, int32_t topk, double accept_rate,
                   int64_t vocab, uint64_t seed, int64_t sequence, int64_t position);

}  // namespace kda::serving
