// online_softmax_block's per-ISA copies (online_softmax.cc compiled once per ISA, see
// kda/common/isa_target.h), behind the entry point of online_softmax.h. Private to the library.
#pragma once

#include "kda/kernels/online_softmax.h"

namespace kda::kernels {

#define KDA_ONLINE_SOFTMAX_DECLS                                                                             \
  void online_softmax_block(float* s, int64_t n, int64_t rows, float scale, float* mx, float* l, float* acc, \
                            int64_t dv);

namespace portable {
KDA_ONLINE_SOFTMAX_DECLS
}  // namespace portable
namespace avx2 {
KDA_ONLINE_SOFTMAX_DECLS
}  // namespace avx2
namespace avx512 {
KDA_ONLINE_SOFTMAX_DECLS
}  // namespace avx512

#undef KDA_ONLINE_SOFTMAX_DECLS

}  // namespace kda::kernels
