#!/usr/bin/env python3
"""How long an inner TCP flow's packets take between the two ends of the tunnel (or of the link,
for `direct`), one way, measured on the wire during a lab run.

Runs `mpquic-lab run SCENARIO` (a scenario with one system and an iperf3 flow on port 5201),
waits for its namespaces, and after `--after` seconds captures the flow for `--secs` seconds
with tcpdump in the client's and the server's namespace: for mpquic on the TUN devices (the
inner packets as they enter and leave the tunnel), for direct on the WAN interfaces. Both
namespaces share this host's clock, so a data segment's capture times on the two sides give
its one-way delay through the tunnel and the link; the inner flow's pure ACKs give the other
direction. Compare with the path's own one-way delay (a `direct` run of the same scenario):
what is above it waited inside the tunnel.

  sudo python3 bench/inner-delay.py bench/scenarios/26j-inner-delay.yaml --system mpquic
  sudo python3 bench/inner-delay.py bench/scenarios/26j-inner-delay.yaml --system direct
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(
    r"(\d+\.\d+) \S+\s+(In|Out)\s+ifindex (\d+) .*?: \S+ > \S+: Flags \[[^\]]*\](.*)")


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    find = lambda tail: next((n for n in names if n.startswith("mql-") and n.endswith(tail)), None)
    return find("-cli"), find("-srv")


def ifindex(ns, name):
    out = subprocess.run(["ip", "netns", "exec", ns, "ip", "-o", "link", "show", name],
                         capture_output=True, text=True).stdout
    m = re.match(r"(\d+):", out)
    if not m:
        sys.exit(f"no interface {name} in {ns}")
    return int(m.group(1))


def read(pcap):
    out = subprocess.run(["tcpdump", "-r", pcap, "-tt", "-n", "-e", "-S"],
                         capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        rest = m.group(4)
        seq = re.search(r"seq (\d+):", rest)
        ack = re.search(r"ack (\d+)", rest)
        length = re.search(r"length (\d+)", rest)
        rows.append((float(m.group(1)), m.group(2), int(m.group(3)),
                     int(seq.group(1)) if seq else None, int(ack.group(1)) if ack else None,
                     int(length.group(1)) if length else 0))
    return rows


def first(rows, ifi, direction, data):
    """Capture time of each segment (data: by sequence number; ACKs: by ACK number), first seen."""
    seen = {}
    for t, d, i, seq, ack, length in rows:
        if i == ifi and d == direction and (length > 0) == data:
            seen.setdefault(seq if data else ack, t)
    return seen


def spread(delays):
    if not delays:
        return "none matched"
    v = sorted(delays)
    at = lambda q: v[min(len(v) - 1, int(q * len(v)))]
    return (f"n={len(v)} min {v[0]:.1f} p10 {at(0.1):.1f} median {at(0.5):.1f} "
            f"p90 {at(0.9):.1f} p99 {at(0.99):.1f} max {v[-1]:.1f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario")
    ap.add_argument("--system", required=True, help="direct or mpquic (the scenario's only one)")
    ap.add_argument("--after", type=float, default=4.0, help="seconds after the lab is up")
    ap.add_argument("--secs", type=float, default=4.0, help="seconds captured")
    ap.add_argument("--bins", type=float, default=0,
                    help="also print the data's and the ACKs' delay per bin of this many ms from the flow's first segment")
    a = ap.parse_args()
    scenario = yaml.safe_load(open(a.scenario))
    scenario["systems"] = [a.system]
    work = tempfile.mkdtemp(prefix="inner-delay-")
    path = os.path.join(work, "scenario.yaml")
    yaml.safe_dump(scenario, open(path, "w"))
    lab = subprocess.Popen([os.path.join(ROOT, "target/release/mpquic-lab"), "run", path,
                            "--out", os.path.join(work, "out")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        cli = srv = None
        while time.time() < deadline and not (cli and srv):
            cli, srv = namespaces()
            time.sleep(0.1)
        if not (cli and srv):
            sys.exit("the lab's namespaces did not appear")
        dev = "mpq0" if a.system == "mpquic" else "wan1"
        deadline = time.time() + 30
        while subprocess.run(["ip", "netns", "exec", cli, "ip", "link", "show", dev],
                             capture_output=True).returncode != 0:
            if time.time() > deadline:
                sys.exit(f"no {dev} in {cli}")
            time.sleep(0.1)
        time.sleep(a.after)
        ifc, ifs = ifindex(cli, dev), ifindex(srv, dev)
        caps = []
        for ns, name in ((cli, "cli"), (srv, "srv")):
            out = os.path.join(work, f"{name}.pcap")
            caps.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "timeout", str(a.secs), "tcpdump", "-i", "any",
                 "-n", "-s", "96", "-w", out, "tcp port 5201"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for c in caps:
            c.wait()
    finally:
        lab.wait()
    cli_rows = read(os.path.join(work, "cli.pcap"))
    srv_rows = read(os.path.join(work, "srv.pcap"))
    shutil.rmtree(work)
    sent, got = first(cli_rows, ifc, "Out", True), first(srv_rows, ifs, "In", True)
    acked, back = first(srv_rows, ifs, "Out", False), first(cli_rows, ifc, "In", False)
    up = [(got[s] - t) * 1000 for s, t in sent.items() if s in got]
    down = [(back[s] - t) * 1000 for s, t in acked.items() if s in back]
    where = "tunnel (TUN to TUN)" if a.system == "mpquic" else "link (WAN to WAN)"
    print(f"{a.scenario}, {a.system}, through the {where}, one way:")
    print(f"  data, client -> server: {spread(up)}")
    print(f"  ACKs, server -> client: {spread(down)}")
    if a.bins and sent:
        start = min(sent.values())

        def binned(left, arrived):
            # One-way delays (ms) grouped by when they left, in bins of a.bins ms from `start`.
            out = {}
            for k, t in left.items():
                if k in arrived:
                    out.setdefault(int((t - start) * 1000 // a.bins), []).append((arrived[k] - t) * 1000)
            return out

        bins, backs = binned(sent, got), binned(acked, back)
        for b in sorted(set(bins) | set(backs)):
            print(f"  {b * a.bins:6.0f} ms: data {spread(bins.get(b, []))}")
            print(f"  {'':6}     ACKs {spread(backs.get(b, []))}")


if __name__ == "__main__":
    main()
