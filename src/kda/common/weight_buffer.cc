#include "kda/common/weight_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace kda {

void WeightBufferFree::operator()(void* p) const {
  if (p == nullptr) return;
  if (bytes == 0) {
    std::free(p);
    return;
  }
  ::munmap(p, bytes);
}

WeightBuffer allocate_weights(std::size_t bytes) {
  if (bytes < kHugePageBytes) {
    const std::size_t n = std::max<std::size_t>(64, (bytes + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, n);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, n);  // zeroed as the mapped ones are: a packing's padding bytes are then defined
    return WeightBuffer(p, WeightBufferFree{0});
  }
  // Map one huge page more than needed and keep the span from the first 2 MiB boundary: the parts before
  // and after it go back at once. The span is the bytes rounded to 4 KiB, not to 2 MiB (an int4 expert's
  // 2.4 MB would take 4 MiB): its whole 2 MiB steps get huge pages, the rest ordinary ones.
  const std::size_t len = (bytes + 4095) / 4096 * 4096;
  void* raw =
      ::mmap(nullptr, len + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > base) ::munmap(raw, aligned - base);
  const uintptr_t tail = base + len + kHugePageBytes - (aligned + len);
  if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + len), tail);
  void* p = reinterpret_cast<void*>(aligned);
#if defined(MADV_HUGEPAGE)
  ::madvise(p, len, MADV_HUGEPAGE);  // advice: refused (no THP in this kernel), the pages stay 4 KiB
#endif
  return WeightBuffer(p, WeightBufferFree{len});
}

}  // namespace kda
