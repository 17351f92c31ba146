#!/usr/bin/env bash
# The files a call of average_gradients_into passes through on its way to the kernel: a small
# unit (2 towers of one 64-float std::vector, default options) built with -O0 -g, stopped in
# gdb where the kernel's steps begin (group_pass::run_steps); its call stack printed from the caller down,
# then the count of file changes and of files entered again after being left.
#
#   scripts/call-path.sh        (needs g++, gdb and Eigen's headers)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v gdb >/dev/null; then
  echo "call-path.sh: skipped: needs gdb (apt-get install gdb)"
  exit 0
fi
root="$PWD"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cat >"$work/call.cpp" <<'CPP'
#include <gradavg/gradavg.hpp>
#include <utility>
#include <vector>
int main() {
  std::vector<std::vector<std::pair<std::vector<float>, int>>> towers(2);
  for (int k = 0; k < 2; ++k) towers[k].push_back({std::vector<float>(64, float(k)), 0});
  std::vector<std::vector<float>> means(1, std::vector<float>(64));
  gradavg::average_gradients_into(towers, means);
  return means[0][0] == 0.5f ? 0 : 1;
}
CPP
"${CXX:-g++}" -std=c++20 -O0 -g -isystem /usr/include/eigen3 -I"$root/include" "$work/call.cpp" -o "$work/call"
line="$(grep -n 'const bool prefetching = software_prefetch && prefetch;' include/gradavg/detail/kernel_level.hpp | head -1 | cut -d: -f1)"
gdb -batch -ex "break kernel_level.hpp:$line" -ex run -ex bt "$work/call" 2>/dev/null |
  sed -nE 's/^#[0-9]+ .* at (.*):([0-9]+)$/\1:\2/p' | sed "s|^$root/include/||" | tac >"$work/stack"
cat "$work/stack"
cut -d: -f1 "$work/stack" | grep -v 'call\.cpp$' | awk '
  $0 != previous { if (previous != "") changes++; if (seen[$0]) reentered++; seen[$0] = 1; previous = $0 }
  END { printf "%d file changes from average.hpp to the kernel, %d files entered again\n", changes, reentered }'
