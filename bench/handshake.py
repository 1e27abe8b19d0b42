"""What the post-quantum key exchange costs a connection: QUIC handshake time and bytes with the
default (`tls_post_quantum: true`, X25519MLKEM768) against classic (`tls_post_quantum: false`,
X25519), on the same lab path, variants alternated client start by client start.

Each sample is one client start: its first path's handshake as the client logs it ("QUIC
handshake done": from the Initial sent to the handshake confirmed, and the UDP bytes each way
until then), and the key exchange group the client's log says it negotiated. Two paths: one
emulated (`--spec`, default 20 ms RTT) and one plain veth (where the handshake is CPU only).

    sudo python3 bench/handshake.py [--rounds 40] [--spec rate=100mbit,delay=10ms] [--out bench/results/handshake.json]
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))

import labctl  # noqa: E402

VARIANTS = {"post_quantum": "tls_post_quantum: true\n", "classic": "tls_post_quantum: false\n"}


def events(text):
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def one_start(lab, variant, n):
    """Start the client with `variant`, wait for its handshake, stop it; the sample."""
    yaml = lab.client_yaml() + "log_format: json\n" + VARIANTS[variant]
    key = lab.start_client(yaml=yaml, key=f"hs{n}")
    deadline = time.monotonic() + 15
    done = group = None
    while time.monotonic() < deadline and not (done and group):
        for e in events(lab.log(key)):
            f = e.get("fields", e)  # `log_format: json` flattens the fields
            if f.get("message") == "QUIC handshake done" and done is None:
                done = f
            if f.get("message") == "TLS key exchange" and group is None:
                group = f.get("group")
        time.sleep(0.05)
    lab.stop(key)
    if not done:
        raise RuntimeError(f"no handshake logged by {key}:\n{lab.log(key)}")
    return {"ms": float(done["handshake_ms"]), "sent": int(done["sent_bytes"]),
            "received": int(done["received_bytes"]), "group": group}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(samples):
    ms = [s["ms"] for s in samples]
    return {"n": len(ms), "p50_ms": round(pct(ms, 0.5), 2), "p95_ms": round(pct(ms, 0.95), 2),
            "mean_ms": round(statistics.mean(ms), 2),
            "sent_bytes": statistics.median(s["sent"] for s in samples),
            "received_bytes": statistics.median(s["received"] for s in samples),
            "groups": sorted({s["group"] for s in samples if s["group"]})}


def run_path(name, rounds, **lab_args):
    with labctl.Lab(paths=1, mode=None, congestion=None, **lab_args) as lab:
        lab.pki()
        lab.start_server()
        samples = {v: [] for v in VARIANTS}
        order = list(VARIANTS)
        for r in range(rounds):
            for v in (order if r % 2 == 0 else order[::-1]):
                samples[v].append(one_start(lab, v, f"{r}{v[0]}"))
        rows = {v: summary(s) for v, s in samples.items()}
        pq, cl = rows["post_quantum"], rows["classic"]
        ratio = {"p50": round(pq["p50_ms"] / cl["p50_ms"], 2), "p95": round(pq["p95_ms"] / cl["p95_ms"], 2)}
        print(f"{name}: post-quantum p50 {pq['p50_ms']} / p95 {pq['p95_ms']} ms, {pq['sent_bytes']:.0f} B sent, "
              f"{pq['received_bytes']:.0f} B received, groups {pq['groups']}; classic p50 {cl['p50_ms']} / "
              f"p95 {cl['p95_ms']} ms, {cl['sent_bytes']:.0f} / {cl['received_bytes']:.0f} B, groups {cl['groups']}; "
              f"ratio p50 {ratio['p50']}x, p95 {ratio['p95']}x", flush=True)
        return {"rows": rows, "ratio": ratio, "samples": samples}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40, help="client starts per variant and path")
    ap.add_argument("--spec", default="rate=100mbit,delay=10ms", help="the emulated path (mpquic-lab spec)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "handshake.json"))
    args = ap.parse_args()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpus": os.cpu_count(), "rounds": args.rounds, "paths": {}}
    report["paths"][f"emulated {args.spec}"] = run_path(f"emulated {args.spec}", args.rounds, specs=[args.spec])
    report["paths"]["veth"] = run_path("veth", args.rounds, emulated=False)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"(results in {args.out})")


if __name__ == "__main__":
    main()
