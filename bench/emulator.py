"""The link emulator's own ceiling: TCP through mpquic-lab with no rate limit, 2 paths x 4 flows
at once, with the emulator's CPU. Target: at least 1 Gbit/s aggregate so it is never what we measure.

    sudo python3 bench/emulator.py [--seconds 6] [--out bench/results/emulator.json]

MPQUIC_LAB_BIN=PATH runs another build (to compare two side by side in one session).
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lab import topo  # noqa: E402

LAB = os.environ.get("MPQUIC_LAB_BIN", os.path.join(topo.REPO, "target", "release", "mpquic-lab"))
TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        x = f.read().rsplit(")", 1)[1].split()
    return (int(x[11]) + int(x[12])) / TICK


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--out", default=os.path.join(topo.REPO, "bench", "results", "emulator.json"))
    args = ap.parse_args()
    name = f"bench{os.getpid() % 100000}"
    st = json.loads(subprocess.run([LAB, "up", name, "--path", "delay=1ms", "--path", "delay=1ms"],
                                   capture_output=True, text=True, check=True).stdout)
    ns = st["namespaces"]
    try:
        for port in (5201, 5202):
            subprocess.run(["ip", "netns", "exec", ns["server"], "iperf3", "-s", "-D", "-p", str(port)], check=True)
        time.sleep(0.5)
        pid = st["emulator_pid"]
        c0, t0 = cpu(pid), time.monotonic()
        procs = [subprocess.Popen(["ip", "netns", "exec", ns["client"], "iperf3", "-c", f"10.10.{i}.1", "-p",
                                   str(5200 + i), "-t", str(args.seconds), "-P", "4", "-J"],
                                  stdout=subprocess.PIPE, text=True) for i in (1, 2)]
        outs = [json.loads(p.communicate()[0]) for p in procs]
        c1, t1 = cpu(pid), time.monotonic()
        mbit = [o["end"]["sum_received"]["bits_per_second"] / 1e6 for o in outs]
        stats = json.loads(subprocess.run([LAB, "stats", name], capture_output=True, text=True).stdout)
        pkts = sum(p[d]["stats"]["out_packets"] for p in stats["paths"] for d in ("up", "down"))
        cpu_pct = 100 * (c1 - c0) / (t1 - t0)
        total = sum(mbit)
        res = {"paths_mbit": mbit, "total_mbit": total, "packets_per_s": pkts / (t1 - t0),
               "emulator_cpu_pct": cpu_pct, "cpu_pct_per_gbit": cpu_pct / (total / 1000)}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"TCP through the emulator, 2 paths x 4 flows: {total:.0f} Mbit/s ({mbit[0]:.0f} + {mbit[1]:.0f}), "
              f"{res['packets_per_s']:.0f} packets/s, emulator CPU {cpu_pct:.0f}% of a core "
              f"({res['cpu_pct_per_gbit']:.0f}% per Gbit/s)")
    finally:
        subprocess.run([LAB, "down", name], capture_output=True)


if __name__ == "__main__":
    main()
