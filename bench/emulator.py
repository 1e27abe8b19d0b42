"""The link emulator's own cost: TCP through mpquic-lab with no VPN, with the emulator's CPU.

Cases (one lab, changed live between cases):
- ceiling: no rate limit, 1 ms, 2 paths x 4 flows at once (target >= 1 Gbit/s, so the emulator is
  never what a tunnel benchmark measures);
- the links of scenario 05 (300 Mbit/s 5 ms + 80 Mbit/s 15 ms): 1 and 16 flows on each, and both
  paths at once;
- a rate sweep on one path (10 Mbit/s .. 1 Gbit/s, 5 ms, 16 flows): CPU per Gbit/s must not depend
  on the rate limit (target <= 0.4 core per Gbit/s everywhere);
- idle: the emulator with no traffic.

CPU is the emulator process's time on a CPU (all threads, from /proc/PID/task/*/schedstat, in
nanoseconds), wake-ups are its threads' voluntary context switches. Beside it: the kernel threads
that receive frames on the endpoints' WAN interfaces (threaded NAPI, `napi/wan*`): the traffic's
own receive work (TCP receive, acknowledgements), which a kernel emulator would also cause, and
how late the emulator released packets after their model time (mean, from the emulator's
counters).

    sudo python3 bench/emulator.py [--seconds 8] [--only NAME...] [--split] [--out bench/results/emulator.json]

--split moves the endpoints' receive work out of the emulator's send() calls into kernel threads
(threaded NAPI with GRO on the client's and server's WAN interfaces; it adds ~0.1 ms to an idle
RTT, so labs do not do it): the emulator's column is then its own work, the receive threads'
column the traffic's.

MPQUIC_LAB_BIN=PATH runs another build (to compare two side by side).
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))
import labctl  # noqa: E402

LAB = labctl.LAB

SCEN05 = ["rate=300mbit,delay=5ms", "rate=80mbit,delay=15ms"]
# (name, spec of path 1, spec of path 2, flows on path 1, flows on path 2)
CASES = [("ceiling", "rate=none,delay=1ms", "rate=none,delay=1ms", 4, 4)]
CASES += [(f"05-{which}-{n}", SCEN05[0], SCEN05[1], n if which != "80" else 0, n if which != "300" else 0)
          for which in ("300", "80", "both") for n in (1, 16)]
CASES += [(f"sweep-{r}", f"rate={r},delay=5ms", SCEN05[1], 16, 0)
          for r in ("10mbit", "30mbit", "100mbit", "300mbit", "1gbit")]


def cpu_and_wakes(pid):
    """(seconds on a CPU, voluntary context switches) summed over the process's threads."""
    ns = wakes = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns += int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                wakes += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, StopIteration):
            pass
    return ns / 1e9, wakes


def napi_cpu():
    """Seconds on a CPU of the kernel's receive threads of all labs' endpoint WAN interfaces."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("napi/wan"):
                    continue
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass
    return total / 1e9


def late(name):
    """(packets released, total ns late) over all paths and directions of lab `name`."""
    st = json.loads(lab("stats", name))
    xs = [p[d]["stats"] for p in st["paths"] for d in ("up", "down")]
    return sum(x["out_packets"] for x in xs), sum(x.get("late_ns_total", 0) for x in xs)


def lab(*args):
    return subprocess.run([LAB, *args], capture_output=True, text=True, check=True).stdout


def measure(lab_name, name, ns, pid, flows, seconds):
    """Traffic as given by `flows` (per path), or none; returns the case's row."""
    c0, w0 = cpu_and_wakes(pid)
    n0, (p0, l0) = napi_cpu(), late(lab_name)
    t0 = time.monotonic()
    procs = [subprocess.Popen(["ip", "netns", "exec", ns["client"], "iperf3", "-c", f"10.10.{i}.1", "-p",
                               str(5200 + i), "-t", str(seconds), "-P", str(n), "-J"],
                              stdout=subprocess.PIPE, text=True)
             for i, n in enumerate(flows, start=1) if n]
    outs = [json.loads(p.communicate()[0]) for p in procs]
    if not procs:
        time.sleep(seconds)
    c1, w1 = cpu_and_wakes(pid)
    n1, (p1, l1) = napi_cpu(), late(lab_name)
    t1 = time.monotonic()
    mbit = [o["end"]["sum_received"]["bits_per_second"] / 1e6 for o in outs]
    total = sum(mbit)
    core = (c1 - c0) / (t1 - t0)
    row = {"case": name, "flows": flows, "paths_mbit": mbit, "total_mbit": total,
           "emulator_core": core, "wakeups_per_s": (w1 - w0) / (t1 - t0),
           "endpoint_rx_core": (n1 - n0) / (t1 - t0),
           "late_mean_us": (l1 - l0) / max(1, p1 - p0) / 1e3,
           "core_per_gbit": core / (total / 1000) if total else None}
    per = f", {row['core_per_gbit']:.2f} core per Gbit/s" if total else ""
    print(f"{name:14} {total:7.1f} Mbit/s ({' + '.join(f'{m:.1f}' for m in mbit) or 'idle'}): "
          f"emulator {100 * core:5.1f}% of a core{per}, {row['wakeups_per_s']:.0f} wake-ups/s, "
          f"released {row['late_mean_us']:.0f} us late on average; endpoints' receive threads "
          f"{100 * row['endpoint_rx_core']:.1f}%", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="case names (prefixes) to run")
    ap.add_argument("--split", action="store_true", help="endpoints' receive in kernel threads")
    ap.add_argument("--out", default=os.path.join(labctl.REPO, "bench", "results", "emulator.json"))
    args = ap.parse_args()
    name = f"bench{os.getpid() % 100000}"
    st = json.loads(lab("up", name, "--path", SCEN05[0], "--path", SCEN05[1]))
    ns, pid = st["namespaces"], st["emulator_pid"]
    rows = []
    try:
        if args.split:
            for side in ("client", "server"):
                for dev in ("wan1", "wan2"):
                    subprocess.run(["ip", "netns", "exec", ns[side], "sh", "-c",
                                    f"ethtool -K {dev} gro on >/dev/null && echo 1 > /sys/class/net/{dev}/threaded"],
                                   check=True)
        for port in (5201, 5202):
            subprocess.run(["ip", "netns", "exec", ns["server"], "iperf3", "-s", "-D", "-p", str(port)], check=True)
        time.sleep(0.5)
        cases = [c for c in CASES if not args.only or any(c[0].startswith(o) for o in args.only)]
        if not args.only or "idle" in args.only:
            rows.append(measure(name, "idle", ns, pid, [0, 0], args.seconds))
        for case, spec1, spec2, f1, f2 in cases:
            lab("set", name, "1", spec1)
            lab("set", name, "2", spec2)
            time.sleep(0.3)
            rows.append(measure(name, case, ns, pid, [f1, f2], args.seconds))
        res = {"lab_bin": LAB, "seconds": args.seconds, "split": args.split, "rows": rows}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    finally:
        subprocess.run([LAB, "down", name], capture_output=True)


if __name__ == "__main__":
    main()
