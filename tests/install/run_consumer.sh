#!/usr/bin/env bash
# Installs the build tree's kda into a fresh prefix, builds the outside program of consumer/ against it
# with find_package(kda), and runs it on one vendored case.
# Usage: run_consumer.sh BUILD_DIR WORK_DIR DUMPS_DIR
set -euo pipefail
build=$1 work=$2 dumps=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$here/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" >/dev/null
# Only the public headers were installed: no private kernel, SIMD or bench header is there.
for private in kernels/kda/vec_math.h kernels/kda/avx512.h kernels/kda/scratch.h bench/inputs.h \
               kernels/kda/prepare.h kernels/kda/impl.h kernels/kda/chunk/common.h common/isa_target.h; do
  if [ -e "$work/prefix/include/kda/$private" ]; then
    echo "private header installed: $private" >&2
    exit 1
  fi
done
"$work/build/kda_consumer" "$dumps" "$dumps/T65.npz"
