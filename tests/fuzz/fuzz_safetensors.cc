// libFuzzer entry for the safetensors parser (tests/fuzz/targets.cc: kda::fuzz::safetensors).
#include <cstddef>
#include <cstdint>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kda::fuzz::safetensors(data, size);
  return 0;
}
