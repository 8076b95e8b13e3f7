#!/usr/bin/env bash
# Every test and the lint: the Release suite, the same suite under AddressSanitizer +
# UndefinedBehaviorSanitizer, and pre-commit (clang-format, cppcheck).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
JOBS=$(nproc)

echo "== lint (pre-commit)"
pre-commit run --all-files --show-diff-on-failure

echo "== Release build + tests"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS"

echo "== ASan + UBSan build + tests"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDA_SANITIZE=ON -DKDA_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS"
