#!/usr/bin/env bash
# Runs the error, in-place and aliasing tests (and test_fused where it exists) under valgrind
# memcheck: every error leaves inputs and outputs untouched, so those paths must read no
# uninitialised byte, write out of no bounds and leak nothing.
#
#   bash scripts/valgrind.sh
#
# Installs valgrind when it is missing (scripts/install-deps.sh: apt-get, with sudo when not root). Valgrind 3.19
# cannot decode AVX-512, so the tests are built for x86-64-v3 (AVX2 + FMA: 32-byte packets, the
# widest it runs) instead of -march=native, in ${GRADAVG_BUILD_ROOT:-build}/valgrind, with
# ${GRADAVG_JOBS:-$(nproc)} build jobs. Valgrind replaces the allocation functions itself, so the
# tests do not replace them to count allocations (GRADAVG_TEST_COUNT_ALLOCATIONS=0, as under ASan):
# test_allocations and the ASan-free builds of scripts/test.sh prove "allocates nothing". Exits non-zero when any test fails or valgrind reports an
# error (an invalid read or write, a use of an uninitialised value, a definite or possible leak).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${GRADAVG_BUILD_ROOT:-build}/valgrind"
jobs="${GRADAVG_JOBS:-$(nproc)}"

if ! command -v valgrind > /dev/null; then
  bash scripts/install-deps.sh valgrind
fi

tests=(test_errors test_in_place test_aliasing)
if [ -f tests/core/test_fused.cpp ]; then tests+=(test_fused); fi

start=$(date +%s)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADAVG_WERROR=ON -DGRADAVG_NATIVE=OFF \
  -DCMAKE_CXX_FLAGS="-march=x86-64-v3 -DGRADAVG_TEST_COUNT_ALLOCATIONS=0" -DGRADAVG_ISA_TESTS=OFF \
  -DGRADAVG_BUILD_BENCH=OFF -DGRADAVG_BUILD_EXAMPLES=OFF > /dev/null
cmake --build "$build" --target "${tests[@]}" -j "$jobs"
echo "valgrind.sh: built ${tests[*]} in $(($(date +%s) - start)) s"

failed=()
for t in "${tests[@]}"; do
  t0=$(date +%s)
  if valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,possible \
       --log-file="$build/$t.valgrind.log" "$build/tests/$t" -w NoTests > "$build/$t.out" 2>&1; then
    echo "valgrind.sh: $t clean ($(($(date +%s) - t0)) s): $(grep -m1 'ERROR SUMMARY' "$build/$t.valgrind.log" | cut -d' ' -f2-);" \
      "$(grep -m1 -E '^(All tests passed|test cases:)' "$build/$t.out")"
  else
    echo "valgrind.sh: $t FAILED ($(($(date +%s) - t0)) s); valgrind log $build/$t.valgrind.log, output $build/$t.out"
    tail -n 30 "$build/$t.valgrind.log"
    tail -n 10 "$build/$t.out"
    failed+=("$t")
  fi
done
if ((${#failed[@]})); then
  echo "valgrind.sh: failed: ${failed[*]}"
  exit 1
fi
echo "valgrind.sh: all clean in $(($(date +%s) - start)) s"
