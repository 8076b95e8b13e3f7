// Stop strings over streamed text: a stop string may span tokens, so the tail of the text that could
// still become one is held back until it either completes (the stream stops; the stop text is never
// emitted) or can no longer. The stream stops before the stop string that ends first (of those ending at the
// same byte, the longest), so the result does not depend on how the text was cut into pieces.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kda::sampling {

class StopStringMatcher {
 public:
  // Empty or invalid UTF-8 stop strings -> std::invalid_argument naming the index.
  explicit StopStringMatcher(std::vector<std::string> stops);
  // emit: text safe to send (never a stop string's start that may still complete; never the stop text).
  // Pieces of valid UTF-8 in, whole characters out.
  struct Result {
    std::string emit;
    bool stopped = false;
  };
  // The text after the last push; once stopped, every later push emits nothing and says stopped.
  Result push(std::string_view text);
  std::string flush();  // at the end without a stop: what was held back
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  size_t longest_ = 0;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace kda::sampling
