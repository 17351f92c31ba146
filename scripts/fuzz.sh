#!/usr/bin/env bash
# Fuzzes gradavg with libFuzzer under ASan+UBSan (tests/fuzz/fuzz_average.cpp: every call
# checked against a model of the contract). Builds the target with clang++-14 (Debian: clang-14
# and libclang-rt-14-dev), replays tests/fuzz/corpus and tests/fuzz/regressions, then fuzzes.
#
#   bash scripts/fuzz.sh [-t SECONDS] [-n RUNS] [-- LIBFUZZER_OPTIONS...]
#
# Stops after SECONDS (default 600; 0: no limit) or RUNS executions (default: no limit),
# whichever comes first, or at the first contract violation or sanitizer report, which exits
# non-zero and leaves the input as crash-* in the artifacts folder. New inputs accumulate in the
# working corpus, so consecutive runs continue where the last stopped. Both live under
# ${GRADAVG_BUILD_ROOT:-build}/fuzz. Replay one input: <build>/tests/fuzz/fuzz_average FILE
# (GRADAVG_FUZZ_VERBOSE=1 prints the decoded call and the model's verdict).
# GRADAVG_FUZZ_NO_LARGE=1 leaves out the cases large enough for several threads' chunks (about
# 1 MiB per chunk, hundreds of times the cost of a small case): for long runs that count
# executions; run without it too, so that the threaded split is fuzzed.
# GRADAVG_FUZZ_NATIVE=OFF builds without -march, in ${GRADAVG_BUILD_ROOT:-build}/fuzz-baseline,
# and runs the SSE2 kernel (GRADAVG_ISA=sse2 unless set: 16-byte packets, four per step) instead
# of this machine's widest: some kernel paths differ by packet width (a reload offset within a
# step is invisible with one 64-byte packet per step), so fuzz both.
# GRADAVG_FUZZ_TOLERATE=name,... lets known, reported deviations of the library pass (their
# names are in fuzz_average.cpp, where each is checked), so that a long run looks for others.
set -euo pipefail
cd "$(dirname "$0")/.."
native="${GRADAVG_FUZZ_NATIVE:-ON}"
build="${GRADAVG_BUILD_ROOT:-build}/fuzz"
if [ "$native" = OFF ]; then build="$build-baseline"; fi
seconds=600
runs=-1
while (($#)); do
  case "$1" in
    -t) seconds="$2"; shift 2 ;;
    -n) runs="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-t SECONDS] [-n RUNS] [-- LIBFUZZER_OPTIONS...]" >&2; exit 2 ;;
  esac
done

cmake -S . -B "$build" -DCMAKE_CXX_COMPILER="${GRADAVG_FUZZ_CXX:-clang++-14}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADAVG_BUILD_FUZZ=ON -DGRADAVG_BUILD_BENCH=OFF -DGRADAVG_BUILD_EXAMPLES=OFF -DGRADAVG_WERROR=ON \
  -DGRADAVG_NATIVE="$native" > /dev/null
cmake --build "$build" --target fuzz_average -j "$(nproc)"

if [ "$native" = OFF ]; then export GRADAVG_ISA="${GRADAVG_ISA:-sse2}"; fi
inputs=(tests/fuzz/corpus)
if [ -d tests/fuzz/regressions ]; then inputs+=(tests/fuzz/regressions); fi
mkdir -p "$build/corpus" "$build/artifacts"
"$build/tests/fuzz/fuzz_average" -max_total_time="$seconds" -runs="$runs" -max_len=1024 -print_final_stats=1 \
  -artifact_prefix="$build/artifacts/" "$@" "$build/corpus" "${inputs[@]}"
