#!/usr/bin/env bash
# Builds gradavg_bench_c10d (bench/bench_c10d.cpp; Release, -march=native) and runs it with
# PyTorch's DistributedDataParallel over gloo (bench/ddp_peer.py) on the same layout, one after the
# other in one run: gradavg::c10d against gloo's allreduce, c10d_data_parallel's step against
# DDP's (bench/README.md, "Across processes over c10d"). Not part of CI.
#
#   scripts/bench-c10d.sh [--ranks N] [--link RATE[,RATE...]] [-- BENCH ARGS]
#
#   --ranks N     processes (default 2)
#   --link RATES  on an emulated cluster link (scripts/netlink.sh each: a namespace per rank,
#                 GLOO_SOCKET_IFNAME its port), once per rate (tc syntax: 1gbit, 2500mbit). Needs
#                 root and iproute2: skipped with a message otherwise. Without --link: this host
#                 (tests/support/launch_ranks.sh, a TCPStore on 127.0.0.1).
#   BENCH ARGS    to both, e.g. --model bert_base --rounds 5 (bench_c10d also takes --fusion-kib K)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${GRADAVG_BUILD_ROOT:-build}/bench-c10d"
ranks=2 links=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --link) links="${2//,/ }"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [ -n "$links" ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v tc > /dev/null || ! command -v ip > /dev/null; then
    echo "bench-c10d.sh: --link needs root and iproute2 (ip, tc): skipped" >&2
    exit 0
  fi
fi
bash scripts/install-deps.sh python3-torch libtorch-dev libgloo-dev
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRADAVG_BUILD_TESTS=OFF -DGRADAVG_BUILD_EXAMPLES=OFF \
  -DGRADAVG_BUILD_BENCH=ON -DGRADAVG_MPI=OFF > /dev/null
cmake --build "$build" --target gradavg_bench_c10d -j "${GRADAVG_JOBS:-2}"
bench="$PWD/$build/bench/gradavg_bench_c10d"
# ddp_peer.py takes --model and --rounds only.
ddp_args=()
for ((i = 1; i <= $#; ++i)); do
  case "${!i}" in
    --model | --rounds) j=$((i + 1)); ddp_args+=("${!i}" "${!j}") ;;
  esac
done
if [ -z "$links" ]; then
  sh tests/support/launch_ranks.sh "$ranks" tcp "$bench" "$@"
  sh tests/support/launch_ranks.sh "$ranks" tcp /usr/bin/python3 "$PWD/bench/ddp_peer.py" "${ddp_args[@]}"
  exit 0
fi
trap 'bash scripts/netlink.sh teardown' EXIT
bash scripts/netlink.sh setup "$ranks"
for rate in $links; do
  bash scripts/netlink.sh shape "$rate"
  bash scripts/netlink.sh each "$bench" "$@"
  bash scripts/netlink.sh each /usr/bin/python3 "$PWD/bench/ddp_peer.py" "${ddp_args[@]}"
done
