// The sampler on a full-vocabulary row: the optimized RequestSampler against sample_reference (in turns),
// and the serving loop's plain-greedy argmax against its scan, each row's time beside one LM-head GEMV of
// the same width, the memory-bound step that produces the row it samples from.
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/layers/linear.h"
#include "kda/sampling/argmax.h"
#include "kda/sampling/sampler.h"

namespace kda::bench {
namespace {

constexpr int64_t kVocab = io::KimiLinear48bShape::kVocab;
// The LM head is built in blocks of rows, as the model builds it, so that the fp32 weights it is made
// from are one block's at a time.
constexpr int64_t kHeadBlock = 16384;

// Logits with an LLM's shape: a few ids well above a broad normal body.
std::vector<float> logits_row() {
  std::vector<float> l = bench_randn(kVocab, 11, 2.0f);
  for (int i = 0; i < 8; ++i) l[(i * 7919 + 13) % kVocab] = 14.0f - i;
  return l;
}

}  // namespace

void bench_sampling(nlohmann::json& j, const Say& say) {
  // The GEMV: 2304 x 163840 bf16 weights, one fp32 row in, fp32 logits out.
  std::vector<layers::Linear> head;
  {
    const std::vector<float> w = bench_randn(static_cast<size_t>(kHeadBlock * kD), 5, 0.02f);
    for (int64_t b = 0; b < kVocab; b += kHeadBlock) head.emplace_back(kD, kHeadBlock, w, Precision::BF16);
  }
  const std::vector<float> x = bench_randn(kD, 6);
  std::vector<float> logits(kVocab);
  const double gemv = best_seconds(
      [&] {
        for (size_t b = 0; b < head.size(); ++b)
          head[b].forward(x.data(), 1, kD, logits.data() + b * kHeadBlock, kVocab);
      },
      5, 1.0);
  const double head_bytes = 2.0 * static_cast<double>(kD) * kVocab;
  say("\nLM head GEMV %lldx%lld bf16 (1 row): %.2f ms, %.1f GB/s\n", static_cast<long long>(kD),
      static_cast<long long>(kVocab), gemv * 1e3, head_bytes / gemv / 1e9);
  j["sampling_gemv"] = {
      {"in", kD}, {"out", kVocab}, {"ms", gemv * 1e3}, {"read_gbps", head_bytes / gemv / 1e9}};

  const std::vector<float> row = logits_row();
  struct Case {
    const char* name;
    sampling::SamplingParams p;
  };
  std::vector<Case> cases(5);
  cases[0].name = "greedy";
  cases[0].p.temperature = 0.0f;
  cases[1].name = "temperature 1.0 (full vocab)";
  cases[2].name = "T 0.8 top-k 50 top-p 0.9";
  cases[2].p.temperature = 0.8f;
  cases[2].p.top_k = 50;
  cases[2].p.top_p = 0.9f;
  cases[3].name = "T 0.8 top-p 0.9";
  cases[3].p.temperature = 0.8f;
  cases[3].p.top_p = 0.9f;
  cases[4].name = "top-p 0.9 + penalties, logprobs 5";
  cases[4].p.top_p = 0.9f;
  cases[4].p.repetition_penalty = 1.1f;
  cases[4].p.frequency_penalty = 0.5f;
  cases[4].p.logprobs = 5;
  std::vector<int32_t> prompt(1000);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 104729) % kVocab);
  const std::vector<int32_t> generated(prompt.begin(), prompt.begin() + 200);

  say("%-36s %12s %12s %9s %12s\n", "sampler (163840-wide row)", "optimized us", "reference us", "speedup",
      "% of GEMV");
  for (const Case& c : cases) {
    sampling::RequestSampler s(c.p, prompt, 1);
    for (int32_t t : generated) s.accept(t);
    std::vector<float> scratch(kVocab);
    sampling::TokenLogprob lp;
    sampling::TokenLogprob* lpp = c.p.logprobs >= 0 ? &lp : nullptr;
    // Both copy the row first: the optimized sampler works in place on the engine's logits.
    const auto t =
        best_interleaved({[&] {
                            scratch = row;
                            s.sample(scratch, nullptr, lpp);
                          },
                          [&] {
                            scratch = row;
                            sampling::sample_reference(scratch, nullptr, c.p, prompt, generated, 1, lpp);
                          }},
                         5, 1.0);
    j["sampling"].push_back({{"case", c.name},
                             {"vocab", kVocab},
                             {"optimized_us", t[0] * 1e6},
                             {"reference_us", t[1] * 1e6},
                             {"speedup", t[1] / t[0]},
                             {"gemv_fraction", t[0] / gemv}});
    say("%-36s %12.1f %12.1f %8.1fx %11.1f%%\n", c.name, t[0] * 1e6, t[1] * 1e6, t[1] / t[0],
        100 * t[0] / gemv);
  }
  // The serving loop's own pick for plain-greedy requests (no sampler: no penalties, no logprobs), on the
  // row as it lies: the blocked argmax against its scan.
  int32_t picked[2] = {0, 0};
  const auto t =
      best_interleaved({[&] { picked[0] = sampling::argmax_allowed(row.data(), kVocab, nullptr); },
                        [&] { picked[1] = sampling::argmax_allowed_reference(row.data(), kVocab, nullptr); }},
                       5, 1.0);
  if (picked[0] != picked[1]) throw std::logic_error("bench_sampling: the greedy picks differ");
  const char* name = "plain greedy (serving's argmax)";
  j["sampling"].push_back({{"case", name},
                           {"vocab", kVocab},
                           {"optimized_us", t[0] * 1e6},
                           {"reference_us", t[1] * 1e6},
                           {"speedup", t[1] / t[0]},
                           {"gemv_fraction", t[0] / gemv}});
  say("%-36s %12.1f %12.1f %8.1fx %11.1f%%\n", name, t[0] * 1e6, t[1] * 1e6, t[1] / t[0], 100 * t[0] / gemv);
}

}  // namespace kda::bench
