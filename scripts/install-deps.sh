#!/usr/bin/env bash
# Installs what the demo and the tests need on a fresh Debian 12 machine (as root).
set -euo pipefail
missing=()
# wireguard-go + wg: the reference VPN of the scenario runner and bench/throughput.py;
# fonts-dejavu-core: the text of mpquic-lab's PNG plots; mptcpize: the lab's kernel-MPTCP
# reference row (iperf3 on MPTCP sockets).
for pair in iperf3:iperf3 nft:nftables ping:iputils-ping ip:iproute2 tc:iproute2 ss:iproute2 sysctl:procps ethtool:ethtool \
            wireguard-go:wireguard-go wg:wireguard-tools mptcpize:mptcpize; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
done
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
# --tests (or --browser, its old name): what only the tests use. Debian's chromium and
# chromedriver drive the dashboard's page; installed with their recommended packages (fonts,
# GL), the set the dashboard test was run with. debootstrap and systemd-nspawn boot a Debian
# container with systemd as PID 1 (this machine has none) for the package's systemctl test.
browser=false
case "${1:-}" in --tests|--browser) browser=true ;; esac
if $browser; then
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  command -v systemd-nspawn >/dev/null 2>&1 || missing+=(systemd-container)
  # The NAT-rebinding tests: conntrack flushes a NAT's mappings, tcpdump captures a genuine
  # packet to forge from.
  command -v conntrack >/dev/null 2>&1 || missing+=(conntrack)
  command -v tcpdump >/dev/null 2>&1 || missing+=(tcpdump)
fi
if $browser && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  echo "installing: chromium chromium-driver"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium chromium-driver >/dev/null
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi
python3 -c 'import pytest' 2>/dev/null || python3 -m pip install -q pytest
if $browser; then
  python3 -c 'import selenium' 2>/dev/null || python3 -m pip install -q selenium
fi
