// UTF-8 checks and the replacement decoding a stream of token bytes needs.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kda::tokenizer {

// The byte offset of the first byte that is not part of a well-formed UTF-8 sequence (overlong forms,
// surrogates and code points above U+10FFFF included), or npos when text is valid.
size_t utf8_invalid_offset(std::string_view text);

// Appends to out the characters of in, ill-formed parts replaced by U+FFFD (one per maximal subpart, as
// Unicode's "substitution of maximal subparts" and Python's errors="replace" do). final = false: a valid
// but incomplete sequence at the end is held back; returns the number of bytes consumed.
size_t utf8_decode_replace(std::string_view in, std::string& out, bool final);

// The UTF-8 encoding of code point cp (cp <= 0x10FFFF, not a surrogate).
void utf8_append(std::string& out, char32_t cp);

}  // namespace kda::tokenizer
