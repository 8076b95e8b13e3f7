#include "kda/server_args.h"

#include <stdexcept>

namespace kda {

void ServerArgs::check_server_args(bool model_has_recurrent_state) {
  if (chunked_prefill_size <= 0)
    throw std::invalid_argument("--chunked-prefill-size must be positive, got " +
                                std::to_string(chunked_prefill_size));
  if (!model_has_recurrent_state) return;
  disable_radix_cache = true;
  if (!speculative_algorithm.empty())
    throw std::invalid_argument("speculative decoding ('" + speculative_algorithm +
                                "') is not supported with the KDA backend: DRAFT_EXTEND and TARGET_VERIFY "
                                "have no recurrent-state rollback");
}

}  // namespace kda
