// kda serve: builds the model (a checkpoint folder, or synthetic weights with a generated tokenizer), its
// pools and the engine, then answers OpenAI-compatible HTTP requests until SIGINT / SIGTERM.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "kda/cli/commands.h"
#include "kda/common/precision.h"
#include "kda/common/weights.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/layers/onednn_isa.h"
#include "kda/mem_cache/radix_cache.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/server/openai_server.h"
#include "kda/serving/engine.h"
#include "kda/serving/model_runner.h"
#include "kda/serving/simulate.h"
#include "kda/tokenizer/chat_format.h"
#include "kda/tokenizer/tokenizer.h"

namespace kda::cli {

namespace {

// --synthetic's defaults: the first 4 decoder layers of the 48B pattern (3 KDA + 1 MLA, 3 of them MoE)
// with 8 routed experts each and a 32768-token vocabulary: about 1.1 GB of bf16 weights, built in
// seconds, so that the quick start answers its first request soon after it starts.
constexpr int kSyntheticLayers = 4;
constexpr int kSyntheticExperts = 8;
constexpr int64_t kSyntheticVocab = 32768;
// Without MLA layers nothing per token is pooled; the context is still bounded (1M tokens: the real
// model's).
constexpr int64_t kMaxContext = int64_t{1} << 20;

// One KDA request slot's bytes (every KDA layer's recurrent state, fp32, and conv state) and one MLA
// token slot's bytes (every MLA layer's row), as the pools lay them out.
int64_t slot_bytes(const models::KimiLinearForCausalLM& m) {
  const auto c = m.recurrent_pool_config(1);
  const int64_t per_layer =
      int64_t{c.num_heads} * c.head_k_dim * c.head_v_dim * 4 +
      int64_t{c.conv_kernel - 1} * c.conv_dim * (c.conv_dtype == Precision::BF16 ? 2 : 4);
  return static_cast<int64_t>(c.layer_ids.size()) * per_layer;
}

int64_t kv_token_bytes(const models::KimiLinearForCausalLM& m) {
  const auto c = m.kv_pool_config(1);
  return static_cast<int64_t>(c.layer_ids.size()) * (int64_t{c.kv_lora_rank} + c.qk_rope_head_dim) *
         (c.dtype == Precision::BF16 ? 2 : 4);
}

// SIGINT / SIGTERM are blocked in every thread (the mask is set before any thread starts) and taken by
// one thread with sigtimedwait: no work in a signal handler. Before the server exists (loading the
// model) a signal ends the process at once; after, it stops the server.
class SignalStopper {
 public:
  SignalStopper() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    thread_ = std::thread([this] { loop(); });
  }
  ~SignalStopper() {
    done_.store(true);
    thread_.join();
  }
  void attach(server::OpenAIServer& srv) {
    std::lock_guard lock(mu_);
    srv_ = &srv;
  }
  // Before the server goes (a stop() in flight finishes first).
  void detach() {
    std::lock_guard lock(mu_);
    srv_ = nullptr;
  }

 private:
  void loop() {
    const timespec poll = {0, 200 * 1000 * 1000};
    bool signalled = false;
    while (!done_.load()) {
      const int sig = sigtimedwait(&set_, nullptr, &poll);
      if (sig == SIGINT || sig == SIGTERM) {
        if (!signalled)
          std::fprintf(stderr, "kda serve: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
        signalled = true;
        if (!attached()) std::_Exit(128 + sig);  // still loading: nothing to stop cleanly
      }
      std::lock_guard lock(mu_);
      attached_ = attached_ || srv_ != nullptr;
      // Repeated until serve() returns: a stop that raced with the start of serve() is not lost.
      if (signalled && srv_) srv_->stop();
    }
  }

  bool attached() {
    std::lock_guard lock(mu_);
    return attached_ || srv_ != nullptr;
  }

  sigset_t set_;
  std::atomic<bool> done_{false};
  std::mutex mu_;
  server::OpenAIServer* srv_ = nullptr;
  bool attached_ = false;  // the loop thread's own: the server was there once
  std::thread thread_;
};

}  // namespace

int run_serve(const ServeCliOptions& o) {
  SignalStopper signals;  // before any thread exists (OpenMP's start with the model)
  if (o.synthetic == !o.model.empty())
    throw std::invalid_argument("kda serve: give --model DIR or --synthetic");
  if (o.batch_invariant) layers::make_bf16_batch_invariant();  // before any oneDNN kernel exists
  const int64_t state_memory = serving::parse_byte_size(o.state_memory, "--state-memory");
  const int64_t kv_memory = serving::parse_byte_size(o.kv_memory, "--kv-memory");
  if (!(o.admission_window_ms >= 0.0 && o.admission_window_ms <= 1000.0))  // NaN fails too
    throw std::invalid_argument("--admission-window-ms must be in [0, 1000], got " +
                                std::to_string(o.admission_window_ms));

  const auto t0 = std::chrono::steady_clock::now();
  models::ModelOptions mo;
  mo.precision = parse_precision(o.precision);
  mo.weights = parse_weights(o.weights);
  mo.quantize_lm_head = o.quantize_lm_head;
  mo.kernel = kernels::parse_kernel_impl(o.kernel);
  std::unique_ptr<models::KimiLinearForCausalLM> model;
  std::unique_ptr<tokenizer::Tokenizer> tok;
  std::unique_ptr<tokenizer::ChatFormat> chat;
  if (o.synthetic) {
    mo.num_layers = o.layers > 0 ? o.layers : kSyntheticLayers;
    mo.num_experts = o.experts > 0 ? o.experts : kSyntheticExperts;
    mo.vocab = o.vocab > 0 ? o.vocab : kSyntheticVocab;
    std::fprintf(stderr,
                 "kda serve: building a synthetic model (%d decoder layer%s, %d experts, vocab %lld, %s)\n",
                 mo.num_layers, mo.num_layers == 1 ? "" : "s", mo.num_experts,
                 static_cast<long long>(mo.vocab), o.precision.c_str());
    model = models::KimiLinearForCausalLM::synthetic(io::kimi_linear_48b_config(), mo, o.seed);
    tok = std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::synthetic(mo.vocab, o.seed));
    chat = std::make_unique<tokenizer::ChatFormat>(tokenizer::ChatFormat::builtin());
  } else {
    std::fprintf(stderr, "kda serve: loading %s (%s)\n", o.model.c_str(), o.precision.c_str());
    // The tokenizer and the chat template first: a folder without them fails before the weights load.
    chat = std::make_unique<tokenizer::ChatFormat>(
        tokenizer::ChatFormat::from_dir(o.model, o.chat_template == "builtin"));
    model = models::KimiLinearForCausalLM::from_pretrained(o.model, mo);
    tok =
        std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::from_dir(o.model, model->vocab_size()));
  }

  const int64_t sb = slot_bytes(*model);
  if (sb == 0)
    throw std::invalid_argument("kda serve: the model has no KDA layer (request slots are KDA slots)");
  int64_t slots = state_memory / sb;
  if (slots < 1)
    throw std::invalid_argument("--state-memory " + o.state_memory +
                                " is too small for one request slot of " + std::to_string(sb) + " bytes");
  // Past a few batches' worth, slots only hold waiting requests' memory.
  slots = std::min<int64_t>(slots, 4 * o.max_batch);
  const bool mla = !model->mla_layer_ids().empty();
  const int64_t kv_tokens = mla ? kv_memory / kv_token_bytes(*model) : 0;
  if (mla && kv_tokens < 2)
    throw std::invalid_argument("--kv-memory " + o.kv_memory + " holds no MLA KV token slot");
  int64_t context =
      o.context_length > 0 ? o.context_length : std::min(kMaxContext, mla ? kv_tokens : kMaxContext);
  if (mla && context > kv_tokens)
    throw std::invalid_argument("--context-length " + std::to_string(context) +
                                ": the MLA KV pool (--kv-memory " + o.kv_memory + ") holds " +
                                std::to_string(kv_tokens) + " tokens");

  serving::SpeculativeOptions spec;
  spec.algorithm = serving::parse_spec_algorithm(o.speculative);
  if (spec.algorithm == serving::SpecAlgorithm::kReplay)
    throw std::invalid_argument(
        "--speculative replay: it drafts a known continuation (kda simulate only); use ngram");
  if (o.draft_tokens < 1 || o.draft_tokens > 64)
    throw std::invalid_argument("--draft-tokens must be in 1..64, got " + std::to_string(o.draft_tokens));
  if (o.draft_topk < 1 || o.draft_topk > 16)
    throw std::invalid_argument("--draft-topk must be in 1..16, got " + std::to_string(o.draft_topk));
  spec.draft_tokens = static_cast<int32_t>(o.draft_tokens);
  spec.topk = static_cast<int32_t>(o.draft_topk);
  spec.depth_mode = serving::parse_draft_depth_mode(o.draft_depth);
  spec.validate();
  // The prefix cache's snapshots live in idle request slots and its tokens' KV rows in the KV pool, both
  // given back (evicted) as requests need them; its budget caps the bytes it holds.
  int64_t cache_budget = 0;
  if (!o.no_prefix_cache) {
    if (o.cache_interval < 64 || o.cache_interval % 64 != 0)
      throw std::invalid_argument("--cache-interval must be a positive multiple of 64, got " +
                                  std::to_string(o.cache_interval));
    cache_budget = o.prefix_cache_memory == "0"
                       ? 0
                       : serving::parse_byte_size(o.prefix_cache_memory, "--prefix-cache-memory");
    if (cache_budget > 0 && cache_budget < sb)
      throw std::invalid_argument("--prefix-cache-memory " + o.prefix_cache_memory +
                                  " is too small for one state snapshot of " + std::to_string(sb) + " bytes");
  }
  // A verify row per decode row: the batch's rows, each up to spec.max_verify_tokens() tokens.
  serving::ModelRunner runner(*model, slots, kv_tokens, mo.kernel, spec.max_verify_tokens(),
                              spec.enabled() ? std::min<int64_t>(o.max_batch, slots) : 0);
  // After the runner (its pools), before the engine that uses it.
  std::optional<mem_cache::RadixCache> cache;
  serving::EngineOptions eo;
  eo.spec = spec;
  if (cache_budget > 0) {
    cache.emplace(runner.pools().recurrent_state_pool, static_cast<size_t>(cache_budget),
                  runner.pools().token_to_kv_pool.get());
    eo.scheduler.cache = &*cache;
    eo.scheduler.cache_interval = o.cache_interval;
  }
  eo.scheduler.token_budget = o.token_budget;
  eo.scheduler.max_batch = o.max_batch;
  eo.admission_window_ms = o.admission_window_ms;
  eo.stop_ids = tok->stop_ids();
  eo.producible = tok->producible();
  eo.max_context = context;
  serving::Engine engine(runner, eo);

  server::ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.api_key = o.api_key;
  so.model_name = o.served_model_name;
  so.threads = o.threads;
  so.max_context = context;
  so.max_batch = o.max_batch;
  server::OpenAIServer srv(engine, *tok, *chat, so);
  const int port = srv.bind();
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(
      stderr,
      "kda serve: ready in %.1f s: %lld request slots, %lld MLA KV token slots, context %lld tokens, "
      "vocab %lld, prefix cache %s\n",
      build_s, static_cast<long long>(slots), static_cast<long long>(kv_tokens),
      static_cast<long long>(context), static_cast<long long>(model->vocab_size()),
      cache ? (std::to_string(cache_budget) + " bytes").c_str() : "off");
  if (spec.enabled())
    std::fprintf(stderr,
                 "kda serve: speculative decoding: ngram, %d drafts per branch, %d branch%s, %s depth\n",
                 spec.draft_tokens, spec.topk, spec.topk == 1 ? "" : "es", to_string(spec.depth_mode));
  std::printf("kda serve: listening on http://%s:%d\n", o.host.c_str(), port);
  std::fflush(stdout);
  signals.attach(srv);
  struct Detach {
    SignalStopper& s;
    ~Detach() { s.detach(); }
  } detach{signals};  // on any way out, before srv goes
  srv.serve();
  std::fprintf(stderr, "kda serve: stopped\n");
  return 0;
}

}  // namespace kda::cli
