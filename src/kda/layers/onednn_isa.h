// The instruction set oneDNN may use in this process. On a CPU with AMX (Sapphire Rapids and later Xeons)
// oneDNN's bf16 matmul multiplies with AMX tiles, and how it blocks a call (chosen per row count and
// thread count) changes the order in which a row's products are summed: a row's bits then depend on how
// many rows share its call, so a request served in a batch computes other bits than alone, and a MoE
// expert's row other bits depending on which tokens chose that expert too. Its AVX512_BF16 kernel sums a
// row the same way at every row count, shape and thread count (tests/test_linear_invariance.cc), at the
// cost of AMX's speed where a call has many rows (a 2048-row prefill GEMM about 5x slower). Speed is the
// default, as in vLLM and sglang; `--batch-invariant` (kda simulate, kda serve) asks for invariance.
// Private to the library, its tests and the CLI.
#pragma once

namespace kda::layers {

// Makes bf16 rows batch-invariant for the rest of the process: on a CPU with AMX, caps oneDNN at
// AVX512_CORE_BF16 (nothing to do elsewhere: the cap would also bar AVX2_VNNI, which is not below it).
// Must run before oneDNN generates its first kernel (before any model is built): std::runtime_error
// when it is too late, or when ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA in the environment allow AMX.
void make_bf16_batch_invariant();

// Whether oneDNN's bf16 matmul may use AMX tiles in this process (its effective ISA includes AMX).
bool onednn_bf16_uses_amx();

// Whether the CPU has AMX's bf16 tile multiply (cpuid; whether the OS lets a process use the tiles is
// oneDNN's to ask).
bool cpu_has_amx_bf16();

}  // namespace kda::layers
