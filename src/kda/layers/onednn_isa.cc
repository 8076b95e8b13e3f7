#include "kda/layers/onednn_isa.h"

#include <cstdlib>
#include <dnnl.hpp>
#include <mutex>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kda::layers {

bool cpu_has_amx_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool amx = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, a, b, c, d);
    return (d >> 22 & 1u) != 0;  // CPUID.(EAX=7, ECX=0):EDX[22] AMX-BF16
  }();
  return amx;
#else
  return false;
#endif
}

void limit_onednn_isa() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("ONEDNN_MAX_CPU_ISA") || std::getenv("DNNL_MAX_CPU_ISA")) return;  // the user's choice
    // Only where AMX is there to lose: the cap would also bar AVX2_VNNI, which is not below it.
    if (cpu_has_amx_bf16()) dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16);
  });
}

bool onednn_bf16_uses_amx() {
  // The ISA values are sets of feature bits.
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  return (isa & amx) == amx;
}

}  // namespace kda::layers
