#include "kda/common/isa.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kda {

const char* to_string(Isa isa) {
  switch (isa) {
    case Isa::Portable:
      return "portable";
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
  }
  return "unknown";
}

Isa parse_isa(std::string_view s) {
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512}) {
    if (s == to_string(isa)) return isa;
  }
  throw std::invalid_argument("kda: unknown ISA '" + std::string(s) +
                              "' (expected portable, avx2 or avx512)");
}

bool isa_compiled(Isa isa) {
  switch (isa) {
    case Isa::Portable:
      return true;
    case Isa::Avx2:
#if defined(KDA_WITH_AVX2)
      return true;
#else
      return false;
#endif
    case Isa::Avx512:
#if defined(KDA_WITH_AVX512)
      return true;
#else
      return false;
#endif
  }
  return false;
}

// The features each copy is compiled with (isa_target.h), all of them required. libgcc's cpuid
// reading also checks XCR0, so a feature whose registers the OS does not save reads as absent.
bool isa_supported_by_cpu(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  static const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512vl");
  switch (isa) {
    case Isa::Portable:
      return true;
    case Isa::Avx2:
      return avx2;
    case Isa::Avx512:
      return avx512;
  }
  return false;
#else
  return isa == Isa::Portable;
#endif
}

bool cpu_has_bf16_gemm() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool bf16 = __builtin_cpu_supports("avx512bf16");
  return bf16;
#else
  return false;
#endif
}

bool isa_available(Isa isa) { return isa_compiled(isa) && isa_supported_by_cpu(isa); }

void require_isa(Isa isa) {
  if (!isa_compiled(isa)) {
    throw std::invalid_argument(std::string("kda: the ") + to_string(isa) +
                                " kernels are not in this build (configured without them)");
  }
  if (!isa_supported_by_cpu(isa)) {
    throw std::invalid_argument(std::string("kda: this CPU does not run the ") + to_string(isa) + " kernels");
  }
}

namespace {

Isa detect_best() {
  Isa best = Isa::Portable;
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (isa_available(isa)) best = isa;
  }
  if (const char* cap = std::getenv("KDA_ISA"); cap != nullptr && *cap != '\0') {
    const Isa want = parse_isa(cap);
    require_isa(want);
    best = want;
  }
  return best;
}

}  // namespace

Isa best_isa() {
  static const Isa best = detect_best();  // a throw leaves it undecided: the next call throws again
  return best;
}

}  // namespace kda
