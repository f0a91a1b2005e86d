#!/usr/bin/env bash
# Build the conformance driver of the Go library (drivers/go) against the library as
# ../shared/go-ref builds it, offline. Nothing else in envq needs Go.
#
#   scripts/build_go_driver.sh [OUT]      # default OUT: build/go-driver
#
# Exit 3 (and say so) when go-ref is not there: the Go audit is then skipped, not failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
goref=${GOREF:-$root/../shared/go-ref/go-ref.sh}
out=${1:-$root/build/go-driver}
case "$out" in /*) ;; *) out=$PWD/$out ;; esac  # go-ref builds from its own directory
if [ ! -x "$goref" ]; then
  echo "build_go_driver: $goref not found; the Go driver cannot be built here" >&2
  exit 3
fi
mkdir -p "$(dirname "$out")"
"$goref" --driver "$root/drivers/go" --out "$out" >&2
echo "$out"
