// kda simulate as a library: a serving engine's scheduler driving the whole Kimi-Linear decoder
// (models::KimiLinearForCausalLM: KDA and MLA layers, dense MLP and MoE) with continuous batching, its
// statistics, the --outputs archive and the self-check.
//
// Everything the options can get wrong is checked before any work (no model is built, no pool
// allocated): each error is a std::invalid_argument naming the option.
//
// A request runs its prompt_len prompt tokens (EXTEND, chunked by the token budget), then output_len
// decode tokens per continuation, each the token generated just before (greedy: final norm, LM head,
// argmax), output_len + 1 tokens generated in all (request.h). With --parallel-samples n the request
// itself is continuation 0 and keeps its slot; continuations 1..n-1 are forked from it after the prompt
// (with greedy decoding they generate the same tokens). Outputs (--outputs, SimulateResult): per
// continuation, the last-layer output (the residual stream after the last decoder layer, before the final
// norm) of every token it processed, [prompt_len + output_len, hidden] float32, key "req_<id>" (n = 1) or
// "req_<id>_s<j>" (n > 1, the prompt rows repeated in every continuation), and the generated token ids,
// [output_len + 1] int32, key "tokens_<id>" or "tokens_<id>_s<j>".
//
// The self-check teacher-forces: each checked request is re-run alone on a fresh pool on the token
// sequence the batched run produced (its prompt, then each continuation's generated tokens as the
// decode inputs), and every position's last-layer output must match the batched run's within the
// precision's tolerance; whether its own argmax picks equal the batched run's tokens is reported
// (a near-tie between the two top logits may flip under rounding, bf16 above all), not required.
//
// The pool holds min(state_memory / slot bytes, the workload's sequence count) request slots, plus
// min(prefix_cache_memory / slot bytes, the snapshots the workload could create) with the cache: more could
// never be in use at once. With MLA layers, min(kv_memory / bytes per token, the workload's tokens) MLA KV
// token slots beside it (with speculative decoding, each continuation's verify drafts too); a model with
// MLA layers serves without the prefix cache (a KDA state snapshot cannot restore the prefix's MLA KV
// rows).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/distributed/communicator.h"
#include "kda/io/config.h"
#include "kda/server_args.h"
#include "kda/serving/request.h"
#include "kda/serving/speculative.h"
#include "kda/serving/workload_driver.h"

namespace kda::serving {

struct SimulateOptions {
  // Model: a checkpoint folder, or (empty) seeded synthetic weights at `synthetic_config`'s shapes
  // (default: Kimi-Linear-48B-A3B; a synthetic config needs the model fields, has_model_fields).
  std::string model_dir;
  std::optional<io::KimiLinearConfig> synthetic_config;
  int layers = 0;  // the first N decoder layers of the config's pattern; 0: all
  // Synthetic only: routed experts per MoE layer (top-k stays the config's, so the active parameters
  // per token are the config's). 0: kDefaultExperts for the default 48B config, else the config's.
  int num_experts = 0;
  Precision precision = Precision::BF16;
  Weights weights = Weights::BF16;
  bool quantize_lm_head = false;  // the LM head in `weights` too (models::ModelOptions::quantize_lm_head)
  std::string kernel = "auto";    // auto | naive | optimized
  uint64_t seed = 0;              // weights, workload and inputs
  // Vocabulary of the seeded embedding and LM head; 0: the config's vocab_size (a checkpoint's always:
  // a value unlike it is an error).
  int64_t vocab = 0;
  std::string workload = "random";  // a label for the summary (the requests are what runs)

  std::vector<RequestSpec> requests;  // the workload: make_workload() or load_trace()
  // Token budget per step = server_args.chunked_prefill_size; mixed batches = enable_mixed_chunk.
  // disable_radix_cache: the library serves without the prefix cache unless asked (kda simulate asks).
  ServerArgs server_args = [] {
    ServerArgs a;
    a.disable_radix_cache = true;
    return a;
  }();
  int64_t max_batch = 64;
  int64_t state_memory = int64_t{2} << 30;  // bytes for the recurrent state pool (requests)
  int64_t kv_memory = int64_t{1} << 30;     // bytes for the MLA token KV pool (models with MLA layers)
  // Prefix cache of state snapshots (mem_cache::RadixCache), on unless server_args.disable_radix_cache:
  // the pool gets prefix_cache_memory bytes of snapshot slots on top of state_memory (one pool accounts
  // for both; admission evicts snapshots when requests need their slots). A snapshot every
  // cache_interval prompt tokens (a multiple of 64). 0 bytes: a cache that never stores.
  int64_t prefix_cache_memory = int64_t{1} << 30;
  int64_t cache_interval = 256;
  int32_t parallel_samples = 1;
  // Speculative decoding (serving/speculative.h); server_args.speculative_algorithm must name the same
  // algorithm. The backend's verify buffer (max_verify_tokens tokens per verify row, one row per decode
  // row of a step: min(max_batch, request slots), which also caps the rows of a decode step; its limits
  // are set in the pool's config) comes out of state_memory with the request slots. replay first
  // serves the workload without speculation for the true continuations; the statistics are the
  // speculative run's.
  SpeculativeOptions spec;
  int64_t check = 0;          // requests re-run alone and compared
  bool keep_outputs = false;  // SimulateResult::outputs holds every sequence's rows
  std::string outputs_path;   // .npz of every sequence's rows (empty: none)

  // Tensor parallelism: this rank's place in its group (size 1: none). Every rank of the group runs the
  // same schedule on its shard of every layer; the outputs are whole on every rank.
  distributed::TensorParallel tp;
  // Data-parallel attention: `dp` groups of ranks own disjoint requests (workload index i goes to group
  // i % dp), each group with its own pool and slots. `world` spans every rank of every group; rank 0 of
  // the world gathers the groups' statistics and outputs. dp == 1: one group, `world` unused.
  int dp = 1;
  int dp_rank = 0;
  distributed::Communicator* world = nullptr;

  const std::atomic<bool>* stop = nullptr;            // SIGINT: stop after the current step
  std::function<void(const ProgressInfo&)> progress;  // after every step of the main run
  std::function<void(const std::string&)> log;        // phase lines (model built, check...)
};

struct CheckReport {
  std::vector<int64_t> request_ids;  // the requests re-run alone
  // fp32: "max_err_ratio", the worst elementwise |a - b| / (1e-5 + 1e-5 |b|) (the spec's tolerance),
  // bound 1. bf16: "rel_l2", the relative L2 of a continuation's rows, bound bf16_check_bound(layers);
  // int8 / int4 weights: "rel_l2", bound quantized_check_bound() (self_check.cc says why).
  std::string metric;
  double worst = 0.0;        // the value reached: the worst over every continuation
  double bound = 1.0;        // passes when worst <= bound
  double worst_ratio = 0.0;  // worst / bound
  bool ok = true;
  double wall_s = 0.0;
  // The re-runs' own argmax tokens against the batched run's generated tokens (reported, not required).
  int64_t tokens_matched = 0, tokens_total = 0;
  bool tokens_all_matched() const { return tokens_matched == tokens_total; }
};

// The synthetic 48B model's routed experts per MoE layer by default: the most that keeps the default
// `kda simulate` within 14 GiB of resident memory on the 23 GiB development machine (bf16 weights: each
// expert is 14 MB per MoE layer, 26 MoE layers; the rest of the model is about 5 GB).
inline constexpr int kDefaultExperts = 16;

struct SimulateResult {
  std::string model;  // "synthetic" or the checkpoint folder
  Precision precision = Precision::BF16;
  Weights weights = Weights::BF16;
  bool quantize_lm_head = false;  // the LM head in `weights` too
  int64_t weight_bytes = 0;       // resident weight bytes per decoder layer, the mean (this rank)
  // The whole model on this rank (embedding, layers, LM head), what a decoded token reads of it, and the
  // model's active parameters per token (every rank's: the config's top-k experts whatever num_experts).
  int64_t model_weight_bytes = 0, active_weight_bytes = 0, active_params = 0;
  int kda_layers = 0, mla_layers = 0, moe_layers = 0;
  int num_experts = 0, experts_per_token = 0;  // routed experts per MoE layer, top-k (0 without MoE)
  // MLA token KV pool (zero without MLA layers): token slots, bytes per token over every MLA layer, bytes.
  int64_t kv_tokens = 0, kv_token_bytes = 0, kv_bytes = 0;
  int layers = 0;
  int64_t hidden = 0;
  bool mixed = false, radix_cache_disabled = false;
  int64_t token_budget = 0, max_batch = 0;
  int32_t parallel_samples = 1;
  int64_t requests = 0;
  int64_t vocab = 0;
  std::string workload;
  int64_t slot_bytes = 0, pool_slots = 0, pool_bytes = 0;
  int64_t prefix_cache_memory = 0, cache_interval = 0;  // 0 / 0 with the cache off
  SpeculativeOptions spec;
  double replay_prerun_s = 0.0;  // replay: the run without speculation that gave the true continuations
  double build_s = 0.0;
  ServeResult serve;
  double step_ms_p50 = 0.0, step_ms_p99 = 0.0;
  double ttft_ms_p50 = 0.0, ttft_ms_p99 = 0.0;
  double ttft_ms_p50_later_turns = 0.0, ttft_ms_p99_later_turns = 0.0;  // turns >= 2 only (0: none)
  std::optional<CheckReport> check;  // absent when --check 0 or interrupted
  // Accounting after the serving loop (a completed run): state slots held by neither a request nor a
  // cached snapshot, request indices still taken, and whether the prefix cache's tree is consistent with
  // nothing pending or locked. A leak fails the run (ok() false). Summed over --dp groups.
  int64_t leaked_slots = 0, leaked_request_indices = 0;
  int64_t leaked_kv_tokens = 0;  // MLA KV token slots still taken after the run
  bool cache_consistent = true;
  std::string accounting_error;  // the first inconsistency, empty when none
  bool accounting_ok() const {
    return leaked_slots == 0 && leaked_request_indices == 0 && leaked_kv_tokens == 0 && cache_consistent;
  }
  // Resident memory (VmRSS) after each step of the serving loop, bytes; rss_growth = the last sample over
  // the sample at the end of the first tenth of the steps, minus 1 (a soak's leak shows as growth).
  std::vector<int64_t> rss_bytes;
  double rss_growth() const;
  bool ok() const { return (!check || check->ok) && accounting_ok(); }
};

// Output archive key of a sequence: "req_<id>" with one sample per request, else "req_<id>_s<j>";
// of its generated tokens: "tokens_<id>" or "tokens_<id>_s<j>".
std::string output_key(const SequenceOutput& s, int32_t parallel_samples);
std::string tokens_key(const SequenceOutput& s, int32_t parallel_samples);

// The vocabulary a run uses (SimulateOptions::vocab): needed before the model is built, to generate
// a workload's token ids and check a trace's. Reads only a checkpoint's tensor headers.
// `vocab` 0: the checkpoint's config's vocab_size, else the synthetic config's (default: the 48B model's).
int64_t resolve_vocab(const std::string& model_dir, int64_t vocab,
                      const std::optional<io::KimiLinearConfig>& synthetic_config = std::nullopt);

// "2GiB", "512MiB", "64M", "1073741824": bytes (binary units; B, K/KiB, M/MiB, G/GiB, T/TiB).
int64_t parse_byte_size(const std::string& text, const std::string& option);

SimulateResult run_simulation(const SimulateOptions& options);

double percentile(std::vector<double> v, double p);  // nearest-rank, p in [0, 100]
// The --json summary. prefill_tok_s / decode_tok_s are tokens over the serving loop's wall time (model
// build and self-check excluded); step_ms_* cover every model step (all layers); pool_bytes is what
// the pool allocated; check_worst_error_ratio (worst / bound) is null without a check, check_worst the
// value reached and check_bound its bound (check_metric names the metric). prefill_tokens counts the prompt
// tokens of the requests served, prefill_tokens_computed those that went through the layers (equal
// without a prefix cache); ttft_ms_* are the requests' arrival-to-first-token times, ttft_ms_*_later_turns
// the same over the later_turns requests that are a session's turn 2 or later (0 when none).
// prefix_cache_hit_tokens are prompt tokens restored from snapshots, prefix_cache_hit_rate = hit tokens /
// prompt tokens, and prefix_cache_bytes / _snapshots what the cache held at the end (summed over --dp
// groups), _evictions how many snapshots it evicted. With hits, a kept output's rows start at its restored
// prefix (rows_from). Speculative decoding: spec_draft_tokens drafted, spec_accepted_tokens accepted,
// spec_accept_rate = accepted / drafted, spec_tokens_per_step = tokens emitted per request per verify step
// (accepted + 1), spec_verify_steps, spec_mean_depth the mean depth decode rows drafted at (adaptive:
// chosen per sequence, 0 where speculation did not pay), spec_state_bytes the backend's verify buffer;
// decode_tokens counts generated tokens either way (drafts are not counted), so decode_tok_s compares with
// and without
// speculation. The model: layers decoder layers, kda_layers / mla_layers / moe_layers of them, num_experts
// routed experts per MoE layer and experts_per_token (top-k) of them per token, weight_bytes the mean
// resident bytes of a decoder layer, model_weight_bytes the whole model's, active_weight_bytes what one
// decoded token reads, active_params the parameters one token uses (the real model's whenever top-k and the
// expert size are). MLA KV pool: kv_tokens token slots of kv_token_bytes (every MLA layer), kv_bytes
// allocated, peak_kv_tokens in use at the busiest step, leaked_kv_tokens still taken after the run (0 or the
// run fails).
nlohmann::json to_json(const SimulateResult& r);

}  // namespace kda::serving
