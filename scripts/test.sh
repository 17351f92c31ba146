#!/usr/bin/env bash
# The whole test suite, on a fresh Debian 12 machine (x86-64), in stages; each prints its name
# and how long it took, and a summary of the times comes at the end:
#   deps      installs what is missing (scripts/install-deps.sh)
#   werror    GCC, -march=native, -Wall -Wextra -Wpedantic -Werror: tests, examples, benchmarks;
#             with the instruction-set matrix (the kernel tests built once without -march and
#             run at SSE2, AVX2, AVX-512 and AVX-512 BF16, the Eigen tests at AVX-512 unless
#             -march=native is, each skipped where this machine lacks the level) and the MPI
#             tests (gradavg::mpi
#             under mpiexec with 2, 3 and 4 ranks, train_mpi with 2); the other stages build
#             without MPI (-DGRADAVG_MPI=OFF: Open MPI's own allocations would fail LeakSanitizer,
#             and the cross build has no aarch64 MPI); the libtorch test,
#             example and bench (gradavg::torch) in this stage only (-DGRADAVG_TORCH=OFF elsewhere)
#   sanitize  GCC, ASan+UBSan (-fno-sanitize-recover=all), no -march (the kernel at every level
#             the machine runs in test_dispatch, at its widest elsewhere), -O0
#             (the tests take 76 s there against 31 s at -O1, the build 7 min against 16):
#             tests and examples (not the package tests, which the werror stage runs)
#   clang     Clang 14 with libstdc++, -march=native, -Werror: tests and examples
#   tsan      Clang 14, ThreadSanitizer: the thread tests
#   arm       aarch64 (NEON) cross build with g++-aarch64-linux-gnu: tests and examples, run
#             under qemu-aarch64
#   fuzz      Clang 14 libFuzzer target under ASan+UBSan (no -march, the SSE2 kernel: 16-byte packets,
#             four per step, exercise what one 64-byte packet per step hides): the seed corpus,
#             the regression inputs, then 60 s of fuzzing (fuzz_smoke); longer runs:
#             scripts/fuzz.sh
# GRADAVG_STAGES="werror clang" runs only the stages named; stages joined by + run side by side
# (tsan+fuzz, the default: the fuzz stage builds one unit and fuzzes in one process, leaving a
# core to the other), each into a log under the build root that is printed when both are done.
# Build trees go under ${GRADAVG_BUILD_ROOT:-build}; GRADAVG_JOBS sets the build and test
# parallelism (default: nproc).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
root="${GRADAVG_BUILD_ROOT:-build}"
jobs="${GRADAVG_JOBS:-$(nproc)}"
stages="${GRADAVG_STAGES:-deps werror sanitize clang arm tsan+fuzz}"
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi

# configure <dir> <cmake options...>; build <dir> [targets...]; run_ctest <dir> [ctest options...]
configure() {
  local dir="$1"
  shift
  cmake -S . -B "$dir" "${generator[@]}" "$@"
}
build() {
  local dir="$1"
  shift
  local targets=()
  if (($# > 0)); then targets=(--target "$@"); fi
  cmake --build "$dir" -j "$jobs" "${targets[@]}"
}
run_ctest() {
  local dir="$1"
  shift
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" "$@"
}

stage_deps() {
  bash scripts/install-deps.sh
}

stage_werror() {
  configure "$root/werror" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2" \
    -DGRADAVG_WERROR=ON
  build "$root/werror"
  run_ctest "$root/werror"
}

stage_sanitize() {
  configure "$root/sanitize" -DGRADAVG_TORCH=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O0 -g1" \
    -DGRADAVG_WERROR=ON -DGRADAVG_SANITIZE=address,undefined -DGRADAVG_BUILD_BENCH=OFF \
    -DGRADAVG_NATIVE=OFF -DGRADAVG_ISA_TESTS=OFF -DGRADAVG_MPI=OFF
  build "$root/sanitize"
  # Not the package tests: their consumer projects build with the compiler alone, none of this
  # stage's flags, so they would repeat the werror stage's (about 1 CPU minute). Not the no_mmx
  # checks: they read the instructions an optimised build emits (the werror and clang stages
  # run them); at -O0 nothing is vectorised and disassembling the instrumented programs took
  # 3 CPU minutes.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    run_ctest "$root/sanitize" -E "^(package_|no_mmx: )"
}

stage_clang() {
  configure "$root/clang" -DGRADAVG_TORCH=OFF -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2" -DGRADAVG_WERROR=ON -DGRADAVG_BUILD_BENCH=OFF \
    -DGRADAVG_ISA_TESTS=OFF -DGRADAVG_MPI=OFF
  build "$root/clang"
  run_ctest "$root/clang"
}

stage_tsan() {
  # Clang: GCC 12 rejects the atomic_thread_fence in Eigen's ThreadPool under TSan (-Wtsan).
  configure "$root/tsan" -DGRADAVG_TORCH=OFF -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
    -DGRADAVG_WERROR=ON -DGRADAVG_SANITIZE=thread -DGRADAVG_BUILD_BENCH=OFF \
    -DGRADAVG_BUILD_EXAMPLES=OFF -DGRADAVG_ISA_TESTS=OFF -DGRADAVG_MPI=OFF
  # OpenMP's runtime is not instrumented for TSan: test_threads_openmp is left out.
  # test_fused: the fused step's per-segment records and its merge after the join.
  build "$root/tsan" test_threads test_thread_failures test_fused test_transport
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    run_ctest "$root/tsan" -R "^(test_threads|test_thread_failures|test_fused|test_transport):"
}

stage_arm() {
  configure "$root/aarch64" -DGRADAVG_TORCH=OFF --toolchain cmake/toolchains/aarch64-linux-gnu.cmake \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2" -DGRADAVG_WERROR=ON \
    -DGRADAVG_BUILD_BENCH=OFF -DGRADAVG_MPI=OFF
  build "$root/aarch64"
  run_ctest "$root/aarch64"
}

stage_fuzz() {
  configure "$root/fuzz" -DGRADAVG_TORCH=OFF -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2" -DGRADAVG_WERROR=ON -DGRADAVG_NATIVE=OFF -DGRADAVG_BUILD_FUZZ=ON \
    -DGRADAVG_BUILD_BENCH=OFF -DGRADAVG_BUILD_EXAMPLES=OFF -DGRADAVG_ISA_TESTS=OFF -DGRADAVG_MPI=OFF
  build "$root/fuzz" fuzz_average
  run_ctest "$root/fuzz" -R "^fuzz_smoke"
}

# cpu_seconds <pid>: CPU seconds (user + system) used so far by that shell's finished child
# processes.
cpu_seconds() {
  awk -v hz="$(getconf CLK_TCK)" '{ printf "%d", ($16 + $17) / hz }' "/proc/$1/stat"
}

mkdir -p "$root"
timings_file="$root/stage-times.txt"
: >"$timings_file"

# run_stage <name>: runs it, prints its time and appends it to the summary.
run_stage() {
  stage="$1"
  echo "== stage $stage"
  start=$SECONDS
  local shell_pid=$BASHPID cpu_start elapsed cpu  # this stage's shell: a subshell when side by side
  cpu_start=$(cpu_seconds "$shell_pid")
  "stage_$stage"
  elapsed=$((SECONDS - start))
  cpu=$(($(cpu_seconds "$shell_pid") - cpu_start))
  printf '%-9s %3dm%02ds   (%dm%02ds CPU)\n' "$stage" $((elapsed / 60)) $((elapsed % 60)) $((cpu / 60)) $((cpu % 60)) \
    >>"$timings_file"
  echo "== stage $stage passed in $((elapsed / 60))m$((elapsed % 60))s (CPU $((cpu / 60))m$((cpu % 60))s)"
}

stage=""
trap 'echo "== stage $stage FAILED after $((SECONDS - start))s"' ERR
for group in $stages; do
  IFS=+ read -r -a members <<<"$group"
  for member in "${members[@]}"; do
    if ! declare -F "stage_$member" >/dev/null; then
      echo "unknown stage '$member' (deps werror sanitize clang tsan arm fuzz)" >&2
      exit 2
    fi
  done
  if ((${#members[@]} == 1)); then
    run_stage "${members[0]}"
    continue
  fi
  echo "== stages ${members[*]}, side by side (logs: $root/stage-<name>.log)"
  pids=()
  for member in "${members[@]}"; do
    (run_stage "$member") >"$root/stage-$member.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for i in "${!members[@]}"; do
    wait "${pids[$i]}" || failed=1
  done
  for member in "${members[@]}"; do
    cat "$root/stage-$member.log"
  done
  if ((failed)); then
    exit 1
  fi
done
echo "== all stages passed:"
sed 's/^/   /' "$timings_file"
