// An engine's view of the installed library: one KDA layer of a checkpoint on one case, through the
// public headers only (config, checkpoint, layer, pools, batch, backend), checked against the case's
// float64 output. Usage: kda_consumer DUMPS_DIR CASE.npz; exit 0 when within the fp32 tolerance.
#include <kda/io/config.h>
#include <kda/io/npy.h>
#include <kda/io/safetensors.h>
#include <kda/kernels/kda/kda.h>
#include <kda/layers/attention/linear/kda_backend.h>
#include <kda/mem_cache/memory_pool.h>
#include <kda/model_executor/forward_batch_info.h>
#include <kda/models/kimi_linear.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

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

    kda::mem_cache::RecurrentStatePoolConfig pc;
    pc.layer_ids = {0};
    pc.size = 1;
    pc.num_heads = cfg.num_heads;
    pc.head_k_dim = pc.head_v_dim = cfg.head_dim;
    pc.conv_kernel = cfg.short_conv_kernel_size;
    pc.conv_dim = 3 * cfg.projection_size();
    kda::mem_cache::MemoryPools pools(pc, 1);
    const auto reqs = pools.req_to_token_pool.alloc(1);
    const auto slots = pools.req_to_token_pool.get_recurrent_indices(reqs);
    kda::layers::attention::linear::KDAAttnBackend backend;
    auto fb = kda::model_executor::ForwardBatch::extend(reqs, {static_cast<int32_t>(T)}, {0});
    fb.attn_backend = &backend;
    backend.init_forward_metadata(fb, slots);
    std::vector<float> out(x.size());
    layer->forward(x.data(), T, fb, pools.recurrent_state_pool, out.data());

    double worst = 0.0;
    for (size_t i = 0; i < out.size(); ++i)
      worst = std::max(worst, std::fabs(double(out[i]) - ref[i]) / (1e-5 + 1e-5 * std::fabs(double(ref[i]))));
    std::printf("kda_consumer: T=%lld D=%lld, worst |out - out_fp32| / (1e-5 + 1e-5|b|) = %.4f\n",
                static_cast<long long>(T), static_cast<long long>(D), worst);
    return worst <= 1.0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_consumer: %s\n", e.what());
    return 1;
  }
}
