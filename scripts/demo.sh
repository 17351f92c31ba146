#!/usr/bin/env bash
# The main demo, on a fresh Debian 12 machine: installs what is missing, builds the examples
# (Release), then runs the README's program, a data-parallel training job on synthetic data it
# generates, a mixed-precision one (binary16 gradients with a dynamic loss scale, bfloat16
# gradients without one; clipping, noise scale), when MPI is installed, the data-parallel job
# across 2 processes (mpiexec -n 2, 2 towers each), and, when libtorch is installed, libtorch
# replicas on threads learning scikit-learn's handwritten digits (scripts/fetch-digits.sh gets
# them from Debian's python3-sklearn package), then the same across 2 processes when MPI is
# installed too. Extra arguments go to the first training job (e.g. --towers 8 --steps 400).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${GRADAVG_BUILD_ROOT:-build}/demo"

bash scripts/install-deps.sh
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRADAVG_BUILD_TESTS=OFF -DGRADAVG_BUILD_BENCH=OFF \
  -DGRADAVG_BUILD_EXAMPLES=ON > /dev/null
cmake --build "$build" -j "$(nproc)"

echo "== examples/readme_main.cpp"
"$build/examples/readme_main"
echo
echo "== examples/train_data_parallel.cpp"
"$build/examples/train_data_parallel" "$@"
echo
echo "== examples/train_mixed_precision.cpp"
"$build/examples/train_mixed_precision"

if [ -x "$build/examples/train_mpi" ]; then
  echo
  echo "== examples/train_mpi.cpp (mpiexec -n 2)"
  preflags=()
  if mpiexec --version 2>/dev/null | grep -Eq "Open MPI|OpenRTE"; then preflags=(--oversubscribe); fi
  if [ "$(id -u)" -eq 0 ] && ((${#preflags[@]})); then preflags+=(--allow-run-as-root); fi
  mpiexec -n 2 "${preflags[@]}" "$build/examples/train_mpi" --towers 2 --steps 600
  mpi=1
else
  echo
  echo "== examples/train_mpi.cpp: not built (no MPI; scripts/install-deps.sh installs Open MPI)"
fi

if [[ -x "$build/examples/train_torch_threads" ]]; then
  echo
  echo "== examples/train_torch_threads.cpp"
  digits="$(bash scripts/fetch-digits.sh "${GRADAVG_BUILD_ROOT:-build}/data")"
  "$build/examples/train_torch_threads" --data "$digits"
  if [[ -n "${mpi:-}" && -x "$build/examples/train_torch_mpi" ]]; then
    echo
    echo "== examples/train_torch_processes.cpp as train_torch_mpi (mpiexec -n 2, 2 replicas each)"
    mpiexec -n 2 "${preflags[@]}" "$build/examples/train_torch_mpi" --data "$digits" --replicas 2
  fi
  if [[ -x "$build/examples/train_torch_c10d" ]]; then
    echo
    # The same over a gloo process group, started the torchrun way (a shell loop without torchrun).
    if command -v torchrun > /dev/null; then
      echo "== examples/train_torch_processes.cpp as train_torch_c10d (torchrun --nproc_per_node=2 --no_python)"
      # Debian 12's torchrun (PyTorch 1.13 under Python 3.11) fails on its own default --redirects 0
      # and --tee 0: standard output is redirected to its log files and copied here.
      torchrun --nproc_per_node=2 --redirects 1 --tee 1 --no_python "$build/examples/train_torch_c10d" \
        --data "$digits" --replicas 2 --quiet
    else
      echo "== examples/train_torch_processes.cpp as train_torch_c10d (2 processes, RANK/WORLD_SIZE/MASTER_*)"
      sh tests/support/launch_ranks.sh 2 tcp "$build/examples/train_torch_c10d" --data "$digits" --replicas 2 --quiet
    fi
  fi
fi
