#!/bin/sh
# launch_ranks.sh <ranks> <file|tcp> <program> [argument...]: runs <ranks> copies of <program> the
# torchrun way, as the c10d tests need: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, and either
# GRADAVG_TEST_STORE (a FileStore's path in a fresh folder) or MASTER_ADDR=127.0.0.1 and a free
# MASTER_PORT (from 20000 to 31999). Each copy is ended after GRADAVG_TEST_RANK_TIMEOUT seconds (default 240): a rank
# that hangs fails the run. Every rank's output is printed, rank by rank; the status is the
# copies' own when they all end with the same (0, or 77: ctest's skip), else 1.
set -u
ranks=$1
store=$2
shift 2
folder=$(mktemp -d)
trap 'rm -rf "$folder"' EXIT
export WORLD_SIZE="$ranks" LOCAL_WORLD_SIZE="$ranks"
if [ "$store" = file ]; then
  export GRADAVG_TEST_STORE="$folder/store"
else
  export MASTER_ADDR=127.0.0.1
  # A free port below Linux's ephemeral range (32768 and up), where the listening sockets of other
  # gloo groups on this host (ephemeral ports) cannot take it before rank 0's store binds it.
  MASTER_PORT=$(python3 -c '
import random, socket
while True:
    port = random.randrange(20000, 32000)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        print(port)
        break
    except OSError:
        pass
    finally:
        s.close()
')
  export MASTER_PORT
fi
pids=""
r=0
while [ "$r" -lt "$ranks" ]; do
  RANK=$r LOCAL_RANK=$r timeout -k 5 "${GRADAVG_TEST_RANK_TIMEOUT:-240}" "$@" >"$folder/out.$r" 2>&1 &
  pids="$pids $!"
  r=$((r + 1))
done
status=""
r=0
for pid in $pids; do
  wait "$pid"
  code=$?
  [ "$code" -ne 0 ] && echo "rank $r ended with $code"
  if [ -z "$status" ]; then status=$code; elif [ "$status" -ne "$code" ]; then status=1; fi
  r=$((r + 1))
done
[ "$status" -eq 77 ] || [ "$status" -eq 0 ] || status=1
r=0
while [ "$r" -lt "$ranks" ]; do
  echo "---- rank $r"
  cat "$folder/out.$r"
  r=$((r + 1))
done
exit $status
