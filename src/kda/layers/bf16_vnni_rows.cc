#include "kda/layers/bf16_vnni_rows.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "kda/common/bf16.h"
#include "kda/common/weight_buffer.h"
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
  // W's columns repeat every 64, one block of the layout: each column still sums probe values of every
  // exponent, so a chunk that is not oneDNN's shows in every column, while W is drawn and reordered one
  // block's worth (the head's blocks are 29 K columns) and copied block after block into the layout,
  // whose 64-column blocks are contiguous; the last block reordered at its own width, so that its
  // padding columns are oneDNN's zeros.
  constexpr int64_t kBlock = 64;
  const std::vector<bf16_t> x = probe_values(M * K, 11);
  const std::vector<bf16_t> wt = probe_values(std::min(N, kBlock) * K, 7);
  auto block_of = [&](int64_t n) {  // [K, n] in the layout, n <= 64: one block's bytes, padding included
    const memory::desc md({K, n}, memory::data_type::bf16, memory::format_tag::BA16a64b2a);
    memory plain({{K, n}, memory::data_type::bf16, memory::dims{1, K}}, eng, const_cast<bf16_t*>(wt.data()));
    memory blk(md, eng);
    dnnl::reorder(plain, blk).execute(stream, plain, blk);
    stream.wait();
    const auto* p = static_cast<const uint8_t*>(blk.get_data_handle());
    return std::vector<uint8_t>(p, p + md.get_size());
  };
  const int64_t full = N / kBlock, tail = N % kBlock;
  const std::vector<uint8_t> body = block_of(std::min(N, kBlock));
  const size_t block_bytes = body.size();
  if (pd.weights_desc().get_size() != block_bytes * static_cast<size_t>(full + (tail > 0))) return -1;
  const WeightBuffer buf = allocate_weights(pd.weights_desc().get_size());
  auto* wb = static_cast<uint8_t*>(buf.get());
  for (int64_t b = 0; b < full; ++b) std::memcpy(wb + b * block_bytes, body.data(), block_bytes);
  if (tail > 0) {
    const std::vector<uint8_t> last = block_of(tail);
    if (last.size() != block_bytes) return -1;
    std::memcpy(wb + full * block_bytes, last.data(), block_bytes);
  }
  memory w(pd.weights_desc(), eng, buf.get());
  std::vector<float> want(static_cast<size_t>(M * N)), got(want.size());
  memory xs(src, eng, const_cast<bf16_t*>(x.data())), ys(dst, eng, want.data());
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
