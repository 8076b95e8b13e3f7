// libFuzzer entry for the tokenizer on text (tests/fuzz/targets.cc: kda::fuzz::tokenizer_text).
#include <cstddef>
#include <cstdint>

#include "targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kda::fuzz::tokenizer_text(data, size);
  return 0;
}
