// Standard base64 (RFC 4648, with padding), as tiktoken.model stores token bytes.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kda::tokenizer {

std::string base64_encode(std::string_view bytes);
// Strict: the standard alphabet, a length that is a multiple of 4, padding only at the end, zero pad bits;
// nullopt otherwise.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace kda::tokenizer
