#!/usr/bin/env python3
"""A lab scenario with a per-second trace beside it: what the tunnel and the inner TCP flow do
while the figures are made. Runs `mpquic-lab run FILE --out DIR` and, each second, prints the
client's and the server's first path (carriage, pacing rate, congestion window, smoothed RTT,
playout delay, packets refused `queue_full`), the LAN host's TCP counters that changed (`nstat`:
retransmissions, timeouts, HyStart's exits and the window they happened at) and the iperf3
flow's `ss -ti` line (its RTT, window, ssthresh).

    sudo python3 bench/trace.py bench/trace/loss30-onset.yaml
    sudo python3 bench/trace.py bench/trace/handover-switch.yaml --out /tmp/trace

The binaries are target/release's (`MPQUIC_BIN` / `MPQUIC_LAB_BIN` override them).
"""

import argparse
import glob
import json
import os
import re
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPQUIC = os.environ.get("MPQUIC_BIN", os.path.join(ROOT, "target", "release", "mpquic"))
LAB = os.environ.get("MPQUIC_LAB_BIN", os.path.join(ROOT, "target", "release", "mpquic-lab"))
NSTAT = ["TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPSpuriousRTOs", "TcpExtTCPLossUndo",
         "TcpExtTCPDSACKUndo", "TcpExtTCPHystartDelayDetect", "TcpExtTCPHystartDelayCwnd",
         "TcpExtTCPHystartTrainDetect", "TcpExtTCPHystartTrainCwnd"]
SS = re.compile(r"\b(rtt|cwnd|ssthresh|retrans|lost|unacked):(\S+)")


def path_status(sock):
    """The first path of the first tunnel in `mpquic status --json`, or None."""
    r = subprocess.run([MPQUIC, "status", "--json", "--socket", sock], capture_output=True, text=True)
    try:
        return json.loads(r.stdout)["tunnels"][0]["paths"][0]
    except (ValueError, KeyError, IndexError):
        return None


def fmt_path(who, p, prev):
    if p is None:
        return f"{who} -"
    refused = p["drops"]["queue_full"]
    new = refused - prev.get(who, refused)
    prev[who] = refused
    return (f"{who} {p.get('state')} {p.get('carry') or '-'} pace {p.get('pacing_mbit') or 0:.1f} "
            f"cwnd {(p.get('cwnd_bytes') or 0) // 1000}k srtt {p.get('srtt_ms') or 0:.0f} "
            f"playout {p.get('playout_ms') or 0:.0f} refused +{new}")


def tcp(ns, prev):
    r = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-az"] + NSTAT, capture_output=True, text=True)
    now = {l.split()[0]: int(l.split()[1]) for l in r.stdout.splitlines() if l and not l.startswith("#")}
    changed = [f"{k.removeprefix('TcpExt').removeprefix('Tcp')} +{v - prev.get(k, v)}"
               for k, v in now.items() if v != prev.get(k, v)]
    prev.update(now)
    r = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tin", "dport", "= :5201"], capture_output=True, text=True)
    flows = [l for l in r.stdout.splitlines() if "cwnd" in l]
    flow = max(flows, key=len, default="")
    return " ".join(changed) + " | " + " ".join(f"{k}={v}" for k, v in SS.findall(flow))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="mpquic-trace-")
    lab = subprocess.Popen([LAB, "run", os.path.abspath(a.scenario), "--out", out],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # mpquic-lab names its lab after its process (`run<pid>`), so other labs are not read.
    ns = f"mql-run{lab.pid}-lan"
    t0, prev, counters = time.monotonic(), {}, {}
    while lab.poll() is None:
        time.sleep(1)
        line = [f"{time.monotonic() - t0:5.1f}"]
        for who, pattern in (("client", "client*.sock"), ("server", "server.sock")):
            socks = glob.glob(os.path.join(out, "**", pattern), recursive=True)
            line.append(fmt_path(who, path_status(socks[0]) if socks else None, prev))
        if os.path.exists(f"/run/netns/{ns}"):
            line.append(tcp(ns, counters))
        else:
            counters.clear()
        print(" | ".join(line), flush=True)
    if lab.returncode != 0:
        print(lab.stderr.read())
    print(f"results: {out}/results.json, report: {out}/report.md")
    raise SystemExit(lab.returncode)


if __name__ == "__main__":
    main()
