#include "kda/tokenizer/utf8.h"

#include <cstdint>

namespace kda::tokenizer {
namespace {

// The length a lead byte announces (0: not a lead byte) and the range its second byte must lie in, which
// is what excludes overlong forms, surrogates and code points above U+10FFFF (Unicode table 3-7).
struct Lead {
  int len;
  uint8_t lo, hi;
};

Lead lead_of(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// How many bytes from in[i] form a valid prefix of one character (1..len), and whether it is complete.
// Returns 0 when in[i] itself is not a lead byte.
int valid_prefix(std::string_view in, size_t i, bool* complete) {
  const Lead l = lead_of(static_cast<uint8_t>(in[i]));
  *complete = false;
  if (l.len == 0) return 0;
  if (l.len == 1) {
    *complete = true;
    return 1;
  }
  int n = 1;
  while (n < l.len && i + n < in.size()) {
    const auto c = static_cast<uint8_t>(in[i + n]);
    const bool ok = n == 1 ? (c >= l.lo && c <= l.hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) return n;
    ++n;
  }
  *complete = n == l.len;
  return n;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

}  // namespace

size_t utf8_invalid_offset(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<uint8_t>(text[i]) < 0x80) {  // the common case, byte by byte
      ++i;
      continue;
    }
    bool complete = false;
    const int n = valid_prefix(text, i, &complete);
    if (!complete) return i;  // the sequence starting here is ill-formed or cut short
    i += n;
  }
  return std::string_view::npos;
}

size_t utf8_decode_replace(std::string_view in, std::string& out, bool final) {
  size_t i = 0;
  while (i < in.size()) {
    bool complete = false;
    const int n = valid_prefix(in, i, &complete);
    if (complete) {
      out.append(in.substr(i, n));
      i += n;
    } else if (n == 0) {
      out.append(kReplacement);
      i += 1;
    } else if (i + n == in.size() && !final) {
      break;  // a character that the next bytes may complete
    } else {
      out.append(kReplacement);  // the maximal subpart, then continue at the byte that broke it
      i += n;
    }
  }
  return i;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace kda::tokenizer
