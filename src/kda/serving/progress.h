// Progress of a simulation: a one-line bar redrawn in place on a terminal, plain lines otherwise.
// Hand-written: Debian packages no C++ progress-bar library, and one line of \r-redrawn text is all
// this needs. Terminal redraws are throttled to ~8 per second; plain lines are written at every 10% of
// the tokens at most, and no more than one per 2 seconds, so logs stay short.
#pragma once

#include <cstdio>

#include "kda/serving/workload_driver.h"

namespace kda::serving {

class Progress {
 public:
  Progress(std::FILE* out, bool terminal) : out_(out), terminal_(terminal) {}
  void update(const ProgressInfo& p);
  void finish();  // ends the bar's line (terminal); prints nothing more otherwise

 private:
  std::FILE* out_;
  bool terminal_;
  bool drawn_ = false;
  double last_s_ = -1.0;
  int last_decile_ = 0;
  ProgressInfo last_;
};

}  // namespace kda::serving
