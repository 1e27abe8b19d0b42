"""Long round trips: a path of 600 ms RTT (a geostationary satellite: 300 ms each way, a 600 ms
queue), alone and bonded with a 40 ms one. It must come up within two round trips of its
handshake, carry TCP, never change state while it works, and fail over to and from the short
path both ways."""

import re
import signal
import time
from datetime import datetime

from conftest import report
import labctl

GEO = "rate=50mbit,delay=300ms,queue=600ms"
SHORT = "rate=50mbit,delay=20ms"
INTERVAL = 0.02


def stamp(line):
    """The time of a log line (RFC 3339, UTC), in seconds."""
    return datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()


def state_changes(log, path):
    """The log's path-state lines for `path`."""
    return [l for l in log.splitlines() if "path state" in l and f"path={path} " in l]


def handshake_to_up(log, path):
    """Seconds from the path's QUIC handshake to its first `up`, and the handshake's RTT."""
    hs = next(l for l in log.splitlines() if "QUIC handshake done" in l and f"path={path} " in l)
    up = next(l for l in state_changes(log, path) if 'to="up"' in l)
    rtt = float(re.search(r'handshake_ms="([\d.]+)"', hs).group(1)) / 1000
    return stamp(up) - stamp(hs), rtt


def outage(lab, p, back_within):
    """Path p black-holed both ways for 4 s, then repaired and waited for until it is up."""
    lab.block(p, "both")
    time.sleep(4)
    lab.unblock(p)
    name = f"wan{p + 1}"
    labctl.wait_until(f"{name} back up",
                      lambda: lab.path_status("client0", name)["state"] == "up", back_within)


def test_a_long_path_comes_up_carries_and_stays_up(make_lab):
    lab = make_lab(paths=1, mode=None, congestion=None, specs=[GEO])
    lab.start_tunnel(timeout=20)
    took, rtt = handshake_to_up(lab.log("client0"), "wan1")
    lab.iperf_server()
    up = lab.iperf(seconds=10)["end"]["sum_received"]["bits_per_second"] / 1e6
    down = lab.iperf(seconds=10, reverse=True)["end"]["sum_received"]["bits_per_second"] / 1e6
    changes = {k: state_changes(lab.log(k), "wan1") for k in ("client0", "server")}
    report(f"600 ms path: up {took:.3f} s after its handshake (handshake RTT {rtt:.3f} s); TCP "
           f"{up:.1f} up, {down:.1f} down Mbit/s; state changes: client {len(changes['client0'])}, "
           f"server {len(changes['server'])}")
    # The hello's round trip, then the first probe's.
    assert took <= 2 * rtt + 0.15, f"up {took:.3f} s after a handshake of {rtt:.3f} s"
    assert up > 10 and down > 10, (up, down)
    for key, lines in changes.items():
        assert len(lines) == 1, f"{key}: {lines}"


def test_a_long_path_bonded_with_a_short_one_fails_over_both_ways(make_lab):
    lab = make_lab(paths=2, mode=None, congestion=None, policy="wlb", priorities=[1, 1],
                   specs=[SHORT, GEO])
    lab.start_tunnel(timeout=20)
    lab.iperf_server()
    bonded = lab.iperf(seconds=8)["end"]["sum_received"]["bits_per_second"] / 1e6
    lab.start_ping("ping", interval=INTERVAL)
    time.sleep(2)
    # The short path dark both ways: the satellite carries; back, and then the satellite dark.
    outage(lab, 0, back_within=10)
    time.sleep(2)
    outage(lab, 1, back_within=15)
    lab.stop("ping", sig=signal.SIGINT)
    ping = labctl.parse_ping(lab.log("ping"))
    lost, longest = labctl.ping_gaps(ping, INTERVAL)
    changes = {p: state_changes(lab.log("client0"), p) for p in ("wan1", "wan2")}
    report(f"600 ms path bonded with a 40 ms one (wlb): one TCP flow up {bonded:.1f} Mbit/s; "
           f"ping every 20 ms through both outages: {len(lost)} of {ping['sent']} lost, longest "
           f"gap {longest * 1000:.0f} ms; state changes {[len(v) for v in changes.values()]}")
    assert bonded > 30, bonded
    # Each path: up, down for its outage, up again; nothing else.
    for p, lines in changes.items():
        assert len(lines) == 3, f"{p}: {lines}"
    # The short path's own failover bound (350 ms of silence and a probe interval, as on any
    # short path); the satellite carries nothing of one flow while the short path is up.
    assert longest <= 0.6, f"longest gap {longest * 1000:.0f} ms: lost {lost}"
