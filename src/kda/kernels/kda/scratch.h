// Per-thread scratch for the optimized KDA kernels.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

namespace kda::kernels {

// A 64-byte aligned buffer that only grows. Kept thread_local by the kernels, so steady-state calls do
// no heap allocation (OpenMP's worker threads persist, and so do their buffers).
class ScratchBuffer {
 public:
  float* get(size_t n) {
    if (n > cap_) {
      const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
      mem_.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      if (!mem_) throw std::bad_alloc();
      cap_ = n;
    }
    return mem_.get();
  }

 private:
  std::unique_ptr<float, decltype(&std::free)> mem_{nullptr, &std::free};
  size_t cap_ = 0;
};

}  // namespace kda::kernels
