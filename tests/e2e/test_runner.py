"""mpquic-lab run: a short scenario end to end, and nothing left behind after a crash."""

import json
import os
import signal
import subprocess
import tempfile
import time

from conftest import report
import labctl

LAB = labctl.LAB

WIREGUARD = os.path.join(labctl.REPO, "bench", "vpns", "wireguard-go.yaml")

SMOKE = """name: smoke
description: two paths, path 1 black-holed for 3 s under a 20 ms ping
paths:
  - "rate=50mbit,delay=5ms"
  - "rate=50mbit,delay=10ms"
systems: [direct, mpquic, wireguard-go]
vpns: {wireguard-go: @WIREGUARD@}
mpquic:
  policy: failover
  priorities: [1, 2]
mpquic_variants:
  - {label: failover}
  - {label: ipv6, requires: [ipv6]}
traffic:
  - {kind: ping, interval: 20ms, duration: 8s}
  - {kind: iperf3, label: tcp, duration: 8s, streams: 2, rate: 10M}
  - {kind: voice, label: call, duration: 8s}
  - {kind: web, label: web, duration: 8s, streams: 2, length: 50000}
schedule:
  - {at: 2s, path: 1, set: "state=blackhole"}
  - {at: 5s, path: 1, set: "state=up"}
sample: 500ms
""".replace("@WIREGUARD@", WIREGUARD)


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
        assert systems["mpquic-ipv6"]["status"] == "unsupported"
        direct = systems["direct"]["traffic"][0]
        mpq = systems["mpquic-failover"]["traffic"][0]
        report(f"runner smoke: direct longest gap {direct['longest_gap_s']:.2f} s, "
               f"mpquic failover longest gap {mpq['longest_gap_s']:.2f} s; schedule applied "
               f"{[c['ok'] for c in systems['direct']['schedule_applied']]}")
        assert all(c["ok"] for c in systems["direct"]["schedule_applied"])
        assert direct["longest_gap_s"] > 2.5
        assert mpq["longest_gap_s"] < 1.0
        assert systems["mpquic-failover"]["path_mean_mbit"][0]["up_mbit"] > 0
        # A voice-like call both ways: direct loses the black hole's 3 s of it, the tunnel fails over.
        dv, mv = systems["direct"]["traffic"][2], systems["mpquic-failover"]["traffic"][2]
        report(f"runner smoke: voice lost or late, direct up {dv['up']['bad_percent']:.1f}% down "
               f"{dv['down']['bad_percent']:.1f}%, mpquic failover up {mv['up']['bad_percent']:.1f}% down "
               f"{mv['down']['bad_percent']:.1f}%")
        for v in (dv, mv):
            assert 380 <= v["up"]["sent"] <= 410 and 380 <= v["down"]["sent"] <= 410, v
        assert dv["up"]["bad_percent"] > 25 and dv["down"]["bad_percent"] > 25
        assert mv["up"]["bad_percent"] < 15 and mv["down"]["bad_percent"] < 15
        assert "voice up:" in md
        # Web-like transfers (50 KB objects, 2 at a time, each on a new connection): every
        # object counted, with its completion time; the tunnel keeps fetching through the
        # black hole.
        dw, mw = systems["direct"]["traffic"][3]["result"], systems["mpquic-failover"]["traffic"][3]["result"]
        report(f"runner smoke: web objects fetched direct {dw['fetched']} (failed {dw['failed']}, p95 "
               f"{dw['completion_ms'] and dw['completion_ms']['p95']} ms), mpquic failover {mw['fetched']} "
               f"(failed {mw['failed']}, p95 {mw['completion_ms'] and mw['completion_ms']['p95']} ms)")
        assert mw["fetched"] > dw["fetched"] > 0, (dw, mw)
        assert mw["completion_ms"]["median"] <= mw["completion_ms"]["p95"] <= mw["completion_ms"]["max"]
        assert "web: " in md
        # Inner TCP's stalls, from the receiver's own ACKs: direct's two flows stop for the
        # black hole (3 s and the retransmission timer's back-off), the tunnel's fail over.
        t0 = systems["direct"]["t0_unix"]
        ds, ms = systems["direct"]["traffic"][1]["stalls"], systems["mpquic-failover"]["traffic"][1]["stalls"]
        report(f"runner smoke: tcp longest stall direct {ds['longest_ms']} ms from "
               f"{ds['longest_at_unix'] - t0:.2f} s ({ds['over_threshold']} of 200 ms or more), mpquic failover "
               f"{ms['longest_ms']} ms ({ms['over_threshold']}); ACKs not captured {ds['capture_drops']} / "
               f"{ms['capture_drops']}")
        assert ds["flows"] == 2 and ms["flows"] == 2, (ds, ms)
        assert ds["longest_ms"] > 2800 and 1.5 < ds["longest_at_unix"] - t0 < 2.3, ds
        assert ds["over_threshold"] >= 2 and ds["capture_drops"] == 0, ds
        assert ms["longest_ms"] < 2000, ms
        assert "longest stall" in md
        assert "## mpquic-failover (ok)" in md and "unsupported" in md
        # Another VPN from commands (bench/vpns/wireguard-go.yaml): single path, so the black hole
        # cuts it off like the direct baseline; its daemons' CPU and RSS are sampled.
        wg = systems["wireguard-go"]
        assert wg["status"] == "ok", wg.get("reason")
        wg_ping, wg_tcp = wg["traffic"][:2]
        report(f"runner smoke: wireguard-go longest gap {wg_ping['longest_gap_s']:.2f} s, "
               f"tcp {wg_tcp['mbit']:.1f} Mbit/s; rss {[p['rss_kib'] for p in wg['samples'][-1]['procs']]} KiB")
        assert wg_ping["longest_gap_s"] > 2.5 and wg_tcp["mbit"] > 5
        assert [p["name"] for p in wg["samples"][-1]["procs"]] == ["server: wireguard-go", "client: wireguard-go",
                                                                   "emulator (mpquic-lab)"]
        assert all(p["rss_kib"] for p in wg["samples"][-1]["procs"])
        assert "| mpquic server |" in md and "| client: wireguard-go |" in md
        # The emulator's CPU beside the tunnel's, for every system that ran (direct too).
        ran = [s for s in systems.values() if s["status"] == "ok"]
        assert md.count("| emulator (mpquic-lab) |") == len(ran), md
        # Where loss happens: the kernel's drops at each tunnel interface and mpquic's own counters.
        assert md.count("Client tunnel interface:") == 2 and "mpquic drops at the end:" in md
        assert wg["samples"][0]["tunnel_if"]["tx_packets"] is not None  # sampled from the first sample on
        # Plots: three per system that ran, real PNGs, linked from the report.
        for system in ("direct", "mpquic-failover", "wireguard-go"):
            for plot in ("throughput", "rtt", "loss"):
                rel = f"{system}/{plot}.png"
                with open(os.path.join(out, rel), "rb") as f:
                    png = f.read()
                assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000, rel
                assert f"]({rel})" in md
        # The ping series carries run times: the black hole (t=2..5 s) shows as unanswered pings.
        lost_at = [t for t, rtt in direct["series"] if rtt is None]
        assert lost_at and 1.8 < min(lost_at) < 2.3 and 4.7 < max(lost_at) < 5.3, (min(lost_at), max(lost_at))
        # `plot` redraws from results.json alone.
        os.remove(os.path.join(out, "direct", "rtt.png"))
        r = subprocess.run([LAB, "plot", out], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert os.path.getsize(os.path.join(out, "direct", "rtt.png")) > 10000


BROKEN_VPN = """description: a VPN whose client daemon cannot start
daemons:
  - {ns: server, cmd: "sleep 600"}
  - {ns: client, cmd: "/nonexistent/vpn-client --up"}
tunnel: {client_if: "tun{{id}}", cidr: 10.202.0.0/24}
"""


def test_failing_vpn_step_is_named_and_the_lab_removed():
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "broken.yaml"), "w") as f:
            f.write(BROKEN_VPN)
        scn = os.path.join(d, "s.yaml")
        with open(scn, "w") as f:
            f.write("name: broken\npaths: [\"delay=5ms\"]\nsystems: [broken]\nvpns: {broken: broken.yaml}\n"
                    "traffic:\n  - {kind: ping, duration: 2s}\n")
        out = os.path.join(d, "out")
        p = subprocess.Popen([LAB, "run", scn, "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err  # the run completes; the system is reported failed
        res = json.load(open(os.path.join(out, "results.json")))
        reason = res["systems"][0]["reason"]
        report(f"broken VPN: {res['systems'][0]['status']}: {reason.splitlines()[0]}")
        assert res["systems"][0]["status"] == "failed"
        assert "daemons[1]" in reason and "vpn-client" in reason
        assert [n for n in mql_namespaces() if n.startswith(f"mql-run{p.pid}-")] == []


def start_smoke_run(d):
    """The smoke scenario started in its own process group; returns it once its lab exists."""
    scn = os.path.join(d, "smoke.yaml")
    with open(scn, "w") as f:
        f.write(SMOKE)
    p = subprocess.Popen([LAB, "run", scn, "--out", os.path.join(d, "out")], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(4)
    mine = [n for n in mql_namespaces() if n.startswith(f"mql-run{p.pid}-")]
    assert mine, "the run had built its lab"
    return p, mine


def test_interrupted_run_leaves_nothing_after_down_stale():
    with tempfile.TemporaryDirectory() as d:
        p, mine = start_smoke_run(d)
        os.killpg(p.pid, signal.SIGKILL)  # a crash: nothing of the runner's own cleanup runs
        p.communicate(timeout=30)
        r = subprocess.run([LAB, "down", "--stale"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        left = [n for n in mql_namespaces() if n.startswith(f"mql-run{p.pid}-")]
        report(f"crash mid-run: {len(mine)} namespaces, {len(left)} left after down --stale ({r.stdout.strip()})")
        assert left == []
        assert not os.path.exists(f"/run/mpquic-lab/run{p.pid}")


def test_ctrl_c_removes_the_lab():
    with tempfile.TemporaryDirectory() as d:
        p, mine = start_smoke_run(d)
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground process group
        _, err = p.communicate(timeout=30)
        left = [n for n in mql_namespaces() if n.startswith(f"mql-run{p.pid}-")]
        report(f"Ctrl-C mid-run: exit {p.returncode}, {len(mine)} namespaces, {len(left)} left")
        assert p.returncode == 130, err
        assert "interrupted: removing lab" in err
        assert left == [] and not os.path.exists(f"/run/mpquic-lab/run{p.pid}")
