// `kda bench --only serve`: what the OpenAI-compatible server adds over the engine it drives. One small
// synthetic model, one serving::Engine, and a server::OpenAIServer on it bound to 127.0.0.1 (a free
// port), whose serve() runs the engine's loop, in one process. The same workload runs in turns through both
// doors:
//   - throughput: kRequests requests of about kPromptTokens prompt tokens each, kMaxTokens generated tokens
//     each (greedy, ignore_eos: every request runs to its length), all sent at once; in-process through
//     Engine::submit with the ids, over HTTP by kRequests httplib::Client threads streaming
//     /v1/completions with the text the ids came from. Tokens/s: generated tokens over the time from the
//     first send to the last request's end. http_over_inprocess_tokens_per_s is the ratio of the rounds'
//     best rates; http_over_inprocess_paired_median that of each round's pair, with its min and max (a
//     loaded machine's drifts move a pair's two batches together more than two rounds' bests).
//     The engine's admission window (EngineOptions::admission_window_ms, the default) holds each round's
//     first step until its burst has arrived; the mean hold per round is reported for both doors.
//   - TTFT at a kTtftPromptTokens-token prompt, one request at a time, one token: in-process, submit to
//     its token's event; over HTTP, the POST of the text to the first server-sent event that carries the
//     token (so it counts the request's parsing, tokenization, the engine's queue and the event's
//     formatting and write). http_ttft_added_ms: the median of the rounds' differences (HTTP - in-process),
//     which the prefill's run-to-run scatter swamps. http_ttft_added_direct_ms takes the engine's part out
//     of each HTTP request itself: its TTFT at the client less the engine's part of it, which the server's
//     /metrics give (TTFT from arrival, less the arrival-to-submit preparation), read before and after it.
// The server must count the same prompt tokens as the ids the engine is given: a differing count is an
// error, not a figure.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kda/bench/rows.h"
#include "kda/io/kimi_linear_48b.h"
#include "kda/models/kimi_linear_model.h"
#include "kda/sampling/sampling_params.h"
#include "kda/server/openai_server.h"
#include "kda/serving/engine.h"
#include "kda/serving/model_runner.h"
#include "kda/tokenizer/chat_format.h"
#include "kda/tokenizer/tokenizer.h"

namespace kda::bench {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The model `kda serve --synthetic` serves by default: the real shapes' first kLayers decoder layers
// (KDA with the dense MLP, two KDA with MoE, MLA with MoE), kExperts routed experts, bf16, a kVocab
// vocabulary with its synthetic tokenizer.
constexpr int kLayers = 4;
constexpr int kExperts = 8;
constexpr int64_t kVocab = 32768;
constexpr int kRequests = 16;
constexpr int kPromptTokens = 128;
constexpr int kMaxTokens = 64;
constexpr int kTtftPromptTokens = 1000;
constexpr int kThroughputRounds = 5;
constexpr int kTtftRounds = 11;

// Text of about `tokens` tokens: space-separated words drawn from English and Chinese ones, grown a word
// at a time until it encodes to at least `tokens` ids (a word's few tokens more at most).
std::string prompt_text(const tokenizer::Tokenizer& tok, int tokens, uint64_t seed) {
  static const char* const kWords[] = {
      "the",    "of",    "and",  "model",  "request", "server", "token", "stream", "batch", "state",
      "linear", "delta", "rule", "memory", "cache",   "prefix", "time",  "world",  "city",  "music",
      "我们",   "世界",  "时间", "模型",   "数据",    "计算",   "网络",  "服务",   "请求",  "语言"};
  constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);
  std::mt19937_64 rng(seed);
  std::string text;
  while (static_cast<int>(tok.encode(text, true).size()) < tokens) {
    if (!text.empty()) text += ' ';
    text += kWords[rng() % kNumWords];
  }
  return text;
}

sampling::SamplingParams fixed_length(int max_tokens) {
  sampling::SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// One in-process batch: every request submitted at once; returns the seconds from the first submit to
// the last finish event and sets *tokens to the tokens generated. first_token_s: each request's submit
// to its first event.
double run_inprocess(serving::Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                     int max_tokens, int64_t* tokens, std::vector<double>* first_token_s = nullptr) {
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  std::atomic<int64_t> generated{0};
  const size_t n = prompts.size();
  std::vector<Clock::time_point> sent(n);
  std::vector<double> first(n, -1.0);
  const auto t0 = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    serving::GenerateRequest req;
    req.prompt = prompts[i];
    req.params = fixed_length(max_tokens);
    sent[i] = Clock::now();
    engine.submit(std::move(req), [&, i](const serving::TokenEvent& ev) {
      if (ev.token >= 0) generated.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lk(mu);
      if (first[i] < 0) first[i] = since(sent[i]);
      if (ev.finish != serving::FinishReason::kNone && ++done == static_cast<int>(n)) cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return done == static_cast<int>(n); });
  const double s = since(t0);
  *tokens = generated.load();
  if (first_token_s) *first_token_s = first;
  return s;
}

// One streamed /v1/completions request's outcome.
struct StreamResult {
  // The POST to the first event that carries a token: text or a finish reason (the server's opening
  // chunk, sent before any token, does not count).
  double first_token_s = -1.0;
  int64_t prompt_tokens = -1, completion_tokens = -1;  // the usage chunk's
  bool done = false;                                   // saw data: [DONE]
  std::string error;
};

StreamResult post_stream(int port, const std::string& text, int max_tokens) {
  StreamResult r;
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(600, 0);
  const nlohmann::json body = {{"prompt", text},     {"max_tokens", max_tokens},
                               {"temperature", 0.0}, {"ignore_eos", true},
                               {"stream", true},     {"stream_options", {{"include_usage", true}}}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
  req.body = body.dump();
  std::string buf;
  size_t received = 0;
  const auto t0 = Clock::now();
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    const double now = since(t0);
    received += len;
    buf.append(data, len);
    // Events end with a blank line; each of ours is one `data: ...` line.
    for (size_t end; (end = buf.find("\n\n")) != std::string::npos; buf.erase(0, end + 2)) {
      const std::string ev = buf.substr(0, end);
      if (ev.rfind("data: ", 0) != 0) continue;
      const std::string payload = ev.substr(6);
      if (payload == "[DONE]") {
        r.done = true;
        continue;
      }
      const auto j = nlohmann::json::parse(payload, nullptr, false);
      if (j.is_discarded()) {
        r.error = "an event that is not JSON: " + payload.substr(0, 200);
        return false;
      }
      if (j.contains("error")) {
        r.error = j["error"].dump();
        return false;
      }
      if (r.first_token_s < 0 && j.contains("choices") && j["choices"].is_array())
        for (const auto& c : j["choices"]) {
          const bool text =
              c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty();
          const bool finish = c.contains("finish_reason") && !c["finish_reason"].is_null();
          if (text || finish) r.first_token_s = now;
        }
      if (j.contains("usage") && j["usage"].is_object()) {
        r.prompt_tokens = j["usage"].value("prompt_tokens", int64_t{-1});
        r.completion_tokens = j["usage"].value("completion_tokens", int64_t{-1});
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (!cli.send(req, res, err)) {
    if (r.error.empty())
      r.error = "HTTP request failed after " + std::to_string(since(t0)) + " s and " +
                std::to_string(received) + " bytes of the reply: " + httplib::to_string(err);
  } else if (res.status != 200) {
    r.error = "HTTP " + std::to_string(res.status) + ": " + buf.substr(0, 300);
  } else if (!r.done) {
    r.error = "the stream ended without data: [DONE]";
  }
  return r;
}

// One HTTP batch: a client thread per request, released together; the seconds from the release to the
// last stream's end. Every request must succeed with the expected token counts.
double run_http(int port, const std::vector<std::string>& texts, const std::vector<std::vector<int32_t>>& ids,
                int max_tokens, int64_t* tokens) {
  const size_t n = texts.size();
  std::vector<StreamResult> res(n);
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return go; });
      }
      try {
        res[i] = post_stream(port, texts[i], max_tokens);
      } catch (const std::exception& e) {  // no exception leaves a thread
        res[i].error = e.what();
      }
    });
  const auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> lk(mu);
    go = true;
  }
  cv.notify_all();
  for (auto& t : threads) t.join();
  const double s = since(t0);
  *tokens = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!res[i].error.empty())
      throw std::runtime_error("bench serve: request " + std::to_string(i) + ": " + res[i].error);
    if (res[i].prompt_tokens != static_cast<int64_t>(ids[i].size()))
      throw std::runtime_error("bench serve: the server counted " + std::to_string(res[i].prompt_tokens) +
                               " prompt tokens where the engine is given " + std::to_string(ids[i].size()) +
                               ": not the same workload");
    if (res[i].completion_tokens != max_tokens)
      throw std::runtime_error("bench serve: request " + std::to_string(i) + " generated " +
                               std::to_string(res[i].completion_tokens) + " tokens, not " +
                               std::to_string(max_tokens));
    *tokens += res[i].completion_tokens;
  }
  return s;
}

// The server's /metrics: the sums of its TTFT and preparation histograms, in seconds.
struct ServerTimes {
  double ttft_s = 0.0, prepare_s = 0.0;
};

ServerTimes scrape(int port) {
  httplib::Client cli("127.0.0.1", port);
  const auto res = cli.Get("/metrics");
  if (!res || res->status != 200) throw std::runtime_error("bench serve: GET /metrics failed");
  ServerTimes t;
  bool ttft = false, prepare = false;
  const auto value = [&](const char* name, double* v, bool* seen) {
    const std::string key = std::string("\n") + name + " ";
    const size_t at = res->body.find(key);
    if (at == std::string::npos) return;
    *v = std::stod(res->body.substr(at + key.size(), 40));
    *seen = true;
  };
  value("kda_time_to_first_token_seconds_sum", &t.ttft_s, &ttft);
  value("kda_request_prepare_seconds_sum", &t.prepare_s, &prepare);
  if (!ttft || !prepare) throw std::runtime_error("bench serve: /metrics lacks the TTFT or preparation sums");
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

struct Figures {
  double best_in = 0.0, best_http = 0.0;  // tokens/s, the best round of each
  int64_t steps_in = 0, steps_http = 0;   // the engine's steps in each one's best round
  // The admission window's hold at the start of each round (its burst's spread at the engine, until the
  // batch was full), the mean over the rounds in ms.
  double hold_in_ms = 0.0, hold_http_ms = 0.0;
  // Each round's HTTP / in-process rate (its two batches ran back to back): the median and the spread.
  double ratio_median = 0.0, ratio_min = 0.0, ratio_max = 0.0;
  double in_ms = 0.0, http_ms = 0.0, added_ms = 0.0, direct_ms = 0.0, prepare_ms = 0.0;
};

// The measured rounds, in turns, after a warm-up of both paths (the pools' first touch, the server's
// threads): the throughput rounds' best rates, then the TTFT medians in ms.
Figures rounds(serving::Engine& engine, int port, const std::vector<std::string>& texts,
               const std::vector<std::vector<int32_t>>& ids, const std::string& long_text,
               const std::vector<int32_t>& long_ids) {
  Figures f;
  int64_t gen_in = 0, gen_http = 0;
  run_inprocess(engine, {ids[0]}, 2, &gen_in);
  run_http(port, {texts[0]}, {ids[0]}, 2, &gen_http);
  // Each round runs both; which goes first alternates, so that neither always meets the other's
  // after-effects (warm caches, the load the other left).
  // The steps tell a slower round's cause: more steps (requests that reached the engine spread over
  // more than one step) or slower ones.
  double rate_in = 0.0, rate_http = 0.0;
  std::vector<double> ratios;
  const auto held_ms = [&](double before) { return (engine.stats().admission_wait_s - before) * 1e3; };
  const auto in_round = [&] {
    const int64_t steps = engine.stats().steps;
    const double held = engine.stats().admission_wait_s;
    const double s = run_inprocess(engine, ids, kMaxTokens, &gen_in);
    f.hold_in_ms += held_ms(held) / kThroughputRounds;
    rate_in = static_cast<double>(gen_in) / s;
    if (rate_in > f.best_in) {
      f.best_in = rate_in;
      f.steps_in = engine.stats().steps - steps;
    }
  };
  const auto http_round = [&] {
    const int64_t steps = engine.stats().steps;
    const double held = engine.stats().admission_wait_s;
    const double s = run_http(port, texts, ids, kMaxTokens, &gen_http);
    f.hold_http_ms += held_ms(held) / kThroughputRounds;
    rate_http = static_cast<double>(gen_http) / s;
    if (rate_http > f.best_http) {
      f.best_http = rate_http;
      f.steps_http = engine.stats().steps - steps;
    }
  };
  for (int r = 0; r < kThroughputRounds; ++r) {
    if (r % 2 == 0) {
      in_round();
      http_round();
    } else {
      http_round();
      in_round();
    }
    ratios.push_back(rate_http / rate_in);
  }
  f.ratio_median = median(ratios);
  f.ratio_min = *std::min_element(ratios.begin(), ratios.end());
  f.ratio_max = *std::max_element(ratios.begin(), ratios.end());
  if (gen_in != gen_http)
    throw std::runtime_error("bench serve: in-process generated " + std::to_string(gen_in) +
                             " tokens, HTTP " + std::to_string(gen_http));

  std::vector<double> ttft_in, ttft_http, direct, prepare;
  const auto in_ttft = [&] {
    int64_t t = 0;
    std::vector<double> first;
    run_inprocess(engine, {long_ids}, 1, &t, &first);
    ttft_in.push_back(first[0]);
  };
  const auto http_ttft = [&] {
    const ServerTimes before = scrape(port);
    const StreamResult h = post_stream(port, long_text, 1);
    const ServerTimes after = scrape(port);
    if (!h.error.empty()) throw std::runtime_error("bench serve: TTFT request: " + h.error);
    if (h.prompt_tokens != static_cast<int64_t>(long_ids.size()))
      throw std::runtime_error("bench serve: the server counted " + std::to_string(h.prompt_tokens) +
                               " prompt tokens where the engine is given " + std::to_string(long_ids.size()));
    if (h.first_token_s < 0)
      throw std::runtime_error("bench serve: TTFT request: no event carried its token");
    ttft_http.push_back(h.first_token_s);
    const double engine_s = (after.ttft_s - before.ttft_s) - (after.prepare_s - before.prepare_s);
    direct.push_back(h.first_token_s - engine_s);
    prepare.push_back(after.prepare_s - before.prepare_s);
  };
  for (int r = 0; r < kTtftRounds; ++r) {
    if (r % 2 == 0) {
      in_ttft();
      http_ttft();
    } else {
      http_ttft();
      in_ttft();
    }
  }
  f.in_ms = median(ttft_in) * 1e3;
  f.http_ms = median(ttft_http) * 1e3;
  // The added time: the median of each round's pair (its two requests ran back to back), which cancels
  // the machine's slower drifts better than a difference of the two medians.
  std::vector<double> added;
  for (size_t r = 0; r < ttft_in.size(); ++r) added.push_back(ttft_http[r] - ttft_in[r]);
  f.added_ms = median(added) * 1e3;
  f.direct_ms = median(direct) * 1e3;
  f.prepare_ms = median(prepare) * 1e3;
  return f;
}

}  // namespace

void bench_serve(nlohmann::json& j, const Say& say) {
  io::KimiLinearConfig cfg = io::kimi_linear_48b_config();
  models::ModelOptions mo;
  mo.precision = Precision::BF16;
  mo.weights = Weights::BF16;
  mo.num_layers = kLayers;
  mo.num_experts = kExperts;
  mo.vocab = kVocab;
  auto model = models::KimiLinearForCausalLM::synthetic(cfg, mo, 0);
  const auto tok = tokenizer::Tokenizer::synthetic(kVocab, 0);
  const auto chat = tokenizer::ChatFormat::builtin();

  // Prompts: kRequests texts for the throughput rounds, one long one for TTFT; the engine gets their ids.
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
  for (int i = 0; i < kRequests; ++i) {
    texts.push_back(prompt_text(tok, kPromptTokens, 100 + i));
    ids.push_back(tok.encode(texts.back(), true));
  }
  const std::string long_text = prompt_text(tok, kTtftPromptTokens, 99);
  const std::vector<int32_t> long_ids = tok.encode(long_text, true);
  int64_t prompt_tokens = 0;
  for (const auto& p : ids) prompt_tokens += static_cast<int64_t>(p.size());

  const int64_t slots = kRequests + 2;
  const int64_t kv_tokens = slots * (static_cast<int64_t>(long_ids.size()) + kPromptTokens + kMaxTokens + 64);
  serving::ModelRunner runner(*model, slots, kv_tokens, kernels::KernelImpl::Auto);
  serving::EngineOptions eo;
  eo.scheduler.max_batch = kRequests;
  eo.scheduler.token_budget = 4096;
  eo.stop_ids = tok.stop_ids();
  eo.producible = tok.producible();
  serving::Engine engine(runner, eo);

  server::ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.max_batch = kRequests;
  server::OpenAIServer srv(engine, tok, chat, so);
  const int port = srv.bind();

  // serve() runs the engine's loop on a thread of its own too: the in-process requests go to the same
  // running engine.
  std::string server_error;  // written by the server's thread, read after its join
  std::thread server_thread([&] {
    try {
      srv.serve();
    } catch (const std::exception& e) {
      server_error = e.what();
    }
  });
  say("\nserver overhead (%d layers of Kimi-Linear-48B-A3B shapes, %d experts, vocab %lld; HTTP on "
      "127.0.0.1:%d)\n",
      kLayers, kExperts, static_cast<long long>(kVocab), port);
  // The rounds; both loops end whatever they throw.
  Figures f;
  std::exception_ptr failure;
  try {
    f = rounds(engine, port, texts, ids, long_text, long_ids);
  } catch (...) {
    failure = std::current_exception();
  }
  srv.stop();
  server_thread.join();
  if (failure) std::rethrow_exception(failure);
  if (!server_error.empty()) throw std::runtime_error("bench serve: the server: " + server_error);

  // Of what HTTP adds, the tokenization alone: the long prompt's encode, best of a few (a small, steady
  // figure beside the TTFT difference, which the model's step time makes noisy).
  const double tokenize_ms = best_seconds([&] { (void)tok.encode(long_text, true); }, 5, 0.2) * 1e3;
  say("%-34s %12s %12s %10s\n", "", "in-process", "HTTP", "HTTP/in");
  say("%-34s %12.1f %12.1f %10.3f\n", "16 streams, tokens/s", f.best_in, f.best_http,
      f.best_http / f.best_in);
  say("%-34s %12s %12s %10.3f (of %d pairs: %.3f to %.3f)\n", "same, median of each round's pair", "", "",
      f.ratio_median, kThroughputRounds, f.ratio_min, f.ratio_max);
  say("%-34s %12lld %12lld\n", "engine steps of those rounds", static_cast<long long>(f.steps_in),
      static_cast<long long>(f.steps_http));
  say("%-34s %12.3f %12.3f (window %.1f ms)\n", "first step held for arrivals, ms", f.hold_in_ms,
      f.hold_http_ms, eo.admission_window_ms);
  say("%-34s %12.2f %12.2f %+9.2f ms\n", "TTFT ms (median; added: of pairs)", f.in_ms, f.http_ms, f.added_ms);
  say("%-34s %12s %12.3f ms (of it, preparing the request %.3f ms; tokenizing alone %.3f ms)\n",
      "TTFT added by HTTP, direct (median)", "", f.direct_ms, f.prepare_ms, tokenize_ms);
  say("(%d requests x %lld prompt tokens in all, %d tokens each, best of %d rounds in turns; TTFT at a "
      "%zu-token prompt, median of %d in turns)\n",
      kRequests, static_cast<long long>(prompt_tokens), kMaxTokens, kThroughputRounds, long_ids.size(),
      kTtftRounds);
  j["serve"] = {{"layers", kLayers},
                {"experts", kExperts},
                {"vocab", kVocab},
                {"requests", kRequests},
                {"prompt_tokens", prompt_tokens},
                {"max_tokens", kMaxTokens},
                {"inprocess_tokens_per_s", f.best_in},
                {"http_tokens_per_s", f.best_http},
                {"http_over_inprocess_tokens_per_s", f.best_http / f.best_in},
                {"http_over_inprocess_paired_median", f.ratio_median},
                {"http_over_inprocess_paired_min", f.ratio_min},
                {"http_over_inprocess_paired_max", f.ratio_max},
                {"inprocess_steps", f.steps_in},
                {"http_steps", f.steps_http},
                {"admission_window_ms", eo.admission_window_ms},
                {"inprocess_admission_hold_ms", f.hold_in_ms},
                {"http_admission_hold_ms", f.hold_http_ms},
                {"ttft_prompt_tokens", static_cast<int64_t>(long_ids.size())},
                {"inprocess_ttft_ms", f.in_ms},
                {"http_ttft_ms", f.http_ms},
                {"http_ttft_added_ms", f.added_ms},
                {"http_ttft_added_direct_ms", f.direct_ms},
                {"http_ttft_prepare_ms", f.prepare_ms},
                {"ttft_tokenize_ms", tokenize_ms}};
}

}  // namespace kda::bench
