#!/usr/bin/env bash
# The whole test suite against Eigen 5 instead of the system's Eigen 3.4: the warnings-as-errors
# build of scripts/test.sh (tests, examples and benchmarks, -march=native), then ctest.
#
#   EIGEN5_PREFIX=<prefix holding share/eigen3/cmake> bash scripts/check-eigen5.sh
#   EIGEN5_SOURCE=<Eigen git repository, bare or not> [EIGEN5_REF=5.0.1] bash scripts/check-eigen5.sh
#
# With EIGEN5_SOURCE, Eigen at EIGEN5_REF is installed (headers and CMake package; nothing to
# compile) into $root/eigen5-prefix first. Without either it says why it skips and exits 0.
# Build trees go under ${GRADAVG_BUILD_ROOT:-build}; JOBS (default: nproc) builds and tests in parallel;
# EIGEN5_CMAKE_ARGS adds configure arguments (split at spaces).
set -euo pipefail
cd "$(dirname "$0")/.."
root="${GRADAVG_BUILD_ROOT:-build}"
jobs="${JOBS:-$(nproc)}"

say() { printf '[check-eigen5 %(%H:%M:%S)T] %s\n' -1 "$*"; }
if [[ -z ${EIGEN5_PREFIX:-} && -z ${EIGEN5_SOURCE:-} ]]; then
  echo "check-eigen5: skipped (set EIGEN5_PREFIX to an installed Eigen 5, or EIGEN5_SOURCE to an Eigen git repository)"
  exit 0
fi

if [[ -z ${EIGEN5_PREFIX:-} ]]; then
  ref=${EIGEN5_REF:-5.0.1}
  src="$root/eigen5-source"
  EIGEN5_PREFIX="$(realpath -m "$root/eigen5-prefix")"
  say "== Eigen $ref from $EIGEN5_SOURCE into $EIGEN5_PREFIX"
  rm -rf "$src" "$root/eigen5-build" "$EIGEN5_PREFIX"
  mkdir -p "$src"
  git -C "$EIGEN5_SOURCE" archive "$ref" | tar -x -C "$src"
  cmake -S "$src" -B "$root/eigen5-build" -DCMAKE_INSTALL_PREFIX="$EIGEN5_PREFIX" \
    -DBUILD_TESTING=OFF -DEIGEN_BUILD_TESTING=OFF -DEIGEN_BUILD_BLAS=OFF -DEIGEN_BUILD_LAPACK=OFF \
    -DEIGEN_BUILD_DOC=OFF -DEIGEN_BUILD_DEMOS=OFF -DEIGEN_BUILD_PKGCONFIG=ON -DEIGEN_BUILD_CMAKE_PACKAGE=ON >/dev/null
  cmake --install "$root/eigen5-build" >/dev/null
fi
eigen_dir="$EIGEN5_PREFIX/share/eigen3/cmake"
[[ -f $eigen_dir/Eigen3Config.cmake ]] || { echo "check-eigen5: no Eigen3Config.cmake in $eigen_dir" >&2; exit 1; }
eigen_version=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$eigen_dir/Eigen3ConfigVersion.cmake")
case $eigen_version in
  5.*) say "Eigen $eigen_version at $EIGEN5_PREFIX" ;;
  *) echo "check-eigen5: $EIGEN5_PREFIX holds Eigen $eigen_version, not 5" >&2; exit 1 ;;
esac

say "== warnings-as-errors build against Eigen $eigen_version"
cmake -S . -B "$root/eigen5" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2" \
  -DGRADAVG_WERROR=ON -DEigen3_DIR="$eigen_dir" ${EIGEN5_CMAKE_ARGS:-}
# The build must not have found another Eigen.
grep -q "^Eigen3_DIR:.*=$eigen_dir\$" "$root/eigen5/CMakeCache.txt" ||
  { echo "check-eigen5: the build did not take Eigen from $eigen_dir" >&2; exit 1; }
cmake --build "$root/eigen5" -j "$jobs"
ctest --test-dir "$root/eigen5" --output-on-failure -j "$jobs"
say "PASS: the test suite against Eigen $eigen_version"
