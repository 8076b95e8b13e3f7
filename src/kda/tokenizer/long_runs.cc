#include "kda/tokenizer/long_runs.h"

#include <cstdint>

namespace kda::tokenizer {

bool python_isspace(char32_t cp) {
  // CPython's _Py_ascii_whitespace and _PyUnicode_IsWhitespace (Zs, or bidi WS / B / S); the list has
  // not changed since Unicode 6.3 dropped U+180E from Zs.
  if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20);
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

namespace {

// The code point at text[i] (valid UTF-8) and its length in bytes.
char32_t decode_at(std::string_view text, size_t i, size_t* len) {
  const auto b = static_cast<uint8_t>(text[i]);
  const auto cont = [&](size_t k) { return static_cast<char32_t>(static_cast<uint8_t>(text[i + k]) & 0x3F); };
  if (b < 0x80) {
    *len = 1;
    return b;
  }
  if (b < 0xE0) {
    *len = 2;
    return (static_cast<char32_t>(b & 0x1F) << 6) | cont(1);
  }
  if (b < 0xF0) {
    *len = 3;
    return (static_cast<char32_t>(b & 0x0F) << 12) | (cont(1) << 6) | cont(2);
  }
  *len = 4;
  return (static_cast<char32_t>(b & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

}  // namespace

void cut_long_runs(std::string_view text, std::vector<std::string_view>& out) {
  size_t i = 0;
  while (i < text.size()) {  // one chunk
    size_t start = i;
    int64_t chars = 0, run = 0;
    bool run_space = false;
    while (i < text.size() && chars < kKimiChunkChars) {
      size_t len = 0;
      const bool space = python_isspace(decode_at(text, i, &len));
      if (chars == 0 || space != run_space) {
        run = 1;
        run_space = space;
      } else if (++run > kKimiMaxRunChars) {
        out.push_back(text.substr(start, i - start));
        start = i;
        run = 1;
      }
      i += len;
      ++chars;
    }
    out.push_back(text.substr(start, i - start));
  }
}

}  // namespace kda::tokenizer
