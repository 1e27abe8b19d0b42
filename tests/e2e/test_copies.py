"""While a path loses data, both ends also send the small packets that are not TCP (a call, DNS,
a ping) on another path that is up, for a second after the path's connection last declared a
loss, and the receiver keeps the first copy. Here wan1 (the primary) loses 10% each way under
pings every 10 ms: the pings lose nothing and none comes twice, both ends count the copies, and
once wan1 is clean again the copies stop. That the copies carry a call through an overflowing
queue's losses is the simulator's (crates/core/tests/sim.rs,
`a_call_beside_a_losing_path_gets_copies_on_the_other`) and the lab's (docs/BENCHMARKS.md, "Real
links")."""

import signal
import time

from conftest import report
import labctl

INTERVAL = 0.01
SPECS = ["rate=50mbit,delay=10ms", "rate=50mbit,delay=10ms"]


def wan1(lab, key):
    return next(p for p in lab.status(key)["tunnels"][0]["paths"] if p["name"] == "wan1")


def copies(lab):
    return {k: wan1(lab, k)["loss_copies"] for k in ("client0", "server")}


def test_small_packets_go_twice_while_a_path_loses(make_lab):
    lab = make_lab(paths=2, mode=None, congestion=None, specs=SPECS)
    lab.start_tunnel(up=["wan1", "wan2"])
    assert copies(lab) == {"client0": 0, "server": 0}
    lab.set_link(0, "loss=10%")
    lab.start_ping("ping", interval=INTERVAL)
    time.sleep(4.0)
    ping, lost, dups = labctl.stop_ping_counted(lab, "ping", INTERVAL)
    during = copies(lab)
    second = {k: lab.status(k)["tunnels"][0]["reorder"]["duplicates"]
              for k in ("client0", "server")}
    lab.set_link(0, "loss=0%")
    # A second after the last loss the copies stop; losses are declared a round trip late.
    time.sleep(2.0)
    settled = copies(lab)
    lab.start_ping("ping2", interval=INTERVAL)
    time.sleep(2.0)
    lab.stop("ping2", sig=signal.SIGINT)
    after = copies(lab)
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
