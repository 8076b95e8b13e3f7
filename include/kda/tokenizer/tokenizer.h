// Kimi's tokenizer: tiktoken's byte-level BPE over the checkpoint's tiktoken.model, the spec's
// pre-tokenizer pattern, and the special tokens named by tokenizer_config.json.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kda::tokenizer {

struct TokenizerData;  // the vocabulary, the rank table, the special tokens, the compiled pattern

class Tokenizer {
 public:
  // dir/tiktoken.model ("base64(bytes) rank" per line, ranks 0..B-1 contiguous, every single byte among them)
  // and, when present, dir/tokenizer_config.json (added_tokens_decoder: special token names by id). Special
  // tokens take ids B .. B+257 as Kimi's tokenization_kimi.py numbers them (named from the config, else
  // <|reserved_token_{id}|>). vocab_size: the model's embedding rows; ids >= vocab_size (Kimi's last two
  // reserved ones) are never produced by encode (their text is encoded as plain text) and refused by decode.
  // vocab_size <= 0: B + 256, as Kimi's config.json has it. Errors name the file and line.
  static Tokenizer from_dir(const std::string& dir, int64_t vocab_size);
  // A generated tiktoken-format vocabulary for a synthetic model with vocab_size ids (>= 512): B = vocab_size
  // - 256 base tokens (the 256 single bytes, then tokens made by concatenating two earlier tokens, drawn from
  // seed, no duplicates) and the special tokens named as Kimi's files name them, at Kimi's ids.
  static Tokenizer synthetic(int64_t vocab_size, uint64_t seed = 0);
  // Writes dir/tiktoken.model and dir/tokenizer_config.json so that from_dir(dir, vocab_size()) reads it
  // back.
  void save(const std::string& dir) const;

  // The ids of Kimi's tokenizer as vLLM calls it (Hugging Face's tokenizer call over tokenization_kimi.py):
  // special-token strings split the text (allow_special; the longest at a position); each part between
  // them is cut as tokenization_kimi.py cuts its text (long_runs.h: runs of over 25,000 whitespace or
  // non-whitespace characters, 400,000-character chunks) and each piece goes through tiktoken's encode on
  // its own: the spec's pre-tokenizer (PCRE2, UTF + UCP), then tiktoken's byte-pair merge by rank.
  // !allow_special: special-token strings are plain text.
  // Invalid UTF-8 -> std::invalid_argument naming the byte offset. Thread safe.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;
  // Raw concatenated bytes (a special token's: its text); an id out of range or without bytes ->
  // std::invalid_argument naming it.
  std::string decode_bytes(std::span<const int32_t> ids) const;
  // Text as a stream emits it: StreamDecoder over ids, then flush (invalid UTF-8 -> U+FFFD), always valid
  // UTF-8.
  std::string decode(std::span<const int32_t> ids) const;

  int64_t vocab_size() const;       // the model's
  int64_t num_base_tokens() const;  // B
  bool is_special(int32_t id) const;
  std::optional<int32_t> special_id(std::string_view text) const;  // "<|im_end|>" -> id (only ids < vocab)
  const std::string& token_bytes(int32_t id) const;                // a special's: its text
  int32_t bos_id() const;                                          // [BOS]
  int32_t eos_id() const;                                          // [EOS]
  int32_t im_end_id() const;                       // <|im_end|> (end of turn; the config's eos_token_id)
  std::vector<int32_t> stop_ids() const;           // {<|im_end|>, [EOS]}
  const std::vector<uint8_t>& producible() const;  // [vocab_size]: 1 where an id has bytes

  // The pre-tokenizer's pieces of text (no special-token handling, no cut of long runs), as views into
  // text: tests and tools.
  std::vector<std::string_view> split(std::string_view text) const;

 private:
  explicit Tokenizer(std::shared_ptr<const TokenizerData> d);
  std::shared_ptr<const TokenizerData> d_;  // immutable once built: copies share it
};

// Incremental detokenizer for streaming: text only up to the last complete UTF-8 character; bytes that can
// never start/continue a valid character become U+FFFD at once.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok);
  std::string push(int32_t id);  // the newly completed text (maybe empty); a bad id -> invalid_argument
  std::string flush();           // what is held back, as U+FFFD

 private:
  const Tokenizer* tok_;
  std::string pending_;  // the bytes of an incomplete character (at most 3)
};

}  // namespace kda::tokenizer
