#include "kda/tokenizer/bpe.h"

#include <algorithm>
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

int32_t pair_or_none(const RankTable& r, int32_t a, int32_t b) {
  const int32_t k = r.find_pair(a, b);
  return k < 0 ? kNone : k;
}

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
  // Every way a token splits into two tokens.
  std::vector<std::pair<uint64_t, int32_t>> splits;
  for (size_t r = 0; r < tokens.size(); ++r) {
    const std::string_view t = tokens[r];
    for (size_t k = 1; k < t.size(); ++k) {
      const int32_t a = find(t.substr(0, k));
      if (a < 0) continue;
      const int32_t b = find(t.substr(k));
      if (b < 0) continue;
      splits.emplace_back((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b),
                          static_cast<int32_t>(r));
    }
  }
  const uint64_t pcap = std::bit_ceil<uint64_t>(splits.size() * 2 + 16);
  pair_shift_ = 64 - std::countr_zero(pcap);
  pair_mask_ = pcap - 1;
  pairs_.assign(pcap, PairSlot{});
  const uint64_t fbits = std::max<uint64_t>(std::bit_ceil<uint64_t>(splits.size() * 16), 64);
  filter_shift_ = 64 - std::countr_zero(fbits);
  filter_.assign(fbits / 64, 0);
  for (const auto& [k, merged] : splits) {
    const uint64_t f = (k * 0xD6E8FEB86659FD93ull) >> filter_shift_;
    filter_[f >> 6] |= uint64_t{1} << (f & 63);
    uint64_t i = (k * 0x9E3779B97F4A7C15ull) >> pair_shift_;
    while (pairs_[i].merged >= 0) i = (i + 1) & pair_mask_;
    pairs_[i] = {k, merged};
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
  // parts[i]: part i's token and the rank of it merged with part i+1 (tiktoken's layout, with the parts'
  // tokens kept so that a merge's rank is a pair lookup).
  struct Part {
    int32_t tok;
    int32_t rank;
  };
  std::vector<Part> parts(n);
  for (size_t i = 0; i < n; ++i) parts[i].tok = ranks.byte_rank(static_cast<uint8_t>(piece[i]));
  for (size_t i = 0; i + 1 < n; ++i) parts[i].rank = pair_or_none(ranks, parts[i].tok, parts[i + 1].tok);
  parts[n - 1].rank = kNone;
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
    parts[at].tok = best;
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    if (at > 0) parts[at - 1].rank = pair_or_none(ranks, parts[at - 1].tok, best);
    parts[at].rank = at + 1 < parts.size() ? pair_or_none(ranks, best, parts[at + 1].tok) : kNone;
  }
  for (const Part& p : parts) out.push_back(p.tok);
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
  std::vector<int32_t> rank(n, kNone), tok(n);
  for (size_t i = 0; i < n; ++i) tok[i] = ranks.byte_rank(static_cast<uint8_t>(piece[i]));
  std::vector<uint8_t> alive(n, 1);
  for (size_t i = 0; i < n; ++i) {
    next[i] = static_cast<uint32_t>(i + 1);
    prev[i] = static_cast<uint32_t>(i == 0 ? n : i - 1);  // n: none
  }
  auto pair_rank = [&](size_t i) {
    const size_t j = next[i];
    return j >= n ? kNone : pair_or_none(ranks, tok[i], tok[j]);
  };
  std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<>> heap;
  auto key = [](int32_t r, size_t i) { return (static_cast<uint64_t>(r) << 32) | i; };
  std::vector<uint64_t> init;
  init.reserve(n);
  for (size_t i = 0; i + 1 < n; ++i) {
    rank[i] = pair_or_none(ranks, tok[i], tok[i + 1]);
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
    tok[i] = r;
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
  for (size_t i = 0; i < n; i = next[i]) out.push_back(tok[i]);
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
