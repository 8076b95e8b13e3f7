// Server arguments that concern the KDA component, and the checks a recurrent model imposes on them
// (sglang's ServerArgs.__post_init__ / check_server_args).
#pragma once

#include <cstdint>
#include <string>

namespace kda {

struct ServerArgs {
  bool disable_radix_cache = false;
  // Prefill chunks and 1-token decodes in one EXTEND batch. The RFC could only guard this as
  // unverified; this component verifies mixed batches (tests: mixed batch == requests run alone).
  bool enable_mixed_chunk = false;
  int64_t chunked_prefill_size = 4096;
  std::string speculative_algorithm;  // empty: none

  // A model with recurrent state shares prefixes through the radix cache of state snapshots
  // (mem_cache/radix_cache.h: a snapshot summarises its whole prefix, so a hit is one slot copy), so
  // disable_radix_cache is left as it is (it used to be forced on). Speculative decoding with
  // drafts from outside the model (NGRAM, REPLAY: TARGET_VERIFY + accept) is allowed; an algorithm with a
  // draft model (DRAFT_EXTEND) is refused. Throws std::invalid_argument naming the option.
  void check_server_args(bool model_has_recurrent_state);
};

}  // namespace kda
