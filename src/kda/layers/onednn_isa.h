// The instruction set oneDNN may use in this process. On a CPU with AMX (Sapphire Rapids and later Xeons)
// oneDNN's bf16 matmul multiplies with AMX tiles, and how it blocks a call (chosen per row count and
// thread count) changes the order in which a row's products are summed: a row's bits then depend on how
// many rows share its call, so a request served in a batch computes other bits than alone, and a MoE
// expert's row other bits depending on which tokens chose that expert too. Its AVX512_BF16 kernel sums a
// row the same way at every row count, shape and thread count (tests/test_linear_invariance.cc), at the
// cost of AMX's speed where a call has many rows (prefill). Invariance comes first: Linear caps oneDNN at
// AVX512_CORE_BF16 on such a CPU, unless the user chose oneDNN's ISA (ONEDNN_MAX_CPU_ISA or
// DNNL_MAX_CPU_ISA in the environment, e.g. AVX512_CORE_AMX for AMX's prefill speed without invariance).
// Private to the library and its tests.
#pragma once

namespace kda::layers {

// Caps oneDNN as above, once per process; called before a projection creates its first primitive (oneDNN
// takes a cap only before it has generated any kernel).
void limit_onednn_isa();

// Whether oneDNN's bf16 matmul may use AMX tiles in this process: the environment asked for it, or
// oneDNN had generated a kernel before the cap (then the cap did not take).
bool onednn_bf16_uses_amx();

// Whether the CPU has AMX's bf16 tile multiply (cpuid; whether the OS lets a process use the tiles is
// oneDNN's to ask).
bool cpu_has_amx_bf16();

}  // namespace kda::layers
