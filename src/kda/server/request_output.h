// One request's output as the server builds it from the engine's token events: per continuation, the
// text (an incremental detokenizer, then the stop strings), the logprob entries, the token ids and the
// finish reason. The streamed updates concatenate to exactly the text of the finished choice.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kda/sampling/stop_strings.h"
#include "kda/server/protocol.h"
#include "kda/serving/engine.h"
#include "kda/tokenizer/tokenizer.h"

namespace kda::server {

// What one event added to its continuation.
struct OutputUpdate {
  int32_t index = 0;
  std::string text;                    // newly visible text (may be empty)
  int64_t text_offset = 0;             // where `text` starts in the continuation's text
  std::vector<LogprobEntry> logprobs;  // when asked: the event's token's entry
  std::vector<int32_t> token_ids;      // the event's token (when it carried one)
  std::optional<std::string> finish;   // set when the continuation finished with this event
};

class RequestOutput {
 public:
  // `tok` must outlive it. stop: the request's stop strings (none: empty).
  RequestOutput(const tokenizer::Tokenizer& tok, int32_t n, const std::vector<std::string>& stop,
                bool logprobs);

  // Applies one event of this request. A stop string ends its continuation ("stop"; the stop text and
  // what follows are never shown); later events of a finished continuation change nothing. The stop
  // token's text (an event finishing with kStop) and special tokens' text are never shown.
  OutputUpdate apply(const serving::TokenEvent& e);

  bool done() const { return open_ == 0; }                // every continuation finished
  bool engine_done() const { return engine_open_ == 0; }  // the engine finished every continuation
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t cached_tokens() const { return cached_tokens_; }
  int64_t completion_tokens() const;  // tokens generated, every continuation (stop tokens included)
  // The request's finish reason for the metrics: "abort" if any continuation was aborted, else "stop"
  // if any stopped, else "length".
  std::string finish_reason() const;
  // The finished choices by index (done() must hold). with_ids: each choice's token ids.
  std::vector<Choice> choices(bool with_ids) const;

 private:
  struct Continuation {
    tokenizer::StreamDecoder dec;
    std::optional<sampling::StopStringMatcher> stop;
    std::string text;
    std::vector<int32_t> ids;
    std::vector<LogprobEntry> logprobs;
    int64_t generated = 0;
    std::string finish;  // empty: open
    bool engine_done = false;
  };
  LogprobEntry entry(const sampling::TokenLogprob& lp) const;

  const tokenizer::Tokenizer* tok_;
  bool logprobs_;
  std::vector<Continuation> conts_;
  int32_t open_, engine_open_;
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0;
};

}  // namespace kda::server
