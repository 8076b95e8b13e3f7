#include "kda/distributed/communicator.h"

#include <cstring>

namespace kda::distributed {

void LocalCommunicator::allgather(const float* send, size_t n, float* recv) {
  if (n) std::memcpy(recv, send, n * sizeof(float));
}

}  // namespace kda::distributed
