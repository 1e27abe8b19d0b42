"""The self-contained demo: a site with two WAN links reaches the internet through mpquic.

WAN 1 is fast, WAN 2 is limited to 50 Mbit/s with htb. iperf3 runs from the LAN host to the
internet host while a ping runs every 10 ms; WAN 1 goes down mid-run and comes back. The summary
shows throughput per phase, the failover gap and lost pings. Everything is removed afterwards,
also on Ctrl-C.

    sudo ./scripts/demo.sh [--mode datagram|reliable] [--seconds 18]
"""

import argparse
import signal
import subprocess
import sys
import threading
import time

from lab import topo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["datagram", "reliable"], default="datagram")
    ap.add_argument("--seconds", type=int, default=18, help="length of the iperf3 run (three equal phases)")
    ap.add_argument("--wan2-mbit", type=int, default=50)
    args = ap.parse_args()
    # Ctrl-C and SIGTERM both become KeyboardInterrupt so the lab is always torn down (SIGINT is
    # set explicitly: a shell starts background jobs with it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    removed = topo.down_stale()
    if removed:
        print(f"removed {len(removed)} namespaces left by an earlier crashed run")

    phase = args.seconds // 3
    step = "building the lab"
    lab = topo.Lab(paths=2, policy="failover", mode=args.mode, rates_mbit=[None, args.wan2_mbit])
    try:
        print(f"[1/5] {step}: namespaces lan, client, server, internet; WAN1 unshaped, WAN2 {args.wan2_mbit} Mbit/s (htb)")
        lab.up()
        step = "issuing certificates"
        print(f"[2/5] {step} (mpquic pki) and starting server and client ({args.mode} mode, failover policy)")
        lab.pki()
        lab.start_server()
        lab.start_client()
        step = "bringing the tunnel up"
        lab.wait_tunnel()
        lab.iperf_server()
        step = "running traffic"
        print(f"[3/5] {step}: iperf3 TCP LAN -> internet for {args.seconds} s, ping every 10 ms; "
              f"WAN1 down at {phase} s, up at {2 * phase} s")
        lab.start_ping("ping", interval=0.01)
        events = {}

        def faults():
            time.sleep(phase)
            events["down"] = time.monotonic()
            lab.link_down(0)
            print(f"      t={phase}s  WAN1 link down")
            time.sleep(phase)
            events["up"] = time.monotonic()
            lab.link_up(0)
            print(f"      t={2 * phase}s WAN1 link up")

        t = threading.Thread(target=faults, daemon=True)
        t0 = time.monotonic()
        t.start()
        data = lab.iperf(seconds=args.seconds, streams=1)
        t.join()
        time.sleep(0.5)
        lab.stop("ping", sig=signal.SIGINT)
        step = "summarising"
        print("[4/5] results")
        summary(lab, data, phase, args)
        print("[5/5] status of the client (mpquic status):\n")
        print(subprocess.run([topo.BIN, "status", "--socket", lab.sock("client0")], capture_output=True,
                             text=True).stdout)
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up")
        return 130
    except Exception as e:
        print(f"\nthe demo failed while {step}: {e}", file=sys.stderr)
        for key in ("server", "client0"):
            print(f"--- last lines of the {key} log:\n" + "\n".join(lab.log(key).splitlines()[-15:]), file=sys.stderr)
        return 1
    finally:
        lab.down()
        print("lab removed")
    return 0


def summary(lab, data, phase, args):
    ivals = [(i["sum"]["start"], i["sum"]["bits_per_second"] / 1e6) for i in data["intervals"]]
    names = [("before (WAN1 + WAN2 up, on WAN1)", 0, phase),
             (f"WAN1 down (on WAN2, {args.wan2_mbit} Mbit/s)", phase, 2 * phase),
             ("WAN1 back (on WAN1 again)", 2 * phase, 3 * phase)]
    print(f"      {'phase':<40} {'TCP Mbit/s':>10}")
    for name, a, b in names:
        vals = [v for s, v in ivals if a <= s < b]
        avg = sum(vals) / len(vals) if vals else 0.0
        print(f"      {name:<40} {avg:>10.1f}")
    ping = topo.parse_ping(lab.log("ping"))
    lost, longest = topo.gaps(ping["received"], ping["sent"], 0.01)
    print(f"      whole run: {data['end']['sum_received']['bits_per_second'] / 1e6:.1f} Mbit/s received")
    print(f"      pings: {ping['sent']} sent, {len(lost)} lost; longest gap (failover) {longest * 1000:.0f} ms")
    print()


if __name__ == "__main__":
    sys.exit(main())
