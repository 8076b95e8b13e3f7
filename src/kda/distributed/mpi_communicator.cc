#include "kda/distributed/mpi_communicator.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#ifdef KDA_WITH_MPI
#include <mpi.h>
#endif

namespace kda::distributed {

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}

#ifdef KDA_WITH_MPI

bool mpi_available() { return true; }

namespace {

// Every communicator returns its errors (MPI_ERRORS_RETURN, set when it is wrapped): under MPI's
// default handler (MPI_ERRORS_ARE_FATAL) a failed call ends the job inside MPI, and these checks would
// never run. A throw reaches the command's error handler, which prints it and aborts the other ranks.
void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw std::runtime_error(
      std::string("MPI error in ") + what + ": " +
      (len > 0 ? std::string(text, static_cast<size_t>(len)) : "code " + std::to_string(rc)));
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm c, bool owned) : comm_(c), owned_(owned) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allreduce_sum(float* data, size_t n) override {
    // Counts are int in MPI: reduce in pieces for very large buffers.
    constexpr size_t kMax = size_t{1} << 30;
    for (size_t off = 0; off < n; off += kMax)
      check(MPI_Allreduce(MPI_IN_PLACE, data + off, static_cast<int>(std::min(kMax, n - off)), MPI_FLOAT,
                          MPI_SUM, comm_),
            "MPI_Allreduce");
  }
  bool allreduce_or(bool v) override {
    int in = v ? 1 : 0, out = 0;
    check(MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_LOR, comm_), "MPI_Allreduce(LOR)");
    return out != 0;
  }
  void allgather(const float* send, size_t n, float* recv) override {
    check(MPI_Allgather(send, static_cast<int>(n), MPI_FLOAT, recv, static_cast<int>(n), MPI_FLOAT, comm_),
          "MPI_Allgather");
  }
  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& send) override {
    int n = static_cast<int>(send.size());
    std::vector<int> sizes(size_), displs(size_);
    check(MPI_Allgather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm_), "MPI_Allgather(sizes)");
    int total = 0;
    for (int r = 0; r < size_; ++r) {
      displs[r] = total;
      total += sizes[r];
    }
    std::vector<uint8_t> all(static_cast<size_t>(total));
    check(MPI_Allgatherv(send.data(), n, MPI_BYTE, all.data(), sizes.data(), displs.data(), MPI_BYTE, comm_),
          "MPI_Allgatherv");
    std::vector<std::vector<uint8_t>> out(size_);
    for (int r = 0; r < size_; ++r)
      out[r].assign(all.begin() + displs[r], all.begin() + displs[r] + sizes[r]);
    return out;
  }
  void barrier() override { check(MPI_Barrier(comm_), "MPI_Barrier"); }
  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

void ensure_mpi_initialized() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) return;
  int provided = 0;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  std::atexit(finalize_at_exit);
}

std::unique_ptr<Communicator> mpi_world() {
  ensure_mpi_initialized();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, false);
}

void abort_other_ranks(int code) {
  int inited = 0, finalized = 0, size = 1;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (!inited || finalized) return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
}

std::unique_ptr<Communicator> mpi_split(Communicator& parent, int color, int key) {
  auto* p = dynamic_cast<MpiCommunicator*>(&parent);
  if (!p) throw std::invalid_argument("mpi_split: the parent is not an MPI communicator");
  MPI_Comm c;
  check(MPI_Comm_split(p->comm(), color, key, &c), "MPI_Comm_split");
  return std::make_unique<MpiCommunicator>(c, true);
}

#else  // !KDA_WITH_MPI

bool mpi_available() { return false; }

void abort_other_ranks(int) {}

void ensure_mpi_initialized() {
  throw std::runtime_error(
      "this kda was built without MPI: install libopenmpi-dev and rebuild for --tp / --dp");
}

std::unique_ptr<Communicator> mpi_world() {
  ensure_mpi_initialized();
  return nullptr;
}

std::unique_ptr<Communicator> mpi_split(Communicator&, int, int) {
  ensure_mpi_initialized();
  return nullptr;
}

#endif

}  // namespace kda::distributed
