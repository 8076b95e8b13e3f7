#include "kda/layers/bf16_vnni_rows.h"

#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/kernels/gemm/bf16_vnni.h"
#include "kda/layers/onednn_isa.h"

namespace kda::layers {

using dnnl::memory;

bool in_vnni_layout(const memory::desc& weights, int64_t K, int64_t N) {
  return weights == memory::desc({K, N}, memory::data_type::bf16, memory::format_tag::BA16a64b2a);
}

namespace {

// bf16 values of either sign with exponents over 2^-4 .. 2^3, so that the chunks' roundings show (a fixed
// generator: the probe must give the same answer in every process), made as bit patterns.
std::vector<bf16_t> probe_values(int64_t n, uint32_t seed) {
  std::vector<bf16_t> v(static_cast<size_t>(n));
  uint32_t s = seed;
  for (auto& b : v) {
    s = s * 1664525u + 1013904223u;
    const uint32_t sign = s >> 31, exp = 123u + (s >> 20 & 7u), mant = s >> 8 & 0x7Fu;
    b = static_cast<bf16_t>(sign << 15 | exp << 7 | mant);
  }
  return v;
}

int64_t probe(int64_t K, int64_t N) {
  if (!kernels::gemm::cpu_has_bf16_vnni() || onednn_bf16_uses_amx() || !kernels::gemm::bf16_vnni_takes(K) ||
      N < 1)
    return -1;
  constexpr int64_t M = 2;
  const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const memory::desc src({M, K}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc dst({M, N}, memory::data_type::f32, memory::format_tag::ab);
  const memory::desc any({K, N}, memory::data_type::bf16, memory::format_tag::any);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, any, dst), eng);
  if (!in_vnni_layout(pd.weights_desc(), K, N)) return -1;
  std::vector<bf16_t> wt = probe_values(N * K, 7), x = probe_values(M * K, 11);
  memory plain({{K, N}, memory::data_type::bf16, memory::dims{1, K}}, eng, wt.data());
  memory w(pd.weights_desc(), eng);
  dnnl::reorder(plain, w).execute(stream, plain, w);
  std::vector<float> want(static_cast<size_t>(M * N)), got(want.size());
  memory xs(src, eng, x.data()), ys(dst, eng, want.data());
  dnnl::matmul(pd).execute(stream, {{DNNL_ARG_SRC, xs}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, ys}});
  stream.wait();
  const auto* wp = static_cast<const bf16_t*>(w.get_data_handle());
  for (int64_t chunk = 16; chunk < 2 * K; chunk *= 2) {
    const int64_t c = chunk >= K ? 0 : chunk;
    kernels::gemm::gemm_bf16_vnni(x.data(), M, K, wp, K, N, got.data(), N, c);
    if (std::memcmp(got.data(), want.data(), sizeof(float) * want.size()) == 0) return c;
  }
  return -1;
}

}  // namespace

int64_t onednn_bf16_k_chunk(int64_t K, int64_t N) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, int64_t>, int64_t> found;
  std::lock_guard<std::mutex> lock(mu);
  auto it = found.find({K, N});
  if (it == found.end()) it = found.emplace(std::make_pair(K, N), probe(K, N)).first;
  return it->second;
}

}  // namespace kda::layers
