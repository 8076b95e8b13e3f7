// The library's one setting of the C library's allocator, made when the first state pool is built, and
// its relaxation for the span of a model load (LoadAllocatorScope).
//
// glibc malloc serves a block of at least its mmap threshold from its own mapping, and by default raises
// the threshold to the size of each such block freed (up to 32 MiB). After the first large scratch buffer
// is freed (a step's projection scratch, a GEMM primitive's buffers), every later one of that size comes
// from the heap instead, where a long serving run interleaves it with small long-lived allocations: the
// heap fragments and resident memory creeps up step after step. A fixed threshold keeps every large block
// in a mapping of its own, handed back to the system when it is freed, so resident memory stays flat.
#pragma once

#include <cstddef>

namespace kda {

inline constexpr std::size_t kMmapThreshold = 128 * 1024;

// Fixes glibc's M_MMAP_THRESHOLD at kMmapThreshold (which also turns its dynamic raising off), once per
// process; thread-safe. Every RecurrentStatePool constructor calls it, so the CLI, Python and C++ embedders
// all get it. Returns whether the setting is in effect. It leaves malloc as it is (false) where the C
// library is not glibc, or where the process chose its own threshold through the environment
// (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in GLIBC_TUNABLES). A program that wants another
// setting calls mallopt after building its first pool.
bool configure_allocator();

// While one is alive (any thread; scopes nest), blocks up to 32 MiB are served from the heap and freed
// blocks stay there: a model load's per-tensor temporaries (an expert's fp32 gate and up, stacked before
// packing: 18.9 MB at the real shapes) then reuse the same pages instead of each mapping, faulting in and
// unmapping fresh ones -- on a virtual machine a first touch can cost tens of microseconds a page. The
// weights built meanwhile stay out of the heap (their buffers of 2 MiB or more are mappings of their
// own, weight_buffer.h), so freed temporaries leave no holes between them. The last scope to end
// restores configure_allocator()'s threshold and hands the heap's free pages back (malloc_trim), so
// resident memory after the load is what the model holds. Does nothing where configure_allocator() is not
// in effect.
class LoadAllocatorScope {
 public:
  LoadAllocatorScope();
  ~LoadAllocatorScope();
  LoadAllocatorScope(const LoadAllocatorScope&) = delete;
  LoadAllocatorScope& operator=(const LoadAllocatorScope&) = delete;
  // Hands the heap's free pages back now (malloc_trim): a loader calls it between layers, so the
  // temporaries' pages are reused within a layer and the load's peak stays one layer's temporaries above
  // the weights built so far.
  void trim() const;

 private:
  bool active_ = false;
};

}  // namespace kda
