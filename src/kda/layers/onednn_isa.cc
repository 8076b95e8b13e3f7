#include "kda/layers/onednn_isa.h"

#include <cstdlib>
#include <dnnl.hpp>
#include <stdexcept>
#include <string>

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

void make_bf16_batch_invariant() {
  // Not onednn_bf16_uses_amx() first: oneDNN fixes its ISA at the first query.
  if (!cpu_has_amx_bf16()) return;  // invariant already
  for (const char* env : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"})
    if (const char* v = std::getenv(env)) {
      if (!onednn_bf16_uses_amx()) return;  // the environment's cap is below AMX already
      throw std::runtime_error(std::string("batch-invariant bf16: ") + env + "=" + v +
                               " lets oneDNN use AMX, whose rows depend on their batch; unset it or set "
                               "AVX512_CORE_BF16");
    }
  try {
    dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16);
  } catch (const dnnl::error&) {
  }
  if (onednn_bf16_uses_amx())
    throw std::runtime_error(
        "batch-invariant bf16: oneDNN has already generated a kernel in this process, so its instruction "
        "set can no longer be capped below AMX (ask before any model is built)");
}

bool onednn_bf16_uses_amx() {
  // The ISA values are sets of feature bits.
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  return (isa & amx) == amx;
}

}  // namespace kda::layers
