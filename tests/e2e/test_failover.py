"""Failover: ping every 10 ms from the LAN host while WAN 1 fails in three ways, then is repaired."""

import signal
import time

import pytest

from conftest import measured, report
import labctl

INTERVAL = 0.01


def path_tx(lab, key, name):
    return lab.path_status(key, name)["tx_packets"]


def wait_using(lab, key, name, timeout, t0):
    """Seconds from `t0` until path `name` is up and carrying traffic on instance `key`, or None."""
    last = path_tx(lab, key, name)
    while time.monotonic() - t0 < timeout:
        time.sleep(0.05)
        p = lab.path_status(key, name)
        if p["state"] == "up" and p["tx_packets"] > last:
            return time.monotonic() - t0
        last = p["tx_packets"]
    return None


def stop_ping(lab):
    """Stop the running ping; its output, parsed form, lost sequence numbers and longest gap."""
    lab.stop("ping", sig=signal.SIGINT)
    out = lab.log("ping")
    ping = labctl.parse_ping(out)
    lost, longest = labctl.ping_gaps(ping, INTERVAL)
    return out, ping, lost, longest


def fail_under_ping(lab, inject):
    """Start the tunnel, ping every 10 ms, and after 1.5 s `inject` a fault on path 1: the
    moment of the fault and the seconds until the client carries traffic on path 2 (or None)."""
    lab.start_tunnel()
    lab.start_ping("ping", interval=INTERVAL)
    time.sleep(1.5)
    t_fail = time.monotonic()
    inject()
    return t_fail, wait_using(lab, "client0", "wan2", 5, t_fail)


def fmt(t):
    return "never" if t is None else f"{t:.2f} s"


FAULTS = {
    "link_down": (lambda lab: lab.link_down(0), lambda lab: lab.link_up(0)),
    "block_both": (lambda lab: lab.block(0, "both"), lambda lab: lab.unblock(0)),
    "block_server_to_client": (lambda lab: lab.block(0, "down"), lambda lab: lab.unblock(0)),
    # The client's packets vanish while the server's still arrive, ACK frames among them.
    "block_client_to_server": (lambda lab: lab.block(0, "up"), lambda lab: lab.unblock(0)),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_failover_and_return(make_lab, fault):
    lab = make_lab(paths=2, policy="failover")
    lab.start_tunnel()
    assert lab.ping(count=3, interval=0.05)["received"] == [1, 2, 3]
    inject, repair = FAULTS[fault]

    lab.start_ping("ping", interval=INTERVAL)
    t_start = time.monotonic()
    time.sleep(1.5)
    assert path_tx(lab, "client0", "wan1") > 50, "traffic starts on the primary"
    t_fail = time.monotonic()
    inject(lab)
    to_backup_cli = wait_using(lab, "client0", "wan2", 5, t_fail)
    to_backup_srv = wait_using(lab, "server", "wan2", 5, t_fail)
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t_fail)))
    t_repair = time.monotonic()
    repair(lab)
    back_cli = wait_using(lab, "client0", "wan1", 8, t_repair)
    back_srv = wait_using(lab, "server", "wan1", 8, t_repair)
    time.sleep(1.0)
    _, ping, lost, longest = stop_ping(lab)
    # Sequence numbers sent after the failover settled (1 s after the fault) until the end,
    # except the last 0.2 s: pings still in flight when ping was stopped are not losses.
    interval = labctl.sent_interval(ping, INTERVAL)
    settled = int((t_fail - t_start + 1.0) / interval)
    in_flight_at_stop = ping["sent"] - int(0.2 / interval)
    lost_after = [s for s in lost if settled < s <= in_flight_at_stop]
    report(f"failover {fault}: longest ping gap {longest * 1000:.0f} ms, {len(lost)} of {ping['sent']} pings lost; "
           f"on wan2 after {fmt(to_backup_cli)} (client) / {fmt(to_backup_srv)} (server); "
           f"back on wan1 {fmt(back_cli)} / {fmt(back_srv)} after repair; "
           f"lost after failover settled: {len(lost_after)}")
    assert to_backup_cli is not None and to_backup_cli < 1.0, to_backup_cli
    assert to_backup_srv is not None and to_backup_srv < 1.0, to_backup_srv
    assert longest < 1.0, f"gap {longest}s"
    assert back_cli is not None and back_cli < 5.0, (back_cli, lab.log("client0")[-3000:])
    assert back_srv is not None and back_srv < 5.0, (back_srv, lab.log("server")[-3000:])
    assert lost_after == [], (lost_after, t_repair - t_start)


def test_reliable_failover_delivers_nothing_late(make_lab):
    """Reliable mode: a path that goes down hands its recent packets to the live path and is
    closed, so nothing queued on its stream arrives seconds later when it recovers (scenario 03
    had 22 of 3000 pings answered more than 1 s late)."""
    lab = make_lab(paths=2, policy="failover", mode="reliable")
    t_fail, to_backup = fail_under_ping(lab, lambda: lab.block(0, "both"))
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t_fail)))
    t_repair = time.monotonic()
    lab.unblock(0)
    back = wait_using(lab, "client0", "wan1", 10, t_repair)
    time.sleep(1.5)
    out, ping, lost, longest = stop_ping(lab)
    late = [r for r in ping["rtts"] if r > 1000]
    dups = out.count("DUP!")
    report(f"reliable failover: longest gap {longest * 1000:.0f} ms, {len(lost)} of {ping['sent']} lost, "
           f"{len(late)} answered > 1 s late (max RTT {max(ping['rtts']):.0f} ms), {dups} duplicates; "
           f"on wan2 after {fmt(to_backup)}, back on wan1 {fmt(back)} after repair")
    assert to_backup is not None and to_backup < 1.0, to_backup
    assert late == [], late
    assert longest < 1.0, longest
    # Copies come only from the hand-over window (silence bound + a round trip: ~40 pings).
    assert dups <= 50, dups
    assert back is not None and back < 8.0, (back, lab.log("client0")[-3000:])


@pytest.mark.parametrize("direction", ["both", "up", "down"])
@measured
def test_default_black_hole_loses_no_ping(make_lab, direction):
    """The default transport (`auto`): the path is on its stream (quiet), pings are not TCP, so
    they go as datagrams kept for a hand-over as the stream's chunks are, and a path taken out
    of use hands what it sent lately to the live path. A black hole of
    the primary, either way or both, then loses no ping (one at most, at the fault's edge). The client-to-server one ("up") is
    the hard case: the server's packets still arrive, each repeating its last ACK frame, and
    the ACK watch must not take them for acknowledgements (it did: 6-7 pings of 10 ms lost)."""
    lab = make_lab(paths=2, policy="failover", mode=None)
    # Round trips of 10 and 30 ms (the matrix's black-hole cell): the server repeats its ACK
    # frames at its retransmission timer's pace, which a sub-millisecond path makes too short
    # to show the difference.
    lab.set_link(0, "delay=5ms")
    lab.set_link(1, "delay=15ms")
    t_fail, to_backup = fail_under_ping(lab, lambda: lab.block(0, direction))
    time.sleep(max(0.0, 2.0 - (time.monotonic() - t_fail)))
    lab.unblock(0)
    time.sleep(1.5)
    _, ping, lost, longest = stop_ping(lab)
    # Pings still in flight when ping was stopped are not losses.
    lost = [s for s in lost if s <= ping["sent"] - int(0.2 / labctl.sent_interval(ping, INTERVAL))]
    report(f"default, black hole {direction}: {len(lost)} of {ping['sent']} pings lost, longest gap "
           f"{longest * 1000:.0f} ms, on wan2 after {fmt(to_backup)}")
    assert to_backup is not None and to_backup < 1.0, to_backup
    # One ping at the fault's edge is lost now and then (1 run in 6 here, 1 fault in 9 in the
    # matrix): the hand-over reaches back from the watch's first unacknowledged send, and a
    # ping sent just before an in-flight ACK arrived can fall outside it. Not yet understood;
    # the bug this test is for lost 6.
    assert len(lost) <= 1, (lost, lab.log("client0")[-3000:])


def test_an_idle_backup_keeps_its_connection_through_a_short_outage(make_lab):
    """A failover's backup carries nothing; black-holed for a moment (an LTE link's delivery
    stops for up to 0.9 s), its probes go unanswered and it goes down. It keeps its connection:
    nothing it carried can arrive late, and it is up again at its next answered probe. (Closed,
    it was dialled anew at every such gap, the new handshake's first packet often lost in it:
    up to a second each time without a backup.)"""
    lab = make_lab(paths=2, policy="failover", mode=None)
    lab.start_tunnel(up=["wan1", "wan2"])
    lab.start_ping("ping", interval=0.05)
    before = {k: lab.path_status(k, "wan2")["connects"] for k in ("client0", "server")}
    t0 = time.monotonic()
    lab.block(1, "both")
    # Out of use on the client: `down` (its connection kept) or, closed, being dialled anew.
    def state():
        return lab.path_status("client0", "wan2")["state"]
    labctl.wait_until("wan2 out of use on the client", lambda: state() != "up", timeout=5)
    down = state()
    t_down = time.monotonic() - t0
    lab.unblock(1)
    labctl.wait_until("wan2 up again", lambda: all(
        lab.path_status(k, "wan2")["state"] == "up" for k in ("client0", "server")), timeout=5)
    t_up = time.monotonic() - t0
    after = {k: lab.path_status(k, "wan2")["connects"] for k in ("client0", "server")}
    lab.stop("ping", sig=signal.SIGINT)
    ping = labctl.parse_ping(lab.log("ping"))
    lost, _ = labctl.ping_gaps(ping, 0.05, unanswered_tail=0.2)
    report(f"idle backup black-holed until {down} ({t_down:.2f} s), up again at {t_up:.2f} s; "
           f"its connections before / after {before} / {after}; {len(lost)} of {ping['sent']} "
           f"pings on wan1 lost")
    assert down == "down" and after == before, (down, before, after)
    assert not lost, lost
