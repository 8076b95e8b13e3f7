#!/usr/bin/env bash
# Installs the Debian packages the build, the tests and the lint need -- only those that are missing.
set -euo pipefail
PKGS=(build-essential cmake ninja-build pkg-config git ccache
      libdnnl-dev nlohmann-json3-dev libzip-dev zlib1g-dev libcli11-dev
      libgtest-dev libgmock-dev libbenchmark-dev
      libopenmpi-dev openmpi-bin
      pre-commit clang-format cppcheck
      clang libclang-rt-14-dev libomp-dev
      python3 python3-dev python3-venv python3-pip python3-setuptools pybind11-dev python3-pybind11 libdlpack-dev
      libpcre2-dev libcpp-httplib-dev curl
      python3-numpy python3-torch python3-pytest python3-jinja2)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
