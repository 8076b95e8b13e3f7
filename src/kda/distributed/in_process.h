// Tensor-parallel ranks as threads of one process: a group of `size` members that meet at a barrier
// for every collective. It runs the same sharded layers as MPI ranks do, without a launcher (tests,
// and one-host runs that want no MPI).
#pragma once

#include <barrier>
#include <memory>
#include <vector>

#include "kda/distributed/communicator.h"

namespace kda::distributed {

class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  int size() const { return size_; }
  // The communicator of member `rank`; each member must be used by exactly one thread.
  std::unique_ptr<Communicator> member(int rank);

 private:
  friend class InProcessMember;
  int size_;
  std::barrier<> barrier_;
  std::vector<const void*> slots_;  // one published pointer per member
  std::vector<size_t> sizes_;
};

}  // namespace kda::distributed
