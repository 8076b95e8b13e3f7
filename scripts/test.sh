#!/usr/bin/env bash
# Every test and the lint: the Release suite (GoogleTest and the outside program built against an
# install), the Python tests (pytest) on the build tree and on a pip install in a venv, the kernel tests
# of a build without the AVX-512 copies (the portable and AVX2 paths are what runs there), the suite
# under AddressSanitizer + UndefinedBehaviorSanitizer, and pre-commit (clang-format, cppcheck).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
JOBS=$(nproc)
# The tests run $JOBS at a time, each with an OpenMP team of $JOBS threads. Threads that spin at a barrier
# (libgomp's default) take the cores from the other test's threads, which then wait out whole time
# slices, many times over in the tests of small models with many short parallel regions
# (docs/reliability.md, "The test command's time").
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
# The disk this run has (a CI machine once ran out of it halfway through the suite).
df -h . "${TMPDIR:-/tmp}" || true

echo "== lint (pre-commit)"
pre-commit run --all-files --show-diff-on-failure

echo "== Release build + tests"
# Debian's interpreter: NumPy, PyTorch and pytest come from Debian's packages.
PY=/usr/bin/python3
# ccache between this build and the pip install's (below): both compile the library with the same
# commands, so the second is served from the cache instead of compiling all of it again. Only these two
# builds use it (the sanitizer builds share nothing); a caller's own launcher is kept for every build.
CALLER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER-}
export CMAKE_CXX_COMPILER_LAUNCHER=${CALLER_LAUNCHER:-ccache}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$PY >/dev/null
cmake --build build -j "$JOBS"
ctest --test-dir build --output-on-failure -j "$JOBS"

echo "== the test venv: Debian's NumPy, PyTorch and pytest, and from PyPI the outside references the tests"
echo "   compare against (tiktoken) and the clients they drive the server with (openai)"
rm -rf build-venv
$PY -m venv --system-site-packages build-venv
build-venv/bin/pip install -q -r tests/python/requirements.txt
VPY=build-venv/bin/python

echo "== Python tests (pytest, build/python)"
KDA_PYTHONPATH=build/python KDA_BINARY=build/kda $VPY -m pytest -q tests/python

echo "== pip install --no-build-isolation . into the venv (offline), pytest on the installed package"
build-venv/bin/pip install -q --no-build-isolation --no-index .
KDA_PYTHONPATH=- KDA_BINARY=build/kda $VPY -m pytest -q tests/python
if [ -n "$CALLER_LAUNCHER" ]; then export CMAKE_CXX_COMPILER_LAUNCHER=$CALLER_LAUNCHER; else unset CMAKE_CXX_COMPILER_LAUNCHER; fi

echo "== kernel tests without AVX-512 (KDA_ENABLE_AVX512=OFF)"
cmake -S . -B build-portable -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_ENABLE_AVX512=OFF -DKDA_BUILD_BENCH=OFF \
  -DKDA_BUILD_PYTHON=OFF >/dev/null
PORTABLE_TESTS=(test_kernels test_chunk_kda_blocks test_short_conv test_vec_math test_f32_block test_mla_flash test_argmax)
cmake --build build-portable -j "$JOBS" --target "${PORTABLE_TESTS[@]}"
for t in "${PORTABLE_TESTS[@]}"; do build-portable/"$t" --gtest_brief=1; done
# And the AVX2 build's portable copy alone, as on a CPU without AVX2 (KDA_ISA caps the choice).
KDA_ISA=portable build-portable/test_short_conv --gtest_brief=1

echo "== ASan + UBSan build + tests"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDA_SANITIZE=ON -DKDA_BUILD_BENCH=OFF \
  -DKDA_BUILD_PYTHON=OFF >/dev/null
cmake --build build-asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS"

echo "== ThreadSanitizer build of the concurrency test (KDA_TSAN=ON, GCC, OpenMP teams of one thread)"
# test_concurrency's threads against TSan, and its deliberate race, which TSan must report (README,
# "Thread safety"). Only that test and what it links are built.
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDA_TSAN=ON -DKDA_BUILD_BENCH=OFF \
  -DKDA_BUILD_PYTHON=OFF >/dev/null
cmake --build build-tsan -j "$JOBS" --target test_concurrency
ctest --test-dir build-tsan --output-on-failure -R '^(Concurrency|Tsan)\.'

echo "== fuzzing (libFuzzer + ASan + UBSan, about 10 s per parser: scripts/fuzz.sh)"
scripts/fuzz.sh
