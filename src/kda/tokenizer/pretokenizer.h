// The spec's pre-tokenizer pattern through PCRE2 (UTF + UCP, JIT when available), compiled once.
#pragma once

#include <string_view>
#include <vector>

namespace kda::tokenizer {

// The pattern as Kimi's tokenization_kimi.py writes it (fancy-regex syntax, with && class intersections).
extern const char* const kKimiPatternTiktoken;
// The same pattern in PCRE2 syntax (see pretokenizer.cc for how each part is rewritten).
extern const char* const kKimiPatternPcre2;

class Pretokenizer {
 public:
  Pretokenizer();  // compiles kKimiPatternPcre2; std::runtime_error with PCRE2's message on failure
  ~Pretokenizer();
  Pretokenizer(const Pretokenizer&) = delete;
  Pretokenizer& operator=(const Pretokenizer&) = delete;
  // Appends the pieces of text (valid UTF-8, checked by the caller) in order, as tiktoken's find_iter
  // yields them. Thread safe: the match data is the call's own.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8
  bool jit_ = false;
};

}  // namespace kda::tokenizer
