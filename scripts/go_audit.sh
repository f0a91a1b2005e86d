#!/usr/bin/env bash
# Audit the Go library (rate-envelope-queue) through drivers/go with envq conform.
#
#   scripts/go_audit.sh            # build the driver, audit, rewrite docs/conformance.md
#   scripts/go_audit.sh --check    # the same audit; exit 1 if its findings differ from
#                                  # the classified ones in drivers/go/divergences.json (CI)
#
# Needs ../shared/go-ref (an offline Go toolchain and the library's sources); without it
# the script says so and exits 3. PYTHON picks the interpreter that has envq[conform].
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
driver=$("$root/scripts/build_go_driver.sh" "$root/build/go-driver") || exit $?
# The audit's size: 40 examples of 30 steps per round, about 5 minutes on 2 cores.
audit=(--audit --examples 40 --steps 30 --derandomize --time-scale 0.05
  --classify drivers/go/divergences.json --save build/go-conform)
if [ "${1:-}" = "--check" ]; then
  exec "$py" -m envq conform "${audit[@]}" --expect drivers/go/divergences.json -- "$driver"
fi
status=0
"$py" -m envq conform "${audit[@]}" --report md --out docs/conformance.md -- "$driver" || status=$?
# FAIL (1) is the expected verdict for a port with divergences; 2 is a broken run.
[ "$status" -le 1 ] || exit "$status"
echo "docs/conformance.md written" >&2
