"""A path configured `link: starlink` expects Starlink's reconfigurations at 12, 27, 42 and 57 s
past each minute of UTC, and both ends copy the small packets that are not TCP onto the other
path around each one. Here wan1 black-holes for 150 ms from such a second, as a dish's loss burst
does: pings through the tunnel lose none of it, and none comes twice; the client's probes
lost in it are not counted as the path's loss (which would move calls onto its stream), and the
burst does not take the path down (which would close its connection and dial it again). That
the burst took
packets is the emulator's count; that without the key the same burst takes the call's packets is
the simulator's (crates/core/tests/sim.rs, `a_call_rides_through_starlink_reconfigurations`).

A path whose `link` is not configured is recognised as Starlink when it loses such a burst at
each boundary (the client's probes show it; the server learns it from them), and the other path,
which loses nothing, is not."""

import json
import math
import signal
import time

from conftest import report
import labctl
from test_metered import with_path_keys

INTERVAL = 0.01
# Inside the copies' window (100 ms before to 300 ms after the second), with room for the
# emulator's command to take effect.
BURST = 0.15
SPECS = ["rate=50mbit,delay=10ms", "rate=50mbit,delay=10ms"]


def next_boundary(after):
    """The first Starlink boundary (12 s past the minute, then every 15 s) `after` seconds or
    more from now, on the wall clock."""
    t = time.time() + after
    return 12 + 15 * math.ceil((t - 12) / 15)


def blackholed(lab):
    """Packets the emulator dropped on wan1 (both ways) for its `state=blackhole`."""
    for x in json.loads(labctl.lab_cmd("stats", lab.name))["paths"]:
        if x["index"] == 1:
            return sum(x[d]["stats"]["dropped_state"] for d in ("up", "down"))
    raise KeyError(1)


def wan1_connects(lab):
    """How many connections wan1 has had, on each side."""
    return {k: next(p for p in lab.status(k)["tunnels"][0]["paths"] if p["name"] == "wan1")
            ["connects"] for k in ("client0", "server")}


def test_a_call_rides_through_a_starlink_reconfiguration(make_lab):
    lab = make_lab(paths=2, mode=None, congestion=None, specs=SPECS)
    lab.start_tunnel(client=lambda y: with_path_keys(y, "wan1", ["link: starlink"]),
                     up=["wan1", "wan2"])
    b = next_boundary(2.0)
    time.sleep(max(0.0, b - 1.5 - time.time()))
    lab.start_ping("ping", interval=INTERVAL)
    connects = wan1_connects(lab)
    time.sleep(max(0.0, b - time.time()))
    lab.block(0)
    time.sleep(max(0.0, b + BURST - time.time()))
    lab.unblock(0)
    time.sleep(1.5)
    ping, lost, dups = labctl.stop_ping_counted(lab, "ping", INTERVAL)
    dropped = blackholed(lab)
    statuses = {k: lab.status(k)["tunnels"][0] for k in ("client0", "server")}
    connects_after = wan1_connects(lab)
    wan1 = {k: next(p for p in t["paths"] if p["name"] == "wan1") for k, t in statuses.items()}
    copies = {k: p["reconfig_copies"] for k, p in wan1.items()}
    probes = wan1["client0"]
    second = {k: t["reorder"]["duplicates"] for k, t in statuses.items()}
    report(f"link: starlink, {BURST * 1000:.0f} ms black hole on wan1 at a Starlink boundary "
           f"({dropped} packets dropped there): {lost} of {ping['sent']} pings lost, {dups} "
           f"duplicate replies; copies sent {copies}, second copies dropped {second}; client "
           f"probes not counted {probes['probes_across_reconfig']}, probe loss "
           f"{probes['probe_loss_pct']:.1f}%; wan1's connections before / after {connects} / "
           f"{connects_after}")
    assert dropped >= 5, dropped
    assert lost == 0 and dups == 0, (lost, dups)
    for k in ("client0", "server"):
        assert wan1[k]["link"] == "starlink", wan1[k]
        # 50-70 pings a second each way for 0.4 s: ~20 copies per side, each dropped at the
        # other end unless the burst took the original.
        assert copies[k] >= 10 and second[k] >= 5, (copies, second)
    # A probe every 100 ms, 0.4 s of window and a round trip: three or more, one or two of
    # them lost in the burst, none counted.
    assert probes["probes_across_reconfig"] >= 3, probes
    assert probes["probe_loss_pct"] == 0.0, probes
    assert connects_after == connects, (connects, connects_after)


def wan(lab, key, name):
    return next(p for p in lab.status(key)["tunnels"][0]["paths"] if p["name"] == name)


# Enough boundaries for the detector's verdict (four, when nothing changes between them) with
# room to spare, each judged about 5 s after it.
MAX_BOUNDARIES = 7


def recognised_by(lab, until):
    """wan1's status on the client once it says `starlink`, polled until `until` (or None)."""
    while True:
        w = wan(lab, "client0", "wan1")
        if w.get("link") == "starlink":
            return w
        if time.time() >= until:
            return None
        time.sleep(0.2)


def test_an_unconfigured_starlink_link_is_recognised(make_lab):
    lab = make_lab(paths=2, mode=None, congestion=None, specs=SPECS)
    lab.start_tunnel(up=["wan1", "wan2"])
    assert wan(lab, "client0", "wan1").get("link", "") == ""
    # Traffic, as a site has: the tunnel is not quiet, so the paths probe every 100 ms. (A
    # quiet tunnel probes every 500 ms, on the same phase of each 15 s slot: a burst that
    # falls between two probes is missed at every boundary. The delay steps that a
    # reconfiguration also brings are seen at any interval.)
    lab.start_ping("ping", interval=0.05)
    bursts = 0
    recognised = None
    while recognised is None and bursts < MAX_BOUNDARIES:
        b = next_boundary(0.5)
        recognised = recognised_by(lab, b - 0.3)
        if recognised is None:
            time.sleep(max(0.0, b - time.time()))
            lab.block(0)
            time.sleep(max(0.0, b + BURST - time.time()))
            lab.unblock(0)
            bursts += 1
    # The last burst's verdict is due about 5 s after it.
    recognised = recognised or recognised_by(lab, time.time() + 8.0)
    client = wan(lab, "client0", "wan1")
    report(f"wan1 black-holed {BURST * 1000:.0f} ms at {bursts} Starlink boundaries, link not "
           f"configured: client link={client.get('link', '')!r} recognised="
           f"{client.get('link_recognised')} ({client.get('link_evidence', '')})")
    assert recognised is not None, client
    assert recognised["link_recognised"] is True, recognised
    assert "boundaries changed" in recognised["link_evidence"], recognised
    # The server learns it from the client's next probes.
    t = time.time() + 2.0
    while wan(lab, "server", "wan1").get("link") != "starlink" and time.time() < t:
        time.sleep(0.1)
    assert wan(lab, "server", "wan1").get("link") == "starlink"
    for k in ("client0", "server"):
        assert wan(lab, k, "wan2").get("link", "") == "", wan(lab, k, "wan2")
    lab.stop("ping", sig=signal.SIGINT)
