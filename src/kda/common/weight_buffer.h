// Memory for a weight the process packs or reorders at load and reads on every step: blocks of 2 MiB or
// more come from a mapping of their own, aligned to 2 MiB and offered to the kernel's transparent huge
// pages (MADV_HUGEPAGE, which the "madvise" THP mode -- Debian's default -- asks for). Filling a 128 MB
// head block then takes 64 page faults instead of 32 K, and a decode step that streams every weight
// walks a TLB entry per 2 MiB instead of per 4 KiB. Smaller blocks, and kernels without THP, get
// ordinary pages (64-byte aligned), as do the last, partial 2 MiB of a block. Private to the library.
#pragma once

#include <cstddef>
#include <memory>

namespace kda {

struct WeightBufferFree {
  std::size_t bytes = 0;  // the mapping's length; 0: from aligned_alloc
  void operator()(void* p) const;
};
using WeightBuffer = std::unique_ptr<void, WeightBufferFree>;

// `bytes` of zeroed memory, 64-byte aligned at least; std::bad_alloc when none is left.
WeightBuffer allocate_weights(std::size_t bytes);

// The block size from which allocate_weights maps and advises huge pages.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

}  // namespace kda
