#include "kda/tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace kda::tokenizer {

const char* const kKimiPatternTiktoken =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

// The rewrite for PCRE2 10.42, which has neither class intersection nor tiktoken's meaning of two escapes:
// - A && [^Han] as one negated class: the general categories partition the code points, so the complement
//   of {Lu,Lt,Lm,Lo,M} is {Ll,C,N,P,S,Z} and A minus Han = [^ Ll C N P S Z Han] (likewise for the second
//   class). One class, no lookahead per character: long runs backtrack without a frame per character.
// - \p{Han}: tiktoken's regex crate takes a bare script name as the Script property (Chinese punctuation
//   such as U+3001 is not Han there); PCRE2 takes it as Script_Extensions, so sc:Han is spelled out.
// - \s: the regex crate's \s is Unicode White_Space (U+0085 included); PCRE2's UCP \s is Z plus five
//   controls (U+0085 excluded), so the White_Space set is written out.
#define KDA_WS \
  R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})"
#define KDA_UPPERISH R"([^\p{Ll}\p{C}\p{N}\p{P}\p{S}\p{Z}\p{sc:Han}])"
#define KDA_LOWERISH R"([^\p{Lu}\p{Lt}\p{C}\p{N}\p{P}\p{S}\p{Z}\p{sc:Han}])"
#define KDA_CONTRACTION R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
const char* const kKimiPatternPcre2 =
    R"(\p{sc:Han}+)"
    R"(|[^\r\n\p{L}\p{N}]?)" KDA_UPPERISH "*" KDA_LOWERISH "+" KDA_CONTRACTION
    R"(|[^\r\n\p{L}\p{N}]?)" KDA_UPPERISH "+" KDA_LOWERISH "*" KDA_CONTRACTION R"(|\p{N}{1,3})"
    R"(| ?[^)" KDA_WS R"(\p{L}\p{N}]+[\r\n]*)"
    "|[" KDA_WS R"(]*[\r\n]+)"
    "|[" KDA_WS "]+(?![^" KDA_WS
    "])"
    "|[" KDA_WS "]+";
#undef KDA_WS
#undef KDA_UPPERISH
#undef KDA_LOWERISH
#undef KDA_CONTRACTION

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

struct MatchDataFree {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};

}  // namespace

Pretokenizer::Pretokenizer() {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kKimiPatternPcre2), PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
  if (!code)
    throw std::runtime_error("tokenizer: the pre-tokenizer pattern does not compile (PCRE2: " +
                             pcre2_message(err) + " at offset " + std::to_string(off) + ")");
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;  // no JIT on this platform: the interpreter
}

Pretokenizer::~Pretokenizer() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Pretokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  auto* code = static_cast<pcre2_code*>(code_);
  std::unique_ptr<pcre2_match_data, MatchDataFree> md(pcre2_match_data_create_from_pattern(code, nullptr));
  if (!md) throw std::bad_alloc();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos < text.size()) {
    int rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && jit_)  // the interpreter keeps its frames on the heap
      rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;  // as tiktoken: text no alternative matches is skipped
    if (rc < 0)
      throw std::runtime_error("tokenizer: the pre-tokenizer failed at byte " + std::to_string(pos) +
                               " (PCRE2: " + pcre2_message(rc) + ")");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    if (ov[1] <= ov[0])
      throw std::logic_error("tokenizer: the pre-tokenizer matched nothing");  // no empty match
    pieces.push_back(text.substr(ov[0], ov[1] - ov[0]));
    pos = ov[1];
  }
}

}  // namespace kda::tokenizer
