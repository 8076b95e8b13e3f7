#include "kda/sampling/stop_strings.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kda::sampling {
namespace {

// The byte offset of the first invalid UTF-8 sequence, or npos.
size_t invalid_utf8_at(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + n >= s.size()) return i;  // cut short
    for (size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += n + 1;
  }
  return std::string_view::npos;
}

}  // namespace

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (size_t i = 0; i < stops_.size(); ++i) {
    if (stops_[i].empty()) throw std::invalid_argument("stop[" + std::to_string(i) + "]: empty string");
    const size_t bad = invalid_utf8_at(stops_[i]);
    if (bad != std::string_view::npos)
      throw std::invalid_argument("stop[" + std::to_string(i) + "]: invalid UTF-8 at byte " +
                                  std::to_string(bad));
    longest_ = std::max(longest_, stops_[i].size());
  }
}

StopStringMatcher::Result StopStringMatcher::push(std::string_view text) {
  Result r;
  if (stopped_) {
    r.stopped = true;
    return r;
  }
  held_.append(text);
  // The stop string that ends first (a stream stops as soon as one is complete, so how the text was cut
  // into pieces does not matter); of those ending there, the longest.
  size_t first = std::string::npos, end = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = held_.find(s);
    if (at == std::string::npos) continue;
    if (at + s.size() < end || (at + s.size() == end && at < first)) first = at, end = at + s.size();
  }
  if (first != std::string::npos) {
    r.emit = held_.substr(0, first);
    r.stopped = stopped_ = true;
    held_.clear();
    return r;
  }
  // Hold back the longest tail that is a proper prefix of a stop string. It starts where a stop string's
  // first byte matches, a character boundary of valid UTF-8, so the emitted text splits no character.
  size_t keep = held_.size();
  const size_t span = longest_ > 0 ? longest_ - 1 : 0;  // a proper prefix is at most this long
  const size_t from = held_.size() - std::min(held_.size(), span);
  for (size_t j = from; j < held_.size() && keep == held_.size(); ++j) {
    const std::string_view tail = std::string_view(held_).substr(j);
    for (const std::string& s : stops_)
      if (s.size() > tail.size() && s.compare(0, tail.size(), tail) == 0) {
        keep = j;
        break;
      }
  }
  r.emit = held_.substr(0, keep);
  held_.erase(0, keep);
  return r;
}

std::string StopStringMatcher::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace kda::sampling
