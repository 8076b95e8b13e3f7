#include "kda/server/protocol.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <utility>

#include "kda/sampling/stop_strings.h"

namespace kda::server {

using nlohmann::json;

ApiError::ApiError(int status_, std::string param_, const std::string& message, std::string type_)
    : std::runtime_error(message), status(status_), param(std::move(param_)), type(std::move(type_)) {}

std::string error_body(const ApiError& e) {
  json err = {{"message", e.what()}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  return json{{"error", err}}.dump();
}

namespace {

// A body nested deeper than any valid request is refused while parsing (nlohmann's recursion elsewhere,
// e.g. dump(), stays shallow).
constexpr int kMaxDepth = 32;

[[noreturn]] void bad(const std::string& param, const std::string& what) {
  throw ApiError(400, param, param + ": " + what);
}

const char* type_name(const json& v) { return v.type_name(); }

// The field's value, or null when absent or JSON null (OpenAI treats both as "not given").
const json* field(const json& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> opt_number(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(key, std::string("expected a number, got ") + type_name(*v));
  const double d = v->get<double>();
  if (!std::isfinite(d)) bad(key, "must be finite");
  return d;
}

// An integer (a float with an integral value is accepted, as pydantic's lax mode does in vLLM).
std::optional<int64_t> opt_int(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      bad(key, "out of range");
    return v->get<int64_t>();
  }
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
  }
  bad(key,
      std::string("expected an integer, got ") + (v->is_number() ? "a non-integral number" : type_name(*v)));
}

std::optional<bool> opt_bool(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad(key, std::string("expected a boolean, got ") + type_name(*v));
  return v->get<bool>();
}

std::optional<std::string> opt_string(const json& obj, const char* key, const std::string& name = {}) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) bad(name.empty() ? key : name, std::string("expected a string, got ") + type_name(*v));
  return v->get<std::string>();
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void range(const char* key, double v, double lo, double hi, const char* what) {
  if (!(v >= lo && v <= hi)) bad(key, "must be " + std::string(what) + ", got " + fmt(v));
}

int32_t token_id(const json& v, const std::string& param, int64_t vocab) {
  if (!v.is_number_integer()) bad(param, std::string("expected a token id (integer), got ") + type_name(v));
  if (v.is_number_unsigned() ? v.get<uint64_t>() >= static_cast<uint64_t>(vocab)
                             : v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab)
    bad(param, "token id " + v.dump() + " is out of range [0, " + std::to_string(vocab) + ")");
  return static_cast<int32_t>(v.get<int64_t>());
}

std::vector<int32_t> token_ids(const json& arr, const std::string& param, int64_t vocab) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i)
    ids.push_back(token_id(arr[i], param + "[" + std::to_string(i) + "]", vocab));
  return ids;
}

// A message's content: a string, or OpenAI's list of content parts of type "text" (concatenated).
std::string message_content(const json& m, const std::string& param) {
  const json* c = field(m, "content");
  if (!c) return {};  // an assistant message with tool calls only
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array())
    bad(param, std::string("expected a string or a list of content parts, got ") + type_name(*c));
  std::string text;
  for (size_t i = 0; i < c->size(); ++i) {
    const json& part = (*c)[i];
    const std::string pp = param + "[" + std::to_string(i) + "]";
    if (!part.is_object()) bad(pp, "expected a content part object");
    const auto type = opt_string(part, "type", pp + ".type");
    if (!type || *type != "text") bad(pp + ".type", "only \"text\" content parts are supported");
    const auto t = opt_string(part, "text", pp + ".text");
    if (!t) bad(pp + ".text", "missing");
    text += *t;
  }
  return text;
}

// Known OpenAI / vLLM fields whose behaviour this server does not implement: a non-default value is
// refused (a client asking for them would otherwise get a silently different answer).
void refuse_unsupported(const json& j, Endpoint ep) {
  const auto refuse = [](const char* key) { bad(key, "is not supported by this server"); };
  for (const char* key : {"logit_bias", "tools", "functions", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar", "prompt_logprobs", "allowed_token_ids", "bad_words"}) {
    const json* v = field(j, key);
    if (v && !(v->is_array() || v->is_object())) bad(key, std::string("unexpected type ") + type_name(*v));
    if (v && !v->empty()) refuse(key);
  }
  if (const json* v = field(j, "tool_choice"); v && !(v->is_string() && v->get<std::string>() == "none"))
    refuse("tool_choice");
  if (const json* v = field(j, "response_format")) {
    if (!v->is_object()) bad("response_format", std::string("expected an object, got ") + type_name(*v));
    const auto t = opt_string(*v, "type");
    if (!t || *t != "text") refuse("response_format");
  }
  if (ep == Endpoint::kCompletion) {
    if (opt_bool(j, "echo").value_or(false)) refuse("echo");
    if (const auto s = opt_string(j, "suffix"); s && !s->empty()) refuse("suffix");
    if (const auto b = opt_int(j, "best_of"); b && *b != opt_int(j, "n").value_or(1)) refuse("best_of");
  }
  if (const auto b = opt_bool(j, "use_beam_search"); b && *b) refuse("use_beam_search");
}

json parse_json(std::string_view body) {
  try {
    json::parser_callback_t cb = [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxDepth)
        throw ApiError(400, "", "the JSON body is nested deeper than " + std::to_string(kMaxDepth));
      return true;
    };
    return json::parse(body.begin(), body.end(), cb);
  } catch (const json::parse_error& e) {
    throw ApiError(400, "", std::string("invalid JSON body: ") + e.what());
  }
}

}  // namespace

ParsedRequest parse_request(Endpoint ep, std::string_view body, int64_t vocab) {
  const json j = parse_json(body);
  if (!j.is_object())
    throw ApiError(400, "", std::string("the body must be a JSON object, got ") + type_name(j));
  ParsedRequest r;
  r.endpoint = ep;
  r.model = opt_string(j, "model").value_or("");
  opt_string(j, "user");  // accepted (OpenAI's abuse-monitoring tag), checked for its type only
  refuse_unsupported(j, ep);

  if (ep == Endpoint::kChat) {
    const json* m = field(j, "messages");
    if (!m) bad("messages", "missing");
    if (!m->is_array()) bad("messages", std::string("expected a list of messages, got ") + type_name(*m));
    if (m->empty()) bad("messages", "must not be empty");
    for (size_t i = 0; i < m->size(); ++i) {
      const json& msg = (*m)[i];
      const std::string p = "messages[" + std::to_string(i) + "]";
      if (!msg.is_object()) bad(p, std::string("expected a message object, got ") + type_name(msg));
      tokenizer::ChatMessage cm;
      const auto role = opt_string(msg, "role", p + ".role");
      if (!role) bad(p + ".role", "missing");
      cm.role = *role;
      cm.content = message_content(msg, p + ".content");
      cm.name = opt_string(msg, "name", p + ".name").value_or("");
      r.messages.push_back(std::move(cm));
    }
    r.add_generation_prompt = opt_bool(j, "add_generation_prompt").value_or(true);
  } else {
    const json* p = field(j, "prompt");
    if (!p) bad("prompt", "missing");
    if (p->is_string()) {
      r.prompt_text = p->get<std::string>();
    } else if (p->is_array()) {
      if (p->empty()) bad("prompt", "must not be empty");
      const json& first = (*p)[0];
      if (first.is_string() || first.is_array()) {
        // A batch of prompts: one only (each request is one prompt here; send several requests).
        if (p->size() != 1)
          bad("prompt", "a list of " + std::to_string(p->size()) +
                            " prompts: this server takes one prompt per request");
        if (first.is_string())
          r.prompt_text = first.get<std::string>();
        else
          r.prompt_ids = token_ids(first, "prompt[0]", vocab);
      } else {
        r.prompt_ids = token_ids(*p, "prompt", vocab);
      }
    } else {
      bad("prompt", std::string("expected a string, a list of token ids or a list of one string, got ") +
                        type_name(*p));
    }
    if (r.prompt_ids ? r.prompt_ids->empty() : r.prompt_text.empty()) bad("prompt", "must not be empty");
  }

  auto& sp = r.params;
  if (const auto t = opt_number(j, "temperature")) {
    range("temperature", *t, 0.0, 1e6, ">= 0");
    sp.temperature = static_cast<float>(*t);
  }
  if (const auto v = opt_number(j, "top_p")) {
    if (!(*v > 0.0 && *v <= 1.0)) bad("top_p", "must be in (0, 1], got " + fmt(*v));
    sp.top_p = static_cast<float>(*v);
  }
  if (const auto v = opt_int(j, "top_k")) {
    if (*v < -1 || *v > INT32_MAX)
      bad("top_k", "must be -1 or 0 (off) or a positive integer, got " + std::to_string(*v));
    sp.top_k = static_cast<int32_t>(*v);
  }
  if (const auto v = opt_number(j, "min_p")) {
    range("min_p", *v, 0.0, 1.0, "in [0, 1]");
    sp.min_p = static_cast<float>(*v);
  }
  if (const auto v = opt_number(j, "repetition_penalty")) {
    if (!(*v > 0.0)) bad("repetition_penalty", "must be > 0, got " + fmt(*v));
    sp.repetition_penalty = static_cast<float>(*v);
  }
  if (const auto v = opt_number(j, "presence_penalty")) {
    range("presence_penalty", *v, -2.0, 2.0, "in [-2, 2]");
    sp.presence_penalty = static_cast<float>(*v);
  }
  if (const auto v = opt_number(j, "frequency_penalty")) {
    range("frequency_penalty", *v, -2.0, 2.0, "in [-2, 2]");
    sp.frequency_penalty = static_cast<float>(*v);
  }
  // OpenAI's seed is any 64-bit integer: its bits seed the generator.
  if (const auto v = opt_int(j, "seed")) sp.seed = static_cast<uint64_t>(*v);
  // max_completion_tokens is OpenAI's newer name (chat); when both are given it wins, as in vLLM.
  std::optional<int64_t> mt = opt_int(j, "max_tokens");
  const char* mt_name = "max_tokens";
  if (ep == Endpoint::kChat)
    if (const auto v = opt_int(j, "max_completion_tokens")) {
      mt = v;
      mt_name = "max_completion_tokens";
    }
  if (mt) {
    if (*mt < 1 || *mt > INT32_MAX) bad(mt_name, "must be a positive integer, got " + std::to_string(*mt));
    sp.max_tokens = static_cast<int32_t>(*mt);
    r.max_tokens_given = true;
  }
  if (const json* v = field(j, "stop_token_ids")) {
    if (!v->is_array())
      bad("stop_token_ids", std::string("expected a list of token ids, got ") + type_name(*v));
    sp.stop_token_ids = token_ids(*v, "stop_token_ids", vocab);
  }
  sp.ignore_eos = opt_bool(j, "ignore_eos").value_or(false);

  if (const auto v = opt_int(j, "n")) {
    if (*v < 1 || *v > 4096) bad("n", "must be in 1..4096, got " + std::to_string(*v));
    r.n = static_cast<int32_t>(*v);
  }
  r.stream = opt_bool(j, "stream").value_or(false);
  if (const json* so = field(j, "stream_options")) {
    if (!so->is_object()) bad("stream_options", std::string("expected an object, got ") + type_name(*so));
    if (!r.stream) bad("stream_options", "only allowed when stream is true");
    if (const json* iu = field(*so, "include_usage")) {
      if (!iu->is_boolean())
        bad("stream_options.include_usage", std::string("expected a boolean, got ") + type_name(*iu));
      r.include_usage = iu->get<bool>();
    }
  }
  if (const json* s = field(j, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (size_t i = 0; i < s->size(); ++i) {
        if (!(*s)[i].is_string())
          bad("stop",
              std::string("expected a list of strings, got an element of type ") + type_name((*s)[i]));
        r.stop.push_back((*s)[i].get<std::string>());
      }
    } else {
      bad("stop", std::string("expected a string or a list of strings, got ") + type_name(*s));
    }
    for (const auto& s1 : r.stop)
      if (s1.empty()) bad("stop", "a stop string must not be empty");
    try {
      sampling::StopStringMatcher check(r.stop);
    } catch (const std::invalid_argument& e) {
      bad("stop", e.what());
    }
  }

  if (ep == Endpoint::kChat) {
    const bool lp = opt_bool(j, "logprobs").value_or(false);
    const auto top = opt_int(j, "top_logprobs");
    if (top && (*top < 0 || *top > 20)) bad("top_logprobs", "must be in 0..20, got " + std::to_string(*top));
    if (top && *top > 0 && !lp) bad("top_logprobs", "needs logprobs set to true");
    if (lp) sp.logprobs = static_cast<int32_t>(top.value_or(0));
  } else {
    const json* v = field(j, "logprobs");
    if (v && v->is_boolean())
      bad("logprobs", "expected an integer (the number of alternatives, 0..5), got boolean");
    if (const auto lp = opt_int(j, "logprobs")) {
      if (*lp < 0 || *lp > 5) bad("logprobs", "must be in 0..5, got " + std::to_string(*lp));
      sp.logprobs = static_cast<int32_t>(*lp);
    }
  }
  r.return_token_ids = opt_bool(j, "return_token_ids").value_or(false);
  return r;
}

json logprobs_json(Endpoint ep, const std::vector<LogprobEntry>& entries, int64_t text_offset) {
  const auto bytes = [](const std::string& s) {
    json b = json::array();
    for (const unsigned char c : s) b.push_back(static_cast<int>(c));
    return b;
  };
  // A token's text in JSON: its bytes, with what is not valid UTF-8 replaced (a token may end inside a
  // character; "bytes" carries the exact bytes).
  const auto text = [](const std::string& s) {
    return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  const auto str = [&](const std::string& s) { return json::parse(text(s)); };
  if (ep == Endpoint::kChat) {
    json content = json::array();
    for (const auto& e : entries) {
      json top = json::array();
      for (const auto& [t, lp] : e.top)
        top.push_back({{"token", str(t)}, {"logprob", lp}, {"bytes", bytes(t)}});
      content.push_back({{"token", str(e.token)},
                         {"logprob", e.logprob},
                         {"bytes", bytes(e.token)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  int64_t off = text_offset;
  for (const auto& e : entries) {
    tokens.push_back(str(e.token));
    lps.push_back(e.logprob);
    json top = json::object();
    for (const auto& [t, lp] : e.top) top[str(t).get<std::string>()] = lp;
    tops.push_back(top);
    offsets.push_back(off);
    off += static_cast<int64_t>(e.token.size());
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

std::string new_response_id(Endpoint ep) {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%08llx", static_cast<unsigned long long>(gen()),
                static_cast<unsigned long long>(gen() & 0xffffffffULL));
  return std::string(ep == Endpoint::kChat ? "chatcmpl-" : "cmpl-") + buf;
}

namespace {

json head_json(const ResponseHead& h, bool chunk) {
  const char* object = h.endpoint == Endpoint::kChat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                     : "text_completion";
  return {{"id", h.id}, {"object", object}, {"created", h.created}, {"model", h.model}};
}

}  // namespace

json response_json(const ResponseHead& h, const std::vector<Choice>& choices, const json& usage,
                   const std::vector<int32_t>* prompt_ids) {
  json out = head_json(h, false);
  json cs = json::array();
  for (const auto& c : choices) {
    json cj = {{"index", c.index}, {"finish_reason", c.finish_reason}};
    cj["logprobs"] = c.logprobs ? logprobs_json(h.endpoint, *c.logprobs) : json(nullptr);
    if (h.endpoint == Endpoint::kChat)
      cj["message"] = {{"role", "assistant"}, {"content", c.text}};
    else
      cj["text"] = c.text;
    if (c.token_ids) cj["token_ids"] = *c.token_ids;
    if (prompt_ids && h.endpoint == Endpoint::kCompletion) cj["prompt_token_ids"] = *prompt_ids;
    cs.push_back(std::move(cj));
  }
  out["choices"] = std::move(cs);
  out["usage"] = usage;
  if (prompt_ids && h.endpoint == Endpoint::kChat) out["prompt_token_ids"] = *prompt_ids;
  return out;
}

json chunk_json(const ResponseHead& h, const ChunkDelta& d, bool include_usage) {
  json out = head_json(h, true);
  json c = {{"index", d.index}};
  if (h.endpoint == Endpoint::kChat) {
    json delta = json::object();
    if (d.role) delta["role"] = "assistant";
    if (d.text) delta["content"] = *d.text;
    c["delta"] = std::move(delta);
  } else {
    c["text"] = d.text.value_or("");
  }
  c["logprobs"] = d.logprobs ? logprobs_json(h.endpoint, *d.logprobs, d.text_offset) : json(nullptr);
  c["finish_reason"] = d.finish_reason ? json(*d.finish_reason) : json(nullptr);
  if (d.token_ids) c["token_ids"] = *d.token_ids;
  if (d.prompt_ids && h.endpoint == Endpoint::kCompletion) c["prompt_token_ids"] = *d.prompt_ids;
  out["choices"] = json::array({std::move(c)});
  if (d.prompt_ids && h.endpoint == Endpoint::kChat) out["prompt_token_ids"] = *d.prompt_ids;
  if (include_usage) out["usage"] = nullptr;
  return out;
}

json usage_chunk_json(const ResponseHead& h, const json& usage) {
  json out = head_json(h, true);
  out["choices"] = json::array();
  out["usage"] = usage;
  return out;
}

std::string sse(const json& j) {
  return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

}  // namespace kda::server
