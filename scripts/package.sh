#!/usr/bin/env bash
# Builds the Debian packages into target/debian/:
#   mpquic_<version>-1_<arch>.deb      /usr/bin/mpquic, the mpquic@.service template, the man
#                                      page, examples and docs; /etc/mpquic/{instances,tls} (0700)
#   mpquic-lab_<version>-1_<arch>.deb  /usr/bin/mpquic-lab (optional: benchmarks and labs)
# Install: dpkg -i target/debian/mpquic_*.deb; then /etc/mpquic/instances/NAME.yaml and
# systemctl enable --now mpquic@NAME (docs/OPERATIONS.md).
set -euo pipefail
. "$(dirname "$0")/env.sh"
# cargo-deb from crates.io, pinned so a package builds the same way next month.
CARGO_DEB_VERSION=3.6.2
if ! cargo deb --version 2>/dev/null | grep -q "$CARGO_DEB_VERSION"; then
  cargo install --locked --quiet cargo-deb --version "$CARGO_DEB_VERSION"
fi
cargo build --release --quiet -p mpquic -p mpquic-lab
assets=target/deb-assets
mkdir -p "$assets"
# The unit in dist/ is for a binary installed by hand in /usr/local/bin; the package's is in /usr/bin.
sed 's#/usr/local/bin/mpquic#/usr/bin/mpquic#g' dist/mpquic@.service > "$assets/mpquic@.service"
rm -rf "$assets/man" && mkdir -p "$assets/man"
target/release/mpquic man "$assets/man"
gzip -9n "$assets/man"/*.1
cargo deb --no-build --quiet --strip -p mpquic
cargo deb --no-build --quiet --strip -p mpquic-lab
