// Memory for a weight the process packs or reorders at load and reads on every step, offered to the
// kernel's transparent huge pages (MADV_HUGEPAGE, which the "madvise" THP mode -- Debian's default -- asks
// for): a decode step that streams every weight then walks a TLB entry per 2 MiB instead of per 4 KiB, and
// filling a 128 MB head block takes 64 page faults instead of 32 K.
//  - Blocks under 16 MiB (kPooledBytes) are cut, one after another, from shared chunks of kChunkBytes
//    that start on a 2 MiB boundary, so that an int4 expert's down projection (1.2 MB) or a scale vector
//    sits in huge pages as the larger blocks do, and a block's last, partial 2 MiB shares its huge page
//    with the next block. A chunk goes back to the system when its last block is freed; a freed block's
//    bytes are not handed out again (weights live as long as their model), its whole pages go back at once.
//  - Larger blocks get a mapping of their own from a 2 MiB boundary, rounded up to whole huge pages (at
//    most 1/8 more memory). A partial 2 MiB left on 4 KiB pages read at about half the speed of huge
//    pages on a Xeon host (docs/performance.md, "Whole huge pages for every weight block").
// Private to the library.
#pragma once

#include <cstddef>
#include <memory>

namespace kda {

struct WeightChunk;  // a shared chunk (weight_buffer.cc)

struct WeightBufferFree {
  std::size_t bytes = 0;         // the block's length (of its mapping, where it has one of its own)
  WeightChunk* chunk = nullptr;  // else the chunk the block was cut from
  void operator()(void* p) const;
};
using WeightBuffer = std::unique_ptr<void, WeightBufferFree>;

// `bytes` of zeroed memory, 64-byte aligned at least (on 2 MiB from kPooledBytes on); std::bad_alloc when
// none is left. Thread-safe.
WeightBuffer allocate_weights(std::size_t bytes);

inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;  // a transparent huge page (x86-64)
inline constexpr std::size_t kChunkBytes = std::size_t{64} << 20;    // a shared chunk's size
inline constexpr std::size_t kPooledBytes = kChunkBytes / 4;         // blocks below it come from chunks

}  // namespace kda
