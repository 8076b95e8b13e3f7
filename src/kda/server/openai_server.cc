#include "kda/server/openai_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "kda/server/connection.h"
#include "kda/server/metrics.h"
#include "kda/server/protocol.h"
#include "kda/server/request_output.h"

namespace kda::server {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// How long a waiting worker sleeps before it looks at the server's stop flag and the client again.
constexpr auto kPoll = std::chrono::milliseconds(100);

// The events of one request, from the engine's thread (the sink) to the worker answering it. The sink
// holds it too, so that events arriving after the worker gave up land somewhere valid.
struct EventQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<serving::TokenEvent> events;
  // Latency metrics, kept by the sink: the request's arrival and each continuation's last token.
  Clock::time_point arrival;
  bool first_token = false;
  std::vector<Clock::time_point> last_token;
};

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The field an engine message "<field>: <what is wrong>" names (empty when it names none).
std::string field_of(const std::string& msg) {
  const auto colon = msg.find(':');
  if (colon == std::string::npos || colon == 0 || colon > 64) return {};
  const std::string f = msg.substr(0, colon);
  return f.find(' ') == std::string::npos ? f : std::string();
}

void send_json(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, "application/json");
}

}  // namespace

struct OpenAIServer::Impl {
  serving::Engine& engine;
  const tokenizer::Tokenizer& tok;
  const tokenizer::ChatFormat& chat;
  ServerOptions opt;
  httplib::Server http;
  Metrics metrics;
  std::atomic<bool> stopping{false};
  std::atomic<bool> engine_stop{false};
  bool bound = false;
  socket_t listen_sock = INVALID_SOCKET;

  Impl(serving::Engine& e, const tokenizer::Tokenizer& t, const tokenizer::ChatFormat& c, ServerOptions o)
      : engine(e), tok(t), chat(c), opt(std::move(o)) {}

  void fail(httplib::Response& res, const ApiError& e) {
    metrics.count_rejected(e.status);
    send_json(res, e.status, error_body(e));
  }

  // The API key on every endpoint but /health (checked after the body was read, so that a refused
  // request leaves its keep-alive connection in a clean state).
  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (opt.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + opt.api_key) return true;
    ApiError e(401, "", "invalid or missing API key: send \"Authorization: Bearer <key>\"");
    metrics.count_rejected(401);
    json body = json::parse(error_body(e));
    body["error"]["code"] = "invalid_api_key";
    send_json(res, 401, body.dump(-1, ' ', false, json::error_handler_t::replace));
    return false;
  }

  void setup() {
    const int threads =
        opt.threads > 0 ? opt.threads
                        : static_cast<int>(std::max<int64_t>(8, 2 * std::min<int64_t>(opt.max_batch, 512)));
    http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    http.set_payload_max_length(opt.max_body_bytes);
    // Streamed chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each behind the
    // client's delayed ACK.
    http.set_tcp_nodelay(true);
    // SO_REUSEADDR (a restarted server binds while old connections linger in TIME_WAIT) but not
    // httplib's default SO_REUSEPORT, with which a second server would bind the same port and take half
    // of the first one's connections.
    http.set_socket_options([this](socket_t sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
      if (!bound) listen_sock = sock;  // the last one tried before bind() returns is the one that listens
    });
    http.set_read_timeout(30, 0);
    http.set_write_timeout(30, 0);
    http.set_keep_alive_timeout(5);
    http.set_keep_alive_max_count(1000);
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      handle(Endpoint::kChat, req, res);
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      handle(Endpoint::kCompletion, req, res);
    });
    http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      json m = {{"id", opt.model_name}, {"object", "model"}, {"created", unix_now()}, {"owned_by", "kda"}};
      if (opt.max_context > 0) m["max_model_len"] = opt.max_context;
      send_json(res, 200,
                json{{"object", "list"}, {"data", json::array({m})}}.dump(-1, ' ', false,
                                                                          json::error_handler_t::replace));
    });
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      send_json(res, 200, R"({"status":"ok"})");
    });
    http.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      res.set_content(metrics.render(engine.stats()), "text/plain; version=0.0.4");
    });
    // Statuses httplib sets itself (unknown path 404, body too large 413, a malformed request 400)
    // get OpenAI's error body; a handler's own error body is left as it is.
    http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                       httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string msg;
      if (res.status == 404)
        msg = "not found: " + req.method + " " + req.path;
      else if (res.status == 413)
        msg = "the request body is larger than the limit of " + std::to_string(opt.max_body_bytes) + " bytes";
      else if (res.status == 405)
        msg = "method not allowed: " + req.method + " " + req.path;
      else
        msg = "bad request (HTTP status " + std::to_string(res.status) + ")";
      metrics.count_rejected(res.status);
      res.set_content(error_body(ApiError(res.status, "", msg)), "application/json");
      return httplib::Server::HandlerResponse::Handled;
    }));
    http.set_exception_handler(
        [this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
          std::string what = "unknown error";
          try {
            if (ep) std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          metrics.count_rejected(500);
          send_json(res, 500, error_body(ApiError(500, "", "internal error: " + what, "internal_error")));
        });
  }

  // The prompt's token ids (chat: rendered, then encoded with the template's special tokens).
  std::vector<int32_t> prompt_ids(const ParsedRequest& pr) {
    const char* param = pr.endpoint == Endpoint::kChat ? "messages" : "prompt";
    if (pr.prompt_ids) return *pr.prompt_ids;
    std::string text;
    try {
      text = pr.endpoint == Endpoint::kChat ? chat.render(pr.messages, pr.add_generation_prompt)
                                            : pr.prompt_text;
    } catch (const std::invalid_argument& e) {
      throw ApiError(400, param, std::string(param) + ": " + e.what());
    }
    try {
      return tok.encode(text, true);
    } catch (const std::invalid_argument& e) {
      throw ApiError(400, param, std::string(param) + ": " + e.what());
    }
  }

  void handle(Endpoint ep, const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    const auto arrival = Clock::now();
    try {
      ParsedRequest pr = parse_request(ep, req.body, engine.vocab_size());
      if (!pr.model.empty() && pr.model != opt.model_name)
        throw ApiError(
            404, "model",
            "the model `" + pr.model + "` does not exist (this server serves `" + opt.model_name + "`)");
      const char* prompt_param = ep == Endpoint::kChat ? "messages" : "prompt";
      serving::GenerateRequest g;
      g.prompt = prompt_ids(pr);
      if (g.prompt.empty())
        throw ApiError(400, prompt_param, std::string(prompt_param) + ": encodes to no tokens");
      const auto plen = static_cast<int64_t>(g.prompt.size());
      if (opt.max_context > 0 && plen >= opt.max_context)
        throw ApiError(400, prompt_param,
                       std::string(prompt_param) + ": the prompt has " + std::to_string(plen) +
                           " tokens; the context limit is " + std::to_string(opt.max_context) + " tokens");
      if (!pr.max_tokens_given && opt.max_context > 0)
        pr.params.max_tokens = static_cast<int32_t>(std::min<int64_t>(opt.max_context - plen, INT32_MAX));
      if (opt.max_context > 0 && plen + pr.params.max_tokens > opt.max_context)
        throw ApiError(400, pr.max_tokens_given ? "max_tokens" : prompt_param,
                       "max_tokens: the prompt's " + std::to_string(plen) + " tokens + max_tokens " +
                           std::to_string(pr.params.max_tokens) + " exceed the context limit of " +
                           std::to_string(opt.max_context) + " tokens");
      g.params = pr.params;
      g.n = pr.n;
      run(ep, pr, std::move(g), arrival, req, res);
    } catch (const ApiError& e) {
      fail(res, e);
    }
  }

  void run(Endpoint ep, const ParsedRequest& pr, serving::GenerateRequest g, Clock::time_point arrival,
           const httplib::Request& req, httplib::Response& res) {
    auto q = std::make_shared<EventQueue>();
    q->arrival = arrival;
    q->last_token.assign(static_cast<size_t>(g.n), arrival);
    auto prompt = std::make_shared<std::vector<int32_t>>(g.prompt);
    const int32_t n = g.n;
    // On the engine's thread after each step: must not block (a short lock) and may not throw.
    // The worker takes every queued event when it wakes, so only an event that finds the queue empty
    // wakes it: one wake per step however many events (n continuations) the step brings. The wake comes
    // after the unlock, so that the woken worker does not at once block on the lock the engine holds.
    serving::EventSink sink = [q, m = &metrics](const serving::TokenEvent& e) {
      const auto now = Clock::now();
      double ttft = -1.0, itl = -1.0;
      bool wake = false;
      {
        std::lock_guard lock(q->mu);
        if (e.token >= 0 && e.index >= 0 && e.index < static_cast<int32_t>(q->last_token.size())) {
          auto& last = q->last_token[static_cast<size_t>(e.index)];
          if (!q->first_token) {
            q->first_token = true;
            ttft = std::chrono::duration<double>(now - q->arrival).count();
          } else if (last != q->arrival) {
            itl = std::chrono::duration<double>(now - last).count();
          }
          last = now;
        }
        wake = q->events.empty();
        q->events.push_back(e);
      }
      if (ttft >= 0.0) m->observe_ttft(ttft);
      if (itl >= 0.0) m->observe_inter_token(itl);
      if (wake) q->cv.notify_one();
    };
    auto out = std::make_shared<RequestOutput>(tok, n, pr.stop, pr.params.logprobs >= 0);
    int64_t id = 0;
    try {
      id = engine.submit(std::move(g), std::move(sink));
      metrics.observe_prepare(std::chrono::duration<double>(Clock::now() - arrival).count());
    } catch (const std::invalid_argument& e) {
      std::string field = field_of(e.what());
      if (field == "prompt" && ep == Endpoint::kChat) field = "messages";
      throw ApiError(400, field, e.what());
    }
    ResponseHead head{ep, new_response_id(ep), unix_now(), opt.model_name};
    // A stream learns that its client left when a write fails, but it writes only when a token comes:
    // watched, a client that leaves while its request waits for a slot or a long prefill frees it then.
    const ClientConnection conn(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
    if (!pr.stream) {
      // Collect every event; the server stopping or the client leaving aborts the request.
      // The events are taken out under the lock and decoded outside it: the engine's sink never waits
      // for a detokenizer.
      std::deque<serving::TokenEvent> events;
      while (!out->done()) {
        if (stopping.load()) {
          engine.abort(id);
          throw ApiError(503, "", "the server is shutting down", "server_error");
        }
        if (conn.gone()) {
          engine.abort(id);
          metrics.count_finished("abort");
          // nginx's "client closed request": no client reads it but one that only half-closed.
          send_json(
              res, 499,
              error_body(ApiError(499, "", "the client closed its connection", "client_closed_request")));
          return;
        }
        {
          std::unique_lock lock(q->mu);
          q->cv.wait_for(lock, kPoll, [&] { return !q->events.empty(); });
          events.swap(q->events);
        }
        for (const auto& e : events) {
          if (out->done()) break;
          out->apply(e);
        }
        events.clear();
        if (out->done() && !out->engine_done()) engine.abort(id);  // stop strings ended every continuation
      }
      metrics.count_finished(out->finish_reason());
      const json usage = usage_json(out->prompt_tokens(), out->completion_tokens(), out->cached_tokens());
      send_json(res, 200,
                response_json(head, out->choices(pr.return_token_ids), usage,
                              pr.return_token_ids ? prompt.get() : nullptr)
                    .dump(-1, ' ', false, json::error_handler_t::replace));
      return;
    }
    // Streaming: the first chunk of each choice (chat: the role), then one chunk per event that shows
    // something, each choice's finish chunk, the usage chunk when asked, and [DONE].
    struct StreamState {
      bool started = false, finished = false;
    };
    auto st = std::make_shared<StreamState>();
    const bool include_usage = pr.include_usage, ids = pr.return_token_ids;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, q, out, st, head, prompt, id, n, include_usage, ids, conn](size_t, httplib::DataSink& sink) {
          std::string buf;
          if (!st->started) {
            st->started = true;
            for (int32_t j = 0; j < n; ++j) {
              ChunkDelta d;
              d.index = j;
              d.role = head.endpoint == Endpoint::kChat;
              d.text = "";
              if (ids) d.prompt_ids = prompt.get();
              buf += sse(chunk_json(head, d, include_usage));
            }
          }
          std::deque<serving::TokenEvent> events;
          {
            std::unique_lock lock(q->mu);
            if (buf.empty()) q->cv.wait_for(lock, kPoll, [&] { return !q->events.empty(); });
            events.swap(q->events);
          }
          if (stopping.load()) return false;  // the releaser aborts the request
          if (events.empty() && buf.empty() && conn.gone()) return false;
          for (const auto& e : events) {
            if (out->done()) break;
            const OutputUpdate u = out->apply(e);
            if (u.text.empty() && u.logprobs.empty() && !u.finish && !(ids && !u.token_ids.empty())) continue;
            ChunkDelta d;
            d.index = u.index;
            d.text = u.text;
            d.finish_reason = u.finish;
            if (!u.logprobs.empty()) d.logprobs = u.logprobs;
            d.text_offset = u.text_offset;
            if (ids) d.token_ids = u.token_ids;
            buf += sse(chunk_json(head, d, include_usage));
          }
          if (out->done() && !out->engine_done()) engine.abort(id);  // stop strings ended the request
          if (out->done()) {
            if (include_usage)
              buf += sse(usage_chunk_json(
                  head, usage_json(out->prompt_tokens(), out->completion_tokens(), out->cached_tokens())));
            buf += kSseDone;
          }
          if (!buf.empty() && !sink.write(buf.data(), buf.size())) return false;  // the client went away
          if (out->done()) {
            st->finished = true;
            metrics.count_finished(out->finish_reason());
            sink.done();
          }
          return true;
        },
        [this, out, st, id](bool) {
          // The stream ended: normally, or the client went away / the server stopped mid-stream.
          if (!st->finished) {
            engine.abort(id);
            metrics.count_finished("abort");
          }
        });
  }
};

OpenAIServer::OpenAIServer(serving::Engine& engine, const tokenizer::Tokenizer& tok,
                           const tokenizer::ChatFormat& chat, ServerOptions opt)
    : impl_(std::make_unique<Impl>(engine, tok, chat, std::move(opt))) {
  impl_->setup();
}

OpenAIServer::~OpenAIServer() = default;

int OpenAIServer::bind() {
  auto& o = impl_->opt;
  const int port = o.port == 0 ? impl_->http.bind_to_any_port(o.host)
                               : (impl_->http.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port <= 0)
    throw std::runtime_error("kda serve: cannot listen on " + o.host + ":" + std::to_string(o.port) +
                             " (address in use, or not an address of this machine)");
  // httplib 0.11 listens with a backlog of 5: a burst of clients connecting at once (the bench's 16)
  // overflows it, and the dropped handshakes are retried a second or more later. Listening again on the
  // bound socket raises the backlog to the system's limit.
  if (impl_->listen_sock != INVALID_SOCKET && ::listen(impl_->listen_sock, SOMAXCONN) != 0)
    throw std::runtime_error("kda serve: cannot listen on " + o.host + ":" + std::to_string(port) +
                             " with a backlog of " + std::to_string(SOMAXCONN));
  o.port = port;
  impl_->bound = true;
  return port;
}

void OpenAIServer::serve() {
  if (!impl_->bound) bind();
  auto& im = *impl_;
  std::exception_ptr engine_error;
  // The engine's workspaces are sized and touched on its own thread (the forwards' thread scratch is that
  // thread's) before the server takes requests: the first long prompt then costs what later ones do.
  std::promise<void> ready;
  std::thread engine_thread([&] {
    try {
      im.engine.reserve_workspaces();
      ready.set_value();
      im.engine.run(im.engine_stop);
    } catch (...) {
      engine_error = std::current_exception();
      im.stopping.store(true);
      im.http.stop();
      try {
        ready.set_value();
      } catch (const std::future_error&) {  // set already: the loop was running
      }
    }
  });
  ready.get_future().wait();
  if (!im.stopping.load()) im.http.listen_after_bind();
  im.stopping.store(true);
  im.engine_stop.store(true);
  engine_thread.join();
  if (engine_error) std::rethrow_exception(engine_error);
}

void OpenAIServer::stop() {
  impl_->stopping.store(true);
  impl_->http.stop();
}

}  // namespace kda::server
