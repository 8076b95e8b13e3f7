// `kda bench --only gemm`, the quantized decode rows: int8 / int4 weights at decode and MoE row counts
// (1..64) on the model's projection shapes, each kernel the AVX-512 copy takes (VNNI or AVX-512BW, and
// the AMX tiles where the CPU has them) called directly on activations quantized beforehand, and
// QuantLinear's whole call (the activations' quantization included) as the layers make it, beside the
// bf16 projection (oneDNN's matmul) timed in the same turns: the ratios say which is faster per format
// and row count on this CPU. Every projection cycles through copies of its weights larger together than
// the caches, so that each call reads them from memory as a model's decode step does. Where the CPU has
// AMX-BF16 or AVX512_BF16, bf16 rows on their decode kernels follow (bench_bf16_decode).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/bench/timing.h"
#include "kda/common/bf16.h"
#include "kda/common/isa.h"
#include "kda/common/weight_buffer.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/kernels/gemm/bf16_amx.h"
#include "kda/kernels/gemm/quant_amx.h"
#include "kda/kernels/gemm/quant_gemm.h"
#include "kda/kernels/gemm/quant_gemm_isa.h"
#include "kda/kernels/gemm/weight_format.h"
#include "kda/layers/bf16_vnni_rows.h"
#include "kda/layers/linear.h"
#include "kda/layers/onednn_isa.h"
#include "kda/layers/quant_linear.h"

namespace kda::bench {

namespace {

namespace qg = kernels::gemm;

struct DecodeShape {
  const char* name;
  int64_t in, out;
};

// Copies of a projection whose weights together pass this many bytes.
constexpr int64_t kColdBytes = int64_t{512} << 20;
int copies_for(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>(kColdBytes / bytes + 1, 1, 256));
}

// bf16 weights at the decode row counts, where the CPU has bf16 GEMM hardware: the LM head's row block
// (2304 -> 29127, as the model splits the head for oneDNN) and the whole head (2304 -> the vocabulary),
// each through oneDNN as compute_logits took it there (one row straight into the logits' columns, more
// into a dense block buffer and copied to them), and the projection shapes above through a bf16 Linear
// (oneDNN), each beside this CPU's decode kernels, in turns: with AMX-BF16 the AMX kernel (bf16_amx.h, on
// W in its tiled layout, as the model's LM head lies there),
// with AVX512_BF16 where it gives oneDNN's bits the Linear with its decode rows on the vnni kernel
// (Bf16Gemm::OneDnnVnni, bf16_vnni.h), and where oneDNN uses AMX tiles the Linear with its decode rows on
// the AMX rows kernel (Bf16Gemm::OneDnnAmx, bf16_amx_block.h), all writing straight into y. Rows of
// quant_decode with weights "bf16".
void bench_bf16_decode(nlohmann::json& j, const Say& say) {
  const bool amx = qg::cpu_has_amx_bf16(), vnni = layers::onednn_bf16_k_chunk(kD, 2048) >= 0;
  if (!amx && !vnni) return;
  const bool amx_rows = amx && !vnni && layers::onednn_bf16_uses_amx();
  const int64_t block = (int64_t{1} << 26) / kD;  // the model's head block (kHeadBlockValues / D)
  const std::vector<float> w = bench_randn(static_cast<size_t>(block * kD), 7, 0.02f);
  std::vector<bf16_t> wb(w.size());
  f32_to_bf16_array(w.data(), wb.data(), wb.size());
  using S = io::KimiLinear48bShape;
  const DecodeShape shapes[] = {{"LM head block", kD, block},
                                {"LM head", kD, S::kVocab},
                                {"KDA fused projection", kD, 3 * kP + 2 * kK + kH},
                                {"expert gate+up", kD, 2 * S::kMoeIntermediate},
                                {"expert down", S::kMoeIntermediate, kD}};
  for (const DecodeShape& sh : shapes) {
    const int64_t blocks = (sh.out + block - 1) / block, copies = copies_for(2 * sh.in * sh.out);
    // Per copy the Linear blocks (the head's; a projection is one), and the same weights as one bf16
    // matrix in the AMX kernel's tiled layout in huge pages, as the model's head lies (in 4 KiB pages the
    // tiled layout reads slower than [N, K]: docs/performance.md, "The LM head in tile order"); every
    // block's rows the first ones of w: the values do not change the time.
    std::vector<std::vector<layers::Linear>> d16(static_cast<size_t>(copies)),
        v16(vnni || amx_rows ? d16.size() : 0);
    std::vector<WeightBuffer> a16(amx ? static_cast<size_t>(copies) : 0);
    for (int64_t c = 0; c < copies; ++c) {
      if (amx)
        a16[c] =
            allocate_weights(sizeof(bf16_t) * static_cast<size_t>(qg::bf16_amx_tiled_size(sh.out, sh.in)));
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = std::min(block, sh.out - b * block);
        const std::vector<float> wn = n == block ? w : std::vector<float>(w.begin(), w.begin() + n * sh.in);
        d16[c].emplace_back(sh.in, n, wn, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnn);
        if (vnni || amx_rows)  // Auto: OneDnnVnni or OneDnnAmx here
          v16[c].emplace_back(sh.in, n, wn, Precision::BF16, Weights::BF16);
        if (amx)
          qg::bf16_amx_tile_rows(wb.data(), b * block, b * block + n, sh.in,
                                 static_cast<bf16_t*>(a16[c].get()));
      }
    }
    // The Auto rows only where every block of this shape took the decode kernel (Auto falls back to oneDNN
    // alone for a shape whose bits the vnni kernel cannot give, or whose inputs the AMX one cannot take).
    const layers::Bf16Gemm decode_kernel = vnni ? layers::Bf16Gemm::OneDnnVnni : layers::Bf16Gemm::OneDnnAmx;
    bool auto_here = vnni || amx_rows;
    for (const auto& blocks_of : v16)
      for (const layers::Linear& l : blocks_of) auto_here &= l.bf16_gemm() == decode_kernel;
    for (int64_t M :
         {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}, int64_t{16}, int64_t{32}, int64_t{64}}) {
      std::vector<float> x = bench_randn(static_cast<size_t>(M * sh.in), 6),
                         logits(static_cast<size_t>(M * sh.out)), buf(static_cast<size_t>(M * block));
      round_bf16_inplace(x.data(), x.size());
      std::vector<bf16_t> xb(x.size());
      size_t i16 = 0, ia = 0, iv = 0;
      std::vector<std::function<void()>> fns{
          [&] {
            const std::vector<layers::Linear>& hs = d16[i16++ % d16.size()];
            for (int64_t b = 0; b < blocks; ++b) {
              if (M == 1 || blocks == 1) {
                hs[b].forward(x.data(), M, sh.in, logits.data() + b * block, sh.out);
                continue;
              }
              const int64_t n = hs[b].out_features();
              hs[b].forward(x.data(), M, sh.in, buf.data(), n);
              for (int64_t m = 0; m < M; ++m)
                std::memcpy(logits.data() + m * sh.out + b * block, buf.data() + m * n, sizeof(float) * n);
            }
          },
      };
      std::vector<const char*> names{"bf16 oneDNN"};
      if (amx) {
        fns.push_back([&] {
          f32_to_bf16_array(x.data(), xb.data(), xb.size());
          qg::gemm_bf16_amx_tiled(xb.data(), M, sh.in,
                                  static_cast<const bf16_t*>(a16[ia++ % a16.size()].get()), sh.in, sh.out,
                                  logits.data(), sh.out);
        });
        names.push_back("amx bf16");
      }
      if (auto_here) {
        fns.push_back([&] {
          const std::vector<layers::Linear>& hs = v16[iv++ % v16.size()];
          for (int64_t b = 0; b < blocks; ++b)
            hs[b].forward(x.data(), M, sh.in, logits.data() + b * block, sh.out);
        });
        names.push_back(vnni ? "vnni bf16" : "amx rows");
      }
      const std::vector<double> t = best_interleaved(fns, 5, 1.0);
      const int64_t bytes = 2 * sh.in * sh.out;
      for (size_t i = 0; i < t.size(); ++i) {
        j["quant_decode"].push_back({{"shape", sh.name},
                                     {"in", sh.in},
                                     {"out", sh.out},
                                     {"rows", M},
                                     {"weights", "bf16"},
                                     {"kernel", names[i]},
                                     {"ms", t[i] * 1e3},
                                     {"gbps", bytes / t[i] / 1e9},
                                     {"over_bf16_ms", t[i] / t[0]}});
        say("%-22s %5s %4lld %-12s %9.3f %8.1f %10.2f\n", i == 0 ? sh.name : "", "bf16",
            static_cast<long long>(M), names[i], t[i] * 1e3, bytes / t[i] / 1e9, t[i] / t[0]);
      }
    }
  }
}

}  // namespace

void bench_quant_decode(nlohmann::json& j, const Say& say) {
  using S = io::KimiLinear48bShape;
  const DecodeShape shapes[] = {
      {"KDA fused projection", kD, 3 * kP + 2 * kK + kH},
      {"expert gate+up", kD, 2 * S::kMoeIntermediate},
      {"expert down", S::kMoeIntermediate, kD},
  };
  [[maybe_unused]] const bool avx512 = isa_available(Isa::Avx512);
  const bool amx8 = qg::cpu_has_amx_int8(), amx4 = amx8 && qg::cpu_has_amx_bf16();
  say("\n%-22s %5s %4s %-12s %9s %8s %10s\n", "quantized decode GEMM", "wts", "rows", "kernel", "ms", "GB/s",
      "/ bf16 ms");
  j["quant_decode"] = nlohmann::json::array();
  for (const DecodeShape& sh : shapes) {
    const std::vector<float> w = bench_randn(static_cast<size_t>(sh.in * sh.out), 5, 0.02f);
    std::vector<layers::Linear> d16;
    for (int c = copies_for(2 * sh.in * sh.out); c > 0; --c)
      d16.emplace_back(sh.in, sh.out, w, Precision::BF16, Weights::BF16, layers::Bf16Gemm::OneDnn);
    for (Weights wt : {Weights::Int8, Weights::Int4}) {
      std::vector<layers::QuantLinear> ql;
      ql.reserve(64);
      ql.emplace_back(sh.in, sh.out, w, wt, Precision::BF16);
      for (int c = copies_for(ql[0].weight_bytes()); c > 1; --c)
        ql.emplace_back(ql[0].packed(), Precision::BF16);
      const int64_t bytes = ql[0].weight_bytes();
      for (int64_t M : {int64_t{1}, int64_t{4}, int64_t{8}, int64_t{16}, int64_t{32}, int64_t{64}}) {
        std::vector<float> x = bench_randn(static_cast<size_t>(M * sh.in), 6),
                           y(static_cast<size_t>(M * sh.out));
        round_bf16_inplace(x.data(), x.size());
        std::vector<bf16_t> xb(x.size()), yb(y.size());
        f32_to_bf16_array(x.data(), xb.data(), xb.size());
        // x quantized as the entry points do (a scale per row for int8, per group of 32 for int4).
        const int64_t run = wt == Weights::Int8 ? sh.in : qg::kInt4Group, R = sh.in / run;
        const int qmax = wt == Weights::Int8 ? qg::activation_qmax(sh.in) : qg::kInt4ActivationMax;
        std::vector<int16_t> xq(x.size());
        std::vector<float> sx(static_cast<size_t>(M * R));
        for (int64_t m = 0; m < M; ++m)
          for (int64_t r = 0; r < R; ++r)
            sx[m * R + r] = qg::quantize_activations(x.data() + m * sh.in + r * run, run, qmax,
                                                     xq.data() + m * sh.in + r * run);
        size_t i16 = 0, iq = 0;
        const auto next_q = [&]() -> const qg::PackedWeights& {
          return ql[iq++ % ql.size()].packed().view();
        };
        std::vector<std::string> names{"bf16 oneDNN", "QuantLinear"};
        std::vector<std::function<void()>> fns{
            [&] { d16[i16++ % d16.size()].forward(xb.data(), M, sh.in, yb.data(), sh.out); },
            [&] { ql[iq++ % ql.size()].forward(xb.data(), M, sh.in, yb.data(), sh.out); }};
#if defined(KDA_WITH_AVX512)
        if (avx512) {
          names.emplace_back(qg::cpu_has_vnni() ? "avx512 vnni" : "avx512 bw");
          fns.emplace_back([&] {
            const qg::PackedWeights& p = next_q();
            if (wt == Weights::Int8)
              qg::avx512::gemm_int8(xq.data(), sx.data(), M,
                                    {static_cast<const int8_t*>(p.data), p.scale, p.in, p.out}, y.data(),
                                    sh.out, qg::cpu_has_vnni());
            else
              qg::avx512::gemm_int4(xq.data(), sx.data(), M,
                                    {static_cast<const uint8_t*>(p.data), p.scale, p.in, p.out}, y.data(),
                                    sh.out, qg::cpu_has_vnni());
          });
        }
#endif
        if (wt == Weights::Int8 ? amx8 : amx4) {
          names.emplace_back("amx");
          fns.emplace_back([&] {
            const qg::PackedWeights& p = next_q();
            if (wt == Weights::Int8)
              qg::gemm_int8_amx(xq.data(), sx.data(), M,
                                {static_cast<const int8_t*>(p.data), p.scale, p.in, p.out}, y.data(), sh.out);
            else
              qg::gemm_int4_amx(xq.data(), sx.data(), M,
                                {static_cast<const uint8_t*>(p.data), p.scale, p.in, p.out}, y.data(),
                                sh.out);
          });
        }
        const std::vector<double> t = best_interleaved(fns, 5, 1.0);
        for (size_t i = 0; i < t.size(); ++i) {
          const int64_t b = i == 0 ? 2 * sh.in * sh.out : bytes;
          j["quant_decode"].push_back({{"shape", sh.name},
                                       {"in", sh.in},
                                       {"out", sh.out},
                                       {"rows", M},
                                       {"weights", to_string(wt)},
                                       {"kernel", names[i]},
                                       {"ms", t[i] * 1e3},
                                       {"gbps", b / t[i] / 1e9},
                                       {"over_bf16_ms", t[i] / t[0]}});
          say("%-22s %5s %4lld %-12s %9.3f %8.1f %10.2f\n", i == 0 ? sh.name : "", to_string(wt),
              static_cast<long long>(M), names[i].c_str(), t[i] * 1e3, b / t[i] / 1e9, t[i] / t[0]);
        }
      }
    }
  }
  bench_bf16_decode(j, say);
}

}  // namespace kda::bench
