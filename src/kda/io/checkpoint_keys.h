// The Hugging Face checkpoint's tensor names by decoder layer ("model.layers.{i}.…"): what the loader and
// `kda quantize` both read a key's layer from. Private to the library.
#pragma once

#include <string>

namespace kda::io {

// Layer i of a key "model.layers.{i}.…", else -1 (no such prefix, no digits, or a number past 2^20).
inline int layer_of(const std::string& key) {
  static const std::string p = "model.layers.";
  if (key.compare(0, p.size(), p) != 0) return -1;
  size_t pos = p.size();
  int v = 0;
  bool any = false;
  while (pos < key.size() && key[pos] >= '0' && key[pos] <= '9' && v < (1 << 20)) {
    v = v * 10 + (key[pos++] - '0');
    any = true;
  }
  return any && pos < key.size() && key[pos] == '.' ? v : -1;
}

}  // namespace kda::io
