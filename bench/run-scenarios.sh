#!/usr/bin/env bash
# Runs the scenario catalogue (bench/scenarios/) with mpquic-lab and keeps each run's report.md,
# results.json and plots in bench/results/scenarios/NAME/ (logs, keys and sockets are dropped).
#   sudo bench/run-scenarios.sh                 # every scenario except 00 (the demo) and 07 (one hour)
#   sudo bench/run-scenarios.sh 03-failover 07-stability
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cargo build --release --quiet
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in bench/scenarios/*.yaml; do
    n=$(basename "$f" .yaml)
    [ "$n" = 07-stability ] || [ "$n" = 00-demo ] || names+=("$n")
  done
fi
for n in "${names[@]}"; do
  out=bench/results/scenarios/$n
  tmp=$(mktemp -d)
  echo "=== $n"
  target/release/mpquic-lab run "bench/scenarios/$n.yaml" --out "$tmp"
  rm -rf "$out" && mkdir -p "$out"
  cp "$tmp/report.md" "$tmp/results.json" "$out/"
  for d in "$tmp"/*/; do
    s=$(basename "$d")
    if compgen -G "$d*.png" >/dev/null; then mkdir -p "$out/$s" && cp "$d"*.png "$out/$s/"; fi
  done
  rm -rf "$tmp"
done
