// router_gemm.h's entry points: the packing, the argument checks, the reference, and the copy of the
// kernel for the fastest ISA this CPU runs (best_isa()).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kda/common/isa.h"
#include "kda/kernels/gemm/router_gemm.h"
#include "kda/kernels/gemm/router_gemm_isa.h"

namespace kda::kernels::gemm {

namespace {

void check(const float* x, int64_t T, int64_t D, const float* packed, int64_t E, const float* y,
           const char* who) {
  if (T < 0 || D < 1 || E < 1)
    throw std::invalid_argument(std::string(who) + ": " + std::to_string(T) + " rows of " +
                                std::to_string(D) + " inputs against " + std::to_string(E) +
                                " experts (rows >= 0, inputs and experts >= 1)");
  if (T > 0 && (x == nullptr || packed == nullptr || y == nullptr))
    throw std::invalid_argument(std::string(who) + ": a null input, weight or output pointer");
}

}  // namespace

void pack_router(const float* w, int64_t E, int64_t D, float* packed) {
  if (E < 1 || D < 1 || w == nullptr || packed == nullptr)
    throw std::invalid_argument("pack_router: " + std::to_string(E) + " experts of " + std::to_string(D) +
                                " inputs (both >= 1, non-null buffers)");
  for (int64_t e0 = 0; e0 < E; e0 += kRouterBlock) {
    const int64_t width = std::min(kRouterBlock, E - e0);
    float* b = packed + e0 * D;
    for (int64_t j = 0; j < width; ++j)
      for (int64_t d = 0; d < D; ++d) b[d * width + j] = w[(e0 + j) * D + d];
  }
}

std::vector<float> pack_router(const std::vector<float>& w, int64_t E, int64_t D) {
  if (E < 1 || D < 1 || static_cast<int64_t>(w.size()) != E * D)
    throw std::invalid_argument("pack_router: " + std::to_string(w.size()) + " weights for " +
                                std::to_string(E) + " experts of " + std::to_string(D) + " inputs");
  std::vector<float> p(w.size());
  pack_router(w.data(), E, D, p.data());
  return p;
}

void router_logits(const float* x, int64_t T, int64_t D, const float* packed, int64_t E, float* y) {
  check(x, T, D, packed, E, y, "router_logits");
  if (T == 0) return;
  switch (best_isa()) {
#if defined(KDA_WITH_AVX512)
    case Isa::Avx512:
      return avx512::router_logits(x, T, D, packed, E, y);
#endif
#if defined(KDA_WITH_AVX2)
    case Isa::Avx2:
      return avx2::router_logits(x, T, D, packed, E, y);
#endif
    default:
      return portable::router_logits(x, T, D, packed, E, y);
  }
}

void router_logits_reference(const float* x, int64_t T, int64_t D, const float* packed, int64_t E, float* y) {
  check(x, T, D, packed, E, y, "router_logits_reference");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t e0 = e / kRouterBlock * kRouterBlock, width = std::min(kRouterBlock, E - e0);
      const float* col = packed + e0 * D + (e - e0);
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc = std::fma(x[t * D + d], col[d * width], acc);
      y[t * E + e] = acc;
    }
}

}  // namespace kda::kernels::gemm
