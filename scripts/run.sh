#!/usr/bin/env bash
# The main job: build (Release) and run `kda simulate` on its defaults -- 20 Kimi-Linear-48B-A3B KDA
# layers (synthetic bf16 weights) serving 32 requests with continuous batching, then the self-check --
# and then a multi-turn chat workload with a shared 256-token system prompt, where the prefix cache
# (on by default) serves the system prompt and each conversation's history from state snapshots.
# Extra arguments go to both `kda simulate` runs (e.g. --model DIR for a real checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target kda
./build/kda simulate "$@"
./build/kda simulate --workload multi-turn --shared-prefix-len 256 --turns 3 --requests 8 --prompt-len 16:48 \
  --output-len 16 "$@"
