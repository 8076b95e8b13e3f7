#!/usr/bin/env bash
# The main job: build (Release) and check every vendored dump case through the full stack.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target kda
./build/kda verify --dumps tests/data/kda_dumps/mini "$@"
