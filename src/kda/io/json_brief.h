// A JSON value from outside input, shown in an error message without risk.
//
// nlohmann's dump() recurses once per level of nesting: a config or trace holding a value nested a few
// hundred thousand levels deep (one byte per level) overflowed the stack when an error message dumped
// it. json_brief writes scalars and small flat lists / objects as dump() does, anything nested as its
// kind and size, and cuts long text.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kda::io {

inline std::string json_brief(const nlohmann::json& j) {
  constexpr size_t kMaxElements = 16, kMaxChars = 80;
  bool flat = !j.is_structured() || j.size() <= kMaxElements;
  if (flat && j.is_structured())
    for (const auto& e : j) flat = flat && !e.is_structured();
  if (!flat)
    return std::string(j.is_array() ? "a list" : "an object") + " of " + std::to_string(j.size()) +
           (j.size() == 1 ? " element" : " elements");
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > kMaxChars) s = s.substr(0, kMaxChars - 3) + "...";
  return s;
}

}  // namespace kda::io
