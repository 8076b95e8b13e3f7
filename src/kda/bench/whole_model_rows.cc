// `kda bench --only model`: the whole Kimi-Linear-48B-A3B decoder at its real shapes (synthetic weights,
// 27 layers or the first --layers, vocabulary 163840, --experts routed experts per MoE layer with the real
// top-8), per weights mode: a decode step of one request and of 16, and a 2048-token prefill, beside the
// ceilings the same run measures (read bandwidth for decode, the bf16 and fp32 GEMMs for prefill). One
// model is resident at a time: at the real shapes each is several GB.
//
// A decode step reads every weight it uses once: the attention projections, dense MLPs, routers, shared
// experts and the LM head, and per MoE layer the union of the experts its tokens selected (one request:
// its top-k; 16: each selected expert once for all the tokens routed to it). Its bound is those bytes /
// read bandwidth (per row, the best of the reads after each of its timed steps);
// decode_b1_over_bound and decode_b16_over_bound are the steps' times over their bounds.
// (The recurrent states, read and written once per request and KDA layer, are left out of that bound as
// the issue defines it; the b16 row gives them and the ratio with them.) At 16 rows a step multiplies
// enough that its GEMMs may take longer than its reads on a CPU of few cores: decode_b16_floor_ms is the
// least time the same run's two ceilings allow it (decode_floor below), decode_b16_floor_over_bound how
// far above the read bound that puts it, and decode_b16_over_floor how close the step comes. --rounds
// repeats the decode measurements, each round held to its own minutes' read ceiling: the row's figures
// are the medians over the rounds, decode_rounds gives each round's and decode_spread their ranges. The
// prefill's GEMM work is 2 x T x (the weights a token multiplies) plus the MLA layers' attention scores (QK^T
// and PV over the causal half); prefill_over_gemm is its rate over the same run's GEMM ceiling of the
// precision its GEMMs run in: bf16 with bf16 weights; with int8 / int4 ones the precision of QuantLinear's
// prefill path on this CPU (QuantLinear::prefill_path_for: weight tiles widened to bf16 for oneDNN's bf16
// matmul where it is native, else dequantized fp32 tiles by fp32 activations). Where a step is far from its
// bound the parts are timed alone at the same shapes (the MoE and dense MLPs, the LM head; the rest is
// attention, norms and the residual stream) so the report says where the time goes.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kda/bench/ceilings.h"
#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/layers/quant_linear.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/models/kimi_moe.h"
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

// The weights a step of `batch` decode rows read (total): what one token reads, with each MoE layer's
// router, shared expert and top-k experts replaced by those its last forward read (the union of its
// selections, KimiMoE::last_weight_bytes; their sum: moe), and an embedding row per token.
struct StepBytes {
  int64_t total = 0, moe = 0;
};
StepBytes step_weight_bytes(models::KimiLinearForCausalLM& m, int64_t batch) {
  StepBytes b;
  b.total =
      m.active_weight_bytes() + (batch - 1) * m.hidden_size() * (m.precision() == Precision::BF16 ? 2 : 4);
  for (int i = 0; i < m.num_layers(); ++i)
    if (auto* e = m.model().layer(i).moe()) {
      b.total += e->last_weight_bytes() - e->active_weight_bytes();
      b.moe += e->last_weight_bytes();
    }
  return b;
}

// The recurrent and conv states of one request, every KDA layer: read and written once per decode step.
int64_t request_state_bytes(const models::KimiLinearForCausalLM& m) {
  const mem_cache::RecurrentStatePoolConfig c = m.recurrent_pool_config(1);
  const int64_t conv = (c.conv_kernel - 1) * c.conv_dim * (c.conv_dtype == Precision::BF16 ? 2 : 4);
  return static_cast<int64_t>(c.layer_ids.size()) *
         (int64_t{c.num_heads} * c.head_k_dim * c.head_v_dim * 4 + conv);
}

// The decode step of `steps` that came closest to its bound: its seconds, the weight bytes it read, and
// those of its MoE layers.
struct DecodeStep {
  double seconds = 1e30;
  int64_t bytes = 0, moe_bytes = 0;
};

// The least seconds a decode step of `batch` rows can take on a machine of these ceilings, as a roofline
// per part: the LM head, the MoE layers (routers, shared and selected experts) and the rest (attention
// projections, dense MLPs, norms, embedding rows), each at least its multiply-adds at the bf16 GEMM
// ceiling (2 FLOPs a weight a row; the quantized kernels multiply bf16 or int16 activations, at that
// rate at most) and at least its bytes at the read ceiling, one after the other (each part needs the one
// before's output), plus the states read and written. Within a part compute and reads are taken as
// overlapped perfectly, and MLA's scores over the context are left out: on a steady machine no step is
// faster (a shared host's bandwidth phases can put a step under it, as they can under the bound).
double decode_floor(models::KimiLinearForCausalLM& m, const io::KimiLinearConfig& cfg, int64_t batch,
                    const DecodeStep& s, int64_t state_bytes, double gemm_gflops, double read_gbs) {
  const double D = static_cast<double>(m.hidden_size()), rows = static_cast<double>(batch);
  const double head_params = static_cast<double>(m.vocab_size()) * D;
  double moe_params = 0.0;  // per token
  for (int i = 0; i < m.num_layers(); ++i)
    if (const auto* e = m.model().layer(i).moe())
      moe_params += static_cast<double>(models::kimi_moe_active_params(cfg, e->num_experts()));
  const double rest_params = static_cast<double>(m.active_params()) - head_params - moe_params;
  const double head_bytes = static_cast<double>(m.head_weight_bytes());
  const double moe_bytes = static_cast<double>(s.moe_bytes);
  const double rest_bytes = static_cast<double>(s.bytes) - head_bytes - moe_bytes;
  const auto part = [&](double params, double bytes) {
    return std::max(2.0 * rows * params / (gemm_gflops * 1e9), bytes / (read_gbs * 1e9));
  };
  return part(head_params, head_bytes) + part(moe_params, moe_bytes) + part(rest_params, rest_bytes) +
         2.0 * static_cast<double>(state_bytes) / (read_gbs * 1e9);
}

// `steps` decode steps of `batch` requests that each already hold `context` tokens, each appending a token
// to every request; the one with the least seconds per byte read. After each step, one pass of `rb` (not
// timed with the step): *read_s becomes the least of its seconds and those passes', so that the ceiling a
// row is held to is sampled over the same minutes as its steps (a shared host's bandwidth moves in
// phases, and a ceiling measured at the start of a run held its rows to another phase's:
// docs/performance.md, "Issue 28's table on host B").
DecodeStep time_decode(models::KimiLinearForCausalLM& m, int64_t batch, int64_t context, int steps,
                       ReadBandwidth& rb, double* read_s) {
  Runner r(m, batch, batch * (context + steps + 1));
  const auto reqs = r.pools->req_to_token_pool.alloc(batch);
  r.ids = token_ids(batch * context, m.vocab_size(), 1);
  auto pre = model_executor::ForwardBatch::extend(
      reqs, std::vector<int32_t>(static_cast<size_t>(batch), static_cast<int32_t>(context)),
      std::vector<int32_t>(static_cast<size_t>(batch), 0));
  r.step(pre, batch);
  DecodeStep best;
  for (int s = 0; s < steps; ++s) {
    r.ids = token_ids(batch, m.vocab_size(), s + 2);
    auto fb = model_executor::ForwardBatch::decode(reqs);
    const auto t0 = Clock::now();
    r.step(fb, batch);
    const double t = since(t0);
    const StepBytes bytes = step_weight_bytes(m, batch);
    if (t / static_cast<double>(bytes.total) <
        best.seconds / static_cast<double>(std::max<int64_t>(best.bytes, 1)))
      best = {t, bytes.total, bytes.moe};
    const auto t_read = Clock::now();
    rb.run();
    *read_s = std::min(*read_s, since(t_read));
  }
  return best;
}

// One round of a row's decode measurements: batch 1 and batch 16, each held to the read ceiling sampled
// between its own steps (a phase can turn between the two). A shared host's bandwidth moves in phases
// minutes long; rounds one after the other show how far a ratio moves with them (the issue asks for the
// spread run after run).
struct DecodeRound {
  double read_gbs = 0, read16_gbs = 0, b1_ms = 0, b1_over_bound = 0, b16_ms = 0, b16_over_bound = 0,
         b16_over_bound_state = 0, floor_ms = 0, floor_over_bound = 0, over_floor = 0;
  DecodeStep s16;
};

// A round's figures under their JSON keys: the row gives each one's median over the rounds,
// decode_rounds each round's, and decode_spread the [least, greatest] of the ratios and read ceilings.
struct RoundField {
  const char* key;
  double DecodeRound::*field;
  bool in_spread;
};
constexpr RoundField kRoundFields[] = {
    {"read_bandwidth_gbs", &DecodeRound::read_gbs, true},
    {"read_bandwidth_b16_gbs", &DecodeRound::read16_gbs, true},
    {"model_decode_b1_ms", &DecodeRound::b1_ms, false},
    {"decode_b1_over_bound", &DecodeRound::b1_over_bound, true},
    {"model_decode_b16_ms", &DecodeRound::b16_ms, false},
    {"decode_b16_over_bound", &DecodeRound::b16_over_bound, true},
    {"decode_b16_over_bound_with_state", &DecodeRound::b16_over_bound_state, false},
    {"decode_b16_floor_ms", &DecodeRound::floor_ms, false},
    {"decode_b16_floor_over_bound", &DecodeRound::floor_over_bound, true},
    {"decode_b16_over_floor", &DecodeRound::over_floor, true},
};

DecodeRound decode_round(models::KimiLinearForCausalLM& m, const io::KimiLinearConfig& cfg, int64_t context,
                         int64_t batch, ReadBandwidth& rb, double gemm_bf16) {
  DecodeRound r;
  double read1_s = 1e30, read16_s = 1e30;
  // Enough steps that a few of them meet a quiet moment on a shared host.
  const DecodeStep s1 = time_decode(m, 1, context, 24, rb, &read1_s);
  r.s16 = time_decode(m, batch, context / 4, 12, rb, &read16_s);
  r.read_gbs = rb.gbps(read1_s);
  r.read16_gbs = rb.gbps(read16_s);
  const double bound = static_cast<double>(m.active_weight_bytes()) / (r.read_gbs * 1e9);
  const double bound16 = static_cast<double>(r.s16.bytes) / (r.read16_gbs * 1e9);
  const int64_t state16 = batch * request_state_bytes(m);
  const double floor16 = decode_floor(m, cfg, batch, r.s16, state16, gemm_bf16, r.read16_gbs);
  r.b1_ms = s1.seconds * 1e3;
  r.b1_over_bound = s1.seconds / bound;
  r.b16_ms = r.s16.seconds * 1e3;
  r.b16_over_bound = r.s16.seconds / bound16;
  r.b16_over_bound_state =
      r.s16.seconds / (static_cast<double>(r.s16.bytes + 2 * state16) / (r.read16_gbs * 1e9));
  r.floor_ms = floor16 * 1e3;
  r.floor_over_bound = floor16 / bound16;
  r.over_floor = r.s16.seconds / floor16;
  return r;
}

// The median of the rounds' values of one field (the mean of the middle two for an even count).
double median_of(const std::vector<DecodeRound>& rounds, double DecodeRound::*field) {
  std::vector<double> v;
  for (const DecodeRound& r : rounds) v.push_back(r.*field);
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::pair<double, double> range_of(const std::vector<DecodeRound>& rounds, double DecodeRound::*field) {
  double lo = 1e300, hi = -1e300;
  for (const DecodeRound& r : rounds) {
    lo = std::min(lo, r.*field);
    hi = std::max(hi, r.*field);
  }
  return {lo, hi};
}

int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// A prefill of T tokens (one request, a fresh one each time), the LM head on its last row: the first
// run's seconds and page faults (the model's first prefill at that size: what a server's first request
// meets; the output rows sized beforehand, as the engine's are) and the best of `reps` with the faults of
// the second.
struct PrefillTimes {
  double first = 0.0, best = 1e30;
  int64_t first_faults = 0, second_faults = 0;
};
PrefillTimes time_prefill(models::KimiLinearForCausalLM& m, int64_t T, int reps) {
  Runner r(m, 1, T);
  r.ids = token_ids(T, m.vocab_size(), 3);
  r.h.resize(static_cast<size_t>(T * m.hidden_size()));
  PrefillTimes t;
  for (int i = 0; i < reps; ++i) {
    const auto reqs = r.pools->req_to_token_pool.alloc(1);
    auto fb = model_executor::ForwardBatch::extend(reqs, {static_cast<int32_t>(T)}, {0});
    const int64_t f0 = minor_faults();
    const auto t0 = Clock::now();
    r.step(fb, 1);
    const double s = since(t0);
    if (i == 0) t.first = s, t.first_faults = minor_faults() - f0;
    if (i == 1) t.second_faults = minor_faults() - f0;
    t.best = std::min(t.best, s);
    r.pools->req_to_token_pool.free(reqs);
  }
  return t;
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
  if (o.layers < 0 || o.layers > cfg.num_hidden_layers)
    throw std::invalid_argument("--layers " + std::to_string(o.layers) + ": the model has " +
                                std::to_string(cfg.num_hidden_layers) + " decoder layers");
  const int layers = models::model_layer_count(cfg, o.layers);
  constexpr int64_t kPrefill = 2048, kContext = 256, kBatch = 16;
  std::vector<Weights> modes;
  for (Weights w : {Weights::BF16, Weights::Int8, Weights::Int4})
    if (o.weights == "all" || o.weights == to_string(w)) modes.push_back(w);

  // The ceilings of this run: read bandwidth over a buffer far larger than the caches, the bf16 and fp32
  // GEMMs at the prefill's row count through the Linear the model's projections use.
  ReadBandwidth rb(size_t{1} << 30);
  const double read_gbs = rb.gbps(best_seconds([&] { rb.run(); }, 5, 1.0));
  GemmCeiling c16(Precision::BF16, kPrefill, kP, kD), c32(Precision::FP32, kPrefill, kP, kD);
  double gemm_bf16 = c16.gflops(best_seconds([&] { c16.run(); }));
  double gemm_f32 = c32.gflops(best_seconds([&] { c32.run(); }));
  j["ceilings"] = {
      {"read_bandwidth_gbs", read_gbs}, {"gemm_bf16_gflops", gemm_bf16}, {"gemm_f32_gflops", gemm_f32}};
  say("\nwhole model (Kimi-Linear-48B-A3B shapes, %d layers, top-%d of %d experts, vocab %lld); ceilings: "
      "read %.1f GB/s, bf16 GEMM %.1f GFLOP/s, fp32 GEMM %.1f GFLOP/s\n",
      layers, cfg.num_experts_per_token, experts, static_cast<long long>(cfg.vocab_size), read_gbs, gemm_bf16,
      gemm_f32);
  say("%-8s %10s %12s %10s %9s %11s %10s %12s %10s %9s\n", "weights", "build s", "active GB", "b1 ms",
      "b1/bound", "b16 ms", "b16/bound", "prefill t/s", "% GEMM", "GB res.");
  j["model"] = nlohmann::json::array();
  for (const Weights w : modes) {
    models::ModelOptions mo;
    mo.precision = Precision::BF16;
    mo.weights = w;
    mo.num_experts = experts;
    mo.num_layers = layers;
    const auto t0 = Clock::now();
    auto m = models::KimiLinearForCausalLM::synthetic(cfg, mo, 7);
    const double build_s = since(t0);
    // The workspaces of a kPrefill-token step, sized at load as the engine sizes them for its token budget.
    const auto t_reserve = Clock::now();
    m->reserve(kPrefill);
    const double reserve_s = since(t_reserve);
    const int64_t active = m->active_weight_bytes();
    // The GEMM ceilings sampled again in this row's minutes: each row is held to the best seen so far. A
    // shared host's other tenants can hold one sampling well under the cores' rate (a prefill then read
    // above "its" ceiling).
    gemm_bf16 = std::max(gemm_bf16, c16.gflops(best_seconds([&] { c16.run(); }, 3, 0.0)));
    gemm_f32 = std::max(gemm_f32, c32.gflops(best_seconds([&] { c32.run(); }, 3, 0.0)));
    std::vector<DecodeRound> rounds;
    for (int r = 0; r < o.rounds; ++r)
      rounds.push_back(decode_round(*m, cfg, kContext, kBatch, rb, gemm_bf16));
    // The row's figures: each the median over the rounds (with one round, that round's).
    const auto median = [&](double DecodeRound::*field) { return median_of(rounds, field); };
    const double row_gbs = median(&DecodeRound::read_gbs);
    const double b1 = median(&DecodeRound::b1_ms) / 1e3, b16 = median(&DecodeRound::b16_ms) / 1e3;
    // The bytes of the first round's batch-16 step (each round's best step reads its own union of experts).
    const DecodeStep& s16 = rounds.front().s16;
    const int64_t state16 = kBatch * request_state_bytes(*m);
    const PrefillTimes pt = time_prefill(*m, kPrefill, 3);
    const double pre = pt.best;
    const double flops = prefill_flops(cfg, m->num_layers(), kPrefill, m->vocab_size());
    const double frac = flops / pre / 1e9 / gemm_bf16;
    // The ceiling of the precision the prefill's GEMMs run in (see the top of this file).
    const bool f32_gemm = w != Weights::BF16 && layers::QuantLinear::prefill_path_for(w, Precision::BF16) ==
                                                    layers::QuantLinear::Prefill::Fp32Tiles;
    const double over_gemm = flops / pre / 1e9 / (f32_gemm ? gemm_f32 : gemm_bf16);
    nlohmann::json row = {{"weights", to_string(w)},
                          {"experts", experts},
                          {"build_s", build_s},
                          {"weight_bytes", m->weight_bytes()},
                          {"active_weight_bytes", active},
                          {"active_params", m->active_params()},
                          {"gemm_bf16_gflops", gemm_bf16},
                          {"gemm_f32_gflops", gemm_f32},
                          {"decode_b16_weight_bytes", s16.bytes},
                          {"decode_b16_state_bytes", state16},
                          {"model_prefill_tok_s", static_cast<double>(kPrefill) / pre},
                          {"prefill_first_s", pt.first},
                          {"prefill_first_over_best", pt.first / pre},
                          {"prefill_first_faults", pt.first_faults},
                          {"prefill_second_faults", pt.second_faults},
                          {"reserve_s", reserve_s},
                          {"prefill_gflops", flops / pre / 1e9},
                          {"prefill_gemm_fraction", frac},
                          {"prefill_gemm_ceiling", f32_gemm ? "fp32" : "bf16"},
                          {"prefill_over_gemm", over_gemm}};
    row["decode_rounds"] = nlohmann::json(rounds.size(), nlohmann::json::object());
    row["decode_spread"] = nlohmann::json::object();
    for (const RoundField& f : kRoundFields) {
      row[f.key] = median(f.field);
      for (size_t i = 0; i < rounds.size(); ++i) row["decode_rounds"][i][f.key] = rounds[i].*f.field;
      if (f.in_spread) {
        const auto [lo, hi] = range_of(rounds, f.field);
        row["decode_spread"][f.key] = {lo, hi};
      }
    }
    say("%-8s %10.1f %12.3f %10.1f %9.2f %11.1f %10.2f %12.1f %9.0f%% %9.2f\n", to_string(w), build_s,
        static_cast<double>(active) / 1e9, b1 * 1e3, median(&DecodeRound::b1_over_bound), b16 * 1e3,
        median(&DecodeRound::b16_over_bound), static_cast<double>(kPrefill) / pre, 100 * over_gemm,
        static_cast<double>(m->weight_bytes()) / 1e9);
    if (rounds.size() > 1) {
      const auto [r0, r1] = range_of(rounds, &DecodeRound::read_gbs);
      const auto [a0, a1] = range_of(rounds, &DecodeRound::b1_over_bound);
      const auto [c0, c1] = range_of(rounds, &DecodeRound::b16_over_bound);
      const auto [f0, f1] = range_of(rounds, &DecodeRound::over_floor);
      say("%-8s   %zu decode rounds (medians above): read %.1f-%.1f GB/s, b1/bound %.2f-%.2f, b16/bound "
          "%.2f-%.2f, b16/floor %.2f-%.2f\n",
          "", rounds.size(), r0, r1, a0, a1, c0, c1, f0, f1);
    }
    // Where the time goes: the MLPs and the LM head alone at the decode (1 row) and prefill shapes.
    const Parts d1 = time_parts(*m, 1, 1, 5);
    const Parts d16 = time_parts(*m, kBatch, kBatch, 3);
    const Parts pf = time_parts(*m, kPrefill, 1, 1);
    row["parts"] = {{"decode_b1_moe_ms", d1.moe * 1e3},
                    {"decode_b1_dense_mlp_ms", d1.dense * 1e3},
                    {"decode_b1_lm_head_ms", d1.head * 1e3},
                    {"decode_b1_attention_and_rest_ms", (b1 - d1.moe - d1.dense - d1.head) * 1e3},
                    {"decode_b16_moe_ms", d16.moe * 1e3},
                    {"decode_b16_dense_mlp_ms", d16.dense * 1e3},
                    {"decode_b16_lm_head_ms", d16.head * 1e3},
                    {"decode_b16_attention_and_rest_ms", (b16 - d16.moe - d16.dense - d16.head) * 1e3},
                    {"prefill_moe_ms", pf.moe * 1e3},
                    {"prefill_dense_mlp_ms", pf.dense * 1e3},
                    {"prefill_attention_and_rest_ms", (pre - pf.moe - pf.dense - pf.head) * 1e3}};
    say("%-8s   decode b1 parts: MoE %.1f ms, dense MLP %.1f ms, LM head %.1f ms, attention + rest %.1f ms; "
        "b16: MoE %.1f ms, dense MLP %.1f ms, LM head %.1f ms, attention + rest %.1f ms (%.2f GB of weights, "
        "%.2f GB of states; with them b16/bound %.2f; the ceilings' floor %.1f ms: %.2f x the bound, "
        "the step %.2f x it); prefill: MoE %.0f ms, dense MLP %.0f ms, attention + rest %.0f ms (%s GEMM "
        "ceiling); decode held to %.1f GB/s\n",
        "", d1.moe * 1e3, d1.dense * 1e3, d1.head * 1e3, (b1 - d1.moe - d1.dense - d1.head) * 1e3,
        d16.moe * 1e3, d16.dense * 1e3, d16.head * 1e3, (b16 - d16.moe - d16.dense - d16.head) * 1e3,
        static_cast<double>(s16.bytes) / 1e9, static_cast<double>(state16) / 1e9,
        median(&DecodeRound::b16_over_bound_state), median(&DecodeRound::floor_ms),
        median(&DecodeRound::floor_over_bound), median(&DecodeRound::over_floor), pf.moe * 1e3,
        pf.dense * 1e3, (pre - pf.moe - pf.dense - pf.head) * 1e3, f32_gemm ? "fp32" : "bf16", row_gbs);
    j["model"].push_back(row);
  }
}

}  // namespace kda::bench
