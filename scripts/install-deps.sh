#!/usr/bin/env bash
# Installs what gradavg's build, tests, benchmarks and examples need, from Debian 12's archive.
# Skips the install when every package is already there. Needs root (or sudo).
set -euo pipefail

packages=(
  build-essential cmake pkg-config  # toolchain
  libeigen3-dev                     # the one dependency of the library
  catch2                            # tests
  libbenchmark-dev libdnnl-dev      # benchmarks (oneDNN is a peer measured against)
  python3 python3-matplotlib        # benchmark table and plot
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "installing: ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
