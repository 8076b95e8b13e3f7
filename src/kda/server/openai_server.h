// The OpenAI-compatible HTTP server of `kda serve`: POST /v1/chat/completions and /v1/completions
// (streaming as server-sent events, or one JSON body), GET /v1/models, GET /health, GET /metrics.
// Each request is parsed (protocol.h), rendered (ChatFormat) and encoded (Tokenizer), submitted to the
// engine, and its token events come back through a per-request queue to the HTTP worker thread that
// answers it, which decodes them (StreamDecoder per continuation) and applies the stop strings. A client
// that goes away aborts its request, mid-stream or before a whole answer (ClientConnection watches the
// socket while nothing is written). The engine runs on a thread of its own (serve()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kda/serving/engine.h"
#include "kda/tokenizer/chat_format.h"
#include "kda/tokenizer/tokenizer.h"

namespace kda::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;      // 0: any free port (bind() returns it)
  std::string api_key;  // empty: none; else "Authorization: Bearer <key>" on all but /health
  std::string model_name = "kimi-linear";  // what /v1/models lists and requests must name (or omit)
  size_t max_body_bytes = 4 << 20;
  int threads = 0;  // HTTP worker threads (0: 2 x max batch, at least 8)
  // The model's context limit (prompt + generated tokens; 0: none). A request without max_tokens
  // generates up to what the context leaves (as vLLM); without a limit, SamplingParams' default.
  int64_t max_context = 0;
  int64_t max_batch = 64;  // the engine's decode rows per step (sizes the default thread count)
};

class OpenAIServer {
 public:
  OpenAIServer(serving::Engine& engine, const tokenizer::Tokenizer& tok, const tokenizer::ChatFormat& chat,
               ServerOptions opt);
  ~OpenAIServer();
  OpenAIServer(const OpenAIServer&) = delete;
  OpenAIServer& operator=(const OpenAIServer&) = delete;

  int bind();    // binds host:port; returns the port; std::runtime_error naming host:port on failure
  void serve();  // runs the engine loop on its own thread and answers requests until stop()
  void stop();   // thread safe; a stop before serve() makes serve() return at once

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kda::server
