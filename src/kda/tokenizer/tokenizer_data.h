// What a Tokenizer holds (private): built once by from_dir / synthetic, immutable after.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kda/tokenizer/bpe.h"
#include "kda/tokenizer/pretokenizer.h"

namespace kda::tokenizer {

// Kimi's tokenization_kimi.py numbers num_reserved_special_tokens + 2 = 258 special ids after the base
// tokens; the model's vocab_size (B + 256) leaves the last two without an embedding row.
constexpr int64_t kNumSpecialIds = 258;
// The special tokens of the model's chat format and stop rule, by name.
inline constexpr const char* kBosName = "[BOS]";
inline constexpr const char* kEosName = "[EOS]";
inline constexpr const char* kImEndName = "<|im_end|>";

// Special-token strings as a byte trie: the longest one starting at a position, in one walk.
struct SpecialTrie {
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // (byte, node)
    int32_t id = -1;                                    // the special id ending here
  };
  std::vector<Node> nodes{Node{}};
  void insert(std::string_view s, int32_t id);
  // (length, id) of the longest special at text[pos], or (0, -1).
  std::pair<size_t, int32_t> longest_at(std::string_view text, size_t pos) const;
  bool first_byte[256] = {};
};

struct TokenizerData {
  int64_t num_base = 0;                                  // B
  int64_t vocab = 0;                                     // the model's embedding rows
  std::vector<std::string> tokens;                       // [B + 258]: base token bytes, then special names
  RankTable ranks;                                       // base tokens only
  std::unordered_map<std::string, int32_t> special_ids;  // usable specials (id < vocab) by name
  SpecialTrie trie;                                      // usable specials
  std::vector<uint8_t> producible;                       // [vocab]
  int32_t bos = -1, eos = -1, im_end = -1;
  std::unique_ptr<Pretokenizer> pretokenizer;
};

// Builds everything from the base tokens (rank order), the special names (B .. B+257) and vocab; errors
// (std::invalid_argument / runtime_error) start with `where` (the folder or "synthetic").
std::shared_ptr<TokenizerData> build_tokenizer_data(std::vector<std::string> base,
                                                    std::vector<std::string> specials, int64_t vocab,
                                                    const std::string& where);

// The special names as Kimi's tokenizer_config.json gives them, at their offsets from B; the others are
// <|reserved_token_{id}|>.
std::vector<std::pair<int, std::string>> kimi_named_specials();

}  // namespace kda::tokenizer
