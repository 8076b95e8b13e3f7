// `kda bench --only kernels`, the MLA row: the plain-form MLA prefill attention of one 2048-token prompt
// at the real shapes (32 heads, R 512, dn 128, dr 64, dv 128), the flash-style kernel in fp32 and in the
// bf16 mode (bf16 values in and kv_b as a bf16 Linear, as the layer passes them with bf16 weights; its
// scores on AMX tiles or vdpbf16ps where plain_bf16_keys says so) and the reference (fp32; a block's scores
// over every key), in turns; then the absorbed form's decode step of 16 sequences over 4096 cached tokens
// each, on gathered rows, with the gather from a bf16 pool, and reading that pool in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/common/bf16.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/gemm/bf16_amx_block.h"
#include "kda/layers/attention/mla/mla_attention.h"
#include "kda/layers/linear.h"

namespace kda::bench {

void bench_mla_prefill(nlohmann::json& j, const Say& say) {
  namespace mla = layers::attention::mla;
  using S = io::KimiLinear48bShape;
  const mla::MlaDims d{S::kMlaHeads, S::kQkNope, S::kQkRope, S::kVHead, S::kKvLoraRank};
  const int64_t T = 2048, qw = int64_t{d.heads} * (d.qk_nope + d.qk_rope), lat = d.kv_lora + d.qk_rope,
                ow = int64_t{d.heads} * d.v_head;
  std::vector<float> q = bench_randn(static_cast<size_t>(T * qw), 31),
                     latent = bench_randn(static_cast<size_t>(T * lat), 32),
                     w = bench_randn(static_cast<size_t>(d.heads * (d.qk_nope + d.v_head) * d.kv_lora), 33,
                                     0.05f);
  // bf16 values from the start, so the fp32 and bf16 runs see the same inputs.
  for (std::vector<float>* v : {&q, &latent, &w}) round_bf16_inplace(v->data(), v->size());
  std::vector<float> o(static_cast<size_t>(T * ow));
  const mla::MlaSeq seq{0, 0, T, latent.data(), nullptr};
  const mla::MlaAttnArgs a{d,     q.data(), qw, {&seq, 1}, w.data(), 1.0f / std::sqrt(192.0f),
                           false, o.data(), ow};
  const layers::Linear kv_b(d.kv_lora, int64_t{d.heads} * (d.qk_nope + d.v_head), w, Precision::BF16);
  mla::MlaAttnArgs a16 = a;
  a16.bf16 = true;
  a16.kv_b = &kv_b;
  const bool bf16_keys = mla::plain_bf16_keys(d, true);
  const char* scores = !bf16_keys                                                   ? "fp32"
                       : kernels::gemm::bf16_amx_block_takes(d.qk_nope + d.qk_rope) ? "amx"
                                                                                    : "vdpbf16ps";
  const auto t =
      best_interleaved({[&] { mla::mla_attention_plain(a); }, [&] { mla::mla_attention_plain_reference(a); },
                        [&] { mla::mla_attention_plain(a16); }},
                       3, 2.0);
  // The expansion through kv_b, then per head QK^T over dn + dr and PV over dv on the causal half.
  const double flops = 2.0 * T * d.kv_lora * (d.qk_nope + d.v_head) * d.heads +
                       2.0 * d.heads * (T * (T + 1) / 2.0) * (d.qk_nope + d.qk_rope + d.v_head);
  j["mla_prefill"] = {{"tokens", T},
                      {"flash_ms", t[0] * 1e3},
                      {"reference_ms", t[1] * 1e3},
                      {"flash_gflops", flops / t[0] / 1e9},
                      {"reference_gflops", flops / t[1] / 1e9},
                      {"flash_over_reference", t[0] / t[1]},
                      {"flash_bf16_ms", t[2] * 1e3},
                      {"flash_bf16_gflops", flops / t[2] / 1e9},
                      {"flash_bf16_keys", bf16_keys},
                      {"flash_bf16_scores", scores}};
  say("\n%-30s %8s %12s %12s %10s %14s\n", "MLA prefill attention (plain)", "tokens", "flash ms", "ref ms",
      "flash/ref", "flash GFLOP/s");
  say("%-30s %8lld %12.2f %12.2f %10.2f %14.1f\n", "32 heads, fp32", static_cast<long long>(T), t[0] * 1e3,
      t[1] * 1e3, t[0] / t[1], flops / t[0] / 1e9);
  say("%-30s %8lld %12.2f %12s %10.2f %14.1f\n", (std::string("32 heads, bf16 (") + scores + " QK)").c_str(),
      static_cast<long long>(T), t[2] * 1e3, "", t[2] / t[1], flops / t[2] / 1e9);

  // Decode: the absorbed form on 16 sequences of one new token each after 4096 cached ones, the bf16 mode,
  // with a scratch kept across calls as the layer keeps one. In turns: on rows gathered before the call
  // (the kernel alone), the gather from a bf16 pool (rows scattered over it, as a pool's slots are after
  // churn) into those rows and the call, and the call reading the pool's rows in place (MlaSeq::slots), as
  // the layer runs a decode row.
  const int64_t B = 16, P = 4096, rows = B * (P + 1);
  std::vector<float> qd = bench_randn(static_cast<size_t>(B * qw), 34),
                     lat_d = bench_randn(static_cast<size_t>(rows * lat), 35);
  for (std::vector<float>* v : {&qd, &lat_d}) round_bf16_inplace(v->data(), v->size());
  std::vector<int32_t> slot(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) slot[i] = static_cast<int32_t>(i + 1);
  std::shuffle(slot.begin(), slot.end(), std::mt19937(36));
  std::vector<bf16_t> pool(static_cast<size_t>((rows + 1) * lat));
  for (int64_t i = 0; i < rows; ++i)
    f32_to_bf16_array(lat_d.data() + i * lat, pool.data() + slot[i] * lat, static_cast<size_t>(lat));
  std::vector<float> od(static_cast<size_t>(B * ow));
  std::vector<mla::MlaSeq> seqs, in_place;
  for (int64_t b = 0; b < B; ++b) {
    seqs.push_back({b, P, 1, lat_d.data() + b * (P + 1) * lat, nullptr});
    mla::MlaSeq s{b, P, 1, nullptr, nullptr};
    s.slots = slot.data() + b * (P + 1);
    s.pool_bf16 = pool.data();
    in_place.push_back(s);
  }
  mla::MlaScratch scratch;
  const mla::MlaAttnArgs ad{d,    qd.data(), qw, seqs,    w.data(), 1.0f / std::sqrt(192.0f),
                            true, od.data(), ow, &scratch};
  mla::MlaAttnArgs ap = ad;
  ap.seqs = in_place;
  const auto gather = [&] {
#pragma omp parallel for
    for (int64_t i = 0; i < rows; ++i)
      bf16_to_f32_array(pool.data() + slot[i] * lat, lat_d.data() + i * lat, static_cast<size_t>(lat));
  };
  const std::vector<double> td = best_interleaved({[&] { mla::mla_attention_absorbed(ad); },
                                                   [&] {
                                                     gather();
                                                     mla::mla_attention_absorbed(ad);
                                                   },
                                                   [&] { mla::mla_attention_absorbed(ap); }},
                                                  5, 1.0);
  // Per sequence and head: q~ and o through W_UK / W_UV, then scores over R + dr and u over R per key.
  const double dflops =
      2.0 * B * d.heads * ((d.qk_nope + d.v_head) * d.kv_lora + (P + 1) * (2.0 * d.kv_lora + d.qk_rope));
  j["mla_decode"] = {{"batch", B},
                     {"context", P},
                     {"absorbed_ms", td[0] * 1e3},
                     {"absorbed_gflops", dflops / td[0] / 1e9},
                     {"gather_and_absorbed_ms", td[1] * 1e3},
                     {"pool_in_place_ms", td[2] * 1e3},
                     {"pool_in_place_over_gather", td[2] / td[1]}};
  say("%-30s %8s %12s %14s\n", "MLA decode attention (absorbed)", "batch", "ms", "GFLOP/s");
  say("%-30s %8lld %12.2f %14.1f\n", "32 heads, bf16, 4096 cached", static_cast<long long>(B), td[0] * 1e3,
      dflops / td[0] / 1e9);
  say("%-30s %8lld %12.2f\n", "  + gather from a bf16 pool", static_cast<long long>(B), td[1] * 1e3);
  say("%-30s %8lld %12.2f %14s\n", "  the pool read in place", static_cast<long long>(B), td[2] * 1e3,
      ("x" + std::to_string(td[2] / td[1]).substr(0, 4) + " of gather").c_str());
}

}  // namespace kda::bench
