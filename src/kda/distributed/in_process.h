// Tensor-parallel ranks as threads of one process: a group of `size` members that meet at a barrier
// for every collective. It runs the same sharded layers as MPI ranks do, without a launcher (tests,
// and one-host runs that want no MPI).
//
// A member that fails would leave the others waiting at the barrier forever (as an MPI rank that dies
// leaves its peers in a collective): abort() ends the group, so that every member waiting in a
// collective, and every later collective, throws GroupAborted naming the failed rank and its error.
// run() does this for the caller: one thread per member, the first error aborts the group and is
// rethrown once every thread has returned.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/distributed/communicator.h"

namespace kda::distributed {

// Thrown by a collective of an aborted group.
class GroupAborted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  int size() const { return size_; }
  // The communicator of member `rank`; each member must be used by exactly one thread.
  std::unique_ptr<Communicator> member(int rank);

  // Ends the group after member `rank` failed with `what`: wakes every member waiting in a collective;
  // they, and every collective after, throw GroupAborted. The first call's rank and message are kept.
  void abort(int rank, const std::string& what);
  bool aborted() const;

  // Runs fn(rank, comm) for every member, each on its own thread, and joins them. When one throws,
  // the group is aborted (the others leave their collectives) and, after every thread has returned,
  // the first member's exception is rethrown as it was thrown.
  void run(const std::function<void(int rank, Communicator& comm)>& fn);

 private:
  friend class InProcessMember;
  // The barrier every collective meets at; throws GroupAborted when the group is (or becomes) aborted.
  void arrive_and_wait();

  int size_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;  // completed barriers
  bool aborted_ = false;
  std::string abort_message_;
  std::vector<const void*> slots_;  // one published pointer per member
  std::vector<size_t> sizes_;
};

}  // namespace kda::distributed
