#!/usr/bin/env bash
# The demo: builds mpquic and mpquic-lab, then runs bench/scenarios/00-demo.yaml: a self-contained
# two-WAN lab (namespaces, emulated links) with WAN 1 failing mid-transfer, first without a tunnel
# (direct, WAN 1 only) and then through mpquic. Prints the report; results, plots and logs stay in
# the output directory. Everything the lab made is removed afterwards, also on Ctrl-C.
#
#   sudo ./scripts/demo.sh [--out DIR]        (default /tmp/mpquic-demo)
set -euo pipefail
. "$(dirname "$0")/env.sh"
out=/tmp/mpquic-demo
if [ "${1:-}" = "--out" ] && [ -n "${2:-}" ]; then out=$2; fi
scripts/install-deps.sh
cargo build --release --quiet
target/release/mpquic-lab down --stale >/dev/null
rm -rf "$out"
target/release/mpquic-lab run bench/scenarios/00-demo.yaml --out "$out"
echo
# The report without its plot lines (they are PNG files next to it).
grep -v '^!\[' "$out/report.md" | cat -s
echo
echo "full report with plots: $out/report.md"
