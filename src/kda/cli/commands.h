// The kda CLI's subcommands; main.cc parses the options (CLI11) and calls these.
#pragma once

#include <string>

namespace kda::cli {

struct VerifyOptions {
  std::string dumps;
  std::string precision = "all";  // fp32 | bf16 | all
  std::string kernel = "auto";
  bool json = false;
  int tp = 1;  // tensor-parallel ranks (under mpirun -np tp)
};
int run_verify(const VerifyOptions& o);

struct RunOptions {
  std::string model;
  int layer = -1;
  std::string input;
  std::string output;
  std::string precision = "fp32";
  int decode_tail = 0;
  std::string kernel = "auto";
  int tp = 1;  // tensor-parallel ranks (under mpirun -np tp)
};
int run_run(const RunOptions& o);

struct BenchOptions {
  int threads = 0;  // 0: OpenMP's default
  bool json = false;
  bool skip_naive = false;
};
int run_bench(const BenchOptions& o);

}  // namespace kda::cli
