#!/usr/bin/env bash
# Installs the build tree's kda into a fresh prefix, builds the outside program of consumer/ against it
# with find_package(kda) (and every installed header alone), and runs it on one vendored case.
# Usage: run_consumer.sh BUILD_DIR WORK_DIR DUMPS_DIR
set -euo pipefail
build=$1 work=$2 dumps=$3
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
# The installed headers are exactly include/kda: no private header (src/kda: kernels' SIMD bodies,
# scratch, bench helpers, serving) is there, and nothing public is missing.
installed=$(cd "$work/prefix/include" && find kda -name '*.h' | sort)
public=$(cd "$repo/include" && find kda -name '*.h' | sort)
if [ "$installed" != "$public" ]; then
  echo "installed headers differ from include/kda:" >&2
  diff <(echo "$public") <(echo "$installed") >&2 || true
  exit 1
fi
for private in $(cd "$repo/src" && find kda -name '*.h'); do
  if [ -e "$work/prefix/include/$private" ]; then
    echo "private header installed: $private" >&2
    exit 1
  fi
done
# The consumer includes only <kda/...> headers of the library (and the standard library's).
if grep -E '^#include' "$here/consumer/main.cc" | grep -vE '^#include <(kda/[a-z_/]+\.h|[a-z_]+)>$' >&2; then
  echo "the consumer includes something other than <kda/...> and the standard library" >&2
  exit 1
fi
cmake -S "$here/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/kda_consumer" "$dumps" "$dumps/T65.npz"
