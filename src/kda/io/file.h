// Reading outside input files and writing output files, the two ways every kda file goes through.
//
// Reads accept only regular files: a directory, a FIFO or a device is refused with a message naming
// the path, before anything blocks on it (opening a FIFO for reading would wait for a writer).
// Writes are never partial: the bytes go to a temporary file in the destination's folder, which is
// flushed and renamed over the destination only when complete; on any error it is removed and the
// destination is left as it was.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace kda::io {

// The whole content of a regular file. Throws std::runtime_error naming the path (and `what`, the
// role of the file in the message, e.g. "config file") when it is missing, not a regular file or
// cannot be read.
std::vector<uint8_t> read_regular_file(const std::filesystem::path& path, const std::string& what = "file");
std::string read_regular_text(const std::filesystem::path& path, const std::string& what = "file");

// Opens a regular file for reading (O_RDONLY, never blocking on a FIFO); returns the descriptor and its
// size. The caller closes it. Throws like read_regular_file.
int open_regular_file(const std::filesystem::path& path, const std::string& what, uint64_t& size);

// Writes `size` bytes to `path` atomically (a temporary name in the same folder, renamed when complete).
// Throws std::runtime_error naming the path; on error no temporary is left and `path` is untouched.
void write_file_atomic(const std::filesystem::path& path, const void* data, size_t size);

}  // namespace kda::io
