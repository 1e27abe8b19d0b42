#!/usr/bin/env python3
"""Flap storms: what a path that drops out every few seconds leaves behind.

Two lab paths (100 Mbit/s 5 ms and 50 Mbit/s 10 ms one way), four TCP uploads through the
tunnel, and the paths black-holed one at a time at random (holes and gaps of 0.2-2 s) for
`--seconds`; then, on both ends: fds, threads and RSS against the baseline taken before the
storm (20 s after its end), how soon every path is up again, each path's packet size, and pings
through the tunnel on each path alone (tests/e2e/flapstorm.py). One run per variant: mpquic's
defaults (reliable mode, bbr) under each policy, and with `wlb` datagram mode, `pipes: 2` and
stripe paths.

    sudo python3 bench/flap.py [--seconds 300] [--variants wlb,datagram] [--out bench/results/flap.json]
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))

import flapstorm  # noqa: E402
import labctl  # noqa: E402

# label: the Lab's configuration keys beyond the defaults (what the row ran).
VARIANTS = {
    "failover": {"policy": "failover"},
    "balanced": {"policy": "balanced"},
    "wlb": {"policy": "wlb"},
    "datagram": {"policy": "wlb", "mode": "datagram"},
    "pipes2": {"policy": "wlb", "pipes": [2, 2]},
    "stripe": {"policy": "wlb", "transport": ["stripe", "stripe"]},
}


def run_variant(label, seconds, seed):
    keys = VARIANTS[label]
    with labctl.Lab(paths=2, specs=flapstorm.SPECS, mode=keys.get("mode"), congestion=None,
                    policy=keys["policy"], pipes=keys.get("pipes"),
                    transport=keys.get("transport")) as lab:
        lab.start_all()
        r = flapstorm.run(lab, seconds, seed)
    r["config"] = {"multipath_policy": keys["policy"], **{k: v for k, v in keys.items() if k != "policy"}}
    r["problems"] = flapstorm.problems(r)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.path.join(labctl.REPO, "bench", "results", "flap.json"))
    a = ap.parse_args()
    labctl.run([labctl.LAB, "down", "--stale"], check=False)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "-C", labctl.REPO, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "paths": flapstorm.SPECS,
        "upload_streams": flapstorm.UPLOAD_STREAMS,
        "runs": {},
    }
    for label in a.variants.split(","):
        r = run_variant(label, a.seconds, a.seed)
        out["runs"][label] = r
        print(flapstorm.summary(label, r), flush=True)
        for p in r["problems"]:
            print(f"  PROBLEM {p}", flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    bad = [label for label, r in out["runs"].items() if r["problems"]]
    print(f"wrote {a.out}; " + (f"problems in {bad}" if bad else "no variant left a trace"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
