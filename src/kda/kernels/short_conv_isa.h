// The short conv's per-ISA copies (short_conv.cc compiled once per ISA, see kda/common/isa_target.h),
// behind the entry points of short_conv.h. Private to the library and its tests.
#pragma once

#include "kda/kernels/short_conv.h"

namespace kda::kernels {

#define KDA_SHORT_CONV_DECLS                              \
  void short_conv_extend(const ShortConvArgs<float>& a);  \
  void short_conv_extend(const ShortConvArgs<bf16_t>& a); \
  void short_conv_decode(const ShortConvArgs<float>& a);  \
  void short_conv_decode(const ShortConvArgs<bf16_t>& a);

namespace portable {
KDA_SHORT_CONV_DECLS
}  // namespace portable
namespace avx2 {
KDA_SHORT_CONV_DECLS
}  // namespace avx2
namespace avx512 {
KDA_SHORT_CONV_DECLS
}  // namespace avx512

#undef KDA_SHORT_CONV_DECLS

}  // namespace kda::kernels
