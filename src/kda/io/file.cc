#include "kda/io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace kda::io {

namespace {

[[noreturn]] void fail_errno(const std::filesystem::path& path, const std::string& problem, int err) {
  throw std::runtime_error(path.string() + ": " + problem + ": " + std::strerror(err));
}

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

// Closes a descriptor when the scope ends unless released.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

int open_regular_file(const std::filesystem::path& path, const std::string& what, uint64_t& size) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer; it changes nothing for a
  // regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail_errno(path, "cannot open " + what, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail_errno(path, "cannot stat " + what, e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw std::runtime_error(path.string() + ": " + what + " is " + kind_of(st.st_mode) +
                             ", not a regular file");
  }
  size = static_cast<uint64_t>(st.st_size);
  return fd;
}

std::vector<uint8_t> read_regular_file(const std::filesystem::path& path, const std::string& what) {
  uint64_t size = 0;
  FdGuard fd{open_regular_file(path, what, size)};
  std::vector<uint8_t> buf(static_cast<size_t>(size));
  size_t got = 0;
  while (got < buf.size()) {
    const ssize_t r = ::read(fd.fd, buf.data() + got, buf.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_errno(path, "cannot read " + what, errno);
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  if (got != buf.size())
    throw std::runtime_error(path.string() + ": " + what + " shrank while it was read (" +
                             std::to_string(got) + " of " + std::to_string(buf.size()) + " bytes)");
  return buf;
}

std::string read_regular_text(const std::filesystem::path& path, const std::string& what) {
  const std::vector<uint8_t> buf = read_regular_file(path, what);
  return std::string(buf.begin(), buf.end());
}

void write_file_atomic(const std::filesystem::path& path, const void* data, size_t size) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(path.string() + ": cannot write the output: it is a directory");
  // A name of its own per process and call, hidden (leading dot), beside the destination: rename is
  // atomic only within one file system.
  static std::atomic<uint64_t> counter{0};
  // Appended piece by piece: GCC 12 misreports `"." + string` here as an overlapping memcpy (-Wrestrict).
  std::string base = ".";
  base += path.filename().string();
  base += ".tmp-";
  base += std::to_string(::getpid());
  base += '-';
  std::filesystem::path tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = path.parent_path() / (base + std::to_string(counter.fetch_add(1)));
    // 0666 and the umask: the output gets the permissions a plain create would give it.
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST)
      fail_errno(path, "cannot create a temporary file beside the output", errno);
  }
  if (fd < 0) throw std::runtime_error(path.string() + ": cannot find a free temporary name beside it");

  const auto abandon = [&](const std::string& problem, int err) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    fail_errno(path, problem, err);
  };
  const auto* p = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t w = ::write(fd, p + done, size - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) abandon("cannot write the output", errno);
    done += static_cast<size_t>(w);
  }
  // Flushed before the rename, so the new name never points at a file whose data is still in flight.
  if (::fdatasync(fd) != 0) abandon("cannot flush the output", errno);
  const int closed = ::close(fd);
  fd = -1;
  if (closed != 0) abandon("cannot close the output", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    abandon("cannot rename the finished output into place", errno);
}

}  // namespace kda::io
