#include "kda/common/allocator.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

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

std::mutex load_mutex;
int load_depth = 0;  // live LoadAllocatorScopes that are active

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

LoadAllocatorScope::LoadAllocatorScope() {
#if defined(__GLIBC__)
  if (!configure_allocator()) return;
  const std::lock_guard<std::mutex> lock(load_mutex);
  if (load_depth++ == 0) {
    mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  active_ = true;
#endif
}

void LoadAllocatorScope::trim() const {
#if defined(__GLIBC__)
  if (active_) malloc_trim(0);
#endif
}

LoadAllocatorScope::~LoadAllocatorScope() {
#if defined(__GLIBC__)
  if (!active_) return;
  const std::lock_guard<std::mutex> lock(load_mutex);
  if (--load_depth == 0) {
    mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold));
    mallopt(M_TRIM_THRESHOLD, 128 * 1024);  // glibc's default
    malloc_trim(0);
  }
#endif
}

}  // namespace kda
