"""Path flaps: the paths black-holed one at a time at random (holes and gaps of 0.2-2 s) under four
TCP uploads. Afterwards both ends hold what they held before (fds, threads, runtime tasks; RSS
within 2 MiB 20 s after the storm), every path is up within seconds of the last repair at its link's full packet
size (an outage is not an MTU fall), and each path alone carries pings through the tunnel.
bench/flap.py runs the same for 300 s per policy and transport (docs/BENCHMARKS.md)."""

import random

import pytest

from conftest import measured, report
import flapstorm


@pytest.mark.parametrize("label,seconds,keys", [
    # mpquic's defaults (reliable mode, bbr) with per-packet bonding, as users flap today.
    ("wlb", 90, {"policy": "wlb"}),
    # The other transports' reconnect paths: datagram mode over two pipes per path, failover.
    ("failover-datagram-pipes2", 60, {"policy": "failover", "mode": "datagram", "pipes": [2, 2]}),
])
@measured
def test_a_flap_storm_leaves_no_trace(make_lab, label, seconds, keys):
    lab = make_lab(paths=2, specs=flapstorm.SPECS, mode=keys.get("mode"), congestion=None,
                   policy=keys["policy"], pipes=keys.get("pipes"))
    lab.start_all()
    seed = random.randrange(1 << 30)
    r = flapstorm.run(lab, seconds, seed)
    report(f"flap storm {label} (seed {seed}): " + flapstorm.summary(label, r))
    assert r["holes"] >= seconds / 4, r["holes"]
    problems = flapstorm.problems(r)
    assert not problems, "\n".join(problems) + "\n--- client log tail\n" + lab.log("client0")[-3000:]


@measured
def test_client_restarts_leave_no_trace_on_the_server(make_lab):
    """A client killed (SIGKILL) or stopped (SIGTERM) and started again, 20 times: its new session
    replaces the old one, and the server keeps nothing of the old ones."""
    lab = make_lab(paths=2, specs=flapstorm.SPECS, mode=None, congestion=None, policy="wlb")
    lab.start_all()
    r = flapstorm.restarts(lab, 20)
    b, a = r["before"], r["after"]
    report(f"20 client restarts in {r['seconds']} s, seen from the server: fds {b['fds']} -> {a['fds']}, "
           f"threads {b['threads']} -> {a['threads']}, tasks {b['tasks']} -> {a['tasks']} "
           f"(streams read {b['streams_in']} -> {a['streams_in']}), "
           f"RSS {b['rss_kib'] / 1024:.1f} -> {a['rss_kib'] / 1024:.1f} MiB, "
           f"{r['server_sessions']} session(s) left")
    assert a["fds"] == b["fds"], (b, a)
    assert a["threads"] == b["threads"], (b, a)
    assert flapstorm.own_tasks(a) == flapstorm.own_tasks(b), (b, a)
    assert a["rss_kib"] <= b["rss_kib"] + 2048, (b, a)
    assert r["server_sessions"] == 1
