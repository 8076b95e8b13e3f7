// libFuzzer entry for the trace parser (tests/fuzz/targets.cc: kda::fuzz::trace).
#include <cstddef>
#include <cstdint>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kda::fuzz::trace(data, size);
  return 0;
}
