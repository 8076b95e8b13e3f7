// libFuzzer entry for the safetensors_index parser (tests/fuzz/targets.cc: kda::fuzz::safetensors_index).
#include <cstddef>
#include <cstdint>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kda::fuzz::safetensors_index(data, size);
  return 0;
}
