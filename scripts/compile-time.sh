#!/usr/bin/env bash
# Compile time of a unit that calls gradavg, against the same work written without it: CPU
# seconds (user + system) of one `-c` compile each, median of ROUNDS rounds run alternately (the
# units of one round one after the other, so a machine whose speed drifts moves them alike). Run
# it on a quiet machine.
#
#   scripts/compile-time.sh [ROUNDS]     (default 3; CXX, default g++, and CXXFLAGS, default -O2)
#
# Units (written to a temporary folder):
#   plain        the mean of VectorXf gradients over towers, as an Eigen loop
#   headers      #include <gradavg/gradavg.hpp> alone
#   gradavg      average_gradients_into over the same towers, default options
#   readme       examples/readme_main.cpp
#   torch_plain  a libtorch unit: forward and backward of K replicas (when libtorch is installed)
#   torch        the same, then gradavg::libtorch::average_module_gradients
# Each C++ unit is compiled without -march, with -march=native and (gradavg) with
# GRADAVG_NO_DISPATCH; the ratios are against plain (torch: against torch_plain) at the same flags.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
cxx="${CXX:-g++}"
cxxflags="${CXXFLAGS:--O2}"
root="$PWD"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

eigen_include=""
for dir in /usr/include/eigen3 /usr/local/include/eigen3; do
  if [[ -d "$dir" ]]; then eigen_include="-isystem $dir"; break; fi
done
torch_include=""
for dir in /usr/include/torch/csrc/api/include /usr/local/include/torch/csrc/api/include; do
  if [[ -d "$dir" ]]; then torch_include="-isystem $dir"; break; fi
done

cat >"$work/plain.cpp" <<'EOF'
#include <Eigen/Core>
#include <string>
#include <utility>
#include <vector>
using towers_t = std::vector<std::vector<std::pair<Eigen::VectorXf, std::string>>>;
void step(const towers_t& towers, std::vector<Eigen::VectorXf>& means) {
  for (std::size_t v = 0; v < means.size(); ++v) {
    means[v] = towers[0][v].first;
    for (std::size_t t = 1; t < towers.size(); ++t) means[v] += towers[t][v].first;
    means[v] /= float(towers.size());
  }
}
EOF
cat >"$work/headers.cpp" <<'EOF'
#include <gradavg/gradavg.hpp>
EOF
cat >"$work/gradavg.cpp" <<'EOF'
#include <gradavg/gradavg.hpp>
#include <string>
#include <utility>
#include <vector>
using towers_t = std::vector<std::vector<std::pair<Eigen::VectorXf, std::string>>>;
void step(const towers_t& towers, std::vector<Eigen::VectorXf>& means) {
  gradavg::average_gradients_into(towers, means);
}
EOF
cp examples/readme_main.cpp "$work/readme.cpp"
cat >"$work/torch_plain.cpp" <<'EOF'
#include <torch/torch.h>
struct Net : torch::nn::Module {
  Net() : fc1(register_module("fc1", torch::nn::Linear(8, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
void step(std::vector<std::shared_ptr<Net>>& replicas, const std::vector<torch::Tensor>& xs,
          const std::vector<torch::Tensor>& ys) {
  for (std::size_t k = 0; k < replicas.size(); ++k) {
    replicas[k]->zero_grad();
    torch::mse_loss(replicas[k]->forward(xs[k]), ys[k]).backward();
  }
#ifdef WITH_GRADAVG
  std::vector<torch::nn::Module*> modules;
  for (auto& r : replicas) modules.push_back(r.get());
  gradavg::libtorch::average_module_gradients(modules);
#endif
}
EOF
{ echo '#include <gradavg/torch.hpp>'; echo '#define WITH_GRADAVG 1'; cat "$work/torch_plain.cpp"; } >"$work/torch.cpp"

# compile <name> <source> <flags...>: appends "<name> <seconds>" to $work/times.
compile() {
  local name="$1" source="$2"
  shift 2
  local out
  # shellcheck disable=SC2086 # the include options are word lists
  out=$( { /usr/bin/time -f '%U %S' "$cxx" -std=c++20 $cxxflags -I"$root/include" $eigen_include "$@" \
           -c "$work/$source" -o /dev/null; } 2>&1 >/dev/null | tail -n 1)
  awk -v n="$name" '{ printf "%s %.2f\n", n, $1 + $2 }' <<<"$out" >>"$work/times"
}

: >"$work/times"
for ((r = 1; r <= rounds; ++r)); do
  echo "round $r of $rounds" >&2
  for march in "" "-march=native"; do
    tag="${march:-no-march}"
    compile "plain/$tag" plain.cpp $march
    compile "headers/$tag" headers.cpp $march
    compile "gradavg/$tag" gradavg.cpp $march
    compile "readme/$tag" readme.cpp $march
  done
  compile "gradavg/no-dispatch" gradavg.cpp -DGRADAVG_NO_DISPATCH
  if [[ -n "$torch_include" ]]; then
    # shellcheck disable=SC2086
    compile "torch_plain/no-march" torch_plain.cpp -D_GLIBCXX_USE_CXX11_ABI=1 $torch_include
    # shellcheck disable=SC2086
    compile "torch/no-march" torch.cpp -D_GLIBCXX_USE_CXX11_ABI=1 $torch_include
  fi
done

# Medians, and each unit's ratio to its reference at the same flags.
python3 - "$work/times" <<'EOF'
import statistics, sys
times = {}
for line in open(sys.argv[1]):
    name, seconds = line.split()
    times.setdefault(name, []).append(float(seconds))
median = {name: statistics.median(v) for name, v in times.items()}
print(f"{'unit/flags':<24} {'median s':>9} {'range s':>13} {'ratio':>7}")
for name, m in median.items():
    unit, flags = name.split("/")
    if unit in ("plain", "torch_plain"):
        reference = None
    elif unit == "torch":
        reference = "torch_plain/" + flags
    else:
        reference = "plain/" + ("no-march" if flags == "no-dispatch" else flags)
    ratio = f"{m / median[reference]:.1f}x" if reference in median else ""
    spread = f"{min(times[name]):.1f}-{max(times[name]):.1f}"
    print(f"{name:<24} {m:>9.2f} {spread:>13} {ratio:>7}")
EOF
