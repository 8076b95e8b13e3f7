// libFuzzer entry for the config parser (tests/fuzz/targets.cc: kda::fuzz::config).
#include <cstddef>
#include <cstdint>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kda::fuzz::config(data, size);
  return 0;
}
