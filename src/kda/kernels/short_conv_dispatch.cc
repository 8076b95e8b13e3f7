// The short conv's entry points: the copy for the fastest ISA this CPU runs (best_isa()). Only the
// copies in the build are referenced.
#include "kda/common/isa.h"
#include "kda/kernels/short_conv.h"
#include "kda/kernels/short_conv_isa.h"

namespace kda::kernels {
namespace {

template <class Args>
void dispatch_extend(const Args& a) {
  switch (best_isa()) {
#if defined(KDA_WITH_AVX512)
    case Isa::Avx512:
      return avx512::short_conv_extend(a);
#endif
#if defined(KDA_WITH_AVX2)
    case Isa::Avx2:
      return avx2::short_conv_extend(a);
#endif
    default:
      return portable::short_conv_extend(a);
  }
}

template <class Args>
void dispatch_decode(const Args& a) {
  switch (best_isa()) {
#if defined(KDA_WITH_AVX512)
    case Isa::Avx512:
      return avx512::short_conv_decode(a);
#endif
#if defined(KDA_WITH_AVX2)
    case Isa::Avx2:
      return avx2::short_conv_decode(a);
#endif
    default:
      return portable::short_conv_decode(a);
  }
}

}  // namespace

void short_conv_extend(const ShortConvArgs<float>& a) { dispatch_extend(a); }
void short_conv_extend(const ShortConvArgs<bf16_t>& a) { dispatch_extend(a); }
void short_conv_decode(const ShortConvArgs<float>& a) { dispatch_decode(a); }
void short_conv_decode(const ShortConvArgs<bf16_t>& a) { dispatch_decode(a); }

}  // namespace kda::kernels
