#!/usr/bin/env bash
# Builds gradavg_bench_mpi (bench/bench_mpi.cpp; Release, -march=native) and runs it: gradavg::mpi
# against MPI_Allreduce alone, the local pass alone and per-variable MPI_Allreduce, on ResNet-50 and
# BERT-base layouts (bench/README.md, "Across processes"). Not part of CI.
#
#   scripts/bench-mpi.sh [--ranks N] [--link RATE[,RATE...]] [--ddp MODEL] [-- BENCH ARGS]
#
#   --ranks N     MPI ranks (default 2)
#   --link RATES  run on an emulated cluster link (scripts/netlink.sh: a namespace per rank on a
#                 switch, each port shaped at RATE, Open MPI's TCP transport), once per rate
#                 (tc syntax: 1gbit, 2500mbit; none: unshaped). Needs root and iproute2: skipped
#                 with a message otherwise. Without --link: mpiexec on this host (shared memory).
#   --ddp MODEL   with --link: after gradavg_bench_mpi at each rate, PyTorch's DDP over gloo on the
#                 same link and layout (bench/ddp_peer.py, resnet50|bert_base|all; Debian's
#                 python3-torch, installed by scripts/install-deps.sh when missing)
#   BENCH ARGS    to the benchmark, e.g. --model bert_base --towers 1,8 --rounds 5 --fusion-mib 0,16
set -euo pipefail
cd "$(dirname "$0")/.."
build="${GRADAVG_BUILD_ROOT:-build}/bench-mpi"
ranks=2 links="" ddp=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --link) links="${2//,/ }"; shift 2 ;;
    --ddp) ddp="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [ -n "$links" ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v tc > /dev/null || ! command -v ip > /dev/null; then
    echo "bench-mpi.sh: --link needs root and iproute2 (ip, tc): skipped" >&2
    exit 0
  fi
fi
[ -z "$ddp" ] || bash scripts/install-deps.sh python3-torch
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRADAVG_BUILD_TESTS=OFF -DGRADAVG_BUILD_EXAMPLES=OFF \
  -DGRADAVG_BUILD_BENCH=ON -DGRADAVG_TORCH=OFF > /dev/null
cmake --build "$build" --target gradavg_bench_mpi -j "${GRADAVG_JOBS:-2}"
bench="$PWD/$build/bench/gradavg_bench_mpi"
if [ -z "$links" ]; then
  preflags=()
  if mpiexec --version 2>/dev/null | grep -Eq "Open MPI|OpenRTE"; then
    preflags=(--oversubscribe)
    if [ "$(id -u)" -eq 0 ]; then preflags+=(--allow-run-as-root); fi
  fi
  set -x
  exec mpiexec -n "$ranks" "${preflags[@]}" "$bench" "$@"
fi
trap 'bash scripts/netlink.sh teardown' EXIT
bash scripts/netlink.sh setup "$ranks"
for rate in $links; do
  bash scripts/netlink.sh shape "$rate"
  bash scripts/netlink.sh run "$bench" "$@"
  [ -z "$ddp" ] || bash scripts/netlink.sh each /usr/bin/python3 "$PWD/bench/ddp_peer.py" --model "$ddp"
done
