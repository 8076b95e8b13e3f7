// An engine's view of the installed library, through the public headers only: one KDA layer of a
// checkpoint on one case (config, checkpoint, layer, pools, batch, backend) against the case's float64
// output; prefix caching (a radix cache snapshot taken in the middle of that EXTEND, matched by a second
// request that resumes from it); and a quantized projection against its own dequantized weights in double.
// Usage: kda_consumer DUMPS_DIR CASE.npz; exit 0 when every check holds.
#include <kda/common/precision.h>
#include <kda/common/weights.h>
#include <kda/io/config.h>
#include <kda/io/npy.h>
#include <kda/io/safetensors.h>
#include <kda/kernels/kda/kda.h>
#include <kda/layers/attention/linear/kda_backend.h>
#include <kda/layers/quant_linear.h>
#include <kda/mem_cache/memory_pool.h>
#include <kda/mem_cache/radix_cache.h>
#include <kda/model_executor/forward_batch_info.h>
#include <kda/models/kimi_linear.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numeric>
#include <span>
#include <stdexcept>
#include <vector>

namespace {

using kda::model_executor::ForwardBatch;

// Worst |out - ref| / (1e-5 + 1e-5 |ref|) over rows [r0, r0 + rows) of ref [*, D], out holding those rows.
double worst_ratio(const std::vector<float>& out, const std::vector<float>& ref, int64_t r0, int64_t D) {
  double worst = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double b = ref[static_cast<size_t>(r0 * D) + i];
    worst = std::max(worst, std::fabs(double(out[i]) - b) / (1e-5 + 1e-5 * std::fabs(b)));
  }
  return worst;
}

// The int8 projection y = x W^T against x W_q^T in double (W_q: the weights it quantized to): only the
// int16 activation rounding of its decode kernels and fp32 rounding stay. Returns the relative L2 error.
double quant_projection_error(const std::vector<float>& x, int64_t M, int64_t D) {
  const int64_t N = 96;
  std::vector<float> w(static_cast<size_t>(N * D));
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.05f * std::sin(0.37f * static_cast<float>(i));
  const kda::layers::QuantLinear proj(D, N, w, kda::Weights::Int8, kda::Precision::FP32);
  std::vector<float> y(static_cast<size_t>(M * N));
  proj.forward(x.data(), M, D, y.data(), N);
  const std::vector<float> wq = proj.dequantized();
  double err = 0.0, norm = 0.0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0.0;
      for (int64_t k = 0; k < D; ++k) ref += double(x[m * D + k]) * wq[n * D + k];
      const double d = y[m * N + n] - ref;
      err += d * d;
      norm += ref * ref;
    }
  return std::sqrt(err / norm);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DUMPS_DIR CASE.npz\n", argv[0]);
    return 2;
  }
  try {
    const auto cfg = kda::io::load_config(argv[1]);
    const kda::io::Checkpoint ckpt(argv[1]);
    auto layer = kda::models::KimiDeltaAttention::from_checkpoint(ckpt, cfg, 0, kda::Precision::FP32);
    const auto npz = kda::io::read_npz(argv[2]);
    const auto& hs = npz.at("hidden_states");
    const int64_t T = hs.shape[0], D = hs.shape[1];
    const std::vector<float> x = hs.to_f32(), ref = npz.at("out_fp32").to_f32();
    if (T < 2) throw std::invalid_argument("the case needs at least 2 tokens");

    // Three slots: request A, request B, A's snapshot.
    kda::mem_cache::RecurrentStatePoolConfig pc;
    pc.layer_ids = {0};
    pc.size = 3;
    pc.num_heads = cfg.num_heads;
    pc.head_k_dim = pc.head_v_dim = cfg.head_dim;
    pc.conv_kernel = cfg.short_conv_kernel_size;
    pc.conv_dim = 3 * cfg.projection_size();
    kda::mem_cache::MemoryPools pools(pc, 2);
    auto& pool = pools.recurrent_state_pool;
    kda::mem_cache::RadixCache cache(pool, pool.bytes_per_slot());
    kda::layers::attention::linear::KDAAttnBackend backend;
    // The case's rows stand for tokens 0..T-1.
    std::vector<int32_t> tokens(static_cast<size_t>(T));
    std::iota(tokens.begin(), tokens.end(), 0);
    const int64_t P = T / 2;

    // Request A: the whole case in one EXTEND, keeping the state after its first P tokens.
    const auto a = pools.req_to_token_pool.alloc(1);
    const auto snap = cache.reserve(tokens, P);
    if (!snap || !snap.created) throw std::runtime_error("the cache gave no snapshot slot");
    auto fb = ForwardBatch::extend(a, {static_cast<int32_t>(T)}, {0});
    fb.state_snapshots = {{0, static_cast<int32_t>(P), snap.slot}};
    fb.attn_backend = &backend;
    backend.init_forward_metadata(fb, pools.req_to_token_pool.get_recurrent_indices(a));
    std::vector<float> out(x.size());
    layer->forward(x.data(), T, fb, pool, out.data());
    cache.commit(snap.node);
    const double worst_a = worst_ratio(out, ref, 0, D);

    // Request B, the same prompt: resumes from the snapshot in its own slot and runs the rest.
    const auto m = cache.match_prefix(std::span<const int32_t>(tokens).first(static_cast<size_t>(T - 1)));
    if (m.hit.node != snap.node || m.hit.len != P) throw std::runtime_error("the snapshot was not matched");
    const auto b = pools.req_to_token_pool.alloc(1);
    cache.inc_lock_ref(m.hit.node);
    pool.copy_slot(m.hit.slot, pools.req_to_token_pool.slot_of(b[0]));
    cache.dec_lock_ref(m.hit.node);
    auto fb_b = ForwardBatch::extend(b, {static_cast<int32_t>(T - P)}, {static_cast<int32_t>(P)});
    fb_b.attn_backend = &backend;
    backend.init_forward_metadata(fb_b, pools.req_to_token_pool.get_recurrent_indices(b));
    std::vector<float> out_b(static_cast<size_t>((T - P) * D));
    layer->forward(x.data() + P * D, T - P, fb_b, pool, out_b.data());
    cache.check_invariants();
    const double worst_b = worst_ratio(out_b, ref, P, D);

    const int64_t M = std::min<int64_t>(T, 4);  // decode-sized: the integer kernels
    const double quant = quant_projection_error(x, M, D);

    std::printf(
        "kda_consumer: T=%lld D=%lld, worst |out - out_fp32| / (1e-5 + 1e-5|b|): one EXTEND %.4f, resumed "
        "from the snapshot at %lld %.4f; int8 projection rel L2 %.2e\n",
        static_cast<long long>(T), static_cast<long long>(D), worst_a, static_cast<long long>(P), worst_b,
        quant);
    return worst_a <= 1.0 && worst_b <= 1.0 && quant <= 7.5e-5 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_consumer: %s\n", e.what());
    return 1;
  }
}
