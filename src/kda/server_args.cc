#include "kda/server_args.h"

#include <cctype>
#include <stdexcept>

namespace kda {

void ServerArgs::check_server_args(bool model_has_recurrent_state) {
  if (chunked_prefill_size <= 0)
    throw std::invalid_argument("--chunked-prefill-size must be positive, got " +
                                std::to_string(chunked_prefill_size));
  if (!model_has_recurrent_state) return;
  // Speculative decoding: the KDA backend verifies drafts (TARGET_VERIFY, then accept: each request's slot
  // moves to the state after its accepted tokens, chains and trees), so an algorithm whose drafts come
  // from outside the model (NGRAM, and REPLAY, kda simulate's drafter of known acceptance) is allowed; one
  // with a draft model (EAGLE, STANDALONE, ...) needs DRAFT_EXTEND, which the backend does not support.
  std::string algo = speculative_algorithm;
  for (char& ch : algo) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (!algo.empty() && algo != "NGRAM" && algo != "REPLAY")
    throw std::invalid_argument(
        "speculative decoding ('" + speculative_algorithm +
        "') is not supported with the KDA backend: it needs a draft model's DRAFT_EXTEND; "
        "only target verification of externally proposed drafts (NGRAM, REPLAY) is");
}

}  // namespace kda
