// The process layout of a run: --tp N tensor-parallel ranks per group, --dp M data-parallel groups,
// N*M ranks in all (started by mpirun when N*M > 1). World rank w is tensor-parallel rank w % N of
// data-parallel group w / N.
#pragma once

#include <memory>

#include "kda/distributed/communicator.h"

namespace kda::distributed {

struct ParallelContext {
  int tp = 1, dp = 1;
  int world_rank = 0, world_size = 1;
  int tp_rank = 0, dp_rank = 0;
  std::unique_ptr<Communicator> world;     // all ranks
  std::unique_ptr<Communicator> tp_group;  // the ranks of this data-parallel group

  bool is_root() const { return world_rank == 0; }
  TensorParallel tensor_parallel() const { return {tp_rank, tp, tp == 1 ? nullptr : tp_group.get()}; }
};

// Checks the layout against the launch before any work: --tp and --dp >= 1, and the number of ranks
// mpirun started equal to tp * dp (one process when neither asks for more). Throws
// std::invalid_argument naming the numbers.
ParallelContext make_parallel_context(int tp, int dp);

}  // namespace kda::distributed
