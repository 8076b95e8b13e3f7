// The OpenAI-compatible request and response bodies of /v1/chat/completions and /v1/completions: parsing
// and validating a request into what the engine takes, and building the JSON the clients expect (field
// names and semantics as OpenAI's API, plus vLLM's top_k / min_p / repetition_penalty / stop_token_ids /
// ignore_eos / return_token_ids).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kda/sampling/sampling_params.h"
#include "kda/tokenizer/chat_format.h"

namespace kda::server {

enum class Endpoint { kChat, kCompletion };

// An error as OpenAI reports it: {"error": {"message", "type", "param", "code": null}} with `status`.
struct ApiError : std::runtime_error {
  ApiError(int status, std::string param, const std::string& message,
           std::string type = "invalid_request_error");
  int status;
  std::string param;  // the request field at fault (empty: none)
  std::string type;
};
std::string error_body(const ApiError& e);

// A parsed, validated request. Only what the engine cannot check without the tokenizer is left: the
// prompt's token count against the pool and the context (the engine's submit) and the default max_tokens.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;                               // empty: not given
  std::vector<tokenizer::ChatMessage> messages;    // chat
  bool add_generation_prompt = true;               // chat (vLLM's field)
  std::string prompt_text;                         // completions: the prompt as text ...
  std::optional<std::vector<int32_t>> prompt_ids;  // ... or as token ids (each checked < vocab)
  sampling::SamplingParams params;                 // max_tokens: see max_tokens_given
  bool max_tokens_given = false;                   // else the server picks (what the context leaves)
  int32_t n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::vector<std::string> stop;
  // chat: logprobs (bool) + top_logprobs (0..20); completions: logprobs (0..5). params.logprobs is the
  // number of alternatives (-1: no logprobs).
  bool return_token_ids = false;
};

// Throws ApiError (400, naming the field) for invalid JSON, a wrong type, an out-of-range value, an id
// >= vocab, or a known OpenAI / vLLM field this server does not implement given a non-default value
// (echo, logit_bias, tools, ...: refused rather than ignored). Unknown fields are ignored.
ParsedRequest parse_request(Endpoint ep, std::string_view body, int64_t vocab);

// One generated token's logprob entry, as the response builders take it.
struct LogprobEntry {
  std::string token;  // the token's bytes (may be a partial UTF-8 character)
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;  // the alternatives, most likely first
};

// The logprobs object of a choice (or of a chunk's choice): chat {"content": [...]} or completions
// {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; text_offset: the offset of the first
// entry's text in the choice's text (completions only).
nlohmann::json logprobs_json(Endpoint ep, const std::vector<LogprobEntry>& entries, int64_t text_offset = 0);

// usage: {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details: {cached_tokens}}.
nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// A response's (or a stream's) fixed fields.
struct ResponseHead {
  Endpoint endpoint = Endpoint::kChat;
  std::string id;  // "chatcmpl-..." / "cmpl-..."
  int64_t created = 0;
  std::string model;
};
std::string new_response_id(Endpoint ep);

// One finished choice of a non-streaming response.
struct Choice {
  int32_t index = 0;
  std::string text;
  std::string finish_reason;  // "stop" | "length" | "abort"
  std::optional<std::vector<LogprobEntry>> logprobs;
  std::optional<std::vector<int32_t>> token_ids;  // return_token_ids
};
// chat.completion / text_completion. prompt_ids: return_token_ids (chat: top-level prompt_token_ids;
// completions: each choice's prompt_token_ids, as vLLM places them).
nlohmann::json response_json(const ResponseHead& h, const std::vector<Choice>& choices,
                             const nlohmann::json& usage, const std::vector<int32_t>* prompt_ids);

// One streamed chunk of one choice: chat.completion.chunk (delta) / text_completion (text).
struct ChunkDelta {
  int32_t index = 0;
  bool role = false;  // chat: the first chunk carries role "assistant"
  std::optional<std::string> text;
  std::optional<std::string> finish_reason;
  std::optional<std::vector<LogprobEntry>> logprobs;
  int64_t text_offset = 0;                           // completions' logprobs text_offset of this chunk
  std::optional<std::vector<int32_t>> token_ids;     // return_token_ids: this chunk's ids
  const std::vector<int32_t>* prompt_ids = nullptr;  // return_token_ids: the first chunk's
};
// include_usage: "usage": null on every chunk but the usage chunk (OpenAI's shape).
nlohmann::json chunk_json(const ResponseHead& h, const ChunkDelta& d, bool include_usage);
// The last chunk before [DONE] when include_usage: "choices": [] and the usage.
nlohmann::json usage_chunk_json(const ResponseHead& h, const nlohmann::json& usage);

// Server-sent event framing: "data: <json>\n\n"; the stream ends with "data: [DONE]\n\n".
std::string sse(const nlohmann::json& j);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

}  // namespace kda::server
