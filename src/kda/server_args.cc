#include "kda/server_args.h"

#include <stdexcept>

namespace kda {

void ServerArgs::check_server_args(bool model_has_recurrent_state) {
  if (chunked_prefill_size <= 0)
    throw std::invalid_argument("--chunked-prefill-size must be positive, got " +
                                std::to_string(chunked_prefill_size));
  if (!model_has_recurrent_state) return;
  disable_radix_cache = true;
  // Speculative decoding is allowed: the KDA backend verifies drafts (TARGET_VERIFY, then accept: each
  // request's slot moves to the state after its accepted tokens, chains and trees). A draft model's
  // DRAFT_EXTEND stays a not-supported error of the backend.
}

}  // namespace kda
