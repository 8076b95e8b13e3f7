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
  size_t size() const { return offsets_.empty() ? 0 : offsets_.size() - 1; }

 private:
  static uint64_t hash(std::string_view s);
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
