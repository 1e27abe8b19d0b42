#!/usr/bin/env bash
# The test suite: formatting, lints, unit and simulator tests, then end-to-end tests in network
# namespaces with real TUN devices, TLS, ping and iperf3. CI runs exactly this (.ci/run).
set -euo pipefail
. "$(dirname "$0")/env.sh"
scripts/install-deps.sh --tests
echo "== cargo fmt --check"; cargo fmt --all -- --check
echo "== code layout";       python3 scripts/layout-check.py
# The e2e modules import each other; a broken import should fail here, not after the build.
echo "== e2e collection";    python3 -m pytest --collect-only -q tests/e2e >/dev/null
echo "== cargo clippy";      cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== unit, simulator and CLI tests"; cargo test --workspace --quiet
echo "== the vendored QUIC engine's tests (vendor/README.md)"; scripts/test-vendor.sh
echo "== fuzz targets, 6 s each (bench/fuzz.sh MINUTES for a real run)"; bench/fuzz.sh 0.1
echo "== build release";     cargo build --release --quiet
echo "== end-to-end tests (namespaces)"
target/release/mpquic-lab down --stale
exec python3 -m pytest -v -s tests/e2e "$@"
