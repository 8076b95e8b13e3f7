#!/usr/bin/env bash
# The main job: build (Release) and run `kda simulate` on its defaults -- the whole Kimi-Linear-48B-A3B
# at its real shapes (27 layers, synthetic bf16 weights, 16 routed experts per MoE layer, top-8) serving
# 32 requests with continuous batching, then the self-check -- and then a multi-turn chat workload (8
# conversations of 4 turns, a shared 256-token system prompt) on the same 27 layers, whose later turns hit
# the hybrid prefix cache (the MLA layers' KV rows and the KDA layers' state snapshots); its self-check
# re-runs checked turns alone with their sessions (docs/performance.md, "The prefix cache").
# Extra arguments go to both `kda simulate` runs (e.g. --model DIR for a real checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target kda
./build/kda simulate "$@"
./build/kda simulate --workload multi-turn --shared-prefix-len 256 --turns 4 --requests 8 \
  --prompt-len 16:48 --output-len 16 "$@"
