#include "kda/tokenizer/chat_format.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "kda/io/file.h"
#include "kda/tokenizer/sha256.h"

namespace kda::tokenizer {
namespace {

// Templates whose rendering the built-in format is known to equal, by chat_template_digest, with where
// each comes from. A checkpoint's template outside this list is refused rather than silently replaced.
struct KnownTemplate {
  const char* sha256;
  const char* source;
};
constexpr KnownTemplate kKnownTemplates[] = {
    {"f6dadf54ffe01333281b61804acf2b1409b3ed20330d96cf27c863907f5d72e8",
     "tests/data/chat_template/kimi_builtin.jinja: the spec's format as a Jinja template (rendered by "
     "python3-jinja2 and compared in tests/python/test_tokenizer.py)"},
};

void check_known(const std::string& text, const std::string& where) {
  const std::string digest = chat_template_digest(text);
  for (const auto& k : kKnownTemplates)
    if (digest == k.sha256) return;
  throw std::runtime_error(
      where + ": a chat template the built-in chat format is not known to match (sha256 " + digest +
      " of its normalized text); pass --chat-template builtin to serve with the "
      "built-in format (spec: <|im_{role}|>{name}<|im_middle|>{content}<|im_end|>)");
}

}  // namespace

std::string normalize_chat_template(std::string_view text) {
  std::vector<std::string> lines;
  std::string cur;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == '\n') {
      if (!cur.empty() && cur.back() == '\r') cur.pop_back();
      while (!cur.empty() && (cur.back() == ' ' || cur.back() == '\t' || cur.back() == '\r')) cur.pop_back();
      lines.push_back(std::move(cur));
      cur.clear();
    } else {
      cur.push_back(text[i]);
    }
  }
  size_t b = 0, e = lines.size();
  while (b < e && lines[b].empty()) ++b;
  while (e > b && lines[e - 1].empty()) --e;
  std::string out;
  for (size_t i = b; i < e; ++i) {
    out += lines[i];
    out += '\n';
  }
  return out;
}

std::string chat_template_digest(std::string_view text) { return sha256_hex(normalize_chat_template(text)); }

ChatFormat ChatFormat::builtin() { return ChatFormat(); }

ChatFormat ChatFormat::from_dir(const std::string& dir, bool override_builtin) {
  if (override_builtin) return builtin();
  const auto jinja = std::filesystem::path(dir) / "chat_template.jinja";
  if (std::filesystem::exists(jinja)) check_known(io::read_regular_text(jinja.string()), jinja.string());
  // Older checkpoints carry the template inside tokenizer_config.json.
  const auto config = std::filesystem::path(dir) / "tokenizer_config.json";
  if (std::filesystem::exists(config)) {
    const auto j =
        nlohmann::json::parse(io::read_regular_text(config.string()), nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string())
      check_known(j["chat_template"].get<std::string>(), config.string() + " (chat_template)");
  }
  return builtin();
}

std::string ChatFormat::render(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const char* head = nullptr;
    if (m.role == "system" || m.role == "tool") {
      head = "<|im_system|>";
    } else if (m.role == "user") {
      head = "<|im_user|>";
    } else if (m.role == "assistant") {
      head = "<|im_assistant|>";
    } else {
      throw std::invalid_argument("messages[" + std::to_string(i) + "].role: unknown role \"" + m.role +
                                  "\" (system, user, assistant or tool)");
    }
    out += head;
    out += m.name.empty() ? m.role : m.name;
    out += "<|im_middle|>";
    out += m.content;
    out += "<|im_end|>";
  }
  if (add_generation_prompt) out += "<|im_assistant|>assistant<|im_middle|>";
  return out;
}

}  // namespace kda::tokenizer
