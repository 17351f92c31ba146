#!/bin/sh
# Runs a program with GRADAVG_TIMELINE set to a file per rank under DIR, then checks the files
# with scripts/plot-timeline.py (valid trace JSON, nested events, every rank's phases), merges
# them and draws the last call:
#   check_timeline.sh DIR RANKS COMMAND...
set -eu
dir=$1
ranks=$2
shift 2
rm -rf "$dir"
mkdir -p "$dir"
GRADAVG_TIMELINE="$dir/trace.%r.json" "$@"
files=""
r=0
while [ "$r" -lt "$ranks" ]; do
  files="$files $dir/trace.$r.json"
  r=$((r + 1))
done
# Debian's python3 (python3-matplotlib is its module), not another one first on PATH.
py=/usr/bin/python3
[ -x "$py" ] || py=python3
# shellcheck disable=SC2086  # the file list splits on purpose
"$py" "$(dirname "$0")/../../scripts/plot-timeline.py" --check --ranks "$ranks" --merge "$dir/merged.json" \
  --png "$dir/step.png" $files
test -s "$dir/step.png"
