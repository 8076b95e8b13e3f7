#include "kda/server/request_output.h"

#include <stdexcept>
#include <utility>

namespace kda::server {

RequestOutput::RequestOutput(const tokenizer::Tokenizer& tok, int32_t n, const std::vector<std::string>& stop,
                             bool logprobs)
    : tok_(&tok), logprobs_(logprobs), open_(n), engine_open_(n) {
  if (n < 1) throw std::invalid_argument("RequestOutput: n must be >= 1");
  conts_.reserve(static_cast<size_t>(n));
  for (int32_t j = 0; j < n; ++j) {
    conts_.push_back(Continuation{tokenizer::StreamDecoder(tok), std::nullopt, {}, {}, {}, 0, {}, false});
    if (!stop.empty()) conts_.back().stop.emplace(stop);
  }
}

LogprobEntry RequestOutput::entry(const sampling::TokenLogprob& lp) const {
  LogprobEntry e;
  e.token = tok_->token_bytes(lp.token);
  e.logprob = lp.logprob;
  e.top.reserve(lp.top.size());
  for (const auto& [id, v] : lp.top) e.top.emplace_back(tok_->token_bytes(id), v);
  return e;
}

OutputUpdate RequestOutput::apply(const serving::TokenEvent& e) {
  if (e.index < 0 || e.index >= static_cast<int32_t>(conts_.size()))
    throw std::logic_error("RequestOutput: event for continuation " + std::to_string(e.index) + " of " +
                           std::to_string(conts_.size()));
  prompt_tokens_ = e.prompt_tokens;
  cached_tokens_ = e.cached_tokens;
  Continuation& c = conts_[static_cast<size_t>(e.index)];
  OutputUpdate u;
  u.index = e.index;
  u.text_offset = static_cast<int64_t>(c.text.size());
  if (e.finish != serving::FinishReason::kNone && !c.engine_done) {
    c.engine_done = true;
    --engine_open_;
  }
  if (!c.finish.empty()) return u;  // ended by a stop string: what the engine made after is not shown
  std::string text;
  bool stopped = false;
  if (e.token >= 0) {
    ++c.generated;
    c.ids.push_back(e.token);
    u.token_ids.push_back(e.token);
    const bool stop_token = e.finish == serving::FinishReason::kStop;
    if (!stop_token && logprobs_ && e.logprob) {
      c.logprobs.push_back(entry(*e.logprob));
      u.logprobs.push_back(c.logprobs.back());
    }
    if (!stop_token && !tok_->is_special(e.token)) text = c.dec.push(e.token);
  }
  if (e.finish != serving::FinishReason::kNone) text += c.dec.flush();
  if (c.stop) {
    auto r = c.stop->push(text);
    text = std::move(r.emit);
    stopped = r.stopped;
    if (!stopped && e.finish != serving::FinishReason::kNone) text += c.stop->flush();
  }
  c.text += text;
  u.text = std::move(text);
  if (stopped || e.finish != serving::FinishReason::kNone) {
    c.finish = stopped ? "stop" : serving::finish_reason_name(e.finish);
    --open_;
    u.finish = c.finish;
  }
  return u;
}

int64_t RequestOutput::completion_tokens() const {
  int64_t n = 0;
  for (const auto& c : conts_) n += c.generated;
  return n;
}

std::string RequestOutput::finish_reason() const {
  bool stop = false;
  for (const auto& c : conts_) {
    if (c.finish == "abort") return "abort";
    stop = stop || c.finish == "stop";
  }
  return stop ? "stop" : "length";
}

std::vector<Choice> RequestOutput::choices(bool with_ids) const {
  std::vector<Choice> out;
  out.reserve(conts_.size());
  for (size_t j = 0; j < conts_.size(); ++j) {
    const auto& c = conts_[j];
    Choice ch;
    ch.index = static_cast<int32_t>(j);
    ch.text = c.text;
    ch.finish_reason = c.finish;
    if (logprobs_) ch.logprobs = c.logprobs;
    if (with_ids) ch.token_ids = c.ids;
    out.push_back(std::move(ch));
  }
  return out;
}

}  // namespace kda::server
