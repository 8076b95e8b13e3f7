#include "kda/common/allocator.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kda {

namespace {

// A threshold the process set for itself at start-up (glibc reads these once, before main).
bool threshold_chosen_by_environment() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) return true;
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables != nullptr && std::strstr(tunables, "glibc.malloc.mmap_threshold") != nullptr;
}

}  // namespace

bool configure_allocator() {
#if defined(__GLIBC__)
  static const bool in_effect = [] {
    if (threshold_chosen_by_environment()) return false;
    return mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold)) == 1;
  }();
  return in_effect;
#else
  return false;
#endif
}

}  // namespace kda
