#include "kda/distributed/parallel.h"

#include <stdexcept>
#include <string>

#include "kda/distributed/mpi_communicator.h"

namespace kda::distributed {

ParallelContext make_parallel_context(int tp, int dp) {
  if (tp < 1) throw std::invalid_argument("--tp must be >= 1, got " + std::to_string(tp));
  if (dp < 1) throw std::invalid_argument("--dp must be >= 1, got " + std::to_string(dp));
  ParallelContext ctx;
  ctx.tp = tp;
  ctx.dp = dp;
  if (tp * dp == 1 && !launched_by_mpi()) {
    ctx.world = std::make_unique<LocalCommunicator>();
    ctx.tp_group = std::make_unique<LocalCommunicator>();
    return ctx;
  }
  ctx.world = mpi_world();
  ctx.world_rank = ctx.world->rank();
  ctx.world_size = ctx.world->size();
  if (ctx.world_size != tp * dp)
    throw std::invalid_argument("started with " + std::to_string(ctx.world_size) + " ranks but --tp " +
                                std::to_string(tp) + " x --dp " + std::to_string(dp) + " needs " +
                                std::to_string(tp * dp) + " (mpirun -np " + std::to_string(tp * dp) + ")");
  ctx.tp_rank = ctx.world_rank % tp;
  ctx.dp_rank = ctx.world_rank / tp;
  ctx.tp_group = mpi_split(*ctx.world, ctx.dp_rank, ctx.tp_rank);
  return ctx;
}

}  // namespace kda::distributed
