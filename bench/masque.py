#!/usr/bin/env python3
"""CONNECT-IP (protocol: masque) figures, each side by side with the native protocol in one run:

- loss: one inner TCP flow (bbr, as the issue's acceptance asks; cubic beside it) through a
  60 Mbit/s, 10 ms path with 1% random loss, mpquic's client over CONNECT-IP against the native
  protocol, both with the product's defaults otherwise; runs interleaved (A B A B ...).
- blackhole: a standard client (quic-go's connect-ip-go, tests/interop/connectip) on the mpquic
  server through one path that drops everything both ways for 2 s: the session must come
  through intact (same connection, same address), pings every 10 ms before, during and after.
- bond: one inner TCP flow over two paths of different rates and delays (60 Mbit/s 5 ms +
  30 Mbit/s 20 ms, and 100 Mbit/s 10 ms + 50 Mbit/s 30 ms), `multipath_policy: wlb` and
  defaults otherwise, mpquic's client and server over CONNECT-IP (the server takes the hello in
  the request: the session bonds) against the native protocol; interleaved runs.
- failover: two paths, 100 Mbit/s 10 ms each, defaults (failover policy): the native protocol,
  CONNECT-IP to the mpquic server (both paths connected and probed, as native), and CONNECT-IP
  to a standard server (connect-ip-go's: the paths take turns, one connected at a time). wan1
  dark both ways under a 10 ms ping, then repaired; the longest gap, the time until wan2
  carries, whether the address stayed, and the time until wan1 carries again; interleaved runs.

    sudo python3 bench/masque.py [--runs 3] [--seconds 10] [--only loss|blackhole|bond|failover]

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
        lost, longest = labctl.ping_gaps(ping, 0.01)
        after = lab.status("server")["tunnels"]
        alive = lab.procs["cip"].poll() is None
        same = [t["address"] for t in before] == [t["address"] for t in after] and len(after) == 1
        r = {"hole_s": hole_s, "pings_sent": ping["sent"], "pings_lost": len(lost),
             "longest_gap_s": round(longest, 2), "client_alive": alive, "same_session": same,
             "server_refused": lab.status("server")["refused"]}
        print(f"    black hole {hole_s} s: {r}", flush=True)
        return r


BOND_SPECS = [["rate=60mbit,delay=5ms", "rate=30mbit,delay=20ms"],
              ["rate=100mbit,delay=10ms", "rate=50mbit,delay=30ms"]]


def bond_row(masque, specs, seconds):
    """One TCP flow (the kernel's default, cubic) up and down over two paths, wlb."""
    with labctl.Lab(paths=2, mode=None, congestion=None, policy="wlb", priorities=[1, 1],
                    specs=specs) as lab:
        lab.pki()
        lab.start_server_and_client(masque)
        st = lab.wait_tunnel()
        assert st["tunnels"][0]["protocol"] == ("connect-ip" if masque else "native"), st
        lab.iperf_server()
        out = {}
        for reverse in (False, True):
            d = lab.iperf(seconds=seconds, reverse=reverse)
            out["down" if reverse else "up"] = round(d["end"]["sum_received"]["bits_per_second"] / 1e6, 1)
        print(f"    {'masque' if masque else 'native'} {specs}: {out}", flush=True)
        return out


def standard_server(lab, binary):
    """connect-ip-go's server in the server namespace, and the client's configuration for it."""
    pki = lab.files["pki"]
    lab.spawn("go-server", lab.server_ns, [
        binary, "server", "-listen", f"0.0.0.0:{labctl.MASQUE_PORT}",
        "-cert", os.path.join(pki, "mpquic-server.crt"), "-key", os.path.join(pki, "mpquic-server.key"),
        "-path", "/vpn", "-assign", "10.200.18.2/32", "-local", "10.200.18.1/32", "-tun", "cips0"])
    t0 = time.monotonic()
    while "listening" not in lab.log("go-server"):
        if time.monotonic() - t0 > 10:
            raise RuntimeError(lab.log("go-server"))
        time.sleep(0.1)
    yaml = lab.client_yaml(0, request=False).replace("remote_port: 45017", f"remote_port: {labctl.MASQUE_PORT}")
    return yaml + "protocol: masque\nmasque_path: /vpn\n"


def failover_row(kind, binary):
    """wan1 black-holed under a 10 ms ping, then repaired: `kind` native, masque (to the mpquic
    server) or standard (to connect-ip-go's server, which forwards only from the address it
    gave: the ping goes from the client to that server's end)."""
    spec = "rate=100mbit,delay=10ms"
    with labctl.Lab(paths=2, mode=None, congestion=None, specs=[spec, spec]) as lab:
        lab.pki()
        if kind == "standard":
            lab.start_client(yaml=standard_server(lab, binary))
        else:
            lab.start_server_and_client(kind == "masque")
        address = lab.wait_tunnel(up=["wan1"])["tunnels"][0]["address"]
        time.sleep(1)
        if kind == "standard":
            lab.sh(lab.client_ns(0), "ip route add 10.200.18.1/32 dev mpq0")
            lab.spawn("ping", lab.client_ns(0), ["ping", "-n", "-i", "0.01", "-W", "1", "10.200.18.1"])
        else:
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
        lost, longest = labctl.ping_gaps(ping, 0.01)
        r = {"wan2_carries_after_s": switched, "longest_gap_s": round(longest, 2),
             "pings_lost": len(lost), "pings_sent": ping["sent"],
             "same_address": lab.status("client0")["tunnels"][0]["address"] == address,
             "wan1_carries_again_after_s": back}
        print(f"    {kind}: {r}", flush=True)
        return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--only", choices=["loss", "blackhole", "bond", "failover"])
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
    if args.only in (None, "bond"):
        report["bond"] = []
        for specs in BOND_SPECS:
            print(f"== one TCP flow, wlb over {specs}", flush=True)
            rows = {"specs": specs, "native": [], "masque": []}
            for _ in range(args.runs):
                for masque in (False, True):
                    rows["masque" if masque else "native"].append(bond_row(masque, specs, args.seconds))
            for key in ("up", "down"):
                n = sum(r[key] for r in rows["native"]) / args.runs
                m = sum(r[key] for r in rows["masque"]) / args.runs
                rows.setdefault("ratio", {})[key] = round(m / n, 2)
                print(f"  {key}: native {n:.1f}, CONNECT-IP {m:.1f} Mbit/s: {m / n:.2f}x", flush=True)
            report["bond"].append(rows)
    if args.only in (None, "failover"):
        print("== failover between two paths under a 10 ms ping", flush=True)
        binary = build_interop()
        report["failover"] = {"native": [], "masque": [], "standard": []}
        for _ in range(args.runs):
            for kind in ("native", "masque", "standard"):
                report["failover"][kind].append(failover_row(kind, binary))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"(results in {args.out})")


if __name__ == "__main__":
    main()
