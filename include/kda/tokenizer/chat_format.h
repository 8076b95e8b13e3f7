// The chat format of Kimi's models (spec, "Tokenizer"): messages -> the prompt text.
#pragma once

#include <span>
#include <string>

namespace kda::tokenizer {

struct ChatMessage {
  std::string role;
  std::string content;
  std::string name;  // optional: shown instead of the role
};

class ChatFormat {
 public:
  static ChatFormat builtin();
  // The built-in format, after checking dir/chat_template.jinja (and tokenizer_config.json's chat_template)
  // when present: a template the built-in format is known to match (by its normalized text's SHA-256, the
  // list in chat_format.cc with where each came from) is accepted; any other -> std::runtime_error naming
  // the file and saying to pass --chat-template builtin. override_builtin: use the built-in format whatever
  // the folder has (the CLI's --chat-template builtin).
  static ChatFormat from_dir(const std::string& dir, bool override_builtin = false);
  // roles: system, user, assistant, tool (tool -> <|im_system|>tool<|im_middle|>...); unknown role ->
  // std::invalid_argument naming it. add_generation_prompt appends <|im_assistant|>assistant<|im_middle|>.
  std::string render(std::span<const ChatMessage> messages, bool add_generation_prompt = true) const;

 private:
  ChatFormat() = default;
};

// A template's text as compared: CRLF -> LF, trailing white space cut from every line, leading and
// trailing blank lines dropped.
std::string normalize_chat_template(std::string_view text);
// The lowercase hex SHA-256 of normalize_chat_template(text).
std::string chat_template_digest(std::string_view text);

}  // namespace kda::tokenizer
