// The OpenAI request parser and response builders (src/kda/server/protocol.h): every field's bad value
// is a 400 naming the field; good requests give the right engine request; the responses have OpenAI's
// shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kda/server/protocol.h"
#include "kda/server/request_output.h"
#include "kda/tokenizer/tokenizer.h"

namespace {

using kda::server::ApiError;
using kda::server::Endpoint;
using kda::server::parse_request;
using nlohmann::json;

constexpr int64_t kVocab = 512;

json chat_body() { return {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}}; }
json completion_body() { return {{"prompt", "hello"}}; }

// The ApiError a body raises (fails the test when it raises none).
ApiError error_of(Endpoint ep, const std::string& body) {
  try {
    parse_request(ep, body, kVocab);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no error for " << body;
  return ApiError(0, "", "");
}

void expect_bad(Endpoint ep, const json& body, const std::string& param) {
  const ApiError e = error_of(ep, body.dump());
  EXPECT_EQ(e.status, 400) << body.dump();
  EXPECT_EQ(e.param, param) << body.dump() << " -> " << e.what();
  EXPECT_NE(std::string(e.what()).find(param), std::string::npos) << e.what();
}

json with(json body, const std::string& key, json value) {
  body[key] = std::move(value);
  return body;
}

TEST(ServerProtocol, ChatDefaultsAndEveryField) {
  auto r = parse_request(Endpoint::kChat, chat_body().dump(), kVocab);
  EXPECT_EQ(r.endpoint, Endpoint::kChat);
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[0].content, "hi");
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.max_tokens_given);
  EXPECT_EQ(r.params.logprobs, -1);
  EXPECT_FALSE(r.params.seed.has_value());

  json b = chat_body();
  b["messages"].push_back(
      {{"role", "assistant"},
       {"content", json::array({{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}})},
       {"name", "bot"}});
  b["model"] = "kimi-linear";
  b["temperature"] = 0.5;
  b["top_p"] = 0.9;
  b["top_k"] = 40;
  b["min_p"] = 0.05;
  b["repetition_penalty"] = 1.1;
  b["presence_penalty"] = -0.5;
  b["frequency_penalty"] = 1.5;
  b["seed"] = -7;
  b["max_tokens"] = 10;
  b["max_completion_tokens"] = 12;
  b["n"] = 3;
  b["stream"] = true;
  b["stream_options"] = {{"include_usage", true}};
  b["stop"] = json::array({"x", "yz"});
  b["stop_token_ids"] = json::array({1, 2});
  b["ignore_eos"] = true;
  b["logprobs"] = true;
  b["top_logprobs"] = 5;
  b["return_token_ids"] = true;
  b["user"] = "someone";
  b["unknown_field"] = json::object({{"anything", 1}});
  r = parse_request(Endpoint::kChat, b.dump(), kVocab);
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[1].content, "ab");
  EXPECT_EQ(r.messages[1].name, "bot");
  EXPECT_EQ(r.model, "kimi-linear");
  EXPECT_FLOAT_EQ(r.params.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.params.top_p, 0.9f);
  EXPECT_EQ(r.params.top_k, 40);
  EXPECT_FLOAT_EQ(r.params.min_p, 0.05f);
  EXPECT_FLOAT_EQ(r.params.repetition_penalty, 1.1f);
  EXPECT_FLOAT_EQ(r.params.presence_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.params.frequency_penalty, 1.5f);
  ASSERT_TRUE(r.params.seed.has_value());
  EXPECT_EQ(*r.params.seed, static_cast<uint64_t>(int64_t{-7}));
  EXPECT_EQ(r.params.max_tokens, 12);  // max_completion_tokens wins
  EXPECT_TRUE(r.max_tokens_given);
  EXPECT_EQ(r.n, 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(r.params.stop_token_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(r.params.ignore_eos);
  EXPECT_EQ(r.params.logprobs, 5);
  EXPECT_TRUE(r.return_token_ids);

  // logprobs alone: the chosen token's logprob, no alternatives.
  r = parse_request(Endpoint::kChat, with(chat_body(), "logprobs", true).dump(), kVocab);
  EXPECT_EQ(r.params.logprobs, 0);
  // A stop string alone; nulls mean "not given".
  r = parse_request(Endpoint::kChat, with(with(chat_body(), "stop", "END"), "temperature", nullptr).dump(),
                    kVocab);
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_FLOAT_EQ(r.params.temperature, 1.0f);
}

TEST(ServerProtocol, CompletionPrompts) {
  auto r = parse_request(Endpoint::kCompletion, completion_body().dump(), kVocab);
  EXPECT_EQ(r.prompt_text, "hello");
  EXPECT_FALSE(r.prompt_ids.has_value());
  r = parse_request(Endpoint::kCompletion, json{{"prompt", json::array({"one"})}}.dump(), kVocab);
  EXPECT_EQ(r.prompt_text, "one");
  r = parse_request(Endpoint::kCompletion, json{{"prompt", json::array({5, 6, 511})}}.dump(), kVocab);
  ASSERT_TRUE(r.prompt_ids.has_value());
  EXPECT_EQ(*r.prompt_ids, (std::vector<int32_t>{5, 6, 511}));
  r = parse_request(Endpoint::kCompletion, json{{"prompt", json::array({json::array({7})})}}.dump(), kVocab);
  EXPECT_EQ(*r.prompt_ids, std::vector<int32_t>{7});
  r = parse_request(Endpoint::kCompletion, with(completion_body(), "logprobs", 3).dump(), kVocab);
  EXPECT_EQ(r.params.logprobs, 3);
  r = parse_request(Endpoint::kCompletion, with(completion_body(), "echo", false).dump(), kVocab);
  EXPECT_EQ(r.prompt_text, "hello");
  // An integral float is an integer (pydantic's lax mode, as vLLM parses it).
  r = parse_request(Endpoint::kCompletion, with(completion_body(), "max_tokens", 8.0).dump(), kVocab);
  EXPECT_EQ(r.params.max_tokens, 8);
}

TEST(ServerProtocol, EveryBadFieldIsA400NamingIt) {
  const json c = chat_body(), p = completion_body();
  struct Case {
    Endpoint ep;
    json body;
    std::string param;
  };
  const std::vector<Case> cases = {
      {Endpoint::kChat, json::object(), "messages"},
      {Endpoint::kChat, with(c, "messages", "hi"), "messages"},
      {Endpoint::kChat, with(c, "messages", json::array()), "messages"},
      {Endpoint::kChat, with(c, "messages", json::array({1})), "messages[0]"},
      {Endpoint::kChat, with(c, "messages", json::array({{{"content", "x"}}})), "messages[0].role"},
      {Endpoint::kChat, with(c, "messages", json::array({{{"role", 3}, {"content", "x"}}})),
       "messages[0].role"},
      {Endpoint::kChat, with(c, "messages", json::array({{{"role", "user"}, {"content", 3}}})),
       "messages[0].content"},
      {Endpoint::kChat,
       with(c, "messages",
            json::array({{{"role", "user"}, {"content", json::array({{{"type", "image_url"}}})}}})),
       "messages[0].content[0].type"},
      {Endpoint::kChat, with(c, "model", 5), "model"},
      {Endpoint::kChat, with(c, "temperature", -0.1), "temperature"},
      {Endpoint::kChat, with(c, "temperature", "hot"), "temperature"},
      {Endpoint::kChat, with(c, "top_p", 0.0), "top_p"},
      {Endpoint::kChat, with(c, "top_p", 1.5), "top_p"},
      {Endpoint::kChat, with(c, "top_k", -2), "top_k"},
      {Endpoint::kChat, with(c, "top_k", 1.5), "top_k"},
      {Endpoint::kChat, with(c, "min_p", 1.5), "min_p"},
      {Endpoint::kChat, with(c, "repetition_penalty", 0.0), "repetition_penalty"},
      {Endpoint::kChat, with(c, "presence_penalty", 2.5), "presence_penalty"},
      {Endpoint::kChat, with(c, "frequency_penalty", -3), "frequency_penalty"},
      {Endpoint::kChat, with(c, "seed", "x"), "seed"},
      {Endpoint::kChat, with(c, "max_tokens", 0), "max_tokens"},
      {Endpoint::kChat, with(c, "max_tokens", -5), "max_tokens"},
      {Endpoint::kChat, with(c, "max_completion_tokens", 0), "max_completion_tokens"},
      {Endpoint::kChat, with(c, "n", 0), "n"},
      {Endpoint::kChat, with(c, "n", true), "n"},
      {Endpoint::kChat, with(c, "stream", "yes"), "stream"},
      {Endpoint::kChat, with(c, "stream_options", {{"include_usage", true}}), "stream_options"},
      {Endpoint::kChat, with(with(c, "stream", true), "stream_options", {{"include_usage", 1}}),
       "stream_options.include_usage"},
      {Endpoint::kChat, with(c, "stop", 5), "stop"},
      {Endpoint::kChat, with(c, "stop", json::array({"a", 5})), "stop"},
      {Endpoint::kChat, with(c, "stop", ""), "stop"},
      {Endpoint::kChat, with(c, "stop_token_ids", json::array({512})), "stop_token_ids[0]"},
      {Endpoint::kChat, with(c, "stop_token_ids", json::array({-1})), "stop_token_ids[0]"},
      {Endpoint::kChat, with(c, "ignore_eos", 1), "ignore_eos"},
      {Endpoint::kChat, with(c, "logprobs", 2), "logprobs"},
      {Endpoint::kChat, with(with(c, "logprobs", true), "top_logprobs", 21), "top_logprobs"},
      {Endpoint::kChat, with(c, "top_logprobs", 2), "top_logprobs"},
      {Endpoint::kChat, with(c, "return_token_ids", "true"), "return_token_ids"},
      {Endpoint::kChat, with(c, "user", 3), "user"},
      {Endpoint::kChat, with(c, "logit_bias", {{"5", 1}}), "logit_bias"},
      {Endpoint::kChat, with(c, "tools", json::array({{{"type", "function"}}})), "tools"},
      {Endpoint::kChat, with(c, "response_format", {{"type", "json_object"}}), "response_format"},
      {Endpoint::kCompletion, json::object(), "prompt"},
      {Endpoint::kCompletion, with(p, "prompt", ""), "prompt"},
      {Endpoint::kCompletion, with(p, "prompt", json::array()), "prompt"},
      {Endpoint::kCompletion, with(p, "prompt", 5), "prompt"},
      {Endpoint::kCompletion, with(p, "prompt", json::array({"a", "b"})), "prompt"},
      {Endpoint::kCompletion, with(p, "prompt", json::array({1, 512})), "prompt[1]"},
      {Endpoint::kCompletion, with(p, "prompt", json::array({1, -1})), "prompt[1]"},
      {Endpoint::kCompletion, with(p, "prompt", json::array({1, "a"})), "prompt[1]"},
      {Endpoint::kCompletion, with(p, "logprobs", 6), "logprobs"},
      {Endpoint::kCompletion, with(p, "logprobs", true), "logprobs"},
      {Endpoint::kCompletion, with(p, "echo", true), "echo"},
      {Endpoint::kCompletion, with(p, "suffix", "x"), "suffix"},
      {Endpoint::kCompletion, with(p, "best_of", 3), "best_of"},
  };
  for (const auto& k : cases) expect_bad(k.ep, k.body, k.param);
  // NaN and infinities are not JSON; a body carrying them (a client's non-standard "NaN") is invalid.
  std::string body = with(c, "temperature", 1.0).dump();
  body.replace(body.find("1.0"), 3, "NaN");
  EXPECT_EQ(error_of(Endpoint::kChat, body).status, 400);
}

TEST(ServerProtocol, InvalidJsonAndDeepNesting) {
  for (const std::string body : {"", "{", "{\"messages\": [}", "[1,2]", "42", "null"}) {
    const ApiError e = error_of(Endpoint::kChat, body);
    EXPECT_EQ(e.status, 400) << body;
    EXPECT_EQ(e.param, "") << body;
  }
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const ApiError e = error_of(Endpoint::kChat, deep);
  EXPECT_EQ(e.status, 400);
  EXPECT_NE(std::string(e.what()).find("nested"), std::string::npos) << e.what();
}

TEST(ServerProtocol, ErrorBodyIsOpenAIs) {
  const json j = json::parse(kda::server::error_body(ApiError(400, "top_p", "top_p: bad")));
  EXPECT_EQ(j["error"]["message"], "top_p: bad");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "top_p");
  EXPECT_TRUE(j["error"]["code"].is_null());
  EXPECT_TRUE(json::parse(kda::server::error_body(ApiError(404, "", "x")))["error"]["param"].is_null());
}

TEST(ServerProtocol, ResponseShapes) {
  using namespace kda::server;
  const ResponseHead chat{Endpoint::kChat, new_response_id(Endpoint::kChat), 123, "m"};
  EXPECT_EQ(chat.id.rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(new_response_id(Endpoint::kCompletion).rfind("cmpl-", 0), 0u);
  std::vector<LogprobEntry> lps = {{"a", -0.5f, {{"a", -0.5f}, {"b", -1.5f}}}, {"\xe4", -0.25f, {}}};
  std::vector<Choice> choices = {{0, "ab", "stop", lps, std::vector<int32_t>{1, 2}}};
  const std::vector<int32_t> prompt = {7, 8};
  const json usage = usage_json(2, 2, 1);
  EXPECT_EQ(usage["total_tokens"], 4);
  EXPECT_EQ(usage["prompt_tokens_details"]["cached_tokens"], 1);
  json r = response_json(chat, choices, usage, &prompt);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "ab");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r["choices"][0]["token_ids"], json::array({1, 2}));
  EXPECT_EQ(r["prompt_token_ids"], json::array({7, 8}));
  const json& c0 = r["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(c0.size(), 2u);
  EXPECT_EQ(c0[0]["token"], "a");
  EXPECT_FLOAT_EQ(c0[0]["logprob"].get<float>(), -0.5f);
  EXPECT_EQ(c0[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(c0[1]["bytes"], json::array({0xe4}));  // a partial character: its exact bytes
  EXPECT_EQ(c0[1]["token"], "\xef\xbf\xbd");       // and its text, replaced

  const ResponseHead cmpl{Endpoint::kCompletion, "cmpl-1", 123, "m"};
  r = response_json(cmpl, choices, usage, &prompt);
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["choices"][0]["text"], "ab");
  EXPECT_EQ(r["choices"][0]["prompt_token_ids"], json::array({7, 8}));
  const json& l = r["choices"][0]["logprobs"];
  EXPECT_EQ(l["tokens"].size(), 2u);
  EXPECT_EQ(l["text_offset"], json::array({0, 1}));
  EXPECT_FLOAT_EQ(l["top_logprobs"][0]["b"].get<float>(), -1.5f);

  ChunkDelta d;
  d.index = 1;
  d.role = true;
  d.text = "";
  json ch = chunk_json(chat, d, true);
  EXPECT_EQ(ch["object"], "chat.completion.chunk");
  EXPECT_EQ(ch["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(ch["choices"][0]["index"], 1);
  EXPECT_TRUE(ch["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(ch.contains("usage") && ch["usage"].is_null());
  d = {};
  d.text = "x";
  d.finish_reason = "length";
  ch = chunk_json(cmpl, d, false);
  EXPECT_EQ(ch["choices"][0]["text"], "x");
  EXPECT_EQ(ch["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(ch.contains("usage"));
  const json u = usage_chunk_json(chat, usage);
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], 2);
  EXPECT_EQ(sse(json{{"a", 1}}), "data: {\"a\":1}\n\n");
}

}  // namespace

// RequestOutput: the engine's token events -> each continuation's text, finish reason and logprobs.
namespace {

using kda::server::RequestOutput;
using kda::serving::FinishReason;
using kda::serving::TokenEvent;

TokenEvent event(int32_t index, int32_t token, FinishReason finish = FinishReason::kNone) {
  TokenEvent e;
  e.request = 1;
  e.index = index;
  e.token = token;
  e.finish = finish;
  e.prompt_tokens = 5;
  e.cached_tokens = 2;
  return e;
}

const kda::tokenizer::Tokenizer& byte_tokenizer() {
  static const auto tok = kda::tokenizer::Tokenizer::synthetic(512);  // ids 0..255: the single bytes
  return tok;
}

TEST(ServerOutput, TextUpToWholeCharactersAndTheStopTokenHidden) {
  const auto& tok = byte_tokenizer();
  RequestOutput out(tok, 1, {}, false);
  std::string streamed;
  // "a", then U+4F60 in three byte tokens: nothing shows until the character is whole.
  for (const int32_t id : {0x61, 0xe4, 0xbd}) streamed += out.apply(event(0, id)).text;
  EXPECT_EQ(streamed, "a");
  const auto u = out.apply(event(0, 0xa0));
  EXPECT_EQ(u.text, "\xe4\xbd\xa0");
  EXPECT_EQ(u.text_offset, 1);
  streamed += u.text;
  EXPECT_FALSE(out.done());
  // A special token's text never shows; the stop token ends the continuation unseen.
  EXPECT_EQ(out.apply(event(0, tok.bos_id())).text, "");
  const auto last = out.apply(event(0, tok.im_end_id(), FinishReason::kStop));
  EXPECT_EQ(last.text, "");
  ASSERT_TRUE(last.finish.has_value());
  EXPECT_EQ(*last.finish, "stop");
  EXPECT_TRUE(out.done());
  EXPECT_TRUE(out.engine_done());
  EXPECT_EQ(out.completion_tokens(), 6);  // the stop token counts
  EXPECT_EQ(out.prompt_tokens(), 5);
  EXPECT_EQ(out.cached_tokens(), 2);
  const auto choices = out.choices(true);
  ASSERT_EQ(choices.size(), 1u);
  EXPECT_EQ(choices[0].text, streamed);
  EXPECT_EQ(choices[0].finish_reason, "stop");
  EXPECT_EQ(choices[0].token_ids->size(), 6u);
  EXPECT_EQ(out.finish_reason(), "stop");
}

TEST(ServerOutput, AnIncompleteCharacterAtTheEndIsReplaced) {
  RequestOutput out(byte_tokenizer(), 1, {}, false);
  EXPECT_EQ(out.apply(event(0, 0x62)).text, "b");
  const auto u = out.apply(event(0, 0xe4, FinishReason::kLength));
  EXPECT_EQ(u.text, "\xef\xbf\xbd");
  EXPECT_EQ(*u.finish, "length");
  EXPECT_EQ(out.choices(false)[0].text, "b\xef\xbf\xbd");
}

TEST(ServerOutput, StopStringAcrossTokensEndsTheContinuation) {
  RequestOutput out(byte_tokenizer(), 2, {"cd"}, true);
  std::string s0, s1;
  auto push = [&](int32_t index, int32_t id) {
    TokenEvent e = event(index, id);
    kda::sampling::TokenLogprob lp;
    lp.token = id;
    lp.logprob = -0.5f;
    lp.top = {{id, -0.5f}, {0x7a, -1.0f}};
    e.logprob = lp;
    const auto u = out.apply(e);
    (index == 0 ? s0 : s1) += u.text;
    return u;
  };
  for (const char c : std::string("abc")) push(0, c);
  push(1, 'x');
  EXPECT_EQ(s0, "ab");  // "c" is held back: it may start the stop string
  const auto u = push(0, 'd');
  ASSERT_TRUE(u.finish.has_value());
  EXPECT_EQ(*u.finish, "stop");
  EXPECT_EQ(s0, "ab");
  EXPECT_FALSE(out.done());
  // Continuation 0's later events change nothing; continuation 1 goes on to its length.
  EXPECT_EQ(push(0, 'e').text, "");
  push(1, 'c');
  const auto u1 = out.apply(event(1, 'e', FinishReason::kLength));
  EXPECT_EQ(u1.text, "ce");
  EXPECT_TRUE(out.done());
  EXPECT_FALSE(out.engine_done());  // continuation 0 still runs in the engine: the server aborts it
  out.apply(event(0, -1, FinishReason::kAbort));
  EXPECT_TRUE(out.engine_done());
  const auto choices = out.choices(false);
  EXPECT_EQ(choices[0].text, "ab");
  EXPECT_EQ(choices[1].text, "xce");
  EXPECT_EQ(choices[0].logprobs->size(), 4u);  // a, b, c, d: up to the stop
  EXPECT_EQ((*choices[0].logprobs)[0].token, "a");
  EXPECT_EQ((*choices[0].logprobs)[0].top[1].first, "z");
  EXPECT_EQ(out.finish_reason(), "stop");
}

TEST(ServerOutput, AbortWithoutAToken) {
  RequestOutput out(byte_tokenizer(), 1, {}, false);
  out.apply(event(0, 'q'));
  const auto u = out.apply(event(0, -1, FinishReason::kAbort));
  EXPECT_EQ(*u.finish, "abort");
  EXPECT_EQ(out.completion_tokens(), 1);
  EXPECT_EQ(out.finish_reason(), "abort");
}

}  // namespace
