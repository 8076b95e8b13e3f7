#!/usr/bin/env bash
# Fuzzes every parser of outside input (tests/fuzz: npy, npz, safetensors header, safetensors index,
# config.json, the --trace JSON, text through the tokenizer) with libFuzzer + ASan + UBSan, each for a
# bounded time, and fails on any crash, leak, hang (-timeout), out-of-memory (-rss_limit_mb) or UB
# report. The seeds in tests/fuzz/<target>/ and the regression inputs in tests/fuzz/regressions/<target>/
# are read, never written: new inputs go to a temporary folder, removed at the end. A target that fails
# leaves its crash-* / leak-* / timeout-* file in build-fuzz/artifacts/<target>/ to copy into regressions/.
#
#   scripts/fuzz.sh [seconds_per_target]   (default 10: about a minute for the seven targets)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-10}
TARGETS=(npy npz safetensors safetensors_index config trace tokenizer_text)
BUILD=build-fuzz

cmake -S . -B "$BUILD" -G Ninja -DKDA_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" -j "$(nproc)" >"$BUILD/build.log" 2>&1 || { cat "$BUILD/build.log"; exit 1; }

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=0
export UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
status=0
for t in "${TARGETS[@]}"; do
  mkdir -p "$WORK/$t" "$BUILD/artifacts/$t"
  corpora=("$WORK/$t" "tests/fuzz/$t")
  [ -d "tests/fuzz/regressions/$t" ] && corpora+=("tests/fuzz/regressions/$t")
  log="$BUILD/artifacts/$t.log"
  # The first corpus folder receives new inputs: the temporary one. -timeout: one input taking longer
  # is a hang; -rss_limit_mb / -malloc_limit_mb: a parser that allocates from a forged size.
  if "$BUILD/tests/fuzz/fuzz_$t" "${corpora[@]}" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 \
      -rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len=8192 -print_final_stats=1 \
      -artifact_prefix="$BUILD/artifacts/$t/" >"$log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
    echo "fuzz $t: ok, ${execs:-?} executions in ${SECONDS_PER_TARGET}s, $cov"
  else
    echo "fuzz $t: FAILED (log: $log)"
    grep -E 'ERROR|SUMMARY|runtime error|invariant|Test unit written' "$log" | head -20 || true
    status=1
  fi
done
exit $status
