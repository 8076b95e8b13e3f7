// The tokenizer: encode/decode round trips, special tokens, the tiktoken.model reader's errors, the
// streaming decoder, and the fast BPE merges against the plain quadratic loop.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kda/tokenizer/base64.h"
#include "kda/tokenizer/bpe.h"
#include "kda/tokenizer/chat_format.h"
#include "kda/tokenizer/long_runs.h"
#include "kda/tokenizer/sha256.h"
#include "kda/tokenizer/tokenizer.h"
#include "kda/tokenizer/utf8.h"
#include "support/test_support.h"

namespace kt = kda::tokenizer;

namespace {

const kt::Tokenizer& tok() {
  static const kt::Tokenizer t = kt::Tokenizer::synthetic(8192, 7);
  return t;
}

// Random text over the kinds of characters the pattern treats differently.
std::string random_text(std::mt19937_64& rng, size_t chars) {
  static const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {'a', 'z'},          {'A', 'Z'},       {'0', '9'},         {' ', ' '},         {'\n', '\n'},
      {'\r', '\r'},        {'\t', '\t'},     {'!', '/'},         {0x4E00, 0x9FFF},   {0x3000, 0x303F},
      {0x0300, 0x036F},    {0x00C0, 0x024F}, {0x0370, 0x03FF},   {0x0400, 0x04FF},   {0x0590, 0x06FF},
      {0x0E00, 0x0E7F},    {0xAC00, 0xD7A3}, {0x3040, 0x30FF},   {0x1F300, 0x1F64F}, {0x1F900, 0x1F9FF},
      {0x2000, 0x206F},    {0x00A0, 0x00BF}, {0x20000, 0x2A6DF}, {0xE000, 0xF8FF},   {0x10000, 0x1FFFF},
      {0xF0000, 0x10FFFF}, {0x0080, 0x009F}, {'\'', '\''},       {0xFE00, 0xFE0F},   {0x200D, 0x200D}};
  std::uniform_int_distribution<size_t> pick(0, ranges.size() - 1);
  std::string s;
  for (size_t i = 0; i < chars; ++i) {
    const auto [lo, hi] = ranges[pick(rng)];
    char32_t cp = std::uniform_int_distribution<uint32_t>(lo, hi)(rng);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
    kt::utf8_append(s, cp);
  }
  return s;
}

std::string temp_dir(const std::string& name) { return kda::testing::make_temp_dir("tok_" + name).string(); }

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

}  // namespace

TEST(Tokenizer, RoundTripsRandomUtf8) {
  std::mt19937_64 rng(1);
  for (int t = 0; t < 300; ++t) {
    const std::string s = random_text(rng, 1 + t % 97);
    const auto ids = tok().encode(s);
    ASSERT_EQ(tok().decode_bytes(ids), s);
    ASSERT_EQ(tok().decode(ids), s);
    for (int32_t id : ids) ASSERT_LT(id, tok().vocab_size());
  }
}

TEST(Tokenizer, RoundTripsFixedTexts) {
  for (const std::string& s : std::vector<std::string>{
           "", " ", "  \n\n  \r\n\t x", "Hello, world! It's 2024; I'LL say 12345.",
           "你好，世界。「引用」中文English混合", "a\u0301e\u0308 \u00e9",
           "\U0001F600\U0001F469\u200D\U0001F4BB \U0001F1FA\U0001F1F8", "x\u00a0y\u3000z\u0085w",
           std::string(1000, ' ') + "end", "line\r\n\r\n\nnext"}) {
    const auto ids = tok().encode(s);
    EXPECT_EQ(tok().decode(ids), s);
  }
}

TEST(Tokenizer, PiecesFollowThePattern) {
  auto split = [](std::string_view s) {
    std::vector<std::string> out;
    for (auto p : tok().split(s)) out.emplace_back(p);
    return out;
  };
  using V = std::vector<std::string>;
  // Han runs stand alone (Script=Han: U+3001 and U+3002 are not Han, 々 and 〇 are).
  EXPECT_EQ(split("中文English混合"), (V{"中文", "English", "混合"}));
  EXPECT_EQ(split("你好、世界。「引用」"), (V{"你好", "、", "世界", "。「", "引用", "」"}));
  EXPECT_EQ(split("々〇一"), (V{"々〇一"}));
  // Contractions, case runs, digits in threes, punctuation, whitespace before a word.
  EXPECT_EQ(split("I'LL don't HTTPServer 1234567"),
            (V{"I'LL", " don't", " HTTPServer", " ", "123", "456", "7"}));
  EXPECT_EQ(split("it'\u017f"), (V{"it'\u017f"}));  // (?i) folds U+017F to s, as the regex crate does
  EXPECT_EQ(split("a  b\n\n c"), (V{"a", " ", " b", "\n\n", " c"}));
  EXPECT_EQ(split("x\u0085 y"), (V{"x", "\u0085", " y"}));  // U+0085 is white space (Unicode White_Space)
  EXPECT_EQ(split("end   "), (V{"end", "   "}));
  EXPECT_EQ(split("...!?\n\nok"), (V{"...!?\n\n", "ok"}));
}

TEST(Tokenizer, SpecialTokensInText) {
  const int32_t im_end = tok().im_end_id();
  EXPECT_EQ(im_end, tok().num_base_tokens() + 2);
  EXPECT_EQ(tok().bos_id(), tok().num_base_tokens());
  EXPECT_EQ(tok().eos_id(), tok().num_base_tokens() + 1);
  EXPECT_EQ(tok().special_id("<|im_middle|>"), tok().num_base_tokens() + 17);
  EXPECT_EQ(tok().special_id("<|im_system|>"), tok().num_base_tokens() + 10);
  EXPECT_EQ(tok().special_id("[PAD]"), tok().num_base_tokens() + 255);
  EXPECT_FALSE(tok().special_id("<|reserved_token_" + std::to_string(tok().vocab_size()) + "|>").has_value());
  const std::string text = "hi<|im_end|><|im_user|>user<|im_middle|>x [EOS]";
  const auto ids = tok().encode(text);
  std::vector<int32_t> expect = tok().encode("hi", false);
  expect.push_back(im_end);
  expect.push_back(*tok().special_id("<|im_user|>"));
  for (int32_t id : tok().encode("user", false)) expect.push_back(id);
  expect.push_back(*tok().special_id("<|im_middle|>"));
  for (int32_t id : tok().encode("x ", false)) expect.push_back(id);
  expect.push_back(tok().eos_id());
  EXPECT_EQ(ids, expect);
  EXPECT_EQ(tok().decode(ids), text);
  // allow_special = false: plain text, no special id.
  const auto plain = tok().encode(text, false);
  for (int32_t id : plain) EXPECT_FALSE(tok().is_special(id)) << id;
  EXPECT_EQ(tok().decode(plain), text);
  // An id beyond vocab_size (Kimi's last two reserved ids) is never produced: its text stays text.
  const std::string beyond = "<|reserved_token_" + std::to_string(tok().vocab_size()) + "|>";
  for (int32_t id : tok().encode(beyond)) EXPECT_LT(id, tok().num_base_tokens());
  // A half-written special is text.
  for (int32_t id : tok().encode("<|im_end|")) EXPECT_LT(id, tok().num_base_tokens());
}

TEST(Tokenizer, InvalidUtf8NamesTheOffset) {
  for (const auto& [text, offset] : std::vector<std::pair<std::string, size_t>>{{"ab\xff", 2},
                                                                                {"abc\xc3", 3},
                                                                                {"\xc0\x80", 0},
                                                                                {"ok \xed\xa0\x80", 3},
                                                                                {"\xf4\x90\x80\x80", 0},
                                                                                {"\xe4\xb8", 0},
                                                                                {"x\x80", 1}}) {
    try {
      tok().encode(text);
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("byte offset " + std::to_string(offset)), std::string::npos)
          << e.what();
    }
  }
}

TEST(Tokenizer, DecodeRefusesBadIds) {
  for (int32_t id :
       {-1, static_cast<int32_t>(tok().vocab_size()), static_cast<int32_t>(tok().vocab_size()) + 1}) {
    const std::vector<int32_t> ids = {65, id};
    EXPECT_THROW(tok().decode_bytes(ids), std::invalid_argument);
    EXPECT_THROW(tok().decode(ids), std::invalid_argument);
  }
}

TEST(StreamDecoder, EverySplitOfMultiByteCharacters) {
  // Each byte its own token (ranks 0..255 are the single bytes): every split point of every character.
  const std::string text = "a\u00e9\u4e2d\U0001F600z\u0301";
  std::vector<int32_t> ids;
  for (char c : text) ids.push_back(static_cast<uint8_t>(c));  // rank of byte b is b in synthetic()
  kt::StreamDecoder sd(tok());
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = sd.push(id);
    ASSERT_EQ(kt::utf8_invalid_offset(piece), std::string::npos);
    out += piece;
    ASSERT_EQ(text.compare(0, out.size(), out), 0) << "text emitted before its character completed";
  }
  out += sd.flush();
  EXPECT_EQ(out, text);
}

TEST(StreamDecoder, InvalidBytesBecomeReplacementCharacters) {
  auto run = [](const std::string& bytes, bool flush) {
    kt::StreamDecoder sd(tok());
    std::string out;
    for (char c : bytes) out += sd.push(static_cast<uint8_t>(c));
    if (flush) out += sd.flush();
    return out;
  };
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(run("a\xff", false), "a" + r);          // never starts a character: at once
  EXPECT_EQ(run("a\xe4\xb8", false), "a");          // may still complete: held back
  EXPECT_EQ(run("a\xe4\xb8", true), "a" + r);       // flush: one U+FFFD for the maximal subpart
  EXPECT_EQ(run("\xe4\xb8x", false), r + "x");      // broken by x
  EXPECT_EQ(run("\xed\xa0\x80", true), r + r + r);  // a surrogate: three bad bytes
  EXPECT_EQ(run("\xf0\x9f\x98", true), r);
  EXPECT_EQ(run("\xc0\xaf", true), r + r);  // overlong
  std::mt19937_64 rng(3);
  for (int t = 0; t < 200; ++t) {
    std::string bytes;
    for (int i = 0; i < 20; ++i) bytes += static_cast<char>(rng() & 0xff);
    const std::string out = run(bytes, true);
    ASSERT_EQ(kt::utf8_invalid_offset(out), std::string::npos);
    // The same as decoding the whole buffer at once.
    std::string whole;
    kt::utf8_decode_replace(bytes, whole, true);
    ASSERT_EQ(out, whole);
  }
}

TEST(Bpe, FastMergesEqualTheReference) {
  // Pieces over a small alphabet so that merges chain and ranks tie (repeated pairs).
  const auto& t = tok();
  std::vector<std::string> vocab;
  for (int32_t r = 0; r < t.num_base_tokens(); ++r) vocab.push_back(t.token_bytes(r));
  const kt::RankTable ranks(vocab);
  std::mt19937_64 rng(5);
  const std::string alphabet = "aeiou tnsrl";
  for (int i = 0; i < 2000; ++i) {
    const size_t n = 1 + rng() % 200;
    std::string piece;
    for (size_t k = 0; k < n; ++k) {
      piece += (rng() % 8 == 0) ? static_cast<char>(rng() & 0xff) : alphabet[rng() % alphabet.size()];
    }
    std::vector<int32_t> ref, scan, heap;
    kt::bpe_merge_reference(ranks, piece, ref);
    kt::bpe_merge_scan(ranks, piece, scan);
    kt::bpe_merge_heap(ranks, piece, heap);
    ASSERT_EQ(scan, ref) << piece;
    ASSERT_EQ(heap, ref) << piece;
  }
}

TEST(Bpe, LongSinglePieceIsNotQuadratic) {
  // 100 KB of one "word": one piece for the pattern. The heap merge's work is counted, not timed.
  std::mt19937_64 rng(9);
  std::string word;
  while (word.size() < 100000) word += "abcdefghijklmnopqrstuvwxyz"[rng() % 26];
  const auto pieces = tok().split(word);
  ASSERT_EQ(pieces.size(), 1u);
  std::vector<std::string> vocab;
  for (int32_t r = 0; r < tok().num_base_tokens(); ++r) vocab.push_back(tok().token_bytes(r));
  const kt::RankTable ranks(vocab);
  std::vector<int32_t> heap;
  int64_t steps = 0;
  kt::bpe_merge_heap(ranks, word, heap, &steps);
  // Every merge pushes at most two entries: pops <= initial pairs + 2 * merges < 3 n.
  EXPECT_LT(steps, 3 * static_cast<int64_t>(word.size()));
  // encode() merges it as Kimi's tokenizer does: in 25,000-character pieces.
  std::vector<int32_t> cut;
  for (size_t at = 0; at < word.size(); at += kt::kKimiMaxRunChars)
    kt::bpe_merge_heap(ranks, std::string_view(word).substr(at, kt::kKimiMaxRunChars), cut);
  const auto ids = tok().encode(word);
  EXPECT_EQ(ids, cut);
  EXPECT_EQ(tok().decode(ids), word);
}

// tokenization_kimi.py's _split_whitespaces_or_nonwhitespaces over 400,000-character chunks, written
// plainly over code points: the cuts' character offsets.
std::vector<size_t> reference_cuts(const std::u32string& s) {
  std::vector<size_t> cuts;
  for (size_t chunk = 0; chunk < s.size(); chunk += kt::kKimiChunkChars) {
    if (chunk > 0) cuts.push_back(chunk);
    const size_t end = std::min(s.size(), chunk + static_cast<size_t>(kt::kKimiChunkChars));
    int64_t len = 0;
    bool space = kt::python_isspace(s[chunk]);
    for (size_t i = chunk; i < end; ++i) {
      const bool now = kt::python_isspace(s[i]);
      if (space != now) {
        len = 1;
        space = now;
      } else if (++len > kt::kKimiMaxRunChars) {
        cuts.push_back(i);
        len = 1;
      }
    }
  }
  return cuts;
}

TEST(Tokenizer, LongRunsAreCutAsKimisTokenizerCutsThem) {
  // Python's str.isspace: Zs and bidi WS/B/S -- U+001C..U+001F and U+0085 yes; U+200B, U+180E, U+FEFF no.
  for (char32_t c : {0x09, 0x0A,   0x0B,   0x0C,   0x0D,   0x1C,   0x1D,   0x1E,   0x1F,   0x20,  0x85,
                     0xA0, 0x1680, 0x2000, 0x2005, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000})
    EXPECT_TRUE(kt::python_isspace(c)) << std::hex << static_cast<uint32_t>(c);
  for (char32_t c : {0x00, 0x08, 0x0E, 0x1B, 0x21, 0x84, 0x86, 0x9F, 0xA1, 0x180E, 0x200B, 0x200C, 0x2027,
                     0x202A, 0x2060, 0x3001, 0xFEFF, 0x10FFFF})
    EXPECT_FALSE(kt::python_isspace(c)) << std::hex << static_cast<uint32_t>(c);

  // Runs just under, at and over the limit, of 1- to 4-byte characters, mixed, and over a chunk's end.
  std::mt19937_64 rng(5);
  const std::vector<char32_t> alphabet = {'a', ' ', 0x3000, 0x4E2D, 0x1F600, '\n', 0x85, 0xE9, 0x1C};
  std::vector<std::u32string> texts;
  for (const int64_t n : {kt::kKimiMaxRunChars - 1, kt::kKimiMaxRunChars, kt::kKimiMaxRunChars + 1,
                          3 * kt::kKimiMaxRunChars + 7})
    for (const char32_t c : alphabet) texts.push_back(std::u32string(static_cast<size_t>(n), c));
  std::u32string mixed;
  while (mixed.size() < static_cast<size_t>(kt::kKimiChunkChars) + 60'000) {
    const char32_t c = alphabet[rng() % alphabet.size()];
    mixed.append(rng() % 4 == 0 ? 1 + rng() % 40'000 : 1 + rng() % 50, c);
  }
  texts.push_back(mixed);
  texts.push_back(std::u32string(static_cast<size_t>(kt::kKimiChunkChars) + 10, 'x'));
  for (const auto& t : texts) {
    std::string utf8;
    std::vector<size_t> byte_at;  // character offset -> byte offset
    for (const char32_t c : t) {
      byte_at.push_back(utf8.size());
      kt::utf8_append(utf8, c);
    }
    byte_at.push_back(utf8.size());
    std::vector<std::string_view> got;
    kt::cut_long_runs(utf8, got);
    std::vector<size_t> want_cuts = reference_cuts(t), got_cuts;
    size_t at = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_EQ(got[k].data(), utf8.data() + at) << "the pieces must tile the text";
      at += got[k].size();
      if (k + 1 < got.size()) got_cuts.push_back(at);
    }
    EXPECT_EQ(at, utf8.size());
    for (auto& c : want_cuts) c = byte_at[c];
    EXPECT_EQ(got_cuts, want_cuts) << "a text of " << t.size() << " characters";
  }
  std::vector<std::string_view> none;
  kt::cut_long_runs("", none);
  EXPECT_TRUE(none.empty());
}

TEST(Tokenizer, SyntheticSavesAndReadsBack) {
  const std::string dir = temp_dir("save");
  tok().save(dir);
  const auto back = kt::Tokenizer::from_dir(dir, tok().vocab_size());
  ASSERT_EQ(back.num_base_tokens(), tok().num_base_tokens());
  for (int32_t id = 0; id < tok().vocab_size(); ++id)
    ASSERT_EQ(back.token_bytes(id), tok().token_bytes(id)) << id;
  EXPECT_EQ(back.stop_ids(), tok().stop_ids());
  EXPECT_EQ(back.producible(), tok().producible());
  std::mt19937_64 rng(11);
  const std::string s = random_text(rng, 500) + "<|im_end|>";
  EXPECT_EQ(back.encode(s), tok().encode(s));
  // Same seed, same vocabulary; another seed, another one.
  const auto again = kt::Tokenizer::synthetic(8192, 7);
  for (int32_t id = 0; id < 8192; ++id) ASSERT_EQ(again.token_bytes(id), tok().token_bytes(id));
  const auto other = kt::Tokenizer::synthetic(8192, 8);
  bool differs = false;
  for (int32_t id = 256; id < 8192 - 256 && !differs; ++id)
    differs = other.token_bytes(id) != tok().token_bytes(id);
  EXPECT_TRUE(differs);
  std::filesystem::remove_all(dir);
}

TEST(Tokenizer, BadTiktokenModelFilesAreErrorsNamingTheLine) {
  const std::string dir = temp_dir("bad");
  std::string good;
  for (int b = 0; b < 256; ++b)
    good += kt::base64_encode(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  const std::string ab = kt::base64_encode("ab");
  auto expect_error = [&](const std::string& model, const std::string& needle) {
    write(dir + "/tiktoken.model", model);
    try {
      kt::Tokenizer::from_dir(dir, 256 + 256);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // The config names the specials the tokenizer needs.
  write(dir + "/tokenizer_config.json",
        R"({"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "[EOS]"},
            "258": {"content": "<|im_end|>"}}})");
  expect_error(good + "!!!! 256\n", "tiktoken.model:257: bad base64");
  expect_error(good + "YW= 256\n", "tiktoken.model:257: bad base64");
  expect_error(good + ab + " 258\n", "tiktoken.model:257: rank 258");
  expect_error(good + ab + " 255\n", "tiktoken.model:257: rank 255");
  expect_error(good + kt::base64_encode("a") + " 256\n", "tiktoken.model:257: the same bytes as line 98");
  expect_error(good + ab + " x\n", "tiktoken.model:257: bad rank");
  expect_error(good + ab + "  256\n", "tiktoken.model:257: expected");
  expect_error(good + "\n" + ab + " 256\n", "tiktoken.model:257: empty line");
  expect_error(good.substr(good.find('\n') + 1), "tiktoken.model:1: rank 1");
  // A byte missing: encode could not represent it.
  std::string no_ff = good.substr(0, good.rfind(kt::base64_encode("\xff")));
  expect_error(no_ff, "single byte 0xff");
  // A readable file, CRLF line ends accepted.
  write(dir + "/tiktoken.model", good + ab + " 256\r\n");
  write(dir + "/tokenizer_config.json",
        R"({"added_tokens_decoder": {"257": {"content": "[BOS]"}, "258": {"content": "[EOS]"},
            "259": {"content": "<|im_end|>"}}})");
  const auto t = kt::Tokenizer::from_dir(dir, 257 + 256);
  EXPECT_EQ(t.num_base_tokens(), 257);
  EXPECT_EQ(t.encode("ab", false), std::vector<int32_t>{256});
  EXPECT_EQ(t.bos_id(), 257);
  EXPECT_EQ(t.token_bytes(257 + 5), "<|reserved_token_262|>");
  EXPECT_EQ(t.vocab_size(), 513);
  EXPECT_EQ(t.producible().size(), 513u);
  EXPECT_THROW(kt::Tokenizer::from_dir(dir, 256), std::invalid_argument);  // vocab below the base tokens
  // Config errors name the file and the key.
  write(dir + "/tiktoken.model", good);
  write(dir + "/tokenizer_config.json", R"({"added_tokens_decoder": {"12": {"content": "x"}}})");
  expect_error(good, "added_tokens_decoder key \"12\"");
  write(dir + "/tokenizer_config.json", R"({"added_tokens_decoder": {"256": {"content": 5}}})");
  expect_error(good, "content must be a string");
  write(dir + "/tokenizer_config.json", "{");
  expect_error(good, "tokenizer_config.json: not valid JSON");
  write(dir + "/tokenizer_config.json", R"({"added_tokens_decoder": {}})");
  expect_error(good, "no special token [BOS]");
  std::filesystem::remove_all(dir);
}

TEST(Tokenizer, ThreadSafeEncode) {
  std::mt19937_64 rng(13);
  std::vector<std::string> texts;
  for (int i = 0; i < 8; ++i) texts.push_back(random_text(rng, 2000));
  std::vector<std::vector<int32_t>> expect;
  for (const auto& s : texts) expect.push_back(tok().encode(s));
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      for (int k = 0; k < 20; ++k)
        if (tok().encode(texts[i]) != expect[i]) ++bad;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(ChatFormat, RendersTheSpecFormat) {
  const auto f = kt::ChatFormat::builtin();
  const std::vector<kt::ChatMessage> m = {{"system", "Be brief.", ""},
                                          {"user", "Hi", ""},
                                          {"assistant", "Hello", "kimi"},
                                          {"tool", "{\"x\": 1}", ""}};
  EXPECT_EQ(
      f.render(m),
      "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
      "<|im_assistant|>kimi<|im_middle|>Hello<|im_end|><|im_system|>tool<|im_middle|>{\"x\": 1}<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|>");
  EXPECT_EQ(f.render(std::span(m).first(1), false), "<|im_system|>system<|im_middle|>Be brief.<|im_end|>");
  const std::vector<kt::ChatMessage> bad = {{"user", "x", ""}, {"robot", "y", ""}};
  try {
    f.render(bad);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("messages[1].role: unknown role \"robot\""), std::string::npos)
        << e.what();
  }
  // The rendered prompt's special strings become the chat format's ids.
  const auto ids = tok().encode(f.render(std::span(m).first(2)));
  EXPECT_EQ(ids.front(), *tok().special_id("<|im_system|>"));
  EXPECT_EQ(ids.back(), *tok().special_id("<|im_middle|>"));
}

TEST(ChatFormat, FromDirAcceptsOnlyKnownTemplates) {
  EXPECT_EQ(kda::tokenizer::sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(kda::tokenizer::sha256_hex(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(kda::tokenizer::sha256_hex(std::string(1000, 'a')).size(), 64u);
  const std::string dir = temp_dir("chat");
  EXPECT_NO_THROW(kt::ChatFormat::from_dir(dir));  // no template: the built-in format
  std::ifstream in(std::string(KDA_TEST_DATA_DIR) + "/chat_template/kimi_builtin.jinja", std::ios::binary);
  const std::string builtin((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(builtin.empty());
  write(dir + "/chat_template.jinja", "\n" + builtin + "  \n\n");  // normalized: the same digest
  EXPECT_NO_THROW(kt::ChatFormat::from_dir(dir));
  write(dir + "/chat_template.jinja", builtin + "{{ bos_token }}");
  try {
    kt::ChatFormat::from_dir(dir);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("chat_template.jinja"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--chat-template builtin"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(kt::ChatFormat::from_dir(dir, /*override_builtin=*/true));
  std::filesystem::remove_all(dir);
  const std::string dir2 = temp_dir("chat2");
  write(dir2 + "/tokenizer_config.json", R"({"chat_template": "{{ messages }}"})");
  EXPECT_THROW(kt::ChatFormat::from_dir(dir2), std::runtime_error);
  std::filesystem::remove_all(dir2);
}
