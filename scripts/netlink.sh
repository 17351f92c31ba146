#!/usr/bin/env bash
# netlink.sh: an emulated cluster link for MPI jobs of N ranks on one machine (root, iproute2's ip
# and tc, Open MPI). Each rank runs in a network namespace of its own, joined to a switch (a bridge
# in a hub namespace) by a veth pair; both ends of every pair are shaped by tc tbf at RATE, so each
# rank has a full-duplex port of RATE to the switch. Open MPI's TCP transport over those ports only
# (pml ob1, btl tcp,self). Addresses 10.214.0.(r+1)/24 exist inside the namespaces only; nothing in
# the root namespace is touched. No latency is added: the kernel may have no netem.
#
#   netlink.sh setup N       namespaces ga0 .. ga{N-1} and gahub (tears down old ones first)
#   netlink.sh shape RATE    tbf at RATE (tc syntax: 1gbit, 2500mbit; none: unshaped) on every port
#   netlink.sh run CMD...    CMD as an MPI job of N ranks, rank r in namespace ga{r}
#   netlink.sh each CMD...   CMD once in every namespace at once, not MPI: torchrun's variables
#                            RANK=r, WORLD_SIZE=N, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR
#                            (rank 0's address), MASTER_PORT (29500), and GLOO_SOCKET_IFNAME (the
#                            rank's port); fails if any rank fails
#   netlink.sh teardown      deletes the namespaces (and with them the veth pairs and the bridge)
#
# What the job needs (each found by trying): mpirun runs inside rank 0's namespace, with PMIx's TCP
# listener opened to remote connections on rank 0's port (from the root namespace MPI_Init fails:
# the PMIx server would listen on the root namespace's loopback); btl_tcp_flags without `put`
# (Open MPI's default with it reaches about half the shaped rate); the job in an autogroup of its
# own at nice -10 (NETLINK_NICE; empty: as is) so that other work does not starve it; a timeout
# (NETLINK_TIMEOUT seconds, default 3600). NETLINK_BTL_FLAGS=default keeps Open MPI's own
# btl_tcp_flags; NETLINK_MPIRUN_FLAGS adds mpirun flags (e.g. "--mca btl_tcp_eager_limit 1048576").
set -euo pipefail
pfx=ga
hub="${pfx}hub"
net=10.214.0
state=/tmp/gradavg-netlink.ranks
max_ranks=8

[ "$(id -u)" -eq 0 ] || { echo "netlink.sh: needs root (ip netns, tc)" >&2; exit 2; }
if ! command -v tc > /dev/null || ! command -v ip > /dev/null; then
  echo "netlink.sh: needs iproute2 (ip, tc)" >&2
  exit 2
fi

ranks() { cat "$state" 2>/dev/null || echo 0; }

teardown() {
  local r
  for ((r = 0; r < max_ranks; ++r)); do ip netns del "$pfx$r" 2>/dev/null || true; done
  ip netns del "$hub" 2>/dev/null || true
  rm -f "$state"
}

setup() {
  local n="$1" r
  if [ "$n" -lt 2 ] || [ "$n" -gt "$max_ranks" ]; then
    echo "netlink.sh: 2 to $max_ranks ranks" >&2
    exit 2
  fi
  teardown
  ip netns add "$hub"
  ip -n "$hub" link add br0 type bridge
  ip -n "$hub" link set br0 up
  ip -n "$hub" link set lo up
  for ((r = 0; r < n; ++r)); do
    ip netns add "$pfx$r"
    ip link add "$pfx${r}r" type veth peer name "$pfx${r}h"
    ip link set "$pfx${r}r" netns "$pfx$r"
    ip link set "$pfx${r}h" netns "$hub"
    ip -n "$hub" link set "$pfx${r}h" master br0
    ip -n "$hub" link set "$pfx${r}h" up
    ip -n "$pfx$r" addr add "$net.$((r + 1))/24" dev "$pfx${r}r"
    ip -n "$pfx$r" link set lo up
    ip -n "$pfx$r" link set "$pfx${r}r" up
  done
  echo "$n" > "$state"
  echo "== netlink: $n ranks, $net.1 .. $net.$n on a switch"
}

# tbf burst: 1 ms at the rate, at least 256 KiB (smaller bursts cost rate at high rates).
burst_of() {
  echo "$1" | awk '{ v = $1 + 0; u = tolower($1); sub(/^[0-9.]+/, "", u);
    m = (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1;
    b = v * m / 8 * 0.001; printf "%d", (b > 262144 ? b : 262144) }'
}

shape() {
  local rate="$1" r ns dev
  for ((r = 0; r < $(ranks); ++r)); do
    for x in "$pfx$r:$pfx${r}r" "$hub:$pfx${r}h"; do
      ns="${x%%:*}" dev="${x#*:}"
      ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
      [ "$rate" = none ] ||
        ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst "$(burst_of "$rate")" latency 20ms
    done
  done
  echo "== netlink: ports shaped at $rate each direction"
}

run() {
  local n r apps=() flags=()
  [ "${NETLINK_BTL_FLAGS:-}" = default ] ||
    flags=(--mca btl_tcp_flags "${NETLINK_BTL_FLAGS:-send,inplace,need-ack,need-csum}")
  # shellcheck disable=SC2206  # words on purpose
  flags+=(${NETLINK_MPIRUN_FLAGS:-})
  n="$(ranks)"
  [ "$n" -ge 2 ] || { echo "netlink.sh: run setup first" >&2; exit 2; }
  apps=(-np 1 "$@")
  for ((r = 1; r < n; ++r)); do apps+=(: -np 1 ip netns exec "$pfx$r" "$@"); done
  local nice="${NETLINK_NICE--10}" prefix=()
  # shellcheck disable=SC2016  # $0 and $@ belong to the inner bash
  [ -z "$nice" ] || prefix=(setsid -w bash -c 'echo "$0" > /proc/self/autogroup; exec "$@"' "$nice")
  PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include="${pfx}0r" \
    "${prefix[@]}" timeout -k 10 "${NETLINK_TIMEOUT:-3600}" \
    ip netns exec "${pfx}0" mpirun --allow-run-as-root --oversubscribe --bind-to none \
    --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include "$net.0/24" \
    --mca oob_tcp_if_include "${pfx}0r" "${flags[@]}" "${apps[@]}" < /dev/null
}

each() {
  local n r pids=() rc=0
  n="$(ranks)"
  [ "$n" -ge 2 ] || { echo "netlink.sh: run setup first" >&2; exit 2; }
  for ((r = 0; r < n; ++r)); do
    timeout -k 10 "${NETLINK_TIMEOUT:-3600}" ip netns exec "$pfx$r" env RANK="$r" WORLD_SIZE="$n" LOCAL_RANK=0 \
      LOCAL_WORLD_SIZE=1 MASTER_ADDR="$net.1" MASTER_PORT=29500 GLOO_SOCKET_IFNAME="$pfx${r}r" "$@" < /dev/null &
    pids+=($!)
  done
  for r in "${pids[@]}"; do wait "$r" || rc=$?; done
  return "$rc"
}

cmd="${1:-}"
[ $# -eq 0 ] || shift
case "$cmd" in
  setup) setup "${1:?N}" ;;
  shape) shape "${1:?RATE}" ;;
  run) run "$@" ;;
  each) each "$@" ;;
  teardown) teardown ;;
  *) sed -n '2,25p' "$0"; exit 2 ;;
esac
