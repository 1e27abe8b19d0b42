#!/usr/bin/env bash
# The unit tests of the dependencies carried in vendor/ with a change of ours (vendor/README.md):
# the change's own, and the crate's, which it must not break. Built apart from the workspace
# (their dev-dependencies are not ours).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
CARGO_TARGET_DIR=target/vendor cargo test --quiet --manifest-path vendor/quinn-proto/Cargo.toml --lib "$@"
