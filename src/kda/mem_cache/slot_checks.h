// What the pools share when they check a caller's list of slots (or requests, or offsets).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace kda::mem_cache {

// Rejects a list naming one entry twice: freeing or writing it twice is a caller bug. `what` names the
// call and the kind of entry ("RecurrentStatePool::free: slot").
inline void check_unique(std::span<const int32_t> ids, const char* what) {
  std::vector<int32_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end())
    throw std::invalid_argument(std::string(what) + " " + std::to_string(*dup) + " is listed twice");
}

}  // namespace kda::mem_cache
