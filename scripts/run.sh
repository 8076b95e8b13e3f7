#!/usr/bin/env bash
# The main job: build (Release) and run `kda simulate` on its defaults -- 20 Kimi-Linear-48B-A3B KDA
# layers (synthetic bf16 weights) serving 32 requests with continuous batching, then the self-check.
# Extra arguments go to `kda simulate` (e.g. --model DIR for a real checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target kda
./build/kda simulate "$@"
