// libFuzzer entry for the npz parser (tests/fuzz/targets.cc: kda::fuzz::npz).
#include <cstddef>
#include <cstdint>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kda::fuzz::npz(data, size);
  return 0;
}
