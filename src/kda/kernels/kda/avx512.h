// <immintrin.h> for the AVX-512 copies (isa_target.h): GCC declares every intrinsic whatever the
// command-line flags, each usable in code compiled for its ISA. GCC 12 reports its own shuffle / unpack /
// reduce intrinsics (their _mm512_undefined_ps() pass-through operand) as "(may be) used uninitialized"
// once inlined; the header lines are where the warning is located, so it is silenced around the include
// only. Every file of the project takes the header from here, so the silencing does not depend on which
// include comes first.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
