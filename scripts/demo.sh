#!/usr/bin/env bash
# The demo: builds mpquic and runs a self-contained two-WAN lab with a failover mid-transfer.
set -euo pipefail
. "$(dirname "$0")/env.sh"
scripts/install-deps.sh
cargo build --release --quiet
exec python3 -m lab.demo "$@"
