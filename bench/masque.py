#!/usr/bin/env python3
"""CONNECT-IP (protocol: masque) figures, each side by side with the native protocol in one run:

- loss: one inner TCP flow (bbr, as the issue's acceptance asks; cubic beside it) through a
  60 Mbit/s, 10 ms path with 1% random loss, mpquic's client over CONNECT-IP against the native
  protocol, both with the product's defaults otherwise; runs interleaved (A B A B ...).
- blackhole: a standard client (quic-go's connect-ip-go, tests/interop/connectip) on the mpquic
  server through one path that drops everything both ways for 2 s: the session must come
  through intact (same connection, same address), pings every 10 ms before, during and after.
- failover: mpquic's client over CONNECT-IP with two paths (they take turns: one connected at a
  time) against the native protocol's defaults (both paths connected), 100 Mbit/s 10 ms each:
  wan1 dark both ways under a 10 ms ping, then repaired; the longest gap, the time until wan2
  carries, whether the address stayed, and the time until wan1 carries again; interleaved runs.

    sudo python3 bench/masque.py [--runs 3] [--seconds 10]

Needs Go (the interop client is built as the e2e tests build it). Results: bench/results/masque.json.
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))
import labctl  # noqa: E402

LOSS_SPEC = "rate=60mbit,delay=10ms,loss=1%"
INTEROP = os.path.join(labctl.REPO, "tests", "interop", "connectip")


def tcp(lab, seconds, cc, reverse=False):
    cmd = ["iperf3", "-c", lab.inet_addr, "-t", str(seconds), "-C", cc, "-J"] + (["-R"] if reverse else [])
    r = lab.sh(lab.lan_ns(0), cmd, timeout=seconds + 30, check=False)
    end = json.loads(r.stdout)["end"]
    return round(end["sum_received"]["bits_per_second"] / 1e6, 1)


def loss_row(masque, seconds):
    """Inner bbr and cubic, up and down, through LOSS_SPEC: native defaults or over CONNECT-IP."""
    with labctl.Lab(paths=1, mode=None, congestion=None, specs=[LOSS_SPEC]) as lab:
        lab.pki()
        lab.start_server_and_client(masque)
        lab.wait_tunnel()
        lab.iperf_server()
        out = {}
        for cc in ("bbr", "cubic"):
            for reverse in (False, True):
                key = f"{cc}_{'down' if reverse else 'up'}"
                out[key] = tcp(lab, seconds, cc, reverse)
        print(f"    {'masque' if masque else 'native'}: {out}", flush=True)
        return out


def build_interop():
    out = os.path.join(labctl.REPO, "target", "interop", "connectip")
    subprocess.run(["go", "build", "-o", out, "."], cwd=INTEROP, check=True,
                   env=dict(os.environ, CGO_ENABLED="0"), timeout=600)
    return out


def blackhole(binary, hole_s=2.0):
    """connect-ip-go's client on the mpquic server, one path dark both ways for `hole_s`."""
    with labctl.Lab(paths=1, specs=["rate=100mbit,delay=10ms"]) as lab:
        lab.pki()
        token, entry = labctl.new_token("phone1")
        lab.start_server(yaml=lab.masque_server_yaml([entry]))
        tun4 = lab.files["server"]["tun_addr"].split("/")[0]
        url = f"https://{labctl.SERVER_IP}:{labctl.MASQUE_PORT}/.well-known/masque/ip/*/*/"
        lab.spawn("cip", lab.client_ns(0), [binary, "client", "-url", url, "-ca",
                                             os.path.join(lab.files["pki"], "ca.crt"), "-sni", "mpquic-server",
                                             "-token", token, "-route", f"{tun4}/32"])
        t0 = time.monotonic()
        while "READY" not in lab.log("cip"):
            if time.monotonic() - t0 > 15:
                raise RuntimeError(lab.log("cip") + lab.log("server"))
            time.sleep(0.1)
        before = lab.status("server")["tunnels"]
        lab.spawn("ping", lab.client_ns(0), ["ping", "-n", "-D", "-i", "0.01", "-W", "1", "-c", "700", tun4])
        time.sleep(2)
        lab.block(0)
        time.sleep(hole_s)
        lab.unblock(0)
        lab.procs["ping"].wait(timeout=30)
        ping = labctl.parse_ping(lab.log("ping"))
        lost, longest = labctl.gaps(ping["received"], ping["sent"], 0.01)
        after = lab.status("server")["tunnels"]
        alive = lab.procs["cip"].poll() is None
        same = [t["address"] for t in before] == [t["address"] for t in after] and len(after) == 1
        r = {"hole_s": hole_s, "pings_sent": ping["sent"], "pings_lost": len(lost),
             "longest_gap_s": round(longest, 2), "client_alive": alive, "same_session": same,
             "server_refused": lab.status("server")["refused"]}
        print(f"    black hole {hole_s} s: {r}", flush=True)
        return r


def failover_row(masque):
    """wan1 black-holed under a 10 ms ping, then repaired: over CONNECT-IP or native defaults."""
    spec = "rate=100mbit,delay=10ms"
    with labctl.Lab(paths=2, mode=None, congestion=None, specs=[spec, spec]) as lab:
        lab.pki()
        lab.start_server_and_client(masque)
        address = lab.wait_tunnel(up=["wan1"])["tunnels"][0]["address"]
        time.sleep(1)
        lab.start_ping("ping", interval=0.01)
        time.sleep(2)
        wan2_tx = lab.path_status("client0", "wan2")["tx_packets"]
        lab.block(0)
        t0 = time.monotonic()
        switched = None
        while time.monotonic() - t0 < 5:
            if lab.path_status("client0", "wan2")["tx_packets"] > wan2_tx + 5:
                switched = round(time.monotonic() - t0, 2)
                break
            time.sleep(0.02)
        time.sleep(2)
        lab.unblock(0)
        t1 = time.monotonic()
        back = None
        wan1_tx = lab.path_status("client0", "wan1")["tx_packets"]
        while time.monotonic() - t1 < 10:
            now1 = lab.path_status("client0", "wan1")["tx_packets"]
            if now1 > wan1_tx + 5:
                back = round(time.monotonic() - t1, 2)
                break
            time.sleep(0.02)
        time.sleep(1)
        lab.stop("ping", sig=signal.SIGINT)
        ping = labctl.parse_ping(lab.log("ping"))
        lost, longest = labctl.gaps(ping["received"], ping["sent"], 0.01)
        r = {"wan2_carries_after_s": switched, "longest_gap_s": round(longest, 2),
             "pings_lost": len(lost), "pings_sent": ping["sent"],
             "same_address": lab.status("client0")["tunnels"][0]["address"] == address,
             "wan1_carries_again_after_s": back}
        print(f"    {'masque' if masque else 'native'}: {r}", flush=True)
        return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--only", choices=["loss", "blackhole", "failover"])
    ap.add_argument("--out", default=os.path.join(labctl.REPO, "bench", "results", "masque.json"))
    args = ap.parse_args()
    labctl.run([labctl.LAB, "down", "--stale"], check=False)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "-C", labctl.REPO, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "loss_spec": LOSS_SPEC, "seconds": args.seconds, "loss": {"native": [], "masque": []},
    }
    if args.only in (None, "loss"):
        print(f"== one TCP flow through {LOSS_SPEC}", flush=True)
        for _ in range(args.runs):
            for masque in (False, True):
                report["loss"]["masque" if masque else "native"].append(loss_row(masque, args.seconds))
        for key in report["loss"]["native"][0]:
            n = sum(r[key] for r in report["loss"]["native"]) / args.runs
            m = sum(r[key] for r in report["loss"]["masque"]) / args.runs
            report["loss"].setdefault("ratio", {})[key] = round(m / n, 2)
            print(f"  {key}: native {n:.1f}, CONNECT-IP {m:.1f} Mbit/s: {m / n:.2f}x", flush=True)
    if args.only in (None, "blackhole"):
        print("== a standard client through a 2 s black hole", flush=True)
        report["blackhole"] = blackhole(build_interop())
    if args.only in (None, "failover"):
        print("== failover between two paths under a 10 ms ping", flush=True)
        report["failover"] = {"native": [], "masque": []}
        for _ in range(args.runs):
            for masque in (False, True):
                report["failover"]["masque" if masque else "native"].append(failover_row(masque))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"(results in {args.out})")


if __name__ == "__main__":
    main()
