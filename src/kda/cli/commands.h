// The kda CLI's subcommands; main.cc parses the options (CLI11) and calls these.
#pragma once

#include <cstdint>
#include <string>

namespace kda::cli {

struct VerifyOptions {
  std::string dumps;
  std::string precision = "all";  // fp32 | bf16 | all
  std::string weights = "bf16";   // bf16 | int8 | int4 (common/weights.h)
  std::string kernel = "auto";
  bool json = false;
  int tp = 1;  // tensor-parallel ranks (under mpirun -np tp)
};
int run_verify(const VerifyOptions& o);

// `kda run`: the whole model on a token case (tokens set), or one KDA layer on a layer case (layer, input).
struct RunOptions {
  std::string model;
  std::string tokens;  // whole model: input_ids [, cu_seqlens]
  int layer = -1;      // KDA layer case
  std::string input;   // KDA layer case: hidden_states [, cu_seqlens, initial states]
  std::string output;
  std::string precision = "fp32";
  std::string weights = "bf16";          // bf16 | int8 | int4 (common/weights.h)
  std::string moe_combine = "unbiased";  // --tokens only: unbiased | biased (models/kimi_moe.h)
  int decode_tail = 0;
  std::string kernel = "auto";
  int tp = 1;  // tensor-parallel ranks (under mpirun -np tp)
};
int run_run(const RunOptions& o);

struct BenchOptions {
  int threads = 0;  // 0: OpenMP's default
  bool json = false;
  bool skip_naive = false;
  std::string kernel =
      "optimized";  // the optimized kernels' copy timed: optimized (this CPU's best) or an ISA
  // all | kernels | layer (the ceilings always run: every row is a ratio) | stack (bench_stack only) |
  // gemm (bench_bf16_gemm only) | spec | model (the whole model with its own ceilings) | tokenizer | sampling
  // | serve (HTTP server against in-process engine)
  std::string only = "all";
  std::string weights = "all";  // all | bf16 | int8 | int4: the quantized layer rows beside the dense ones
  int experts = 0;              // --only model: routed experts per MoE layer (0: the default)
  int layers = 0;               // --only model: the first N decoder layers (0: all)
  int rounds = 1;               // --only model: decode rounds per weights mode
};
int run_bench(const BenchOptions& o);

// kda simulate (src/kda/serving/simulate.h). The defaults are the README's main job; they are sized to
// finish in about a minute on 2 cores while still filling the pool and reusing slots.
struct SimulateCliOptions {
  std::string model;  // empty: synthetic Kimi-Linear-48B-A3B
  int layers = 0;     // 0: all decoder layers
  int experts = 0;    // synthetic: routed experts per MoE layer (0: serving::kDefaultExperts)
  std::string precision = "bf16";
  std::string weights = "bf16";   // bf16 | int8 | int4 (common/weights.h)
  bool quantize_lm_head = false;  // the LM head in `weights` too (ModelOptions::quantize_lm_head)
  std::string kernel = "auto";
  int64_t requests = 32;
  std::string prompt_len = "8:48";
  int64_t output_len = 16;
  std::string trace;
  std::string workload = "random";  // random | shared-prefix | multi-turn
  int64_t prefix_groups = 1;
  int64_t shared_prefix_len = -1;  // -1: 64 for shared-prefix, 0 (none) for multi-turn
  int64_t turns = -1;              // multi-turn: turns per conversation (-1: 2)
  int64_t vocab = 0;               // 0: the config's (the checkpoint's, else 163840)
  uint64_t seed = 0;
  int64_t token_budget = 4096;
  int64_t max_batch = 64;
  bool mixed = false;
  std::string state_memory = "1GiB";
  std::string kv_memory = "1GiB";  // the MLA layers' token KV pool
  bool batch_invariant = false;    // bf16 rows independent of their batch (AMX hosts: no AMX)
  bool no_prefix_cache = false;
  std::string prefix_cache_memory = "1GiB";  // snapshot slots, on top of state_memory
  int64_t cache_interval = 256;
  int64_t parallel_samples = 1;
  int64_t check = 2;
  std::string speculative;  // empty: off; ngram | replay
  int64_t draft_tokens = 4;
  int64_t draft_topk = 1;
  double accept_rate = -1.0;  // replay only; -1: not given (replay: 0.7)
  std::string draft_depth = "adaptive";
  std::string outputs;
  bool json = false;
  int tp = 1;  // tensor-parallel ranks (under mpirun -np tp * dp)
  int dp = 1;  // data-parallel groups
};
int run_simulate(const SimulateCliOptions& o);

// kda serve (src/kda/server/openai_server.h): an OpenAI-compatible HTTP server on a checkpoint folder or
// on synthetic weights with a generated tokenizer.
struct ServeCliOptions {
  std::string model;       // checkpoint folder (config, weights, tiktoken.model, tokenizer_config.json)
  bool synthetic = false;  // synthetic Kimi-Linear weights + Tokenizer::synthetic
  // --synthetic's model: the first `layers` decoder layers, `experts` routed experts per MoE layer, a
  // `vocab`-row vocabulary. 0: the quick start's defaults (serve_cmd.cc), small enough to start in seconds.
  int layers = 0;
  int experts = 0;
  int64_t vocab = 0;
  uint64_t seed = 0;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string precision = "bf16";
  std::string weights = "bf16";
  bool quantize_lm_head = false;  // the LM head in `weights` too (ModelOptions::quantize_lm_head)
  std::string kernel = "auto";
  int64_t max_batch = 32;
  int64_t token_budget = 2048;
  double admission_window_ms = 2.0;  // serving::EngineOptions::admission_window_ms
  std::string state_memory = "1GiB";
  std::string kv_memory = "1GiB";
  int64_t context_length = 0;  // 0: what the MLA KV pool holds (at most 1M tokens)
  bool batch_invariant = false;
  bool no_prefix_cache = false;
  std::string prefix_cache_memory = "1GiB";  // snapshot slots (on top of state_memory) + cached tokens' KV
  int64_t cache_interval = 256;
  std::string api_key;
  std::string served_model_name = "kimi-linear";
  std::string chat_template;  // "builtin": the built-in chat format whatever the folder's template
  int threads = 0;            // HTTP worker threads (0: 2 x max batch, at least 8)
  // Speculative decoding: "" / none, or ngram (prompt lookup); drafts per branch; branches of a tree.
  std::string speculative;
  int64_t draft_tokens = 4;
  int64_t draft_topk = 1;
  std::string draft_depth = "adaptive";  // adaptive | fixed (speculative.h's DraftDepthMode)
};
int run_serve(const ServeCliOptions& o);
// kda tokenize / detokenize (tokenize_cmd.cc): the checkpoint's tokenizer (or a synthetic one) on stdin.
struct TokenizeOptions {
  std::string model;            // folder with tiktoken.model (+ tokenizer_config.json, config.json)
  int64_t synthetic_vocab = 0;  // > 0: Tokenizer::synthetic(N, seed) instead of --model
  uint64_t seed = 0;
  bool chat = false;                   // stdin: a JSON messages array, rendered with the generation prompt
  std::string chat_template = "auto";  // auto (the folder's, if known) | builtin
  bool text = false;                   // --chat: print the rendered prompt text, not its ids
  bool no_special = false;             // special-token strings are plain text
  std::string save;                    // write the tokenizer's files to this folder (and read no stdin)
};
int run_tokenize(const TokenizeOptions& o);
int run_detokenize(const TokenizeOptions& o);

// kda quantize (models/quantize_checkpoint.h): a packed checkpoint that later loads map in place.
struct QuantizeOptions {
  std::string model;
  std::string out;
  std::string weights;  // int8 | int4
  // Then load the source converting and the output mapped, time both and compare their logits on a
  // few tokens (they must be equal bit for bit).
  bool check = false;
  std::string precision = "bf16";  // --check's precision
};
int run_quantize(const QuantizeOptions& o);

}  // namespace kda::cli
