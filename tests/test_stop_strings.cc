// StopStringMatcher: stop strings spanning pushes, overlapping stops, held-back prefixes that turn out not
// to be stops, multi-byte UTF-8, flush -- and, on random streams, the matcher against the plain answer:
// the text before the stop string that ends first (the longest of those ending there), or all of it.
#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/sampling/stop_strings.h"

namespace kda::sampling {
namespace {

struct Streamed {
  std::string text;  // everything emitted, flush included when no stop
  bool stopped = false;
  std::vector<std::string> emits;
};

Streamed stream(const std::vector<std::string>& stops, const std::vector<std::string>& pieces) {
  StopStringMatcher m(stops);
  Streamed out;
  for (const std::string& p : pieces) {
    auto r = m.push(p);
    out.emits.push_back(r.emit);
    out.text += r.emit;
    if (r.stopped) {
      out.stopped = true;
      break;
    }
  }
  if (!out.stopped) out.text += m.flush();
  return out;
}

TEST(StopStrings, SpanningPushes) {
  const Streamed s = stream({"<stop>"}, {"Hello <s", "to", "p> world"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.text, "Hello ");
  EXPECT_EQ(s.emits[0], "Hello ");  // "<s" held back
  EXPECT_EQ(s.emits[1], "");
  EXPECT_EQ(s.emits[2], "");
}

TEST(StopStrings, HeldPrefixThatIsNotAStop) {
  StopStringMatcher m({"abc"});
  auto r = m.push("xxab");
  EXPECT_EQ(r.emit, "xx");
  EXPECT_FALSE(r.stopped);
  r = m.push("d");  // "abd": no longer a prefix
  EXPECT_EQ(r.emit, "abd");
  r = m.push("a");
  EXPECT_EQ(r.emit, "");
  EXPECT_EQ(m.flush(), "a");  // the end: what was held back
  EXPECT_EQ(m.flush(), "");
}

TEST(StopStrings, OverlappingStopsTheFirstToEndWins) {
  EXPECT_EQ(stream({"bcd", "abcx"}, {"ab", "c", "d"}).text, "a");
  EXPECT_EQ(stream({"abc", "bc"}, {"xabc"}).text, "x");
  EXPECT_EQ(stream({"bc", "abc"}, {"xabc"}).text, "x");
  EXPECT_EQ(stream({"aab"}, {"a", "a", "a", "b"}).text, "a");  // the held "aa" slides by one
  EXPECT_EQ(stream({"aab"}, {"aaac"}).text, "aaac");
  // The stream stops where a stop string first ends, whatever the pieces: "bc" ends before "abcd" does.
  EXPECT_EQ(stream({"abcd", "bc"}, {"abcd"}).text, "a");
  EXPECT_EQ(stream({"abcd", "bc"}, {"ab", "cd"}).text, "a");
}

TEST(StopStrings, AfterTheStopNothingMore) {
  StopStringMatcher m({"."});
  EXPECT_EQ(m.push("one. two").emit, "one");
  auto r = m.push("three");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.emit, "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopStrings, NoStopsPassEverythingThrough) {
  StopStringMatcher m({});
  EXPECT_EQ(m.push("abc").emit, "abc");
  EXPECT_EQ(m.flush(), "");
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80             ? 0
                     : (c & 0xE0) == 0xC0 ? 1
                     : (c & 0xF0) == 0xE0 ? 2
                     : (c & 0xF8) == 0xF0 ? 3
                                          : 9;
    if (n == 9 || i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n + 1;
  }
  return true;
}

TEST(StopStrings, MultiByteCharactersAreNeverSplit) {
  // "停止" (stop) and "é!" share no byte prefix with the text around them but their lead bytes.
  const std::vector<std::string> stops = {"停止", "é!"};
  const Streamed s = stream(stops, {"我们", "停", "下", "来", "停", "止了"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.text, "我们停下来");
  for (const std::string& e : s.emits) EXPECT_TRUE(valid_utf8(e)) << e;
  EXPECT_EQ(s.emits[1], "");  // "停" held: it may start "停止"
  EXPECT_EQ(s.emits[2], "停下");
  // "é" (C3 A9) then "è" (C3 A8): the shared lead byte does not split a character.
  const Streamed t = stream(stops, {"caf", "é", "è", "é", "!", "x"});
  EXPECT_EQ(t.text, "caféè");
  for (const std::string& e : t.emits) EXPECT_TRUE(valid_utf8(e)) << e;
  EXPECT_THROW(StopStringMatcher({std::string("\xA9")}), std::invalid_argument);
  EXPECT_THROW(StopStringMatcher({std::string("a\xC3")}), std::invalid_argument);
  EXPECT_THROW(StopStringMatcher({"ok", ""}), std::invalid_argument);
}

TEST(StopStrings, RandomStreamsMatchThePlainAnswer) {
  std::mt19937_64 rng(17);
  const std::vector<std::string> alphabet = {"a", "b", "ab", "é", "停", "\U0001F600", " "};
  for (int trial = 0; trial < 3000; ++trial) {
    auto word = [&](int max) {
      std::string w;
      const int n = 1 + static_cast<int>(rng() % max);
      for (int i = 0; i < n; ++i) w += alphabet[rng() % alphabet.size()];
      return w;
    };
    std::vector<std::string> stops;
    for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n; ++i) stops.push_back(word(3));
    std::vector<std::string> pieces;
    std::string all;
    for (int i = 0, n = static_cast<int>(rng() % 12); i < n; ++i) {
      pieces.push_back(word(2));
      all += pieces.back();
    }
    size_t first = std::string::npos, end = std::string::npos;
    for (const auto& s : stops) {
      const size_t at = all.find(s);
      if (at == std::string::npos) continue;
      if (at + s.size() < end || (at + s.size() == end && at < first)) first = at, end = at + s.size();
    }
    const Streamed got = stream(stops, pieces);
    ASSERT_EQ(got.stopped, first != std::string::npos) << all;
    ASSERT_EQ(got.text, first == std::string::npos ? all : all.substr(0, first)) << all;
    for (const std::string& e : got.emits) ASSERT_TRUE(valid_utf8(e));
  }
}

}  // namespace
}  // namespace kda::sampling
