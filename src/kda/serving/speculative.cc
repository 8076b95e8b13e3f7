#include "kda/serving/speculative.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include "kda/common/seeded.h"

namespace kda::serving {

SpecAlgorithm parse_spec_algorithm(const std::string& name) {
  std::string n = name;
  for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n.empty() || n == "none") return SpecAlgorithm::kNone;
  if (n == "ngram") return SpecAlgorithm::kNgram;
  if (n == "replay") return SpecAlgorithm::kReplay;
  throw std::invalid_argument("--speculative '" + name + "': expected ngram or replay");
}

const char* to_string(SpecAlgorithm a) {
  switch (a) {
    case SpecAlgorithm::kNgram:
      return "ngram";
    case SpecAlgorithm::kReplay:
      return "replay";
    default:
      return "none";
  }
}

DraftDepthMode parse_draft_depth_mode(const std::string& name) {
  if (name == "adaptive") return DraftDepthMode::kAdaptive;
  if (name == "fixed") return DraftDepthMode::kFixed;
  throw std::invalid_argument("--draft-depth '" + name + "': expected adaptive or fixed");
}

const char* to_string(DraftDepthMode m) { return m == DraftDepthMode::kFixed ? "fixed" : "adaptive"; }

void SpeculativeOptions::validate() const {
  if (!enabled()) return;
  if (draft_tokens < 1 || draft_tokens > 64)
    throw std::invalid_argument("--draft-tokens must be in 1..64, got " + std::to_string(draft_tokens));
  if (topk < 1 || topk > 16)
    throw std::invalid_argument("--draft-topk must be in 1..16, got " + std::to_string(topk));
  if (!(accept_rate >= 0.0 && accept_rate <= 1.0))
    throw std::invalid_argument("--accept-rate must be in [0, 1], got " + std::to_string(accept_rate));
}

void Draft::add_branch(std::span<const int32_t> branch, int32_t max_size) {
  int32_t parent = -1;
  for (const int32_t tok : branch) {
    int32_t child = -1;
    for (int32_t j = 0; j < size(); ++j)
      if (parents[j] == parent && tokens[j] == tok) {
        child = j;
        break;
      }
    if (child < 0) {
      if (size() >= max_size) return;
      tokens.push_back(tok);
      parents.push_back(parent);
      child = size() - 1;
    }
    parent = child;
  }
}

int32_t draft_depth(const Draft& d) {
  std::vector<int32_t> depth(static_cast<size_t>(d.size()));
  int32_t deepest = 0;
  for (int32_t j = 0; j < d.size(); ++j) {  // trie order: a parent before its children
    const int32_t p = d.parents[static_cast<size_t>(j)];
    depth[static_cast<size_t>(j)] = p < 0 ? 1 : depth[static_cast<size_t>(p)] + 1;
    deepest = std::max(deepest, depth[static_cast<size_t>(j)]);
  }
  return deepest;
}

Draft ngram_draft(std::span<const int32_t> history, int32_t depth, int32_t topk) {
  Draft d;
  const int64_t L = static_cast<int64_t>(history.size());
  if (depth < 1 || L < 2) return d;
  for (int64_t n = std::min<int64_t>(kNgramMax, L - 1); n >= kNgramMin; --n) {
    const auto suffix = history.subspan(static_cast<size_t>(L - n));
    std::vector<int32_t> firsts;  // next tokens of the branches taken: a tree's branches differ there
    // Latest earlier occurrence first; its continuation starts at i + n < L.
    for (int64_t i = L - n - 1; i >= 0 && static_cast<int32_t>(firsts.size()) < topk; --i) {
      if (!std::equal(suffix.begin(), suffix.end(), history.begin() + i)) continue;
      const int32_t first = history[static_cast<size_t>(i + n)];
      if (std::find(firsts.begin(), firsts.end(), first) != firsts.end()) continue;
      firsts.push_back(first);
      const int64_t len = std::min<int64_t>(depth, L - (i + n));
      d.add_branch(history.subspan(static_cast<size_t>(i + n), static_cast<size_t>(len)), depth * topk);
    }
    if (!firsts.empty()) return d;  // the longest n with a match decides
  }
  return d;
}

Draft replay_draft(std::span<const int32_t> truth, int32_t depth, int32_t topk, double accept_rate,
                   int64_t vocab, uint64_t seed, int64_t sequence, int64_t position) {
  Draft d;
  const int32_t len = static_cast<int32_t>(std::min<int64_t>(depth, static_cast<int64_t>(truth.size())));
  constexpr uint64_t kReplayStream = 17;
  constexpr double kInv53 = 1.0 / 9007199254740992.0;  // 2^-53
  std::vector<int32_t> branch(static_cast<size_t>(len));
  for (int32_t b = 0; b < topk; ++b) {
    for (int32_t i = 0; i < len; ++i) {
      const uint64_t u = seeded_bits(seed, kReplayStream, sequence, position, int64_t{b} * 65536 + i);
      const int32_t t = truth[static_cast<size_t>(i)];
      const bool keep = static_cast<double>(u >> 11) * kInv53 < accept_rate;  // rate 1: always, 0: never
      if (keep || vocab < 2) {
        branch[i] = t;
      } else {  // uniform over the vocab - 1 other tokens
        const uint64_t r = seeded_bits(seed, kReplayStream + 1, sequence, position, int64_t{b} * 65536 + i);
        const int32_t o = static_cast<int32_t>(r % static_cast<uint64_t>(vocab - 1));
        branch[i] = o >= t ? o + 1 : o;
      }
    }
    d.add_branch(branch, depth * topk);
  }
  return d;
}

}  // namespace kda::serving
