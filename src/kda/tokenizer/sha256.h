// SHA-256 (FIPS 180-4), for recognising known chat templates by their text.
#pragma once

#include <string>
#include <string_view>

namespace kda::tokenizer {

std::string sha256_hex(std::string_view data);  // lowercase hex

}  // namespace kda::tokenizer
