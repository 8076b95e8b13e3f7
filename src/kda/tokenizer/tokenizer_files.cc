// Tokenizer::from_dir / save / synthetic: the tiktoken.model + tokenizer_config.json files.
#include <charconv>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "kda/io/file.h"
#include "kda/tokenizer/base64.h"
#include "kda/tokenizer/tokenizer.h"
#include "kda/tokenizer/tokenizer_data.h"

namespace kda::tokenizer {
namespace {

std::string reserved_name(int64_t id) { return "<|reserved_token_" + std::to_string(id) + "|>"; }

// tiktoken.model: "base64 rank" per line, rank = the line's index (0-based), a final newline allowed.
std::vector<std::string> read_tiktoken_model(const std::string& path) {
  const std::string text = io::read_regular_text(path);
  std::vector<std::string> tokens;
  std::unordered_map<std::string, size_t> line_of;  // token bytes -> line (1-based), for duplicates
  size_t pos = 0, line = 0;
  while (pos < text.size()) {
    ++line;
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view l(text.data() + pos, end - pos);
    pos = end + 1;
    auto fail = [&](const std::string& what) {
      throw std::invalid_argument(path + ":" + std::to_string(line) + ": " + what);
    };
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    if (l.empty()) fail("empty line");
    const size_t sp = l.find(' ');
    if (sp == std::string_view::npos || l.find(' ', sp + 1) != std::string_view::npos)
      fail("expected \"base64 rank\"");
    const auto bytes = base64_decode(l.substr(0, sp));
    if (!bytes) fail("bad base64 \"" + std::string(l.substr(0, sp)) + "\"");
    const std::string_view r = l.substr(sp + 1);
    int64_t rank = -1;
    const auto [p, ec] = std::from_chars(r.data(), r.data() + r.size(), rank);
    if (ec != std::errc() || p != r.data() + r.size() || r.empty())
      fail("bad rank \"" + std::string(r) + "\"");
    if (rank != static_cast<int64_t>(tokens.size()))
      fail("rank " + std::to_string(rank) + " where " + std::to_string(tokens.size()) +
           " comes next (ranks must run 0, 1, 2, ... without gaps or repeats)");
    const auto [it, fresh] = line_of.emplace(*bytes, line);
    if (!fresh) fail("the same bytes as line " + std::to_string(it->second));
    tokens.push_back(*bytes);
  }
  if (tokens.empty()) throw std::invalid_argument(path + ": no tokens");
  return tokens;
}

// tokenizer_config.json's added_tokens_decoder: {"<id>": {"content": "<name>", ...}, ...}, ids in B .. B+257.
std::vector<std::string> read_special_names(const std::string& path, int64_t num_base) {
  std::vector<std::string> names(kNumSpecialIds);
  for (int64_t k = 0; k < kNumSpecialIds; ++k) names[k] = reserved_name(num_base + k);
  if (!std::filesystem::exists(path)) return names;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_regular_text(path));
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw std::invalid_argument(path + ": expected a JSON object");
  if (!j.contains("added_tokens_decoder")) return names;
  const auto& dec = j["added_tokens_decoder"];
  if (!dec.is_object()) throw std::invalid_argument(path + ": added_tokens_decoder must be an object");
  for (const auto& [key, entry] : dec.items()) {
    int64_t id = -1;
    const auto [p, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || p != key.data() + key.size() || id < num_base || id >= num_base + kNumSpecialIds)
      throw std::invalid_argument(path + ": added_tokens_decoder key \"" + key + "\" is not a special id (" +
                                  std::to_string(num_base) + " .. " +
                                  std::to_string(num_base + kNumSpecialIds - 1) + ")");
    if (!entry.is_object() || !entry.contains("content") || !entry["content"].is_string())
      throw std::invalid_argument(path + ": added_tokens_decoder[\"" + key + "\"].content must be a string");
    names[id - num_base] = entry["content"].get<std::string>();
  }
  return names;
}

}  // namespace

Tokenizer Tokenizer::from_dir(const std::string& dir, int64_t vocab_size) {
  const std::string model = (std::filesystem::path(dir) / "tiktoken.model").string();
  const std::string config = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  std::vector<std::string> base = read_tiktoken_model(model);
  std::vector<std::string> specials = read_special_names(config, static_cast<int64_t>(base.size()));
  if (vocab_size <= 0) vocab_size = static_cast<int64_t>(base.size()) + 256;  // Kimi's: B + 256
  return Tokenizer(build_tokenizer_data(std::move(base), std::move(specials), vocab_size, dir));
}

Tokenizer Tokenizer::synthetic(int64_t vocab_size, uint64_t seed) {
  if (vocab_size < 512)
    throw std::invalid_argument("vocab_size: a synthetic tokenizer needs at least 512 ids, got " +
                                std::to_string(vocab_size));
  const int64_t num_base = vocab_size - 256;
  std::vector<std::string> base;
  base.reserve(num_base);
  std::unordered_set<std::string> seen;
  for (int b = 0; b < 256; ++b) {
    base.emplace_back(1, static_cast<char>(b));
    seen.insert(base.back());
  }
  // Mostly printable ASCII (words, spaces, punctuation), so that text merges as it would with a trained
  // vocabulary; the rest any earlier token. Earlier tokens are drawn towards the low ranks, as a trained
  // vocabulary's merges build on its frequent tokens.
  std::vector<int32_t> text_like;
  for (int b = 32; b < 127; ++b) text_like.push_back(b);
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  auto pick = [&](const std::vector<int32_t>& pool) {
    const double x = u(rng);
    return pool[static_cast<size_t>(x * x * static_cast<double>(pool.size()))];
  };
  std::vector<int32_t> all;
  for (int b = 0; b < 256; ++b) all.push_back(b);
  while (static_cast<int64_t>(base.size()) < num_base) {
    const bool text = u(rng) < 0.85;
    const std::vector<int32_t>& pool = text ? text_like : all;
    std::string t = base[pick(pool)] + base[pick(pool)];
    if (t.size() > 16 || !seen.insert(t).second) continue;
    const auto id = static_cast<int32_t>(base.size());
    base.push_back(std::move(t));
    all.push_back(id);
    if (text) text_like.push_back(id);
  }
  std::vector<std::string> specials(kNumSpecialIds);
  for (int64_t k = 0; k < kNumSpecialIds; ++k) specials[k] = reserved_name(num_base + k);
  for (const auto& [k, name] : kimi_named_specials()) specials[k] = name;
  return Tokenizer(build_tokenizer_data(std::move(base), std::move(specials), vocab_size, "synthetic"));
}

void Tokenizer::save(const std::string& dir) const {
  std::filesystem::create_directories(dir);
  const std::string model = (std::filesystem::path(dir) / "tiktoken.model").string();
  const std::string config = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  {
    std::ofstream f(model, std::ios::binary);
    for (int64_t r = 0; r < d_->num_base; ++r) f << base64_encode(d_->tokens[r]) << ' ' << r << '\n';
    if (!f) throw std::runtime_error(model + ": cannot write");
  }
  nlohmann::json dec = nlohmann::json::object();
  for (int64_t k = 0; k < kNumSpecialIds; ++k) {
    const int64_t id = d_->num_base + k;
    const std::string& name = d_->tokens[id];
    if (name == reserved_name(id)) continue;
    dec[std::to_string(id)] = {{"content", name}, {"lstrip", false},      {"normalized", false},
                               {"rstrip", false}, {"single_word", false}, {"special", true}};
  }
  nlohmann::json j = {{"added_tokens_decoder", dec},
                      {"bos_token", d_->tokens[d_->bos]},
                      {"eos_token", d_->tokens[d_->eos]},
                      {"tokenizer_class", "TikTokenTokenizer"}};
  std::ofstream f(config, std::ios::binary);
  f << j.dump(2) << '\n';
  if (!f) throw std::runtime_error(config + ": cannot write");
}

}  // namespace kda::tokenizer
