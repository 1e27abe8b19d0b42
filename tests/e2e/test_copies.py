"""Small packets that are not TCP (a call, DNS, a ping) also go on a second path, and the
receiver keeps the first copy. On a spare path (up, of the same priority, a primary, no data
budget) they go twice all along: here wan1 loses 10% each way under pings every 10 ms, from the
first ping, and the pings lose nothing. Onto a path kept standing by (here one of a higher
priority number; a metered one or a backup alike, which the simulator and the unit tests cover)
only while a path loses data, for a second after its connection last declared a loss: the pings
lose only what went before the first loss was declared, and once wan1 is clean again the copies
stop. In both none comes twice and both ends count the copies. That the copies carry a call through an
overflowing queue's losses is the simulator's (crates/core/tests/sim.rs,
`a_call_beside_a_losing_path_gets_copies_on_the_other`) and the lab's (docs/BENCHMARKS.md, "Real
links")."""

import signal
import time

from conftest import report
import labctl

INTERVAL = 0.01
SPECS = ["rate=50mbit,delay=10ms", "rate=50mbit,delay=10ms"]


def copies(lab, why):
    """Copies for `why` counted on either path, each side: a copy counts on the path it went
    first, and with both paths of one priority the server may send on wan2 (its paths in the
    order they connected)."""
    return {k: sum(p[f"{why}_copies"] for p in lab.status(k)["tunnels"][0]["paths"])
            for k in ("client0", "server")}


def duplicates(lab):
    return {k: lab.status(k)["tunnels"][0]["reorder"]["duplicates"] for k in ("client0", "server")}


def pings_over_lossy_wan1(lab, seconds):
    """wan1 set to lose 10% each way, pings every 10 ms for `seconds`: ping's parsed output,
    the pings lost and the duplicate replies."""
    lab.set_link(0, "loss=10%")
    lab.start_ping("ping", interval=INTERVAL)
    time.sleep(seconds)
    return labctl.stop_ping_counted(lab, "ping", INTERVAL)


def test_small_packets_go_twice_on_a_spare_path(make_lab):
    lab = make_lab(paths=2, priorities=[1, 1], mode=None, congestion=None, specs=SPECS)
    lab.start_tunnel(up=["wan1", "wan2"])
    ping, lost, dups = pings_over_lossy_wan1(lab, 3.0)
    spare, loss, second = copies(lab, "spare"), copies(lab, "loss"), duplicates(lab)
    report(f"wan1 losing 10% each way, wan2 spare, pings every 10 ms: {lost} of {ping['sent']} "
           f"lost, {dups} duplicate replies; copies on the spare path {spare}, for loss {loss}, "
           f"second copies dropped {second}")
    assert dups == 0, dups
    # Both copies lost: 1% of the pings' 10% (the request's or the reply's), none expected.
    assert lost <= 2, lost
    for k in ("client0", "server"):
        # Every ping copied, from the first (~200 in 3 s each way).
        assert spare[k] >= 0.9 * ping["sent"], (spare, ping["sent"])
        assert second[k] >= 0.5 * ping["sent"], second
        assert loss[k] == 0, loss


def test_small_packets_go_twice_onto_a_standby_path_while_a_path_loses(make_lab):
    lab = make_lab(paths=2, mode=None, congestion=None, specs=SPECS)
    lab.start_tunnel(up=["wan1", "wan2"])
    assert copies(lab, "loss") == {"client0": 0, "server": 0}
    ping, lost, dups = pings_over_lossy_wan1(lab, 4.0)
    during, second = copies(lab, "loss"), duplicates(lab)
    lab.set_link(0, "loss=0%")
    # A second after the last loss the copies stop; losses are declared a round trip late.
    time.sleep(2.0)
    settled = copies(lab, "loss")
    lab.start_ping("ping2", interval=INTERVAL)
    time.sleep(2.0)
    lab.stop("ping2", sig=signal.SIGINT)
    after = copies(lab, "loss")
    report(f"wan1 losing 10% each way, pings every 10 ms: {lost} of {ping['sent']} lost, {dups} "
           f"duplicate replies; copies {during}, second copies dropped {second}; wan1 clean "
           f"again: copies {settled} -> {after} over 2 s of pings")
    assert dups == 0, dups
    assert lost <= 5, lost
    for k in ("client0", "server"):
        # ~400 pings each way, nearly every one copied once the first loss was declared.
        assert during[k] >= 100, during
        assert second[k] >= 50, second
    assert after == settled, (settled, after)
    assert copies(lab, "spare") == {"client0": 0, "server": 0}
