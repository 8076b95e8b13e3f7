// libFuzzer entry for the npy parser (tests/fuzz/targets.cc: kda::fuzz::npy).
#include <cstddef>
#include <cstdint>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kda::fuzz::npy(data, size);
  return 0;
}
