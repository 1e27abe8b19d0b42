"""The server under an unauthenticated flood (docs/SECURITY.md): genuine QUIC Initials (or
garbage) from many spoofed sources at its port, from the lab's internet host, while

- client 1's tunnel carries a TCP upload (its throughput in the flood against the same upload
  without one, side by side in one run), and
- client 2 starts in the middle of the flood (the time until its tunnel is up and a ping
  answered),

with the server's RSS (peak), open fds, runtime tasks, refusal and drop counters before, during
and after. The lab's paths are emulated (100 Mbit/s, 5 ms each way) so the upload has a ceiling
that does not depend on the flood's CPU; `--unshaped` makes them plain veth pairs instead, where
the upload is CPU-bound and the flood's CPU competes with it. `--port stripe` runs the clients'
paths over stripe and floods the server's stripe port (46017) instead of the QUIC one.

    sudo python3 bench/flood.py [--pps 20000] [--seconds 60] [--sources 1000] [--kind initial|garbage]
                                [--unshaped] [--port quic|stripe]
"""

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))

import labctl  # noqa: E402

SPEC = "rate=100mbit,delay=5ms"


def hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


def upload(lab, seconds):
    r = lab.iperf(seconds=seconds, c=0)
    return r["end"]["sum_received"]["bits_per_second"] / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pps", type=int, default=20000)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--sources", type=int, default=1000)
    ap.add_argument("--kind", default="initial", choices=["initial", "garbage"])
    ap.add_argument("--unshaped", action="store_true", help="plain veth paths (a CPU-bound upload)")
    ap.add_argument("--port", default="quic", choices=["quic", "stripe"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "flood.json"))
    args = ap.parse_args()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "spec": SPEC}
    up_s = max(10, int(args.seconds / 3))
    port = {"quic": 45017, "stripe": 46017}[args.port]
    lab_keys = {"emulated": False} if args.unshaped else {"specs": [SPEC]}
    if args.port == "stripe":
        lab_keys["transport"] = ["stripe"]
    report["spec"] = "direct (veth)" if args.unshaped else SPEC
    with labctl.Lab(paths=1, clients=2, mode=None, congestion=None, **lab_keys) as lab:
        lab.pki()
        lab.start_server()
        lab.start_client(0)
        lab.wait_tunnel(0)
        lab.iperf_server()
        server = lab.procs["server"].pid
        base = lab.status("server")
        report["before"] = {"process": base["process"], "refused": base["refused"], "drops": base["drops"]}
        report["upload_alone_mbit"] = round(upload(lab, up_s), 1)
        print(f"upload alone: {report['upload_alone_mbit']} Mbit/s", flush=True)

        flood = {}
        t = threading.Thread(target=lambda: flood.update(json.loads(lab.sh(
            lab.inet_ns, [labctl.LAB, "flood", "--to", f"{labctl.SERVER_IP}:{port}", "--kind", args.kind,
                          "--pps", str(args.pps), "--seconds", str(args.seconds),
                          "--sources", str(args.sources)], timeout=args.seconds + 120).stdout)))
        t.start()
        time.sleep(min(5, args.seconds / 6))
        during = upload(lab, up_s)
        # A client that starts now: until its tunnel is up and a ping answered through it.
        t0 = time.monotonic()
        lab.start_client(1)
        lab.wait_tunnel(1, timeout=30)
        ping = lab.ping(count=1, interval=0.1, c=1)
        connect_s = time.monotonic() - t0
        mid = lab.status("server")
        t.join()
        time.sleep(2)
        after = lab.status("server")
        report.update({
            "flood": flood,
            "upload_in_flood_mbit": round(during, 1),
            "upload_ratio": round(during / report["upload_alone_mbit"], 3),
            "new_client_connect_s": round(connect_s, 3),
            "new_client_ping": len(ping["received"]),
            "during": {"process": mid["process"], "refused": mid["refused"]},
            "kernel_dropped": after["drops"].get("udp_receive_buffer_full"),
            "after": {"process": after["process"], "refused": after["refused"], "drops": after["drops"]},
            "server_peak_rss_mib": round(hwm_kib(server) / 1024, 1),
        })
    print(f"flood {args.kind} at the {args.port} port ({report['spec']}): sent {flood.get('packets')} in {flood.get('seconds', 0):.1f} s "
          f"({flood.get('packets', 0) / max(flood.get('seconds', 1), 1e-9):.0f}/s) from {args.sources} sources; "
          f"upload {report['upload_alone_mbit']} alone, {report['upload_in_flood_mbit']} in the flood "
          f"({report['upload_ratio']:.2f}x); a new client up and answering in {report['new_client_connect_s']} s; "
          f"server peak RSS {report['server_peak_rss_mib']} MiB; refused {report['after']['refused']}; "
          f"dropped by the kernel (socket buffer full) {report['kernel_dropped']}; "
          f"drops {report['before']['drops']} -> {report['after']['drops']}; "
          f"process before {report['before']['process']} after {report['after']['process']}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"(results in {args.out})")


if __name__ == "__main__":
    main()
