#!/usr/bin/env python3
"""Where the CPU goes when many clients go through one server: a lab with N clients (one direct
path each, no emulator), one TCP flow from every client at once, and a system-wide
`perf record -a -g` while they run; prints the samples per process and the top symbols of the
clients and of the server's threads. docs/BENCHMARKS.md ("Server threads and TUN queues") quotes
its output.

    sudo python3 bench/profile_many_clients.py [--clients 16] [--server-threads 2] [--down]
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))
import labctl  # noqa: E402


def report(data, args):
    """perf's summary: samples per command, then the top symbols of `mpquic` (clients; the
    server's threads run as tokio-rt-worker when it has more than one)."""
    base = ["perf", "report", "-i", data, "--no-children", "--stdio", "-g", "none"]
    out = subprocess.run(base + ["--sort", "comm"], capture_output=True, text=True).stdout
    print("samples per process:\n" + "\n".join(l for l in out.splitlines() if l.strip() and not l.startswith("#")))
    for comm in ("mpquic", "tokio-rt-worker"):
        out = subprocess.run(base + ["--comm", comm, "--sort", "sym"], capture_output=True, text=True).stdout
        top = [l for l in out.splitlines() if l.strip() and not l.startswith("#")][:args.top]
        print(f"\ntop symbols of {comm} (% of all samples):\n" + "\n".join(top))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument("--down", action="store_true", help="downloads instead of uploads")
    ap.add_argument("--seconds", type=int, default=8, help="recorded seconds (iperf3 runs 6 s longer)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="/tmp/mpquic-many-clients.perf.data")
    args = ap.parse_args()
    if not shutil.which("perf"):
        sys.exit("perf is not installed (apt-get install linux-perf)")
    n = args.clients
    with labctl.Lab(paths=1, clients=n, emulated=False) as lab:
        lab.start_all(server_yaml=f"worker_threads: {args.server_threads}\n", client_yaml="worker_threads: 1\n")
        for c in range(n):
            lab.iperf_server(5201 + c)
        time.sleep(1)
        cmds = [["ip", "netns", "exec", lab.lan_ns(c), "iperf3", "-c", lab.inet_addr, "-p", str(5201 + c),
                 "-t", str(args.seconds + 6)] + (["-R"] if args.down else []) for c in range(n)]
        procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL) for c in cmds]
        try:
            time.sleep(3)
            subprocess.run(["perf", "record", "-a", "-g", "-o", args.out, "--", "sleep", str(args.seconds)],
                           stderr=subprocess.DEVNULL, check=True)
        finally:
            for p in procs:
                p.wait()
    report(args.out, args)




if __name__ == "__main__":
    main()
