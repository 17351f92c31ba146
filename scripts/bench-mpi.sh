#!/usr/bin/env bash
# bench/bench_mpi.cpp: gradavg::mpi against per-variable MPI_Allreduce and Horovod-style fusion
# on ResNet-50 and BERT-base layouts (bench/README.md, "Across processes"). Builds
# gradavg_bench_mpi (Release, -march=native), then runs it under mpiexec with
# GRADAVG_BENCH_RANKS ranks (default 2); arguments go to the benchmark (e.g. --model resnet50
# --reps 20 --fusion-mib 25). Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${GRADAVG_BUILD_ROOT:-build}/bench-mpi"
ranks="${GRADAVG_BENCH_RANKS:-2}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRADAVG_BUILD_TESTS=OFF -DGRADAVG_BUILD_EXAMPLES=OFF \
  -DGRADAVG_BUILD_BENCH=ON > /dev/null
cmake --build "$build" --target gradavg_bench_mpi -j "${GRADAVG_JOBS:-2}"
preflags=()
if mpiexec --version 2>/dev/null | grep -Eq "Open MPI|OpenRTE"; then
  preflags=(--oversubscribe)
  if [ "$(id -u)" -eq 0 ]; then preflags+=(--allow-run-as-root); fi
fi
set -x
mpiexec -n "$ranks" "${preflags[@]}" "$build/bench/gradavg_bench_mpi" "$@"
