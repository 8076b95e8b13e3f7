// kda: the command-line front of the KDA component.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <stdexcept>

#include "kda/cli/commands.h"
#include "kda/common/allocator.h"
#include "kda/distributed/mpi_communicator.h"

namespace {

constexpr const char* kQuantizeLmHeadHelp =
    "the LM head in --weights too (int8 | int4), as llama.cpp quantizes its output tensor; default: the "
    "head stays as the checkpoint stores it (a packed checkpoint's head too: it is then quantized at load)";

}  // namespace

int main(int argc, char** argv) {
  // Before anything large is allocated (the pools would set it too, later): common/allocator.h.
  kda::configure_allocator();
  CLI::App app{"kda: Kimi Delta Attention inference component (CPU)"};
  app.require_subcommand(1);

  kda::cli::VerifyOptions vo;
  auto* verify = app.add_subcommand("verify", "check every case of a dump folder through the full stack");
  verify->add_option("--dumps", vo.dumps, "dump folder (config.json, model.safetensors, <case>.npz)")
      ->required();
  verify->add_option("--precision", vo.precision, "fp32 | bf16 | all")
      ->check(CLI::IsMember({"fp32", "bf16", "all"}));
  verify
      ->add_option("--weights", vo.weights,
                   "bf16 (the precision's dense weights) | int8 | int4: projections quantized at load")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}));
  verify->add_option("--kernel", vo.kernel, "auto | naive | optimized | portable | avx2 | avx512")
      ->check(CLI::IsMember({"auto", "naive", "optimized", "portable", "avx2", "avx512"}));
  verify->add_flag("--json", vo.json, "print the results as JSON");
  verify->add_option("--tp", vo.tp, "tensor-parallel ranks (start with mpirun -np N)")
      ->check(CLI::PositiveNumber);

  kda::cli::RunOptions ro;
  auto* run = app.add_subcommand(
      "run",
      "run the whole model on a token case (--tokens), or one KDA layer on a layer case (--layer, --input)");
  run->add_option("--model", ro.model, "checkpoint folder (config.json + safetensors)")->required();
  auto* tokens = run->add_option(
      "--tokens", ro.tokens, "whole model: case .npz with input_ids int32 [T] [, cu_seqlens int32 [N+1]]");
  run->add_option("--layer", ro.layer, "KDA layer case: decoder layer index (0-based; must be a KDA layer)")
      ->excludes(tokens);
  run->add_option("--input", ro.input,
                  "KDA layer case: .npz with hidden_states [, cu_seqlens, initial_*_state]")
      ->excludes(tokens);
  run->add_option("--output", ro.output,
                  "output .npz: --tokens: logits, hidden_final, kda_recurrent_state_{i}, kda_conv_state_{i}, "
                  "mla_ckv_{i}, mla_kpe_{i}; --layer: out, recurrent_state, conv_state")
      ->required();
  run->add_option("--precision", ro.precision, "fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  run->add_option("--weights", ro.weights,
                  "bf16 (the precision's dense weights) | int8 | int4: projections quantized at load")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}));
  run->add_option(
         "--moe-combine", ro.moe_combine,
         "--tokens: unbiased (vLLM, sglang) | biased (the HF remote code: scores with the correction bias)")
      ->check(CLI::IsMember({"unbiased", "biased"}))
      ->needs(tokens);
  run->add_option(
         "--decode-tail", ro.decode_tail,
         "run each sequence's last K tokens as DECODE steps (--tokens: K at most the shortest sequence)")
      ->check(CLI::NonNegativeNumber);
  run->add_option("--tp", ro.tp, "tensor-parallel ranks (start with mpirun -np N)")
      ->check(CLI::PositiveNumber);
  run->add_option("--kernel", ro.kernel, "auto | naive | optimized | portable | avx2 | avx512")
      ->check(CLI::IsMember({"auto", "naive", "optimized", "portable", "avx2", "avx512"}));

  kda::cli::BenchOptions bo;
  auto* bench = app.add_subcommand("bench", "kernels and layer against same-run GEMM / memcpy ceilings");
  bench->add_option("--threads", bo.threads, "OpenMP threads (default: all)")->check(CLI::NonNegativeNumber);
  bench->add_flag("--json", bo.json, "print the results as JSON");
  bench->add_flag("--skip-naive", bo.skip_naive, "do not time the reference kernels");
  bench->add_option("--kernel", bo.kernel, "optimized | portable | avx2 | avx512 (the ISA copy timed)")
      ->check(CLI::IsMember({"optimized", "portable", "avx2", "avx512"}));
  bench
      ->add_option(
          "--only", bo.only,
          "all | kernels | layer (ceilings are always measured) | stack (the 20-layer stack decoding "
          "one request per weights mode, in turns) | gemm (the oneDNN and widened bf16 GEMMs, in turns; "
          "the int8 / int4 prefill GEMMs over the bf16 and fp32 GEMMs of their shapes) | "
          "spec (a decode step and verify steps of 1-8 drafts, in turns; then speculative against plain "
          "decoding "
          "through the serving loop on 4 layers, batch 1, fixed and adaptive depth) | model (the whole model "
          "at its "
          "real shapes: decode batch 1 and 16, a 2048-token prefill, per weights mode) | tokenizer (encoding "
          "MB/s on one thread, the 100 KB single-word case) | sampling (the sampler on a 163840-wide row "
          "against its reference and one LM-head GEMV) | serve (16 streaming HTTP clients of the OpenAI "
          "server against the engine in-process, and the TTFT HTTP and tokenization add) | cache (the prefix "
          "cache off and on, 4 layers of the whole model: multi-turn, shared-prefix and no-hit workloads) | "
          "qdecode (gemm's quantized decode rows alone: int8 / int4 kernels at 1-64 rows against the bf16 "
          "projection)")
      ->check(CLI::IsMember({"all", "kernels", "layer", "stack", "gemm", "spec", "model", "tokenizer",
                             "sampling", "serve", "cache", "qdecode"}));
  bench
      ->add_option(
          "--experts", bo.experts,
          "--only model | spec: routed experts per MoE layer, top-8 of them (default 16; 256 is the real "
          "model)")
      ->check(CLI::PositiveNumber);
  bench
      ->add_option("--layers", bo.layers,
                   "--only model: the first N decoder layers of the pattern (default: all 27)")
      ->check(CLI::PositiveNumber);
  bench
      ->add_option("--rounds", bo.rounds,
                   "--only model: decode rounds per weights mode, each held to the read bandwidth of its own "
                   "minutes; the rows give each ratio's median and its range over them (default 1)")
      ->check(CLI::PositiveNumber);
  bench
      ->add_option("--weights", bo.weights,
                   "all | bf16 | int8 | int4: quantized layer rows beside the dense ones (--only spec's "
                   "serving rows: that one mode, int4 for all)")
      ->check(CLI::IsMember({"all", "bf16", "int8", "int4"}));

  kda::cli::SimulateCliOptions so;
  auto* sim = app.add_subcommand(
      "simulate",
      "a serving scheduler driving the whole Kimi-Linear model with continuous batching (main job)");
  sim->add_option("--model", so.model,
                  "checkpoint folder (default: synthetic Kimi-Linear-48B-A3B at its real shapes)");
  sim->add_option("--layers", so.layers, "the first N decoder layers of the pattern (default: all)");
  sim->add_option(
      "--experts", so.experts,
      "synthetic: routed experts per MoE layer, top-k of the config's (default: 16, the most that "
      "fits 14 GiB; 256 is the real model)");
  sim->add_option("--precision", so.precision, "fp32 | bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  sim->add_option("--weights", so.weights,
                  "bf16 (the precision's dense weights) | int8 | int4: projections quantized at load")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}))
      ->capture_default_str();
  sim->add_flag("--quantize-lm-head", so.quantize_lm_head, kQuantizeLmHeadHelp);
  sim->add_option("--kernel", so.kernel, "auto | naive | optimized | portable | avx2 | avx512")
      ->check(CLI::IsMember({"auto", "naive", "optimized", "portable", "avx2", "avx512"}))
      ->capture_default_str();
  auto* reqs =
      sim->add_option("--requests", so.requests, "number of generated requests")->capture_default_str();
  auto* plen = sim->add_option("--prompt-len", so.prompt_len, "prompt lengths MIN:MAX (uniform)")
                   ->capture_default_str();
  auto* olen =
      sim->add_option("--output-len", so.output_len, "decode steps per request")->capture_default_str();
  auto* wl = sim->add_option("--workload", so.workload, "random | shared-prefix | multi-turn")
                 ->check(CLI::IsMember({"random", "shared-prefix", "multi-turn"}))
                 ->capture_default_str();
  auto* groups = sim->add_option("--prefix-groups", so.prefix_groups,
                                 "shared system prompts (shared-prefix, multi-turn)")
                     ->capture_default_str();
  auto* spl = sim->add_option(
      "--shared-prefix-len", so.shared_prefix_len,
      "tokens of each shared system prompt (default: 64 for shared-prefix, 0 for multi-turn)");
  auto* turns = sim->add_option("--turns", so.turns,
                                "turns per conversation (multi-turn, --requests conversations; default 2)");
  sim->add_option("--trace", so.trace,
                  "JSON list of {prompt_len | prompt, output_len, arrival_step[, session, turn]}")
      ->excludes(reqs)
      ->excludes(plen)
      ->excludes(olen)
      ->excludes(wl)
      ->excludes(groups)
      ->excludes(spl)
      ->excludes(turns);
  sim->add_option("--vocab", so.vocab,
                  "vocabulary of the seeded embedding and LM head (default: the config's, 163840; a "
                  "checkpoint's own)");
  sim->add_option("--seed", so.seed, "seed of weights, workload and inputs")->capture_default_str();
  sim->add_option("--token-budget", so.token_budget, "tokens per step (chunked prefill)")
      ->capture_default_str();
  sim->add_option("--max-batch", so.max_batch, "decode rows per step")->capture_default_str();
  sim->add_flag("--mixed", so.mixed, "prefill chunks and decodes in one EXTEND batch");
  sim->add_option("--state-memory", so.state_memory, "bytes for the state pool (e.g. 2GiB, 512MiB)")
      ->capture_default_str();
  sim->add_option("--kv-memory", so.kv_memory, "bytes for the MLA layers' token KV pool (e.g. 1GiB)")
      ->capture_default_str();
  sim->add_flag("--batch-invariant", so.batch_invariant,
                "bf16: a row's bits independent of the rows beside it (on CPUs with AMX: oneDNN without AMX, "
                "prefill GEMMs several times slower); implied by a bf16 self-check (--check > 0)");
  auto* no_cache =
      sim->add_flag("--no-prefix-cache", so.no_prefix_cache, "turn the prefix cache of state snapshots off");
  // The cache's own options with the cache off would be accepted and ignored: refused instead.
  sim->add_option("--prefix-cache-memory", so.prefix_cache_memory,
                  "bytes of the prefix cache (state snapshots, on top of --state-memory, and the cached "
                  "tokens' MLA KV rows, in --kv-memory)")
      ->capture_default_str()
      ->excludes(no_cache);
  sim->add_option("--cache-interval", so.cache_interval,
                  "a prefix-cache snapshot every N prompt tokens (N % 64 == 0)")
      ->capture_default_str()
      ->excludes(no_cache);
  sim->add_option("--parallel-samples", so.parallel_samples, "continuations forked per request after prefill")
      ->capture_default_str();
  sim->add_option("--check", so.check, "requests re-run alone and compared (0: off)")->capture_default_str();
  auto* spec = sim->add_option("--speculative", so.speculative,
                               "speculative decoding: ngram (prompt lookup) | replay (known acceptance)")
                   ->check(CLI::IsMember({"ngram", "replay"}));
  sim->add_option("--draft-tokens", so.draft_tokens, "drafted tokens per verify row (a tree: per branch)")
      ->capture_default_str()
      ->needs(spec);
  sim->add_option("--draft-topk", so.draft_topk, "branches of a draft tree (1: a chain)")
      ->capture_default_str()
      ->needs(spec);
  sim->add_option("--accept-rate", so.accept_rate,
                  "replay: probability that a drafted token is the true one (default 0.7)")
      ->needs(spec);
  sim->add_option("--draft-depth", so.draft_depth,
                  "adaptive: per sequence, from measured acceptance and verify cost (at most --draft-tokens; "
                  "0 where speculation does not pay) | fixed: --draft-tokens")
      ->capture_default_str()
      ->needs(spec);
  sim->add_option("--tp", so.tp, "tensor-parallel ranks per group (start with mpirun -np N*M)")
      ->check(CLI::PositiveNumber);
  sim->add_option("--dp", so.dp, "data-parallel groups owning disjoint requests")->check(CLI::PositiveNumber);
  sim->add_option("--outputs", so.outputs, ".npz of every request's last-layer outputs");
  sim->add_flag("--json", so.json, "print the summary as JSON");

  kda::cli::ServeCliOptions svo;
  auto* serve =
      app.add_subcommand("serve", "an OpenAI-compatible HTTP server (chat and text completions, streaming)");
  auto* serve_model = serve->add_option("--model", svo.model,
                                        "checkpoint folder (config.json, safetensors, tiktoken.model, "
                                        "tokenizer_config.json[, chat_template.jinja])");
  auto* serve_synth =
      serve->add_flag("--synthetic", svo.synthetic, "synthetic Kimi-Linear weights and a generated tokenizer")
          ->excludes(serve_model);
  serve_model->excludes(serve_synth);
  serve->add_option("--layers", svo.layers, "--synthetic: the first N decoder layers (default 4)")
      ->check(CLI::PositiveNumber)
      ->needs(serve_synth);
  serve->add_option("--experts", svo.experts, "--synthetic: routed experts per MoE layer (default 8)")
      ->check(CLI::PositiveNumber)
      ->needs(serve_synth);
  serve->add_option("--vocab", svo.vocab, "--synthetic: vocabulary size, >= 512 (default 32768)")
      ->check(CLI::Range(int64_t{512}, int64_t{1} << 24))
      ->needs(serve_synth);
  serve->add_option("--seed", svo.seed, "--synthetic: seed of the weights and the tokenizer")
      ->capture_default_str()
      ->needs(serve_synth);
  serve->add_option("--host", svo.host, "address to listen on")->capture_default_str();
  serve->add_option("--port", svo.port, "port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  serve->add_option("--precision", svo.precision, "fp32 | bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  serve->add_option("--weights", svo.weights, "bf16 (the precision's dense weights) | int8 | int4")
      ->check(CLI::IsMember({"bf16", "int8", "int4"}))
      ->capture_default_str();
  serve->add_flag("--quantize-lm-head", svo.quantize_lm_head, kQuantizeLmHeadHelp);
  serve->add_option("--kernel", svo.kernel, "auto | naive | optimized | portable | avx2 | avx512")
      ->check(CLI::IsMember({"auto", "naive", "optimized", "portable", "avx2", "avx512"}))
      ->capture_default_str();
  serve->add_option("--max-batch", svo.max_batch, "decode rows per step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  serve->add_option("--token-budget", svo.token_budget, "tokens per step (chunked prefill)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  serve
      ->add_option("--admission-window-ms", svo.admission_window_ms,
                   "on waking from idle, wait this long for more requests before the first step, so that "
                   "a burst starts as one batch; each arrival restarts it, up to 8 windows (0: off; never "
                   "while requests run)")
      ->check(CLI::Range(0.0, 1000.0))
      ->capture_default_str();
  serve->add_option("--state-memory", svo.state_memory, "bytes of request state slots (e.g. 1GiB)")
      ->capture_default_str();
  serve->add_option("--kv-memory", svo.kv_memory, "bytes of the MLA layers' token KV pool (e.g. 1GiB)")
      ->capture_default_str();
  serve->add_flag("--batch-invariant", svo.batch_invariant,
                  "bf16: a row's bits independent of the rows beside it (on CPUs with AMX: oneDNN without "
                  "AMX, prefill GEMMs several times slower)");
  auto* serve_no_cache =
      serve->add_flag("--no-prefix-cache", svo.no_prefix_cache, "turn the prefix cache off");
  serve
      ->add_option("--prefix-cache-memory", svo.prefix_cache_memory,
                   "bytes of the prefix cache (state snapshots, on top of --state-memory, and the cached "
                   "tokens' MLA KV rows, in --kv-memory)")
      ->capture_default_str()
      ->excludes(serve_no_cache);
  serve
      ->add_option("--cache-interval", svo.cache_interval,
                   "a prefix-cache snapshot every N prompt tokens (N % 64 == 0)")
      ->capture_default_str()
      ->excludes(serve_no_cache);
  serve
      ->add_option("--context-length", svo.context_length,
                   "prompt + generated tokens per request (default: what the KV pool holds, at most 1M)")
      ->check(CLI::PositiveNumber);
  serve->add_option("--api-key", svo.api_key, "require \"Authorization: Bearer KEY\" (all but /health)");
  serve->add_option("--served-model-name", svo.served_model_name, "the model name clients send")
      ->capture_default_str();
  serve
      ->add_option("--chat-template", svo.chat_template,
                   "builtin: the built-in chat format whatever the folder's chat_template.jinja")
      ->check(CLI::IsMember({"builtin"}));
  serve->add_option("--threads", svo.threads, "HTTP worker threads (default: 2 x max batch, at least 8)")
      ->check(CLI::PositiveNumber);
  auto* serve_spec = serve->add_option("--speculative", svo.speculative,
                                       "speculative decoding: ngram (prompt lookup drafts; greedy and "
                                       "speculative-sampling verification)");
  serve->add_option("--draft-tokens", svo.draft_tokens, "drafted tokens per verify row (a tree: per branch)")
      ->needs(serve_spec)
      ->capture_default_str();
  serve->add_option("--draft-topk", svo.draft_topk, "branches of a draft tree (1: a chain)")
      ->needs(serve_spec)
      ->capture_default_str();
  serve
      ->add_option("--draft-depth", svo.draft_depth,
                   "adaptive: each continuation's depth from its acceptance and the measured verify cost "
                   "(seeded sampled requests draft at the fixed depth) | fixed: --draft-tokens")
      ->needs(serve_spec)
      ->check(CLI::IsMember({"adaptive", "fixed"}))
      ->capture_default_str();
  kda::cli::TokenizeOptions to;
  auto* tokenize =
      app.add_subcommand("tokenize", "text on stdin -> token ids on stdout (separated by spaces)");
  auto* detokenize = app.add_subcommand("detokenize", "token ids on stdin -> text on stdout");
  for (auto* sub : {tokenize, detokenize}) {
    sub->add_option(
        "--model", to.model,
        "folder with tiktoken.model (+ tokenizer_config.json; config.json's vocab_size, else B + 256)");
    sub->add_option("--synthetic-vocab", to.synthetic_vocab,
                    "a synthetic tokenizer of N ids (>= 512) instead")
        ->check(CLI::PositiveNumber);
    sub->add_option("--seed", to.seed, "--synthetic-vocab: the vocabulary's seed")->capture_default_str();
  }
  tokenize->add_flag(
      "--chat", to.chat,
      "stdin is a JSON array of messages ({role, content[, name]}): the rendered prompt's ids, "
      "with the generation prompt");
  tokenize
      ->add_option("--chat-template", to.chat_template,
                   "auto (the folder's chat_template.jinja when the built-in format is known to match it) | "
                   "builtin (the built-in format whatever the folder has)")
      ->check(CLI::IsMember({"auto", "builtin"}));
  tokenize->add_flag("--text", to.text, "--chat: print the rendered prompt text instead of its ids");
  tokenize->add_flag("--no-special", to.no_special, "special-token strings in the text are plain text");
  tokenize->add_option(
      "--save", to.save,
      "write the tokenizer's tiktoken.model + tokenizer_config.json to this folder (no stdin)");

  kda::cli::QuantizeOptions qo;
  auto* quantize = app.add_subcommand(
      "quantize",
      "pack a checkpoint's projections, experts and MLPs once (int8 / int4) into a checkpoint that "
      "--model maps and uses in place");
  quantize->add_option("--model", qo.model, "source checkpoint folder (config.json + safetensors)")
      ->required();
  quantize->add_option("--out", qo.out, "output folder (must not exist, or be empty)")->required();
  quantize->add_option("--weights", qo.weights, "int8 | int4")
      ->required()
      ->check(CLI::IsMember({"int8", "int4"}));
  quantize->add_flag("--check", qo.check,
                     "then load the source (converting) and the output (mapped): print both load times and "
                     "check that their logits on a few tokens are equal");
  quantize->add_option("--precision", qo.precision, "--check's precision: fp32 | bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}));

  CLI11_PARSE(app, argc, argv);
  try {
    if (verify->parsed()) return kda::cli::run_verify(vo);
    if (run->parsed()) return kda::cli::run_run(ro);
    if (bench->parsed()) return kda::cli::run_bench(bo);
    if (serve->parsed()) {
      if (svo.model.empty() && !svo.synthetic)
        throw std::invalid_argument("kda serve: give --model DIR or --synthetic");
      return kda::cli::run_serve(svo);
    }
    if (tokenize->parsed()) return kda::cli::run_tokenize(to);
    if (detokenize->parsed()) return kda::cli::run_detokenize(to);
    if (sim->parsed()) return kda::cli::run_simulate(so);
    if (quantize->parsed()) return kda::cli::run_quantize(qo);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda: error: %s\n", e.what());
    kda::distributed::abort_other_ranks(2);
    return 2;
  }
  return 1;
}
