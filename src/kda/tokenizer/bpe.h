// tiktoken's byte-pair merge: a piece's bytes merged pairwise, lowest rank first (ties: leftmost).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kda::tokenizer {

// Token bytes -> rank, an open-addressing table over one byte arena (lookups are the encoder's hot path).
class RankTable {
 public:
  RankTable() = default;
  explicit RankTable(const std::vector<std::string>& tokens);  // rank = index; tokens unique
  // The rank of bytes, or -1.
  int32_t find(std::string_view bytes) const {
    const uint64_t h = hash(bytes);
    for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
      const int32_t r = slots_[i];
      if (r < 0) return -1;
      const uint32_t off = offsets_[r], len = offsets_[r + 1] - off;
      if (len == bytes.size() && arena_.compare(off, len, bytes) == 0) return r;
    }
  }
  int32_t byte_rank(uint8_t b) const { return byte_rank_[b]; }
  // The rank of token a's bytes followed by token b's, or -1: what a merge looks up, by the two parts'
  // ranks instead of their bytes (every part of a merge is a token). Equal to find(bytes(a) + bytes(b)).
  int32_t find_pair(int32_t a, int32_t b) const {
    const uint64_t k = (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
    // Most pairs a merge asks about are no token: a bit filter small enough to stay in cache answers
    // those without touching the table.
    const uint64_t f = (k * 0xD6E8FEB86659FD93ull) >> filter_shift_;
    if (!((filter_[f >> 6] >> (f & 63)) & 1)) return -1;
    for (uint64_t i = (k * 0x9E3779B97F4A7C15ull) >> pair_shift_;; i = (i + 1) & pair_mask_) {
      const PairSlot& s = pairs_[i];
      if (s.merged < 0) return -1;
      if (s.key == k) return s.merged;
    }
  }
  size_t size() const { return offsets_.empty() ? 0 : offsets_.size() - 1; }

 private:
  static uint64_t hash(std::string_view s);
  struct PairSlot {
    uint64_t key = 0;
    int32_t merged = -1;
  };
  std::vector<PairSlot> pairs_;  // (a, b) -> rank, for every token that splits into two tokens
  int pair_shift_ = 64;
  std::vector<uint64_t> filter_;  // one bit per (a, b) hash, ~16 bits per pair
  int filter_shift_ = 64;
  uint64_t pair_mask_ = 0;
  std::string arena_;
  std::vector<uint32_t> offsets_;
  std::vector<int32_t> slots_;
  uint64_t mask_ = 0;
  int32_t byte_rank_[256] = {};
};

// Appends the ranks of piece's tokens to out. Every single byte must have a rank.
// The plainest form: scan every adjacent pair for the lowest rank, merge it, repeat (quadratic).
void bpe_merge_reference(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out);
// tiktoken's form: ranks kept per boundary, one scan per merge -- quadratic, fast on short pieces.
void bpe_merge_scan(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out);
// A heap of adjacent pairs over a linked list: O(n log n). *steps (when non-null) += heap pops.
void bpe_merge_heap(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out,
                    int64_t* steps = nullptr);
// What encode uses: the whole piece when it is a token, else scan for short pieces and heap for long ones.
void bpe_encode_piece(const RankTable& ranks, std::string_view piece, std::vector<int32_t>& out);

}  // namespace kda::tokenizer
