#include "kda/serving/progress.h"

#include <algorithm>
#include <string>

namespace kda::serving {

namespace {

std::string clock_str(double s) {
  const long t = std::max(0L, static_cast<long>(s + 0.5));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

}  // namespace

void Progress::update(const ProgressInfo& p) {
  last_ = p;
  const double frac =
      p.tokens_total > 0
          ? std::min(1.0, static_cast<double>(p.tokens_done) / static_cast<double>(p.tokens_total))
          : 1.0;
  const bool complete = p.requests_done == p.requests_total;
  const double rate = p.elapsed_s > 0 ? static_cast<double>(p.tokens_done) / p.elapsed_s : 0.0;
  if (terminal_) {
    if (!complete && last_s_ >= 0 && p.elapsed_s - last_s_ < 0.125) return;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < kWidth) bar += '>' + std::string(static_cast<size_t>(kWidth - filled - 1), ' ');
    const double eta = rate > 0 ? static_cast<double>(p.tokens_total - p.tokens_done) / rate : 0.0;
    std::fprintf(out_, "\r[%s] %3d%%  %lld/%lld tok  req %lld/%lld  step %lld  %.0f tok/s  %s ETA %s ",
                 bar.c_str(), static_cast<int>(frac * 100), static_cast<long long>(p.tokens_done),
                 static_cast<long long>(p.tokens_total), static_cast<long long>(p.requests_done),
                 static_cast<long long>(p.requests_total), static_cast<long long>(p.steps), rate,
                 clock_str(p.elapsed_s).c_str(), clock_str(eta).c_str());
    std::fflush(out_);
    drawn_ = true;
    last_s_ = p.elapsed_s;
    return;
  }
  const int decile = static_cast<int>(frac * 10);
  if (!complete && (decile <= last_decile_ || (last_s_ >= 0 && p.elapsed_s - last_s_ < 2.0))) return;
  if (complete && decile <= last_decile_ && last_decile_ == 10) return;
  std::fprintf(out_, "progress: %3d%%  %lld/%lld tokens  %lld/%lld requests  %lld steps  %.0f tok/s  %s\n",
               static_cast<int>(frac * 100), static_cast<long long>(p.tokens_done),
               static_cast<long long>(p.tokens_total), static_cast<long long>(p.requests_done),
               static_cast<long long>(p.requests_total), static_cast<long long>(p.steps), rate,
               clock_str(p.elapsed_s).c_str());
  std::fflush(out_);
  last_decile_ = decile;
  last_s_ = p.elapsed_s;
}

void Progress::finish() {
  if (terminal_ && drawn_) std::fprintf(out_, "\n");
  drawn_ = false;
}

}  // namespace kda::serving
