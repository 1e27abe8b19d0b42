"""Per-packet bonding (wlb, minrtt): ONE TCP flow over two paths of different rates and delays
gets more than the faster path alone, its packets put back in order by the receiver; on the
native protocol, and over CONNECT-IP between the mpquic client and server (`protocol: masque`:
the server takes the hello the request carries and the session bonds the same way)."""

import pytest

from conftest import measured, report

LINKS = ["rate=60mbit,delay=5ms", "rate=30mbit,delay=20ms"]
FASTEST = 60


@pytest.mark.parametrize("policy,reverse,masque", [
    ("wlb", False, False), ("wlb", True, False), ("minrtt", False, False),
    ("wlb", False, True), ("wlb", True, True),
], ids=["wlb-upload", "wlb-download", "minrtt-upload", "wlb-upload-connect-ip",
        "wlb-download-connect-ip"])
@measured
def test_one_flow_uses_both_paths_in_order(make_lab, policy, reverse, masque):
    lab = make_lab(paths=2, policy=policy, priorities=[1, 1], congestion="bbr")
    for p, spec in enumerate(LINKS):
        lab.set_link(p, spec)
    lab.pki()
    lab.start_server_and_client(masque=masque)
    st = lab.wait_tunnel(up=["wan1", "wan2"])
    assert st["tunnels"][0]["protocol"] == ("connect-ip" if masque else "native"), st["tunnels"][0]
    lab.iperf_server()
    sender = "server" if reverse else "client0"
    receiver = "client0" if reverse else "server"
    before = {p: lab.path_status(sender, p)["tx_bytes"] for p in ("wan1", "wan2")}
    d = lab.iperf(seconds=10, streams=1, reverse=reverse)
    after = {p: lab.path_status(sender, p)["tx_bytes"] for p in ("wan1", "wan2")}
    agg = d["end"]["sum_received"]["bits_per_second"] / 1e6
    sent = {p: after[p] - before[p] for p in before}
    share = {p: 100.0 * sent[p] / sum(sent.values()) for p in sent}
    reorder = lab.status(receiver)["tunnels"][0]["reorder"]
    packets = sum(sent.values()) / 1400
    # A path the ACK watch took out of use shows here (a false silence would starve it).
    silences = {p: lab.path_status(sender, p).get("ack_silences", 0) for p in ("wan1", "wan2")}
    report(f"{policy} {'download' if reverse else 'upload'}{' over CONNECT-IP' if masque else ''}, "
           f"one TCP flow over 60 Mbit/s 10 ms + "
           f"30 Mbit/s 40 ms RTT: {agg:.1f} Mbit/s; shares wan1 {share['wan1']:.1f}% wan2 "
           f"{share['wan2']:.1f}%; receiver's reorder counters {reorder}; retransmits "
           f"{d['end']['sum_sent'].get('retransmits')}; sender's ACK silences {silences}")
    if policy == "wlb":
        # One flow, more than the faster path can carry: it went over both.
        assert agg >= 1.05 * FASTEST, agg
        assert min(share.values()) >= 15, share
    # minrtt's rate is reported, not judged: on a host whose vCPUs are now and then stolen
    # for milliseconds, one flow over these links gets anywhere from 13 to 84 Mbit/s (inner
    # BBR or cubic alike; failover on the faster path alone: 54-58), while wlb keeps 77
    # (docs/CONFIG.md, `multipath_policy`). What minrtt is held to here: order.
    # The slower path's packets overtook nothing unseen: the receiver held packets for them,
    # and hardly any arrived after it had given up waiting.
    assert reorder["held"] > 0, reorder
    assert reorder["late"] <= 0.01 * packets, reorder
    assert reorder["holding"] <= 4096, reorder


@pytest.mark.parametrize("fec", ["off", "auto"])
@measured
def test_redundant_covers_loss_on_both_paths(make_lab, fec):
    """`redundant`: every packet on both paths, each with 10% random loss both ways; the first copy
    is handed on, the second dropped and counted. Pings lost only when both copies are (about 1%
    a way without FEC, 2% a round trip, against 19% on one such path)."""
    lab = make_lab(paths=2, policy="redundant", priorities=[1, 1], congestion="bbr")
    for p in range(2):
        lab.set_link(p, "delay=10ms,loss=10%")
    lab.start_tunnel(client_extra=("fec: auto\n" if fec == "auto" else ""))
    ping = lab.ping(count=2000, interval=0.01, timeout=60)
    lost = 100.0 * (ping["sent"] - len(ping["received"])) / ping["sent"]
    reorder = lab.status("server")["tunnels"][0]["reorder"]
    report(f"redundant, fec {fec}, two paths with 10% loss both ways, 2000 pings every 10 ms: "
           f"{lost:.2f}% lost; server's reorder counters {reorder}")
    assert lost <= (4.0 if fec == "off" else 1.0), lost
    assert reorder["duplicates"] >= 1000, reorder
