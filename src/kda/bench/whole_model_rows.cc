// `kda bench --only model`: the whole Kimi-Linear-48B-A3B decoder at its real shapes (synthetic weights,
// 27 layers, vocabulary 163840, --experts routed experts per MoE layer with the real top-8), per weights
// mode: a decode step of one request and of 16, and a 2048-token prefill, beside the ceilings the same
// run measures (read bandwidth for decode, the bf16 GEMM for prefill). One model is resident at a time:
// at the real shapes each is several GB.
//
// A decode step of one request reads every active weight once (the selected experts, the attention
// projections, the LM head), so its floor is active_weight_bytes / read bandwidth; decode_b1_over_bound is
// the step's time over that floor. The prefill's GEMM work is 2 x T x (the weights a token multiplies)
// plus the MLA layers' attention scores (QK^T and PV over the causal half); its rate over the bf16 GEMM
// ceiling says how far the model's prefill is from GEMM-bound. Where the step is far from its floor the
// parts are timed alone at the same shapes (the MoE and dense MLPs, the LM head; the rest is attention,
// norms and the residual stream) so the report says where the time goes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kda/bench/ceilings.h"
#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/serving/simulate.h"

namespace kda::bench {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// GEMM FLOPs of a prefill of T tokens: every weight a token multiplies (the attention projections, the
// dense MLP or the top-k and shared experts, not the router's few columns nor the embedding lookup), the
// LM head on the last row only, and the MLA scores and values over the causal half (plain form:
// QK^T over dn + dr, PV over dv per head).
double prefill_flops(const io::KimiLinearConfig& c, int layers, int64_t T, int64_t vocab) {
  const double D = static_cast<double>(c.hidden_size), P = c.projection_size(), K = c.head_dim;
  const double H = c.num_heads;
  const double Hm = c.num_attention_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
               dv = c.v_head_dim, R = c.kv_lora_rank;
  // KDA: q, k, v [P, D]; the gate's low-rank pair f_a [K, D], f_b [P, K]; beta b_proj [H, D]; the output
  // gate g_a [K, D], g_b [P, K]; o_proj [D, P].
  const double kda = 3 * P * D + (K * D + P * K) * 2 + H * D + D * P;
  // MLA: q_proj [Hm (dn + dr), D], kv_a [R + dr, D], kv_b [Hm (dn + dv), R], o_proj [D, Hm dv].
  const double mla = Hm * (dn + dr) * D + (R + dr) * D + Hm * (dn + dv) * R + D * Hm * dv;
  const double dense = 3 * D * static_cast<double>(c.intermediate_size);
  const double moe =
      3 * D * static_cast<double>(c.moe_intermediate_size) * (c.num_experts_per_token + c.num_shared_experts);
  double per_token = 0.0, attn = 0.0;
  const double t = static_cast<double>(T);
  for (int i = 0; i < layers; ++i) {
    if (c.is_mla_layer(i)) {
      per_token += mla;
      attn += 2.0 * Hm * (t * (t + 1) / 2) * (dn + dr + dv);
    } else {
      per_token += kda;
    }
    per_token += c.is_moe_layer(i) ? moe : dense;
  }
  return 2.0 * t * per_token + attn + 2.0 * D * static_cast<double>(vocab);
}

// One model's pools and requests for the timed steps.
struct Runner {
  models::KimiLinearForCausalLM* m;
  std::unique_ptr<mem_cache::MemoryPools> pools;
  std::vector<float> h, logits;
  std::vector<int32_t> ids;

  Runner(models::KimiLinearForCausalLM& model, int64_t requests, int64_t kv_tokens)
      : m(&model), pools(model.make_pools(requests, kv_tokens)) {}

  // One step over fb's rows with token ids `ids` (T of them), then the LM head on each row's last token.
  void step(model_executor::ForwardBatch& fb, int64_t rows_for_head) {
    const int64_t T = fb.num_tokens(), D = m->hidden_size();
    h.resize(static_cast<size_t>(T * D));
    m->forward(ids.data(), T, fb, *pools, h.data());
    logits.resize(static_cast<size_t>(rows_for_head * m->vocab_size()));
    m->compute_logits(h.data() + (T - rows_for_head) * D, rows_for_head, logits.data());
  }
};

std::vector<int32_t> token_ids(int64_t n, int64_t vocab, int64_t salt) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>((i * 7919 + salt * 104729 + 17) % vocab);
  return v;
}

// Best seconds of a decode step of `batch` requests that each already hold `context` tokens: `steps`
// steps, each appending a token to every request.
double time_decode(models::KimiLinearForCausalLM& m, int64_t batch, int64_t context, int steps) {
  Runner r(m, batch, batch * (context + steps + 1));
  const auto reqs = r.pools->req_to_token_pool.alloc(batch);
  r.ids = token_ids(batch * context, m.vocab_size(), 1);
  auto pre = model_executor::ForwardBatch::extend(
      reqs, std::vector<int32_t>(static_cast<size_t>(batch), static_cast<int32_t>(context)),
      std::vector<int32_t>(static_cast<size_t>(batch), 0));
  r.step(pre, batch);
  double best = 1e30;
  for (int s = 0; s < steps; ++s) {
    r.ids = token_ids(batch, m.vocab_size(), s + 2);
    auto fb = model_executor::ForwardBatch::decode(reqs);
    const auto t0 = Clock::now();
    r.step(fb, batch);
    best = std::min(best, since(t0));
  }
  return best;
}

// Best seconds of a prefill of T tokens (one request, a fresh one each time), the LM head on its last row.
double time_prefill(models::KimiLinearForCausalLM& m, int64_t T, int reps) {
  Runner r(m, 1, T);
  r.ids = token_ids(T, m.vocab_size(), 3);
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto reqs = r.pools->req_to_token_pool.alloc(1);
    auto fb = model_executor::ForwardBatch::extend(reqs, {static_cast<int32_t>(T)}, {0});
    const auto t0 = Clock::now();
    r.step(fb, 1);
    best = std::min(best, since(t0));
    r.pools->req_to_token_pool.free(reqs);
  }
  return best;
}

// The parts of a step at `T` tokens timed alone on seeded inputs: every MoE layer, every dense MLP, the
// LM head on `head_rows` rows. Seconds each (best of `reps`).
struct Parts {
  double moe = 0, dense = 0, head = 0;
};
Parts time_parts(models::KimiLinearForCausalLM& m, int64_t T, int64_t head_rows, int reps) {
  const int64_t D = m.hidden_size();
  std::vector<float> x = bench_randn(static_cast<size_t>(T * D), 11, 1.0f), y(x.size());
  std::vector<float> logits(static_cast<size_t>(head_rows * m.vocab_size()));
  auto best = [&](const std::function<void()>& f) {
    double b = 1e30;
    for (int i = 0; i < reps; ++i) {
      const auto t0 = Clock::now();
      f();
      b = std::min(b, since(t0));
    }
    return b;
  };
  Parts p;
  auto& model = m.model();
  p.moe = best([&] {
    for (int i = 0; i < model.num_layers(); ++i)
      if (auto* e = model.layer(i).moe()) e->forward(x.data(), T, y.data());
  });
  p.dense = best([&] {
    for (int i = 0; i < model.num_layers(); ++i)
      if (auto* d = model.layer(i).mlp()) d->forward(x.data(), T, y.data());
  });
  p.head = best([&] { m.compute_logits(x.data(), head_rows, logits.data()); });
  return p;
}

}  // namespace

void bench_model(const RowOptions& o, nlohmann::json& j, const Say& say) {
  const io::KimiLinearConfig cfg = io::kimi_linear_48b_config();
  const int experts = o.experts > 0 ? o.experts : serving::kDefaultExperts;
  if (experts > cfg.num_experts)
    throw std::invalid_argument("--experts " + std::to_string(experts) + ": the model has " +
                                std::to_string(cfg.num_experts) + " routed experts per MoE layer");
  constexpr int64_t kPrefill = 2048, kContext = 256, kBatch = 16;
  std::vector<Weights> modes;
  for (Weights w : {Weights::BF16, Weights::Int8, Weights::Int4})
    if (o.weights == "all" || o.weights == to_string(w)) modes.push_back(w);

  // The ceilings of this run: read bandwidth over a buffer far larger than the caches, the bf16 GEMM at
  // the prefill's row count through the Linear the model's projections use.
  ReadBandwidth rb(size_t{1} << 30);
  const double read_gbs = rb.gbps(best_seconds([&] { rb.run(); }, 5, 1.0));
  double gemm_bf16 = 0.0;
  {
    GemmCeiling c16(Precision::BF16, kPrefill, kP, kD);
    gemm_bf16 = c16.gflops(best_seconds([&] { c16.run(); }));
  }
  j["ceilings"] = {{"read_bandwidth_gbs", read_gbs}, {"gemm_bf16_gflops", gemm_bf16}};
  say("\nwhole model (Kimi-Linear-48B-A3B shapes, %d layers, top-%d of %d experts, vocab %lld); ceilings: "
      "read %.1f GB/s, bf16 GEMM %.1f GFLOP/s\n",
      cfg.num_hidden_layers, cfg.num_experts_per_token, experts, static_cast<long long>(cfg.vocab_size),
      read_gbs, gemm_bf16);
  say("%-8s %10s %12s %10s %12s %11s %12s %10s %9s\n", "weights", "build s", "active GB", "b1 ms", "b1/bound",
      "b16 ms", "prefill t/s", "% GEMM", "GB res.");
  j["model"] = nlohmann::json::array();
  for (const Weights w : modes) {
    models::ModelOptions mo;
    mo.precision = Precision::BF16;
    mo.weights = w;
    mo.num_experts = experts;
    const auto t0 = Clock::now();
    auto m = models::KimiLinearForCausalLM::synthetic(cfg, mo, 7);
    const double build_s = since(t0);
    const int64_t active = m->active_weight_bytes();
    const double b1 = time_decode(*m, 1, kContext, 8);
    const double b16 = time_decode(*m, kBatch, kContext / 4, 4);
    const double pre = time_prefill(*m, kPrefill, 2);
    const double bound = static_cast<double>(active) / (read_gbs * 1e9);
    const double flops = prefill_flops(cfg, m->num_layers(), kPrefill, m->vocab_size());
    const double frac = flops / pre / 1e9 / gemm_bf16;
    nlohmann::json row = {{"weights", to_string(w)},
                          {"experts", experts},
                          {"build_s", build_s},
                          {"weight_bytes", m->weight_bytes()},
                          {"active_weight_bytes", active},
                          {"active_params", m->active_params()},
                          {"read_bandwidth_gbs", read_gbs},
                          {"model_decode_b1_ms", b1 * 1e3},
                          {"decode_b1_over_bound", b1 / bound},
                          {"model_decode_b16_ms", b16 * 1e3},
                          {"model_prefill_tok_s", static_cast<double>(kPrefill) / pre},
                          {"prefill_gflops", flops / pre / 1e9},
                          {"prefill_gemm_fraction", frac}};
    say("%-8s %10.1f %12.3f %10.1f %12.2f %11.1f %12.1f %9.0f%% %9.2f\n", to_string(w), build_s,
        static_cast<double>(active) / 1e9, b1 * 1e3, b1 / bound, b16 * 1e3,
        static_cast<double>(kPrefill) / pre, 100 * frac, static_cast<double>(m->weight_bytes()) / 1e9);
    // Where the time goes: the MLPs and the LM head alone at the decode (1 row) and prefill shapes.
    const Parts d1 = time_parts(*m, 1, 1, 5);
    const Parts pf = time_parts(*m, kPrefill, 1, 1);
    row["parts"] = {{"decode_b1_moe_ms", d1.moe * 1e3},
                    {"decode_b1_dense_mlp_ms", d1.dense * 1e3},
                    {"decode_b1_lm_head_ms", d1.head * 1e3},
                    {"decode_b1_attention_and_rest_ms", (b1 - d1.moe - d1.dense - d1.head) * 1e3},
                    {"prefill_moe_ms", pf.moe * 1e3},
                    {"prefill_dense_mlp_ms", pf.dense * 1e3},
                    {"prefill_attention_and_rest_ms", (pre - pf.moe - pf.dense - pf.head) * 1e3}};
    say("%-8s   decode b1 parts: MoE %.1f ms, dense MLP %.1f ms, LM head %.1f ms, attention + rest %.1f ms; "
        "prefill: MoE %.0f ms, dense MLP %.0f ms, attention + rest %.0f ms\n",
        "", d1.moe * 1e3, d1.dense * 1e3, d1.head * 1e3, (b1 - d1.moe - d1.dense - d1.head) * 1e3,
        pf.moe * 1e3, pf.dense * 1e3, (pre - pf.moe - pf.dense - pf.head) * 1e3);
    j["model"].push_back(row);
  }
}

}  // namespace kda::bench
