#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer, AddressSanitizer with leak checks) of every
# target in fuzz/: MINUTES each (default 10; decimals work: CI runs 0.1). Each target starts
# from its corpus in fuzz/corpus/<target>/ (kept between runs, not in git) plus the seeds the
# product's own encoders and examples give (`mpquic_core::harness::seeds`,
# `mpquic::harness::seeds`). A crash, leak or hang (an input over 10 s) stops the run with the input under fuzz/artifacts/<target>/: fix it, then keep
# the input in fuzz/regressions/<target>/ so the normal test suite replays it.
#
#   sudo bench/fuzz.sh [MINUTES [TARGET...]]   # per target: runs, coverage, corpus, verdict
set -euo pipefail
. "$(dirname "$0")/../scripts/env.sh"
minutes=${1:-10}
shift || true
secs=$(awk -v m="$minutes" 'BEGIN { s = int(m * 60); print (s < 1 ? 1 : s) }')
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked --quiet
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
seeds=$(mktemp -d)
trap 'rm -rf "$seeds"' EXIT
for crate in mpquic-core mpquic; do
  FUZZ_SEEDS_DIR="$seeds" cargo test --quiet -p $crate --test fuzz_regressions seeds_run_clean >/dev/null
done
cargo +nightly fuzz build --fuzz-dir fuzz 2>&1 | grep -v '^\s*Compiling' || true
status=0
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list --fuzz-dir fuzz)
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  cp "$seeds/$t"/* "fuzz/corpus/$t/" 2>/dev/null || true
  log="fuzz/target/$t.log"
  if cargo +nightly fuzz run --fuzz-dir fuzz "$t" "fuzz/corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    verdict=ok
  else
    verdict="FAILED (input under fuzz/artifacts/$t/, log $log)"
    status=1
  fi
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo '?')
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 || true)
  echo "$t: ${secs}s, $runs runs, ${cov:-cov: ?}, corpus $(ls "fuzz/corpus/$t" | wc -l) inputs: $verdict"
  [ "$verdict" = ok ] || tail -30 "$log"
done
exit $status
