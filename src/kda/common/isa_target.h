// The per-ISA compilation of one translation unit. CMake compiles each such source once per ISA with
// KDA_ISA_AVX512 or KDA_ISA_AVX2 defined (neither: the portable copy, baseline x86-64); its ISA code
// sits between KDA_ISA_PUSH and KDA_ISA_POP inside namespace ...::KDA_ISA_NS:
//
//   #include <...>                      every other include first
//   KDA_ISA_PUSH
//   namespace kda::kernels::KDA_ISA_NS { ... }
//   KDA_ISA_POP
//
// Why a pragma over the region and not -m flags on the file: with -mavx512f on the command line every
// inline function and template the file instantiates (std::vector, std::sort, the static initializers)
// would be AVX-512 code too, emitted as weak symbols that the linker may pick for the portable callers
// -- an illegal instruction on an older CPU. Under the pragma only the functions defined in the region
// (the kernels, their lambdas and OpenMP bodies) get the ISA; the namespace keeps the region's inline
// functions of the shared headers (vec_math.h, prepare.h, ...) apart per ISA (one definition each).
#pragma once

#if defined(KDA_ISA_AVX512) || defined(KDA_ISA_AVX2)
#if defined(__clang__) || !defined(__GNUC__)
#error \
    "the AVX2 / AVX-512 copies need GCC's target pragma: configure with -DKDA_ENABLE_AVX2=OFF -DKDA_ENABLE_AVX512=OFF"
#endif
#endif

#if defined(KDA_ISA_AVX512)
// x86-64-v4's AVX-512 subset (F, BW, DQ, VL: every AVX-512 CPU since Skylake-SP and Zen 4), which
// isa.cc requires at run time; the code uses nothing beyond it.
#define KDA_ISA_NS avx512
#define KDA_ISA_PUSH          \
  _Pragma("GCC push_options") \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt\")")
#define KDA_ISA_POP _Pragma("GCC pop_options")
#elif defined(KDA_ISA_AVX2)
#define KDA_ISA_NS avx2
#define KDA_ISA_PUSH \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt\")")
#define KDA_ISA_POP _Pragma("GCC pop_options")
#else
#define KDA_ISA_NS portable
#define KDA_ISA_PUSH
#define KDA_ISA_POP
#endif

// For a hot loop outside the per-ISA files (bf16 conversions, the gated norm): GCC compiles the function
// once per listed ISA plus the baseline and picks one at load time (an ifunc resolved by cpuid). Only
// for leaf functions: the body of an OpenMP region inside it would not be cloned. Not under ThreadSanitizer
// (KDA_TSAN): GCC instruments the ifunc resolver, which the dynamic loader runs before TSan's runtime is
// up, and the program dies before main; that build keeps the baseline copy.
#if defined(__SANITIZE_THREAD__)
#define KDA_TARGET_CLONES
#elif defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && \
    defined(KDA_WITH_AVX512) && defined(KDA_WITH_AVX2)
#define KDA_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && \
    defined(KDA_WITH_AVX2)
#define KDA_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KDA_TARGET_CLONES
#endif
