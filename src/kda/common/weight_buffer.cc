#include "kda/common/weight_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace kda {

struct WeightChunk {
  char* base = nullptr;
  std::size_t used = 0;  // bytes handed out, from base
  std::size_t live = 0;  // blocks not yet freed
};

namespace {

#if defined(__SANITIZE_ADDRESS__)
// Under AddressSanitizer a poisoned gap follows each block cut from a chunk, and a freed block is poisoned:
// a kernel reading past its weights' end, or a freed block, is caught as it is on the heap.
constexpr std::size_t kRedzone = 64;
void poison(void* p, std::size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }
void unpoison(void* p, std::size_t n) { ASAN_UNPOISON_MEMORY_REGION(p, n); }
#else
constexpr std::size_t kRedzone = 0;
void poison(void*, std::size_t) {}
void unpoison(void*, std::size_t) {}
#endif

// `len` bytes (a multiple of 4 KiB) from a 2 MiB boundary, advised huge pages: one huge page more is
// mapped, and the parts before the boundary and after the span go back at once.
void* map_aligned(std::size_t len) {
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
  return p;
}

// The chunk blocks are cut from now (null before the first and after it was released), under its mutex.
// Never destroyed: a weight freed during the process's exit still finds it.
struct Pool {
  std::mutex mu;
  WeightChunk* current = nullptr;
};
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

void WeightBufferFree::operator()(void* p) const {
  if (p == nullptr) return;
  if (chunk == nullptr) {
    ::munmap(p, bytes);
    return;
  }
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  poison(p, bytes);
  if (--chunk->live > 0) {
    // The block's whole pages go back now (a block freed at load, a probe's or a conversion's, would
    // otherwise stay resident until its chunk's last block goes); the pages it shares stay.
    const auto lo = (reinterpret_cast<uintptr_t>(p) + 4095) / 4096 * 4096;
    const auto hi = (reinterpret_cast<uintptr_t>(p) + bytes) / 4096 * 4096;
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    return;
  }
  // The chunk's last block: the chunk goes back (its shadow cleared first, for whatever maps there next),
  // and a new one starts with the next block.
  unpoison(chunk->base, kChunkBytes);
  ::munmap(chunk->base, kChunkBytes);
  if (pl.current == chunk) pl.current = nullptr;
  delete chunk;
}

WeightBuffer allocate_weights(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  if (bytes >= kPooledBytes) {
    // Whole huge pages: a last, partial 2 MiB on 4 KiB pages read at about half the speed of the rest
    // (docs/performance.md, "Whole huge pages for every weight block").
    const std::size_t len = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    return WeightBuffer(map_aligned(len), WeightBufferFree{len, nullptr});
  }
  const std::size_t n = (bytes + 63) / 64 * 64;
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  WeightChunk* c = pl.current;
  if (c == nullptr || c->used + n + kRedzone > kChunkBytes) {
    // A full chunk stays mapped while its blocks live (a chunk with none left was released by its last
    // block's free).
    auto fresh = std::make_unique<WeightChunk>();
    fresh->base = static_cast<char*>(map_aligned(kChunkBytes));
    c = fresh.release();
    pl.current = c;
  }
  char* p = c->base + c->used;
  poison(p + n, kRedzone);
  c->used += n + kRedzone;
  ++c->live;
  return WeightBuffer(p, WeightBufferFree{n, c});
}

}  // namespace kda
