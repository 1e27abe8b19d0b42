"""mpquic-lab run: a short scenario end to end, and nothing left behind after a crash."""

import json
import os
import signal
import subprocess
import tempfile
import time

from conftest import report
from lab import topo

LAB = os.environ.get("MPQUIC_LAB_BIN", os.path.join(topo.REPO, "target", "release", "mpquic-lab"))

SMOKE = """name: smoke
description: two paths, path 1 black-holed for 3 s under a 20 ms ping
paths:
  - "rate=50mbit,delay=5ms"
  - "rate=50mbit,delay=10ms"
systems: [direct, mpquic]
mpquic:
  policy: failover
  priorities: [1, 2]
mpquic_variants:
  - {label: failover}
  - {label: fec, requires: [fec]}
traffic:
  - {kind: ping, interval: 20ms, duration: 8s}
schedule:
  - {at: 2s, path: 1, set: "state=blackhole"}
  - {at: 5s, path: 1, set: "state=up"}
sample: 500ms
"""


def mql_namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [l.split()[0] for l in out.splitlines() if l.startswith("mql-")]


def test_run_smoke_scenario():
    with tempfile.TemporaryDirectory() as d:
        scn = os.path.join(d, "smoke.yaml")
        with open(scn, "w") as f:
            f.write(SMOKE)
        out = os.path.join(d, "out")
        p = subprocess.Popen([LAB, "run", scn, "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        # The run removed its lab.
        assert [n for n in mql_namespaces() if n.startswith(f"mql-run{p.pid}-")] == []
        res = json.load(open(os.path.join(out, "results.json")))
        md = open(os.path.join(out, "report.md")).read()
        systems = {s["system"]: s for s in res["systems"]}
        assert systems["mpquic-fec"]["status"] == "unsupported"
        direct = systems["direct"]["traffic"][0]
        mpq = systems["mpquic-failover"]["traffic"][0]
        report(f"runner smoke: direct longest gap {direct['longest_gap_s']:.2f} s, "
               f"mpquic failover longest gap {mpq['longest_gap_s']:.2f} s; schedule applied "
               f"{[c['ok'] for c in systems['direct']['schedule_applied']]}")
        assert all(c["ok"] for c in systems["direct"]["schedule_applied"])
        assert direct["longest_gap_s"] > 2.5
        assert mpq["longest_gap_s"] < 1.0
        assert systems["mpquic-failover"]["path_mean_mbit"][0]["up_mbit"] > 0
        assert "## mpquic-failover (ok)" in md and "unsupported" in md


def test_interrupted_run_leaves_nothing_after_down_stale():
    with tempfile.TemporaryDirectory() as d:
        scn = os.path.join(d, "smoke.yaml")
        with open(scn, "w") as f:
            f.write(SMOKE)
        p = subprocess.Popen([LAB, "run", scn, "--out", os.path.join(d, "out")], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(4)
        mine = [n for n in mql_namespaces() if n.startswith(f"mql-run{p.pid}-")]
        assert mine, "the run had built its lab"
        os.killpg(p.pid, signal.SIGKILL)  # a crash: nothing of the runner's own cleanup runs
        p.wait()
        r = subprocess.run([LAB, "down", "--stale"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        left = [n for n in mql_namespaces() if n.startswith(f"mql-run{p.pid}-")]
        report(f"crash mid-run: {len(mine)} namespaces, {len(left)} left after down --stale ({r.stdout.strip()})")
        assert left == []
        assert not os.path.exists(f"/run/mpquic-lab/run{p.pid}")
