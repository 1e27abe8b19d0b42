#!/usr/bin/env python3
"""How soon a repaired path carries its share again, from a lab run's results.json.

  bench/share_return.py RESULTS.json --path 1 --down 10 --up 20 [--direction down]

For each system: the path's share of the bytes over the paths before the failure (from 2 s in
until it), and the first time after the repair from which its share stays at >= 80% of that
for `--hold` seconds (default 5: a share regained and lost again does not count)."""

import argparse
import json


def rates(samples, path, key):
    """(t, path's bytes/s, all paths' bytes/s) between consecutive samples."""
    out = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t_s"] - a["t_s"]
        if dt <= 0:
            continue
        mine = (b["paths"][path][key] - a["paths"][path][key]) / dt
        total = sum(q[key] - p[key] for p, q in zip(a["paths"], b["paths"])) / dt
        out.append((b["t_s"], mine, total))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--path", type=int, default=1, help="1-based")
    ap.add_argument("--down", type=float, required=True, help="failure time (s)")
    ap.add_argument("--up", type=float, required=True, help="repair time (s)")
    ap.add_argument("--direction", choices=["down", "up"], default="down")
    ap.add_argument("--hold", type=float, default=5.0, help="seconds the share must hold")
    a = ap.parse_args()
    key = "rx_bytes" if a.direction == "down" else "tx_bytes"
    d = json.load(open(a.results))
    for s in d["systems"]:
        r = rates(s["samples"], a.path - 1, key)
        before = [(m, t) for (ts, m, t) in r if 2.0 <= ts <= a.down]
        share = sum(m for m, _ in before) / max(1, sum(t for _, t in before))
        back = None
        after = [(ts, m / t if t else 0.0) for (ts, m, t) in r if ts > a.up]
        for i, (ts, _) in enumerate(after):
            window = [sh for (t2, sh) in after[i:] if t2 <= ts + a.hold]
            if window and all(sh >= 0.8 * share for sh in window):
                # The sample's interval ended at ts: the share was back from its start.
                back = ts - (after[i][0] - after[i - 1][0] if i else 0.0) - a.up
                break
        print(f"{s['system']}: path {a.path} share before the failure {100 * share:.1f}%; "
              + (f"back to >= 80% of it {max(0.0, back):.2f} s after the repair" if back is not None
                 else "not back by the end of the run"))


if __name__ == "__main__":
    main()
