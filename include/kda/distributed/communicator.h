// Collective communication between the ranks of a tensor-parallel group (and across data-parallel
// groups). The layer only needs a sum all-reduce; the drivers gather states and results to rank 0.
// `LocalCommunicator` is the single-process group; `mpi_communicator.h` provides MPI groups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace kda::distributed {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: every rank ends with the element-wise sum over the group.
  virtual void allreduce_sum(float* data, size_t n) = 0;
  // Logical OR over the group (e.g. "stop requested" or "an error happened").
  virtual bool allreduce_or(bool v) = 0;
  // Every rank contributes `n` floats; every rank receives size() * n floats, rank-major.
  virtual void allgather(const float* send, size_t n, float* recv) = 0;
  // Variable-size gather of bytes to every rank (rank-major).
  virtual std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& send) = 0;
  virtual void barrier() = 0;
};

// A group of one process: every collective is the identity.
class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void allreduce_sum(float*, size_t) override {}
  bool allreduce_or(bool v) override { return v; }
  void allgather(const float* send, size_t n, float* recv) override;
  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& send) override {
    return {send};
  }
  void barrier() override {}
};

// The tensor-parallel position of a layer: rank `rank` of `size` ranks, communicating through `comm`
// (null when size == 1).
struct TensorParallel {
  int rank = 0;
  int size = 1;
  Communicator* comm = nullptr;
};

}  // namespace kda::distributed
