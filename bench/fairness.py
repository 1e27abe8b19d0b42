"""Fairness between tunnels (issue 9): two mpquic clients, two sites with their own certificates
and processes, whose single paths cross ONE emulated bottleneck (both client processes run in the
first client's namespace and send over its wan1, so their QUIC connections share that link's
rate and queue). Each carries one bulk TCP upload (inner cubic) for the whole run; the second
starts `--stagger` seconds after the first, as a real second site would, so the first has
already taken the link. Jain's index over the overlap, (x1 + x2)^2 / (2 (x1^2 + x2^2)): 1 is an
even split, 0.5 one flow starved. The baseline row is two plain TCP flows over the same link
(no tunnel), which is what the link gives two flows by itself.

    sudo python3 bench/fairness.py [--seconds 60] [--rate 100] [--delay-ms 10] \\
        [--out bench/results/fairness.json]
"""

import argparse
import datetime
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))

import labctl  # noqa: E402

# mpquic configurations compared: (label, transport_mode, congestion_algorithm); None = the key
# left out (mpquic's default).
VARIANTS = [
    ("mpquic default (reliable, bbr)", None, None),
    ("mpquic datagram, bbr", "datagram", None),
    ("mpquic datagram, quinn cubic", "datagram", "cubic"),
]


def jain(xs):
    s = sum(xs)
    q = sum(x * x for x in xs)
    return round(s * s / (len(xs) * q), 3) if q > 0 else None


def strip_keys(yaml, keys):
    return "".join(l for l in yaml.splitlines(keepends=True) if not l.startswith(tuple(k + ":" for k in keys)))


def set_keys(yaml, mode, cc):
    y = strip_keys(yaml, ["transport_mode", "congestion_algorithm"])
    if mode:
        y += f"transport_mode: {mode}\n"
    if cc:
        y += f"congestion_algorithm: {cc}\n"
    return y


def iperf_pair(lab, ns, flows, seconds, stagger):
    """Two iperf3 uploads from namespace `ns`: flows = [(bind address, server address, port)];
    the second starts `stagger` s after the first and both end together. Per-second rates."""
    out = [None, None]

    def one(i, bind, dst, port, secs, delay):
        time.sleep(delay)
        cmd = ["iperf3", "-c", dst, "-p", str(port), "-t", str(secs), "-J", "-C", "cubic"]
        if bind:
            cmd += ["-B", bind]
        r = lab.sh(ns, cmd, timeout=secs + 40, check=False)
        out[i] = json.loads(r.stdout)

    threads = []
    for i, (bind, dst, port) in enumerate(flows):
        secs = seconds if i == 0 else seconds - stagger
        t = threading.Thread(target=one, args=(i, bind, dst, port, secs, 0 if i == 0 else stagger))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    rates = []
    for d in out:
        if "error" in d:
            raise RuntimeError(d["error"])
        rates.append([iv["sum"]["bits_per_second"] / 1e6 for iv in d["intervals"]])
    return rates


def summarize(label, rates, stagger, extra=None):
    first, second = rates
    # The overlap: the first flow's seconds from `stagger` on, against the second's.
    a = first[stagger:stagger + len(second)]
    b = second[:len(a)]
    n = len(a)
    windows = [jain([sum(a[i:i + 10]), sum(b[i:i + 10])]) for i in range(0, n - 9, 10)]
    row = {
        "system": label,
        "first_mbit": round(sum(a) / n, 1),
        "second_mbit": round(sum(b) / n, 1),
        "jain": jain([sum(a), sum(b)]),
        "jain_after_10s": jain([sum(a[10:]), sum(b[10:])]),
        "jain_10s_windows": windows,
        "per_second": [[round(x, 1) for x in a], [round(x, 1) for x in b]],
    }
    if extra:
        row.update(extra)
    print(f"{label:34} first {row['first_mbit']:6.1f}  second {row['second_mbit']:6.1f}  "
          f"Jain {row['jain']}  after 10 s {row['jain_after_10s']}  10-s windows {windows}", flush=True)
    return row


def link_spec(args):
    return f"rate={args.rate}mbit,delay={args.delay_ms}ms"


def baseline(args):
    """Two plain TCP flows from the first client's router to the server over the same link."""
    lab = labctl.Lab(paths=1, clients=2, rates_mbit=[args.rate]).up()
    try:
        lab.set_link(0, link_spec(args))
        server = lab.state["hosts"]["server_service_addr"]
        for port in (5301, 5302):
            lab.spawn(f"iperf{port}", lab.server_ns, ["iperf3", "-s", "-p", str(port)], log=False)
        time.sleep(0.5)
        rates = iperf_pair(lab, lab.client_ns(0), [(None, server, 5301), (None, server, 5302)],
                           args.seconds, args.stagger)
        return summarize("direct (two TCP flows, no tunnel)", rates, args.stagger)
    finally:
        lab.down()


def mpquic(args, label, mode, cc):
    lab = labctl.Lab(paths=1, clients=2, rates_mbit=[args.rate]).up()
    try:
        lab.set_link(0, link_spec(args))
        lab.pki()
        lab.start_server()
        # Site 1 as the lab made it; site 2's configuration (its own certificate) run in site 1's
        # namespace, over the same wan1, with its own TUN device.
        lab.start_client(0, yaml=set_keys(lab.client_yaml(0), mode, cc))
        lab.wait_tunnel(0)
        y2 = set_keys(lab.client_yaml(1), mode, cc)
        y2 = strip_keys(y2, ["tun_name"]) + "tun_name: mpqb\n"
        cfg = lab.write("client1-shared.yaml", y2)
        lab.spawn("client1", lab.client_ns(0), [labctl.BIN, "--config", cfg])
        addrs = []
        for key in ("client0", "client1"):
            t0 = time.monotonic()
            while True:
                try:
                    t = lab.status(key)["tunnels"][0]
                    if t["address"] and all(p["state"] == "up" for p in t["paths"]):
                        break
                except Exception:
                    pass
                if time.monotonic() - t0 > 20:
                    raise RuntimeError(f"{key} not up:\n{lab.log(key)}")
                time.sleep(0.2)
            addrs.append(t["address"])
        inet = lab.inet_addr
        ns = lab.client_ns(0)
        # Each site's inner packets leave through its own TUN device (policy routing by source
        # address); the internet host already answers the tunnel subnet via the server
        # (`wait_tunnel` ran `mpquic-lab route`).
        for i, (addr, dev) in enumerate(zip(addrs, ("mpq0", "mpqb"))):
            a = addr.split("/")[0]
            lab.sh(ns, f"ip rule add from {a} lookup {101 + i} && "
                       f"ip route replace {inet}/32 dev {dev} table {101 + i}")
        for port in (5301, 5302):
            lab.spawn(f"iperf{port}", lab.inet_ns, ["iperf3", "-s", "-p", str(port)], log=False)
        time.sleep(0.5)
        flows = [(addrs[0].split("/")[0], inet, 5301), (addrs[1].split("/")[0], inet, 5302)]
        rates = iperf_pair(lab, ns, flows, args.seconds, args.stagger)
        drops = {}
        for key in ("client0", "client1"):
            p = lab.status(key)["tunnels"][0]["paths"][0]
            drops[key] = {k: v for k, v in p["drops"].items() if v}
        return summarize(label, rates, args.stagger, {"client_drops": drops})
    finally:
        lab.down()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--stagger", type=int, default=5)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--delay-ms", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--only", help="run only the rows whose label contains this")
    args = ap.parse_args()
    rows = []
    if not args.only or args.only in "direct":
        rows.append(baseline(args))
    for label, mode, cc in VARIANTS:
        if args.only and args.only not in label:
            continue
        rows.append(mpquic(args, label, mode, cc))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "link": link_spec(args),
        "seconds": args.seconds,
        "stagger_s": args.stagger,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
