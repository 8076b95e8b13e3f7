// kda tokenize / detokenize: text <-> ids through the checkpoint's tokenizer, for scripts and tests.
#include <cctype>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/cli/commands.h"
#include "kda/tokenizer/chat_format.h"
#include "kda/tokenizer/tokenizer.h"

namespace kda::cli {
namespace {

// The model's vocab_size from DIR/config.json; 0 (B + 256) without one.
int64_t config_vocab_size(const std::string& dir) {
  const auto path = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::exists(path)) return 0;
  std::ifstream f(path);
  const auto j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw std::invalid_argument(path.string() + ": not a JSON object");
  if (!j.contains("vocab_size")) return 0;
  if (!j["vocab_size"].is_number_integer())
    throw std::invalid_argument(path.string() + ": vocab_size must be an integer");
  return j["vocab_size"].get<int64_t>();
}

tokenizer::Tokenizer load(const TokenizeOptions& o) {
  if (o.synthetic_vocab > 0) {
    if (!o.model.empty()) throw std::invalid_argument("--model and --synthetic-vocab exclude each other");
    return tokenizer::Tokenizer::synthetic(o.synthetic_vocab, o.seed);
  }
  if (o.model.empty()) throw std::invalid_argument("--model DIR or --synthetic-vocab N is required");
  return tokenizer::Tokenizer::from_dir(o.model, config_vocab_size(o.model));
}

std::string read_stdin() {
  std::ios::sync_with_stdio(false);
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

std::vector<tokenizer::ChatMessage> parse_messages(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_array()) throw std::invalid_argument("--chat: stdin must be a JSON array of messages");
  std::vector<tokenizer::ChatMessage> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& m = j[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw std::invalid_argument(at + ": must be an object");
    tokenizer::ChatMessage msg;
    for (const auto& [key, value] : m.items()) {
      if (key != "role" && key != "content" && key != "name")
        throw std::invalid_argument(at + "." + key + ": unknown field (role, content, name)");
      if (!value.is_string()) throw std::invalid_argument(at + "." + key + ": must be a string");
    }
    if (!m.contains("role") || !m.contains("content"))
      throw std::invalid_argument(at + ": needs role and content");
    msg.role = m["role"].get<std::string>();
    msg.content = m["content"].get<std::string>();
    if (m.contains("name")) msg.name = m["name"].get<std::string>();
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace

int run_tokenize(const TokenizeOptions& o) {
  const tokenizer::Tokenizer tok = load(o);
  if (!o.save.empty()) {
    tok.save(o.save);
    std::fprintf(stderr, "wrote %s/tiktoken.model and tokenizer_config.json (vocab_size %lld)\n",
                 o.save.c_str(), static_cast<long long>(tok.vocab_size()));
    return 0;
  }
  std::string text = read_stdin();
  if (o.chat) {
    const auto format = o.model.empty()
                            ? tokenizer::ChatFormat::builtin()
                            : tokenizer::ChatFormat::from_dir(o.model, o.chat_template == "builtin");
    const auto messages = parse_messages(text);
    text = format.render(messages, /*add_generation_prompt=*/true);
    if (o.text) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      return 0;
    }
  }
  const auto ids = tok.encode(text, !o.no_special);
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ' ';
    out += std::to_string(ids[i]);
  }
  out += '\n';
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int run_detokenize(const TokenizeOptions& o) {
  const tokenizer::Tokenizer tok = load(o);
  const std::string in = read_stdin();
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < in.size()) {
    if (std::isspace(static_cast<unsigned char>(in[i]))) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < in.size() && !std::isspace(static_cast<unsigned char>(in[j]))) ++j;
    const std::string word = in.substr(i, j - i);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || v < 0 || v > INT32_MAX)
      throw std::invalid_argument("stdin: \"" + word + "\" (id " + std::to_string(ids.size()) +
                                  ") is not a token id");
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  const std::string text = tok.decode(ids);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace kda::cli
