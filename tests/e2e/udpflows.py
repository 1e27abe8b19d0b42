"""Paced UDP flows for measuring per-flow behaviour without iperf3.

    udpflows.py recv PORT SECONDS            -> prints {"src_port": bytes, ...} as JSON
    udpflows.py send HOST PORT FLOWS MBIT SECONDS [LEN]
    udpflows.py seqsend HOST PORT COUNT PPS  -> COUNT numbered packets at PPS
    udpflows.py seqrecv PORT SECONDS COUNT   -> prints {"received", "lost", "bursts": [run lengths]}
    udpflows.py stampsend HOST PORT SECONDS PPS LEN -> numbered packets stamped with their send time
    udpflows.py stamprecv PORT SECONDS       -> prints [[seq, sent_ns, received_ns], ...] (wall clock;
                                                the receive time is the kernel's stamp)
"""

import json
import socket
import sys
import time

SO_RCVBUFFORCE = 33


def big_rcvbuf(s, size):
    """A receive buffer that holds a stall of the receiver: SO_RCVBUF alone is capped by
    net.core.rmem_max (~212 KB, ~270 small datagrams), whose overflow would look like link loss.
    The tests run as root, which may exceed the cap."""
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
    except PermissionError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


def recv(port, seconds):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    big_rcvbuf(s, 8 << 20)
    s.bind(("0.0.0.0", port))
    s.settimeout(0.2)
    got = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data, (_, sport) = s.recvfrom(65536)
        except socket.timeout:
            continue
        got[sport] = got.get(sport, 0) + len(data)
    print(json.dumps(got))


def send(host, port, flows, mbit, seconds, length=1400):
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(flows)]
    payload = b"x" * length
    gap = length * 8 / (mbit * 1e6)
    start = time.monotonic()
    n = 0
    while True:
        due = start + n * gap
        now = time.monotonic()
        if now - start >= seconds:
            break
        if due > now:
            time.sleep(min(due - now, 0.001))
            continue
        for s in socks:
            s.sendto(payload, (host, port))
        n += 1


def seqsend(host, port, count, pps):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    start = time.monotonic()
    for n in range(count):
        due = start + n / pps
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        s.sendto(n.to_bytes(4, "big") + b"x" * 60, (host, port))


def seqrecv(port, seconds, count):
    """Which of COUNT numbered packets arrived; the lengths of the runs of missing ones (loss
    bursts), so a burst-loss model can be checked from outside."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    big_rcvbuf(s, 16 << 20)
    s.bind(("0.0.0.0", port))
    s.settimeout(0.2)
    got = bytearray(count)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data = s.recv(2048)
        except socket.timeout:
            continue
        n = int.from_bytes(data[:4], "big")
        if n < count:
            got[n] = 1
    bursts, run = [], 0
    for x in got:
        if x:
            if run:
                bursts.append(run)
            run = 0
        else:
            run += 1
    if run:
        bursts.append(run)
    print(json.dumps({"received": sum(got), "lost": count - sum(got), "bursts": bursts}))


def stampsend(host, port, seconds, pps, length):
    """Numbered packets, each with its wall-clock send time (ns), LEN bytes of UDP payload, PPS
    a second (a few per wake-up at high rates: the sender sleeps about 1 ms at a time)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = b"x" * max(0, length - 16)
    start = time.monotonic()
    n = 0
    while True:
        now = time.monotonic()
        if now - start >= seconds:
            break
        due = start + n / pps
        if due > now:
            time.sleep(min(due - now, 0.001))
            continue
        s.sendto(n.to_bytes(8, "big") + time.time_ns().to_bytes(8, "big") + pad, (host, port))
        n += 1


SO_TIMESTAMPNS = 35


def stamprecv(port, seconds):
    """What `stampsend` sent that arrived, with the kernel's receive stamp of each."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    big_rcvbuf(s, 16 << 20)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.bind(("0.0.0.0", port))
    s.settimeout(0.2)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data, anc, _, _ = s.recvmsg(65536, 64)
        except socket.timeout:
            continue
        stamp = time.time_ns()
        for level, kind, value in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = int.from_bytes(value[:8], "little"), int.from_bytes(value[8:16], "little")
                stamp = sec * 1_000_000_000 + nsec
        out.append([int.from_bytes(data[:8], "big"), int.from_bytes(data[8:16], "big"), stamp])
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "seqsend":
        a = sys.argv[2:]
        seqsend(a[0], int(a[1]), int(a[2]), float(a[3]))
    elif sys.argv[1] == "seqrecv":
        seqrecv(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "stampsend":
        a = sys.argv[2:]
        stampsend(a[0], int(a[1]), float(a[2]), float(a[3]), int(a[4]))
    elif sys.argv[1] == "stamprecv":
        stamprecv(int(sys.argv[2]), float(sys.argv[3]))
    elif sys.argv[1] == "recv":
        recv(int(sys.argv[2]), float(sys.argv[3]))
    else:
        a = sys.argv[2:]
        send(a[0], int(a[1]), int(a[2]), float(a[3]), float(a[4]), int(a[5]) if len(a) > 5 else 1400)
