// Scratch vectors whose data starts on a 64-byte boundary: oneDNN's bf16 kernels ran at about half speed
// on operands that were not (AMX tile loads split across cache lines), and the project's kernels load
// their panels with aligned vector loads. Private to the library.
#pragma once

#include <cstdint>
#include <vector>

namespace kda {

// v grown to hold at least n values, never shrunk: a workspace sized once for the largest step (reserve)
// keeps its pages for the smaller ones.
template <class T>
void grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

// v sized for n values from a 64-byte boundary, which it returns (v keeps its capacity between calls).
template <class T>
T* aligned(std::vector<T>& v, int64_t n) {
  v.resize(static_cast<size_t>(n) + 64 / sizeof(T));
  const auto a = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - a % 64) % 64) / sizeof(T);
}

// As grow, for a vector that aligned() will serve n values from.
template <class T>
void grow_aligned(std::vector<T>& v, int64_t n) {
  grow(v, n + static_cast<int64_t>(64 / sizeof(T)));
}

}  // namespace kda
