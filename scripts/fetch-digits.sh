#!/usr/bin/env bash
# Gets scikit-learn's handwritten digits (1,797 8x8 images, digits.csv: 64 pixel values 0..16
# and the label a line) out of Debian's python3-sklearn package, without installing it, and writes
# them to <dir>/digits.csv (default build/data). Prints the file's path. Nothing else is
# downloaded; the data is never committed. Exit 77 when the package cannot be downloaded.
set -euo pipefail
dir="${1:-build/data}"
mkdir -p "$dir"
if [[ -s "$dir/digits.csv" ]]; then
  echo "$dir/digits.csv"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && apt-get download python3-sklearn >/dev/null 2>&1); then
  echo "fetch-digits: cannot download python3-sklearn (apt-get download); no digits" >&2
  exit 77
fi
dpkg -x "$work"/python3-sklearn_*.deb "$work/package"
gunzip -c "$work/package/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz" > "$dir/digits.csv.part"
mv "$dir/digits.csv.part" "$dir/digits.csv"
echo "$dir/digits.csv"
