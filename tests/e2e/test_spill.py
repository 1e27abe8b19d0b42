"""The default policy (`failover`) over two paths of equal priority: one TCP flow stays on the
best path, eight bulk flows are shared with the other (some moved onto it, both ways: the client
moves uploads, the server downloads) and together get more than the best path alone; a path
with a `data_budget` gets none of them. How the flows are divided is the simulator's
(crates/core/src/bond/spill.rs tests); what it gains on Starlink + LTE is the lab's
(docs/BENCHMARKS.md, "Real links")."""

import pytest

from conftest import measured, report
from test_metered import with_path_keys

SPECS = ["rate=40mbit,delay=10ms", "rate=20mbit,delay=20ms"]
BEST = 40


def sent(lab, key):
    return {p: lab.path_status(key, p)["tx_bytes"] for p in ("wan1", "wan2")}


def run(lab, streams, reverse):
    """Goodput (Mbit/s) of `streams` TCP flows for 8 s, the share (%) of the sender's bytes
    wan2 carried, and the flows the sender moved onto wan2."""
    sender = "server" if reverse else "client0"
    before = sent(lab, sender)
    d = lab.iperf(seconds=8, streams=streams, reverse=reverse)
    after = sent(lab, sender)
    moved = {p: after[p] - before[p] for p in after}
    share = 100.0 * moved["wan2"] / max(1, sum(moved.values()))
    mbit = d["end"]["sum_received"]["bits_per_second"] / 1e6
    return mbit, share, lab.path_status(sender, "wan2").get("flows_moved", 0)


@pytest.mark.parametrize("reverse", [False, True], ids=["upload", "download"])
@measured
def test_bulk_flows_share_paths_of_equal_rank(make_lab, reverse):
    lab = make_lab(paths=2, priorities=[1, 1], mode=None, congestion=None,
                   specs=SPECS)
    lab.start_tunnel(up=["wan1", "wan2"])
    lab.iperf_server()
    one, one_share, one_moved = run(lab, 1, reverse)
    many, many_share, many_moved = run(lab, 8, reverse)
    way = "download" if reverse else "upload"
    report(f"default policy, {way}, 40 Mbit/s 20 ms + 20 Mbit/s 40 ms RTT, equal priority: one "
           f"flow {one:.1f} Mbit/s, wan2 {one_share:.1f}% of the bytes, {one_moved} moved; eight "
           f"flows {many:.1f} Mbit/s, wan2 {many_share:.1f}%, {many_moved} moved")
    assert one_moved == 0 and one_share < 2, (one_moved, one_share)
    assert many_moved >= 1, many_moved
    assert many_share >= 15, many_share
    assert many >= 1.1 * BEST, many


@measured
def test_a_metered_path_takes_no_bulk_flows(make_lab):
    lab = make_lab(paths=2, priorities=[1, 1], mode=None, congestion=None,
                   specs=SPECS)
    budget = "data_budget: {limit: 10GB, period: day}"
    lab.start_tunnel(client=lambda y: with_path_keys(y, "wan2", [budget]), up=["wan1", "wan2"])
    lab.iperf_server()
    got = {}
    for reverse in (False, True):
        got["down" if reverse else "up"] = run(lab, 8, reverse)
    report(f"default policy, eight flows, wan2 with a data budget: {got}")
    for mbit, share, moved in got.values():
        assert moved == 0 and share < 2, got
