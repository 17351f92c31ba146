#!/usr/bin/env bash
# Proves ports/gradavg with a real vcpkg:
#   1. installs the port as an overlay port (classic mode, a fresh install root, no binary cache),
#      its source this checkout's HEAD commit (commit first: uncommitted edits are not in it), by
#      default through the portfile's local override (GRADAVG_SOURCE_GIT=file://<checkout>,
#      GRADAVG_SOURCE_REF=<full SHA of HEAD>); with GRADAVG_PORT_SOURCE=github through the
#      released form, vcpkg_from_github, instead: the tarball GitHub would serve for HEAD is made
#      with git archive into $VCPKG_ROOT/downloads, and a copy of the port names HEAD and its SHA512;
#   2. configures, builds and runs tests/package/consumer with vcpkg's toolchain file, checking that
#      gradavg and Eigen both come from vcpkg's install tree, with the kernel compiled once in its
#      own unit (GRADAVG_EXTERN_KERNELS, the installed <gradavg/kernels.hpp>), then by linking
#      gradavg::kernels;
#   3. compiles and runs the same program with the flags of vcpkg's gradavg.pc and eigen3.pc only.
#
#   bash scripts/check-vcpkg-port.sh [VCPKG_ROOT]      (or VCPKG_ROOT in the environment)
#
# Without a vcpkg root it says why it skips and exits 0. Offline, vcpkg must find every download
# (eigen3's source tarball) in $VCPKG_ROOT/downloads; X_VCPKG_ASSET_SOURCES=x-block-origin makes a
# missing one fail at once instead of reaching for the network. Build tools (cmake, ninja, a C++20
# compiler, git, pkg-config) come from PATH (VCPKG_FORCE_SYSTEM_BINARIES=1 unless set); so must
# patchelf offline (Debian: patchelf), which vcpkg runs over a Linux port's files (here: usage),
# else downloads: the script installs it with apt-get when it is missing and apt-get is there.
# Knobs: GRADAVG_PORT_SOURCE (local or github, above), TRIPLET (default from the machine), WORK
# (scratch folder, default a new one under /tmp). Into $VCPKG_ROOT, vcpkg and this script write
# only the port's source archive, under downloads/.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$PWD

root=${1:-${VCPKG_ROOT:-}}
if [[ -z $root ]]; then
  echo "check-vcpkg-port: skipped (set VCPKG_ROOT or pass a vcpkg root to check ports/gradavg with vcpkg)"
  exit 0
fi
root=$(realpath "$root")
vcpkg=$root/vcpkg
[[ -x $vcpkg ]] || { echo "check-vcpkg-port: $vcpkg is not an executable vcpkg" >&2; exit 1; }

say() { printf '[check-vcpkg-port %(%H:%M:%S)T] %s\n' -1 "$*"; }
t0=$SECONDS

# The port's version is the library's (include/gradavg/version.hpp).
version=$(sed -n 's/^#define GRADAVG_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' include/gradavg/version.hpp |
          paste -sd.)
port_version=$(sed -n 's/^ *"version": *"\([^"]*\)".*/\1/p' ports/gradavg/vcpkg.json)
if [[ $port_version != "$version" ]]; then
  echo "check-vcpkg-port: ports/gradavg/vcpkg.json says $port_version, version.hpp says $version" >&2
  exit 1
fi

ref=$(git rev-parse HEAD)
if [[ -n $(git status --porcelain --untracked-files=no) ]]; then
  say "note: uncommitted changes are not part of the port's source (commit $ref)"
fi
case $(uname -m) in
  x86_64) triplet=${TRIPLET:-x64-linux} ;;
  aarch64 | arm64) triplet=${TRIPLET:-arm64-linux} ;;
  *) triplet=${TRIPLET:?set TRIPLET for this machine} ;;
esac
# vcpkg runs patchelf over the port's files; offline it cannot download its own.
if [[ $(uname -s) == Linux ]] && ! command -v patchelf >/dev/null && command -v apt-get >/dev/null; then
  bash scripts/install-deps.sh patchelf
fi
work=${WORK:-$(mktemp -d /tmp/gradavg-vcpkg.XXXXXX)}
mkdir -p "$work"
installed=$work/installed
tree=$installed/$triplet

export VCPKG_ROOT=$root VCPKG_DISABLE_METRICS=1
export VCPKG_FORCE_SYSTEM_BINARIES=${VCPKG_FORCE_SYSTEM_BINARIES:-1}
say "vcpkg $("$vcpkg" version | head -1 | sed 's/.*version //'), root $root"
ports=$checkout/ports
case ${GRADAVG_PORT_SOURCE:-local} in
  local)
    export GRADAVG_SOURCE_GIT=file://$checkout GRADAVG_SOURCE_REF=$ref
    say "gradavg $version from $GRADAVG_SOURCE_GIT at $ref; triplet $triplet; scratch $work" ;;
  github)
    unset GRADAVG_SOURCE_GIT GRADAVG_SOURCE_REF
    repo=$(sed -n 's/^ *REPO \([^ ]*\)$/\1/p' ports/gradavg/portfile.cmake)
    # GitHub's archive of a commit: git archive with the top folder <name>-<SHA>, gzip -n.
    archive=$root/downloads/${repo//\//-}-$ref.tar.gz
    mkdir -p "$root/downloads"
    git archive --format=tar --prefix="${repo#*/}-$ref/" "$ref" | gzip -cn >"$archive"
    sha512=$(sha512sum "$archive" | cut -d' ' -f1)
    ports=$work/ports
    mkdir -p "$ports"
    cp -r ports/gradavg "$ports/"
    sed -i "s/^\( *REF \)\"v\${VERSION}\"$/\1$ref/; s/^\( *SHA512 \)0$/\1$sha512/" "$ports/gradavg/portfile.cmake"
    grep -q "REF $ref" "$ports/gradavg/portfile.cmake" && grep -q "SHA512 $sha512" "$ports/gradavg/portfile.cmake" ||
      { echo "check-vcpkg-port: could not point the port's vcpkg_from_github at $ref" >&2; exit 1; }
    say "gradavg $version through vcpkg_from_github(REPO $repo REF $ref), archive $archive; triplet $triplet; scratch $work" ;;
  *) echo "check-vcpkg-port: GRADAVG_PORT_SOURCE is local or github, not $GRADAVG_PORT_SOURCE" >&2; exit 1 ;;
esac

say "== vcpkg install gradavg (overlay port $ports)"
t=$SECONDS
# --classic: a vcpkg.json in the working folder or above would otherwise switch to manifest mode.
"$vcpkg" install --classic gradavg --overlay-ports="$ports" \
  --triplet="$triplet" --host-triplet="$triplet" --binarysource=clear \
  --x-install-root="$installed" --x-buildtrees-root="$work/buildtrees" --x-packages-root="$work/packages"
say "   installed in $((SECONDS - t)) s"
"$vcpkg" list --classic --x-install-root="$installed" --triplet="$triplet"
eigen_version=$("$vcpkg" list --classic --x-install-root="$installed" --triplet="$triplet" |
                awk -F'[ :]+' '$1 == "eigen3" {print $3; exit}')
say "gradavg's files in the install tree:"
(cd "$tree" && find share/gradavg share/pkgconfig/gradavg.pc -type f | sort && find include/gradavg -type f | wc -l |
   sed 's/$/ headers under include\/gradavg/')

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# The kernel compiled once: in a unit of the consumer's own, then by linking gradavg::kernels.
for kernels in EXTERN_KERNELS KERNELS_TARGET; do
  say "== consumer (tests/package/consumer) with vcpkg's toolchain file, GRADAVG_CONSUMER_$kernels"
  t=$SECONDS
  cmake -S tests/package/consumer -B "$work/consumer_$kernels" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$root/scripts/buildsystems/vcpkg.cmake" -DVCPKG_TARGET_TRIPLET="$triplet" \
    -DVCPKG_INSTALLED_DIR="$installed" -DVCPKG_MANIFEST_MODE=OFF \
    -DGRADAVG_CONSUMER_MODE=find_package -DGRADAVG_EXPECTED_VERSION="$version" \
    -DGRADAVG_EXPECTED_PREFIX="$tree" -DGRADAVG_EXPECTED_EIGEN_PREFIX="$tree" "-DGRADAVG_CONSUMER_$kernels=ON"
  cmake --build "$work/consumer_$kernels" -j "${JOBS:-2}"
  "$work/consumer_$kernels/gradavg_consumer"
  say "   consumer configured, built and ran in $((SECONDS - t)) s"
done

say "== consumer through vcpkg's pkg-config files only"
t=$SECONDS
# PKG_CONFIG_LIBDIR replaces the system's search path: eigen3.pc must be vcpkg's too.
PKG_CONFIG_LIBDIR=$tree/share/pkgconfig:$tree/lib/pkgconfig \
  cmake -DPKG_CONFIG="$(command -v pkg-config)" -DCXX="${CXX:-c++}" -DSOURCE="$checkout/tests/package/consumer/main.cpp" \
    -DBINARY="$work/pkg_config_consumer" -DEXPECTED_VERSION="$version" -DEXPECTED_EIGEN_VERSION="$eigen_version" \
    -P tests/package/pkg_config_consumer.cmake
say "   pkg-config consumer built and ran in $((SECONDS - t)) s"

say "PASS: vcpkg installed gradavg $version (commit $ref, ${GRADAVG_PORT_SOURCE:-local} source) with eigen3 $eigen_version; the consumer built" \
    "and ran through find_package and through pkg-config, in $((SECONDS - t0)) s"
