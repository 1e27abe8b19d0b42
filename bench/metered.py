#!/usr/bin/env python3
"""Metered-link figures from a lab run's results.json (scenarios 20-22).

  bench/metered.py caps    RESULTS.json            # 20-rate-limit: each direction's IP rate vs the cap
  bench/metered.py backup  RESULTS.json --down 10 --up 20   # 21-backup-role
  bench/metered.py budget  RESULTS.json            # 22-data-budget

Rates are IP packets whole (the interface counters' frames less 14 bytes of Ethernet header
each), which is what `rate_limit` and `data_budget` count."""

import argparse
import json

ETHERNET = 14


def ip_bytes(sample, path, direction):
    p = sample["paths"][path]
    b, n = p[f"{direction}_bytes"] or 0, p.get(f"{direction}_packets") or 0
    return b - ETHERNET * n


def window(samples, t0, t1):
    inside = [s for s in samples if t0 <= s["t_s"] <= t1]
    return (inside[0], inside[-1]) if len(inside) >= 2 else (None, None)


def rate(samples, path, direction, t0, t1):
    """Mean Mbit/s of IP packets on `path` (0-based), `tx` or `rx`, between t0 and t1."""
    a, b = window(samples, t0, t1)
    if a is None:
        return None
    return (ip_bytes(b, path, direction) - ip_bytes(a, path, direction)) * 8 / (b["t_s"] - a["t_s"]) / 1e6


def client_paths(system):
    return ((system.get("mpquic_status") or {}).get("client") or {}).get("tunnels", [{}])[0].get("paths", [])


def caps(d, _):
    for s in d["systems"]:
        cap = next((p.get("rate_limit_mbit") for p in client_paths(s)), None)
        for t in s["traffic"]:
            if t["kind"] != "iperf3":
                continue
            dur = len(t.get("intervals_mbit") or [])
            # The first 2 s (slow start, the cap's first burst) and the last second out.
            t0, t1 = t["start_s"] + 2, t["start_s"] + dur - 1
            direction = "rx" if t["reverse"] else "tx"
            r = rate(s["samples"], 0, direction, t0, t1)
            vs = f"  {r / cap:.3f}x the cap" if cap and r else ""
            print(f"{s['system']:<16} {t['label']:<6} cap {cap or '-':>5} Mbit/s  on the link {r:7.2f} Mbit/s{vs}"
                  f"  (TCP goodput {t['mbit']:.2f})")


def backup(d, a):
    for s in d["systems"]:
        smp = s["samples"]
        both = lambda p, t0, t1: sum(rate(smp, p, x, t0, t1) or 0 for x in ("tx", "rx"))
        p1, p2 = both(0, 2, a.down), both(1, 2, a.down)
        share = 100 * p2 / max(p1 + p2, 1e-9)
        during = both(1, a.down + 1, a.up - 1)
        # After the repair: the first time from which path 2 carries < 1% of the total for 3 s.
        idle = None
        steps = [x["t_s"] for x in smp if x["t_s"] > a.up]
        for i, t in enumerate(steps):
            ok = all(both(1, u, u + 0.5) < 0.01 * max(both(0, u, u + 0.5), 1e-9)
                     for u in steps[i:] if u + 0.5 <= t + 3)
            if ok:
                idle = t - a.up
                break
        gap = next((t.get("longest_gap_s") for t in s["traffic"] if t["kind"] == "ping"), None)
        udp = next((t for t in s["traffic"] if t.get("protocol") == "udp"), None)
        over = ""
        if udp:
            u0, u1 = udp["start_s"] + 1, udp["start_s"] + len(udp.get("intervals_mbit") or []) - 1
            over = (f"; offered {udp.get('sent_mbit', 0):.0f} Mbit/s of UDP: path 1 {rate(smp, 0, 'rx', u0, u1):.1f}, "
                    f"path 2 {rate(smp, 1, 'rx', u0, u1):.1f} Mbit/s, {udp['mbit']:.1f} delivered")
        print(f"{s['system']:<18} backup's share while path 1 up {share:.3f}% ({p2 * 1000:.0f} kbit/s of "
              f"{(p1 + p2):.1f} Mbit/s); carries {during:.1f} Mbit/s while path 1 is down; longest ping gap "
              f"{gap:.2f} s; idle again {idle if idle is None else f'{idle:.2f} s'} after the repair{over}")


def budget(d, _):
    for s in d["systems"]:
        smp = s["samples"]
        total = lambda x: sum(ip_bytes(x, 0, k) for k in ("tx", "rx"))
        used = total(smp[-1]) - total(smp[0])
        # When path 1 stopped carrying: the last sample interval in which it moved more than
        # 100 kB (probes and ACKs move a few kB a second).
        stopped, at_stop = None, None
        for a_, b_ in zip(smp, smp[1:]):
            if total(b_) - total(a_) > 100_000:
                stopped, at_stop = b_["t_s"], total(b_) - total(smp[0])
        st = next((p.get("budget") for p in client_paths(s)), None) or {}
        limit = st.get("limit_bytes")
        print(f"{s['system']:<12} path 1 carried {at_stop / 1e6:.2f} MB until {stopped:.1f} s"
              + (f" ({at_stop / limit:.4f}x the {limit / 1e6:.0f} MB budget)" if limit else "")
              + f", {used / 1e6:.2f} MB in the whole run; status: {st.get('state')}, used {st.get('used_bytes')} bytes,"
              f" role {next((p.get('role') for p in client_paths(s)), None)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["caps", "backup", "budget"])
    ap.add_argument("results")
    ap.add_argument("--down", type=float, default=10.0)
    ap.add_argument("--up", type=float, default=20.0)
    a = ap.parse_args()
    d = json.load(open(a.results))
    {"caps": caps, "backup": backup, "budget": budget}[a.what](d, a)


if __name__ == "__main__":
    main()
