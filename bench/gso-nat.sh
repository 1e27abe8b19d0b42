#!/bin/bash
# A kernel behaviour the lab must not stumble on: a NAT on the *sending* host that changes a UDP
# source port, with UDP GSO, over an interface whose checksum offload is off. Every segment of
# a GSO batch then arrives with a wrong UDP checksum (the receiver counts UdpInCsumErrors and
# drops it), while packets sent one by one pass. mpquic's QUIC sends bursts as GSO batches, so
# a client host that masquerades its own WAN traffic with port changes on such an interface
# loses every full-size burst. (mpquic-lab's `nat` translates inside the emulator instead, on
# whole packets, as a CGNAT does.)
#
#   sudo bench/gso-nat.sh            # the four cases, one line each
#
# Two namespaces joined by a veth pair (offloads off on the receiving end); the sender sends 20
# batches of 9 x 1400 bytes (GSO) or 20 single datagrams; the line says how many arrived and
# how many the receiver's kernel refused for their checksum.
set -euo pipefail

one() { # NAT(0|1) TX-CHECKSUM(on|off) GSO(0|1)
  local nat=$1 txcsum=$2 gso=$3 a=gsoA$$ b=gsoB$$
  ip netns add $a; ip netns add $b
  trap "ip netns del $a 2>/dev/null; ip netns del $b 2>/dev/null" RETURN
  ip link add va netns $a type veth peer name vb netns $b
  ip -n $a addr add 10.77.0.2/24 dev va; ip -n $b addr add 10.77.0.1/24 dev vb
  ip -n $a link set va up; ip -n $b link set vb up
  ip netns exec $a ethtool -K va tx "$txcsum" rx off tso off gso off gro off >/dev/null 2>&1
  ip netns exec $b ethtool -K vb tx off rx off tso off gso off gro off >/dev/null 2>&1
  if [ "$nat" = 1 ]; then
    ip netns exec $a nft -f - <<EOF
table ip t {
  chain post {
    type nat hook postrouting priority 100;
    oifname "va" udp dport 9999 masquerade to :20000-40000 random
  }
}
EOF
  fi
  ip netns exec $b nstat -n
  ip netns exec $b python3 -c '
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("10.77.0.1", 9999)); s.settimeout(1)
n = 0
try:
    while True:
        s.recv(65535); n += 1
except OSError:
    pass
print(n)' >/tmp/gso-nat.$$ &
  sleep 0.3
  ip netns exec $a python3 -c '
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("10.77.0.2", 5555))
gso = '"$gso"'
if gso:
    s.setsockopt(socket.SOL_UDP, 103, 1400)  # UDP_SEGMENT
for _ in range(20):
    time.sleep(0.01)
    s.sendto(b"x" * 1400 * (9 if gso else 1), ("10.77.0.1", 9999))'
  wait
  local bad
  bad=$(ip netns exec $b nstat -a 2>/dev/null | awk '$1=="UdpInCsumErrors"{print $2}')
  echo "nat=$nat tx-checksum=$txcsum gso=$gso: sent $((gso ? 180 : 20)), arrived $(cat /tmp/gso-nat.$$), bad checksum ${bad:-0}"
  rm -f /tmp/gso-nat.$$
}

one 0 off 1
one 1 off 1
one 1 on 1
one 1 off 0
