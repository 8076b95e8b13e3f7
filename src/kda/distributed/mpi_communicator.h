// Communicator over MPI (Open MPI from Debian's packages; `mpirun` starts the ranks on one host or
// many). Built only when CMake finds MPI (KDA_WITH_MPI).
#pragma once

#include <memory>

#include "kda/distributed/communicator.h"

namespace kda::distributed {

// True when this process was started by an MPI launcher (mpirun / mpiexec).
bool launched_by_mpi();
// True when the binary was built with MPI support.
bool mpi_available();

// Initialises MPI once (MPI_THREAD_FUNNELED) and finalises it at exit. Throws when MPI support was
// not built in.
void ensure_mpi_initialized();

// After an error on one rank: when MPI runs with more than one rank, aborts them all (the others may
// wait in a collective forever otherwise); returns when there is nothing to abort.
void abort_other_ranks(int code);

// MPI_COMM_WORLD, and sub-groups of it.
std::unique_ptr<Communicator> mpi_world();
// Ranks with the same color form a group, ordered by key.
std::unique_ptr<Communicator> mpi_split(Communicator& parent, int color, int key);

}  // namespace kda::distributed
