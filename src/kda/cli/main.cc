// kda: the command-line front of the KDA component.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "kda/cli/commands.h"
#include "kda/distributed/mpi_communicator.h"

int main(int argc, char** argv) {
  CLI::App app{"kda: Kimi Delta Attention inference component (CPU)"};
  app.require_subcommand(1);

  kda::cli::VerifyOptions vo;
  auto* verify = app.add_subcommand("verify", "check every case of a dump folder through the full stack");
  verify->add_option("--dumps", vo.dumps, "dump folder (config.json, model.safetensors, <case>.npz)")
      ->required();
  verify->add_option("--precision", vo.precision, "fp32 | bf16 | all")
      ->check(CLI::IsMember({"fp32", "bf16", "all"}));
  verify->add_option("--kernel", vo.kernel, "auto | naive | optimized")
      ->check(CLI::IsMember({"auto", "naive", "optimized"}));
  verify->add_flag("--json", vo.json, "print the results as JSON");
  verify->add_option("--tp", vo.tp, "tensor-parallel ranks (start with mpirun -np N)")->check(CLI::PositiveNumber);

  kda::cli::RunOptions ro;
  auto* run = app.add_subcommand("run", "run one KDA layer of a checkpoint on a case");
  run->add_option("--model", ro.model, "checkpoint folder (config.json + safetensors)")->required();
  run->add_option("--layer", ro.layer, "decoder layer index (0-based; must be a KDA layer)")->required();
  run->add_option("--input", ro.input, "case .npz: hidden_states [, cu_seqlens, initial_*_state]")
      ->required();
  run->add_option("--output", ro.output, "output .npz: out, recurrent_state, conv_state")->required();
  run->add_option("--precision", ro.precision, "fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  run->add_option("--decode-tail", ro.decode_tail, "run each sequence's last K tokens as DECODE steps")
      ->check(CLI::NonNegativeNumber);
  run->add_option("--tp", ro.tp, "tensor-parallel ranks (start with mpirun -np N)")->check(CLI::PositiveNumber);
  run->add_option("--kernel", ro.kernel, "auto | naive | optimized")
      ->check(CLI::IsMember({"auto", "naive", "optimized"}));

  kda::cli::BenchOptions bo;
  auto* bench = app.add_subcommand("bench", "kernels and layer against same-run GEMM / memcpy ceilings");
  bench->add_option("--threads", bo.threads, "OpenMP threads (default: all)")->check(CLI::NonNegativeNumber);
  bench->add_flag("--json", bo.json, "print the results as JSON");
  bench->add_flag("--skip-naive", bo.skip_naive, "do not time the reference kernels");

  CLI11_PARSE(app, argc, argv);
  try {
    if (verify->parsed()) return kda::cli::run_verify(vo);
    if (run->parsed()) return kda::cli::run_run(ro);
    if (bench->parsed()) return kda::cli::run_bench(bo);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda: error: %s\n", e.what());
    kda::distributed::abort_other_ranks(2);
    return 2;
  }
  return 1;
}
