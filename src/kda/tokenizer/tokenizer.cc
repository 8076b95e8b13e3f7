#include "kda/tokenizer/tokenizer.h"

#include <algorithm>
#include <stdexcept>

#include "kda/tokenizer/long_runs.h"
#include "kda/tokenizer/tokenizer_data.h"
#include "kda/tokenizer/utf8.h"

namespace kda::tokenizer {

void SpecialTrie::insert(std::string_view s, int32_t id) {
  int32_t n = 0;
  for (char c : s) {
    const auto b = static_cast<uint8_t>(c);
    int32_t child = -1;
    for (const auto& [k, v] : nodes[n].children)
      if (k == b) child = v;
    if (child < 0) {
      child = static_cast<int32_t>(nodes.size());
      nodes[n].children.emplace_back(b, child);
      nodes.emplace_back();
    }
    n = child;
  }
  nodes[n].id = id;
  if (!s.empty()) first_byte[static_cast<uint8_t>(s[0])] = true;
}

std::pair<size_t, int32_t> SpecialTrie::longest_at(std::string_view text, size_t pos) const {
  std::pair<size_t, int32_t> best{0, -1};
  int32_t n = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto b = static_cast<uint8_t>(text[i]);
    int32_t child = -1;
    for (const auto& [k, v] : nodes[n].children)
      if (k == b) child = v;
    if (child < 0) break;
    n = child;
    if (nodes[n].id >= 0) best = {i + 1 - pos, nodes[n].id};
  }
  return best;
}

Tokenizer::Tokenizer(std::shared_ptr<const TokenizerData> d) : d_(std::move(d)) {}

namespace {

void encode_ordinary(const TokenizerData& d, std::string_view text, std::vector<int32_t>& out,
                     std::vector<std::string_view>& pieces) {
  pieces.clear();
  d.pretokenizer->split(text, pieces);
  for (std::string_view p : pieces) bpe_encode_piece(d.ranks, p, out);
}

}  // namespace

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  const size_t bad = utf8_invalid_offset(text);
  if (bad != std::string_view::npos)
    throw std::invalid_argument("text: invalid UTF-8 at byte offset " + std::to_string(bad));
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<std::string_view> cuts, pieces;
  // Each part between special tokens is cut as tokenization_kimi.py cuts the text it is given, and each
  // piece pre-tokenized and merged on its own (the pattern sees the pieces' ends).
  const auto plain = [&](std::string_view part) {
    cuts.clear();
    cut_long_runs(part, cuts);
    for (const std::string_view c : cuts) encode_ordinary(*d_, c, out, pieces);
  };
  if (!allow_special || d_->special_ids.empty()) {
    plain(text);
    return out;
  }
  // As Hugging Face's tokenizer call over Kimi's tokenizer (the way vLLM encodes a prompt): the special
  // tokens split the text first, the longest winning at a position; then each part goes to Kimi's
  // encode, so a run's count starts again after a special token.
  size_t seg = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (!d_->trie.first_byte[static_cast<uint8_t>(text[i])]) continue;
    const auto [len, id] = d_->trie.longest_at(text, i);
    if (len == 0) continue;
    plain(text.substr(seg, i - seg));
    out.push_back(id);
    i += len - 1;
    seg = i + 1;
  }
  plain(text.substr(seg));
  return out;
}

std::vector<std::string_view> Tokenizer::split(std::string_view text) const {
  const size_t bad = utf8_invalid_offset(text);
  if (bad != std::string_view::npos)
    throw std::invalid_argument("text: invalid UTF-8 at byte offset " + std::to_string(bad));
  std::vector<std::string_view> pieces;
  d_->pretokenizer->split(text, pieces);
  return pieces;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= d_->vocab || !d_->producible[id])
    throw std::invalid_argument("token id " + std::to_string(id) +
                                " is not a token of this vocabulary (vocab_size " +
                                std::to_string(d_->vocab) + ")");
  return d_->tokens[id];
}

std::string Tokenizer::decode_bytes(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  for (int32_t id : ids) token_bytes(id);  // every id checked before any text is made
  StreamDecoder sd(*this);
  std::string out;
  for (int32_t id : ids) out += sd.push(id);
  out += sd.flush();
  return out;
}

int64_t Tokenizer::vocab_size() const { return d_->vocab; }
int64_t Tokenizer::num_base_tokens() const { return d_->num_base; }
bool Tokenizer::is_special(int32_t id) const {
  return id >= d_->num_base && id < d_->vocab && d_->producible[id];
}
std::optional<int32_t> Tokenizer::special_id(std::string_view text) const {
  const auto it = d_->special_ids.find(std::string(text));
  if (it == d_->special_ids.end()) return std::nullopt;
  return it->second;
}
int32_t Tokenizer::bos_id() const { return d_->bos; }
int32_t Tokenizer::eos_id() const { return d_->eos; }
int32_t Tokenizer::im_end_id() const { return d_->im_end; }
std::vector<int32_t> Tokenizer::stop_ids() const { return {d_->im_end, d_->eos}; }
const std::vector<uint8_t>& Tokenizer::producible() const { return d_->producible; }

StreamDecoder::StreamDecoder(const Tokenizer& tok) : tok_(&tok) {}

std::string StreamDecoder::push(int32_t id) {
  const std::string& bytes = tok_->token_bytes(id);
  pending_ += bytes;
  std::string out;
  const size_t used = utf8_decode_replace(pending_, out, /*final=*/false);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  utf8_decode_replace(pending_, out, /*final=*/true);
  pending_.clear();
  return out;
}

std::shared_ptr<TokenizerData> build_tokenizer_data(std::vector<std::string> base,
                                                    std::vector<std::string> specials, int64_t vocab,
                                                    const std::string& where) {
  auto d = std::make_shared<TokenizerData>();
  d->num_base = static_cast<int64_t>(base.size());
  if (specials.size() != static_cast<size_t>(kNumSpecialIds))
    throw std::logic_error("build_tokenizer_data: expected 258 special names");
  if (vocab < d->num_base)
    throw std::invalid_argument(where + ": vocab_size " + std::to_string(vocab) + " is below the " +
                                std::to_string(d->num_base) + " base tokens of tiktoken.model");
  d->vocab = vocab;
  d->ranks = RankTable(base);
  for (int b = 0; b < 256; ++b)
    if (d->ranks.byte_rank(static_cast<uint8_t>(b)) < 0)
      throw std::invalid_argument(where + ": tiktoken.model has no token for the single byte 0x" +
                                  std::string(1, "0123456789abcdef"[b >> 4]) + "0123456789abcdef"[b & 15] +
                                  " (every byte must be a token)");
  d->tokens = std::move(base);
  d->producible.assign(vocab, 0);
  std::fill(d->producible.begin(), d->producible.begin() + d->num_base, 1);
  for (int64_t k = 0; k < kNumSpecialIds; ++k) {
    const auto id = static_cast<int32_t>(d->num_base + k);
    const std::string& name = specials[k];
    if (name.empty())
      throw std::invalid_argument(where + ": special token " + std::to_string(id) + " has an empty name");
    if (id < vocab) {
      if (!d->special_ids.emplace(name, id).second)
        throw std::invalid_argument(where + ": special token name \"" + name + "\" is given to ids " +
                                    std::to_string(d->special_ids[name]) + " and " + std::to_string(id));
      d->trie.insert(name, id);
      d->producible[id] = 1;
    }
    d->tokens.push_back(name);
  }
  auto need = [&](const char* name) {
    const auto it = d->special_ids.find(name);
    if (it == d->special_ids.end())
      throw std::invalid_argument(
          where + ": no special token " + name +
          " below vocab_size (tokenizer_config.json's added_tokens_decoder names it)");
    return it->second;
  };
  d->bos = need(kBosName);
  d->eos = need(kEosName);
  d->im_end = need(kImEndName);
  d->pretokenizer = std::make_unique<Pretokenizer>();
  return d;
}

std::vector<std::pair<int, std::string>> kimi_named_specials() {
  return {{0, "[BOS]"},
          {1, "[EOS]"},
          {2, "<|im_end|>"},
          {3, "<|im_user|>"},
          {4, "<|im_assistant|>"},
          {6, "<|start_header_id|>"},
          {7, "<|end_header_id|>"},
          {9, "[EOT]"},
          {10, "<|im_system|>"},
          {17, "<|im_middle|>"},
          {254, "[UNK]"},
          {255, "[PAD]"}};
}

}  // namespace kda::tokenizer
