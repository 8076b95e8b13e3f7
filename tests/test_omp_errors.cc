// No exception may leave an OpenMP region (it would end the process with std::terminate): an allocation
// that fails inside a kernel's parallel region reaches the caller as std::bad_alloc. The optimized KDA
// kernels grow each thread's scratch inside their region; a head of K = V = 2^23 asks every thread for a
// private [K, V] state of 2^46 floats (256 TiB, beyond any address space), which cannot be allocated,
// while the call's own inputs (one token: 32 MiB per tensor) can.
#include <gtest/gtest.h>

#include <new>
#include <vector>

#include "kda/kernels/kda/kda.h"

// ASan's allocator ends the process on an allocation it cannot serve unless told to return null, as
// the system allocator does (the suite also runs under ASan).
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }

namespace kda {
namespace {

struct HugeHead {
  static constexpr int K = 1 << 23, V = 1 << 23;
  std::vector<float> q = std::vector<float>(K, 0.5f), k = q, v = std::vector<float>(V, 0.25f), g = q, o = v;
  float beta = 0.5f;

  kernels::KdaArgs args() {
    kernels::KdaArgs a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.g = g.data();
    a.beta = &beta;
    a.o = o.data();
    a.T = 1;
    a.H = 1;
    a.K = K;
    a.V = V;
    a.N = 1;
    a.use_qk_l2norm_in_kernel = true;
    return a;  // no state pool: the kernels keep the state in their scratch
  }
};

TEST(OmpErrors, ScratchThatCannotBeAllocatedIsBadAllocInTheCaller) {
  HugeHead h;
  for (const auto impl : {kernels::KernelImpl::Optimized, kernels::KernelImpl::Portable}) {
    SCOPED_TRACE(kernels::to_string(impl));
    EXPECT_THROW(kernels::chunk_kda(h.args(), impl), std::bad_alloc);
    EXPECT_THROW(kernels::fused_recurrent_kda(h.args(), impl), std::bad_alloc);
  }
}

}  // namespace
}  // namespace kda
