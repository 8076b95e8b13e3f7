// Run-time CPU dispatch: which instruction sets the optimized code was compiled for and which of them
// this CPU (and its OS) runs. The optimized kernels and the short conv are compiled once per ISA in
// their own translation units and namespaces (see isa_target.h); the dispatchers call the copy that
// best_isa() names.
#pragma once

#include <string_view>

namespace kda {

enum class Isa { Portable, Avx2, Avx512 };  // ascending: a later one runs faster where it runs at all

const char* to_string(Isa isa);  // "portable" | "avx2" | "avx512"
Isa parse_isa(std::string_view s);

// Whether the build has the copies for `isa` (KDA_ENABLE_AVX2 / KDA_ENABLE_AVX512), whether the CPU
// runs it (cpuid, and xgetbv for the OS saving the wide registers; detected once), and both.
bool isa_compiled(Isa isa);
bool isa_supported_by_cpu(Isa isa);
bool isa_available(Isa isa);

// The fastest available ISA, decided once. The environment variable KDA_ISA (portable, avx2, avx512)
// caps it, e.g. to time the portable code on an AVX-512 machine; naming an ISA that is not available
// throws std::invalid_argument.
Isa best_isa();

// Whether the CPU multiplies bf16 in hardware (AVX512_BF16: Cooper Lake, Sapphire Rapids and later,
// Zen 4 and later), where oneDNN's bf16 matmul runs natively; without it oneDNN emulates bf16 GEMMs
// and layers::Linear takes its own bf16 path (linear.h).
bool cpu_has_bf16_gemm();

// Throws std::invalid_argument naming `isa` and why, unless it is available.
void require_isa(Isa isa);

}  // namespace kda
