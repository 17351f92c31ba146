#!/usr/bin/env bash
# The whole test suite, on a fresh Debian 12 machine:
#   1. installs what is missing (scripts/install-deps.sh),
#   2. builds tests, examples and benchmarks with -Wall -Wextra -Wpedantic -Werror, runs ctest,
#   3. builds tests and examples again with ASan+UBSan (-fno-sanitize-recover=all), runs ctest;
#      this build uses the baseline instruction set (SSE2), the first -march=native (AVX...).
# Build trees go under ${GRADAVG_BUILD_ROOT:-build}.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${GRADAVG_BUILD_ROOT:-build}"
jobs="$(nproc)"

bash scripts/install-deps.sh

echo "== warnings-as-errors build"
cmake -S . -B "$root/werror" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2" \
  -DGRADAVG_WERROR=ON
cmake --build "$root/werror" -j "$jobs"
ctest --test-dir "$root/werror" --output-on-failure -j "$jobs"

echo "== ASan+UBSan build"
cmake -S . -B "$root/sanitize" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" \
  -DGRADAVG_WERROR=ON -DGRADAVG_SANITIZE=address,undefined -DGRADAVG_BUILD_BENCH=OFF -DGRADAVG_NATIVE=OFF
cmake --build "$root/sanitize" -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$root/sanitize" --output-on-failure -j "$jobs"
