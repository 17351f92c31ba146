#!/usr/bin/env bash
# Installs what gradavg's build, tests, benchmarks, examples and scripts/test.sh need, from
# Debian 12's archive. Every package is named explicitly: the install runs with
# --no-install-recommends, so nothing a package only recommends comes along.
# Skips the install when every package is already there. Needs root (or sudo).
#
#   bash scripts/install-deps.sh              the packages below
#   bash scripts/install-deps.sh <package>... those packages instead (a script's own tool:
#                                             valgrind.sh, check-vcpkg-port.sh)
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config  # toolchain: GCC 12 (and its ASan, UBSan, TSan)
  libeigen3-dev                     # the one dependency of the library
  catch2                            # tests
  libbenchmark-dev                  # benchmarks
  libdnnl-dev ocl-icd-opencl-dev    # oneDNN peer; its CMake config requires OpenCL's dev package
  python3 python3-matplotlib        # benchmark table and plot
  clang-14 libclang-rt-14-dev       # Clang build (libstdc++ 12) and its sanitizer runtimes
  libomp-14-dev                     # OpenMP for the Clang build's test_threads_openmp
  libtbb-dev                        # oneTBB: test_threads_tbb (gradavg/tbb.hpp)
  libtorch-dev                      # libtorch: gradavg::torch, test_torch, train_torch_threads,
                                    # gradavg_bench_torch; its Depends bring what Torch's CMake
                                    # config finds (gflags, glog, protobuf; oneDNN is above)
  libgloo-dev                       # gloo's headers, which libtorch's c10d headers include:
                                    # gradavg::c10d, test_c10d, train_c10d
  g++-aarch64-linux-gnu qemu-user   # aarch64 (NEON) cross build, run under qemu-aarch64
  libopenmpi-dev openmpi-bin        # gradavg::mpi, its tests (werror stage), train_mpi, bench_mpi;
                                    # nothing they only recommend is used (libopenmpi-dev recommends
                                    # Fortran coarrays alone); openmpi-bin's ssh client is a dependency
)
if (($# > 0)); then packages=("$@"); fi

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
