#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kda/bench/inputs.h"
#include "kda/bench/rows.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/mem_cache/memory_pool.h"
#include "kda/model_executor/forward_batch_info.h"
#include "kda/models/kda_stack.h"

namespace kda::bench {

// The 20-layer stack decoding one request (embedding, every layer, final norm, LM head over a 1024-token
// vocabulary so that its bytes do not hide the layers'), for bf16, int8 and int4 weights in one process:
// one step of each in turn, the best of each over the rounds, so that the three meet the same moments of
// a shared machine (separate `kda simulate` runs minutes apart do not).
void bench_stack(const RowOptions& o, nlohmann::json& j, const Say& say) {
  const io::KimiLinearConfig cfg = io::kimi_linear_48b_config();
  const int layers = 20;
  struct One {
    std::unique_ptr<models::KdaStack> stack;
    layers::attention::linear::KDAAttnBackend backend;
    std::unique_ptr<mem_cache::MemoryPools> pools;
    std::vector<int32_t> reqs;
    model_executor::ForwardBatch fb;
    std::vector<float> x, y;
    int32_t token = 1;
  };
  std::vector<Weights> modes{Weights::BF16};
  for (Weights w : {Weights::Int8, Weights::Int4})
    if (o.weights == "all" || o.weights == to_string(w)) modes.push_back(w);
  std::vector<std::unique_ptr<One>> st;
  for (Weights w : modes) {
    auto s = std::make_unique<One>();
    s->stack = models::KdaStack::synthetic(cfg, layers, Precision::BF16, 7, {}, 1024, w);
    s->pools = std::make_unique<mem_cache::MemoryPools>(s->stack->pool_config(1), 1);
    s->reqs = s->pools->req_to_token_pool.alloc(1);
    s->fb = model_executor::ForwardBatch::decode(s->reqs);
    s->fb.attn_backend = &s->backend;
    s->backend.init_forward_metadata(s->fb, s->pools->req_to_token_pool.get_recurrent_indices(s->reqs));
    s->x.resize(kD);
    s->y.resize(kD);
    st.push_back(std::move(s));
  }
  std::vector<std::function<void()>> fns;
  for (auto& s : st) {
    One* p = s.get();
    fns.push_back([p] {
      p->stack->embed(&p->token, 1, p->x.data());
      p->stack->forward(p->x.data(), 1, p->fb, p->pools->recurrent_state_pool, p->y.data());
      p->stack->next_tokens(p->y.data(), 1, &p->token);
    });
  }
  const auto t = best_interleaved(fns, 30, 20.0);
  say("\n%-22s %8s %14s %12s %14s\n", "stack (20 layers)", "weights", "ms per token", "tokens/s",
      "vs bf16 weights");
  for (size_t i = 0; i < st.size(); ++i) {
    j["stack"].push_back({{"layers", layers},
                          {"weights", to_string(modes[i])},
                          {"ms_per_token", t[i] * 1e3},
                          {"tokens_per_s", 1.0 / t[i]},
                          {"weight_bytes", st[i]->stack->layer_weight_bytes()},
                          {"speedup_vs_bf16", t[0] / t[i]}});
    say("%-22s %8s %14.2f %12.2f %13.2fx\n", "decode, batch 1", to_string(modes[i]), t[i] * 1e3, 1.0 / t[i],
        t[0] / t[i]);
  }
}

// Speculative decoding's cost side: the 20-layer bf16 stack (the simulate's default vocabulary) with one
// request, a decode step (1 token through every layer, final norm, LM head, argmax) and TARGET_VERIFY steps
// of d = 1, 2, 4, 8 chained drafts (d + 1 rows, the LM head over all of them, then accept of d / 2 drafts:
// a replay of d / 2 + 1 tokens), in turns. A verify step that emits n tokens on average beats plain
// decoding when its time is under n decode steps: at accept rate 0.7 and d = 4, n = 2.77.
void bench_spec(nlohmann::json& j, const Say& say) {
  const io::KimiLinearConfig cfg = io::kimi_linear_48b_config();
  const int layers = 20, dmax = 8;
  auto stack = models::KdaStack::synthetic(cfg, layers, Precision::BF16, 7);
  auto pc = stack->pool_config(1);
  pc.max_verify_tokens = dmax + 1;
  pc.verify_rows = 1;
  mem_cache::MemoryPools pools(pc, 1);
  layers::attention::linear::KDAAttnBackend backend;
  const std::vector<int32_t> reqs = pools.req_to_token_pool.alloc(1);
  const auto slots = pools.req_to_token_pool.get_recurrent_indices(reqs);
  const int64_t D = stack->hidden_size();
  std::vector<float> x(static_cast<size_t>((dmax + 1) * D)), y(x.size());
  std::vector<int32_t> toks(dmax + 1, 1), picks(dmax + 1);
  const std::vector<int> drafts{0, 1, 2, 4, 8};  // 0: the decode step
  std::vector<std::function<void()>> fns;
  for (const int d : drafts) {
    fns.push_back([&, d] {
      auto fb = d == 0 ? model_executor::ForwardBatch::decode(reqs)
                       : model_executor::ForwardBatch::target_verify(reqs, {d});
      fb.attn_backend = &backend;
      backend.init_forward_metadata(fb, slots);
      stack->embed(toks.data(), d + 1, x.data());
      stack->forward(x.data(), d + 1, fb, pools.recurrent_state_pool, y.data());
      stack->next_tokens(y.data(), d + 1, picks.data());
      if (d > 0) backend.accept(fb, std::vector<int32_t>{d / 2}, pools.recurrent_state_pool);
    });
  }
  const auto t = best_interleaved(fns, 10, 20.0);
  say("\n%-34s %12s %12s\n", "speculative steps (20 layers, bf16)", "ms", "vs decode");
  for (size_t i = 0; i < drafts.size(); ++i) {
    j["spec"].push_back({{"draft_tokens", drafts[i]}, {"ms", t[i] * 1e3}, {"vs_decode", t[i] / t[0]}});
    const std::string what =
        drafts[i] == 0 ? "decode step" : "verify step, " + std::to_string(drafts[i]) + " drafts";
    say("%-34s %12.2f %11.2fx\n", what.c_str(), t[i] * 1e3, t[i] / t[0]);
  }
}

}  // namespace kda::bench
