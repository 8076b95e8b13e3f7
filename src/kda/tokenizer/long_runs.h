// How Kimi's tokenization_kimi.py hands text to tiktoken: in pieces that tiktoken's regex engine can take
// without overflowing its stack (tiktoken issue 195). The pieces' ends are ends for the pre-tokenizer
// pattern and for the special-token scan too, so they change the ids; encode() cuts the same way.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace kda::tokenizer {

inline constexpr int64_t kKimiChunkChars = 400'000;  // TIKTOKEN_MAX_ENCODE_CHARS
inline constexpr int64_t kKimiMaxRunChars = 25'000;  // MAX_NO_WHITESPACES_CHARS

// Python's str.isspace for one code point: Unicode category Zs or bidirectional class WS, B or S. Not the
// pattern's \s (White_Space): U+001C..U+001F are isspace but not White_Space.
bool python_isspace(char32_t cp);

// Appends text (valid UTF-8) cut as tokenization_kimi.py cuts it: chunks of kKimiChunkChars characters,
// each cut before any character that would make a run of whitespace (python_isspace) or of
// non-whitespace longer than kKimiMaxRunChars characters. The run count restarts at each chunk. Empty
// text appends nothing.
void cut_long_runs(std::string_view text, std::vector<std::string_view>& out);

}  // namespace kda::tokenizer
