#include "kda/tokenizer/bpe.h"

#include <bit>
#include <cstring>
#include <limits>
#include <queue>
#include <stdexcept>

namespace kda::tokenizer {
namespace {

constexpr int32_t kNone = std::numeric_limits<int32_t>::max();

// Above this length the scan's quadratic cost outgrows the heap's constant.
constexpr size_t kScanMaxBytes = 64;

int32_t rank_or_none(const RankTable& r, std::string_view s) {
  const int32_t k = r.find(s);
  return k < 0 ? kNone : k;
}

int32_t token_rank(const RankTable& r, std::string_view s) {
  const int32_t k = r.find(s);
  if (k < 0) throw std::logic_error("bpe: a merged part is not a token");  // cannot happen: merges are tokens
  return k;
}

}  // namespace

uint64_t RankTable::hash(std::string_view s) {
  // FNV-1a over 8-byte words, then a final mix: short keys, so speed over strength.
  uint64_t h = 0xcbf29ce484222325ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 32);
}

RankTable::RankTable(const std::vector<std::string>& tokens) {
  offsets_.reserve(tokens.size() + 1);
  offsets_.push_back(0);
  for (const auto& t : tokens) {
    arena_ += t;
    offsets_.push_back(static_cast<uint32_t>(arena_.size()));
  }
  const uint64_t cap = std::bit_ceil<uint64_t>(tokens.size() * 2 + 16);
  mask_ = cap - 1;
  slots_.assign(cap, -1);
  for (int i = 0; i < 256; ++i) byte_rank_[i] = -1;
  for (size_t r = 0; r < tokens.size(); ++r) {
    const std::string_view t = tokens[r];
    uint64_t i = hash(t) & mask_;
    while (slots_[i] >= 0) i = (i + 1) & mask_;
    slots_[i] = static_cast<int32_t>(r);
    if (t.size() == 1) byte_rank_[static_cast<uint8_t>(t[0])] = static_cast<int32_t>(r);
  }
}

void bpe_merge_reference(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out) {
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  for (;;) {
    int32_t best = kNone;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const int32_t r = rank_or_none(ranks, parts[i] + parts[i + 1]);
      if (r < best) {
        best = r;
        at = i;
      }
    }
    if (best == kNone) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  for (const auto& p : parts) out.push_back(token_rank(ranks, p));
}

void bpe_merge_scan(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out) {
  const size_t n = piece.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(token_rank(ranks, piece));
    return;
  }
  // parts[i] = (start of part i, rank of merging part i with part i+1); two sentinels at the end.
  struct Part {
    size_t start;
    int32_t rank;
  };
  std::vector<Part> parts;
  parts.reserve(n + 1);
  for (size_t i = 0; i + 1 < n; ++i) parts.push_back({i, rank_or_none(ranks, piece.substr(i, 2))});
  parts.push_back({n - 1, kNone});
  parts.push_back({n, kNone});
  auto rank_at = [&](size_t i) {  // the rank of parts i and i+1 merged, once parts i+1 is removed
    if (i + 3 >= parts.size()) return kNone;
    return rank_or_none(ranks, piece.substr(parts[i].start, parts[i + 3].start - parts[i].start));
  };
  for (;;) {
    int32_t best = kNone;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (parts[i].rank < best) {
        best = parts[i].rank;
        at = i;
      }
    }
    if (best == kNone) break;
    if (at > 0) parts[at - 1].rank = rank_at(at - 1);
    parts[at].rank = rank_at(at);
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i)
    out.push_back(token_rank(ranks, piece.substr(parts[i].start, parts[i + 1].start - parts[i].start)));
}

void bpe_merge_heap(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out,
                    int64_t* steps) {
  const size_t n = piece.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(token_rank(ranks, piece));
    return;
  }
  // Part i starts at byte i (its id for life); a merge keeps the left part and unlinks the right one.
  // rank[i]: the rank of part i merged with its successor. The heap holds (rank, start) keys; an entry
  // whose rank is no longer its part's current rank is stale and skipped. Equal ranks pop leftmost first,
  // as tiktoken's scan picks the first minimum.
  std::vector<uint32_t> next(n), prev(n);
  std::vector<int32_t> rank(n, kNone);
  std::vector<uint8_t> alive(n, 1);
  for (size_t i = 0; i < n; ++i) {
    next[i] = static_cast<uint32_t>(i + 1);
    prev[i] = static_cast<uint32_t>(i == 0 ? n : i - 1);  // n: none
  }
  auto pair_rank = [&](size_t i) {
    const size_t j = next[i];
    if (j >= n) return kNone;
    const size_t end = next[j];  // n when j is the last part
    return rank_or_none(ranks, piece.substr(i, end - i));
  };
  std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<>> heap;
  auto key = [](int32_t r, size_t i) { return (static_cast<uint64_t>(r) << 32) | i; };
  std::vector<uint64_t> init;
  init.reserve(n);
  for (size_t i = 0; i + 1 < n; ++i) {
    rank[i] = rank_or_none(ranks, piece.substr(i, 2));
    if (rank[i] != kNone) init.push_back(key(rank[i], i));
  }
  heap =
      std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<>>(std::greater<>(), std::move(init));
  int64_t pops = 0;
  while (!heap.empty()) {
    const uint64_t k = heap.top();
    heap.pop();
    ++pops;
    const auto r = static_cast<int32_t>(k >> 32);
    const auto i = static_cast<size_t>(k & 0xffffffffu);
    if (!alive[i] || rank[i] != r) continue;
    const size_t j = next[i];
    alive[j] = 0;
    next[i] = next[j];
    if (next[j] < n) prev[next[j]] = static_cast<uint32_t>(i);
    rank[i] = pair_rank(i);
    if (rank[i] != kNone) heap.push(key(rank[i], i));
    if (prev[i] < n) {
      const size_t p = prev[i];
      rank[p] = pair_rank(p);
      if (rank[p] != kNone) heap.push(key(rank[p], p));
    }
  }
  if (steps) *steps += pops;
  for (size_t i = 0; i < n; i = next[i]) out.push_back(token_rank(ranks, piece.substr(i, next[i] - i)));
}

void bpe_encode_piece(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out) {
  if (piece.size() == 1) {
    out.push_back(ranks.byte_rank(static_cast<uint8_t>(piece[0])));
    return;
  }
  const int32_t whole = ranks.find(piece);  // tiktoken takes a piece that is a token as it is
  if (whole >= 0) {
    out.push_back(whole);
    return;
  }
  if (piece.size() <= kScanMaxBytes) {
    bpe_merge_scan(ranks, piece, out);
  } else {
    bpe_merge_heap(ranks, piece, out);
  }
}

}  // namespace kda::tokenizer
