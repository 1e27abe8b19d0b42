"""Per-packet bonding (wlb, minrtt): ONE TCP flow over two paths of different rates and delays
gets more than the faster path alone, its packets put back in order by the receiver."""

import pytest

from conftest import report

LINKS = ["rate=60mbit,delay=5ms", "rate=30mbit,delay=20ms"]
FASTEST = 60


@pytest.mark.parametrize("policy,reverse", [("wlb", False), ("wlb", True), ("minrtt", False)],
                         ids=["wlb-upload", "wlb-download", "minrtt-upload"])
def test_one_flow_uses_both_paths_in_order(make_lab, policy, reverse):
    lab = make_lab(paths=2, policy=policy, priorities=[1, 1], congestion="bbr")
    for p, spec in enumerate(LINKS):
        lab.set_link(p, spec)
    lab.pki()
    lab.start_server()
    lab.start_client()
    lab.wait_tunnel()
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
    report(f"{policy} {'download' if reverse else 'upload'}, one TCP flow over 60 Mbit/s 10 ms + "
           f"30 Mbit/s 40 ms RTT: {agg:.1f} Mbit/s; shares wan1 {share['wan1']:.1f}% wan2 "
           f"{share['wan2']:.1f}%; receiver's reorder counters {reorder}; retransmits "
           f"{d['end']['sum_sent'].get('retransmits')}")
    # One flow, more than the faster path can carry: it went over both.
    assert agg >= 1.05 * FASTEST, agg
    assert min(share.values()) >= 15, share
    # The slower path's packets overtook nothing unseen: the receiver held packets for them,
    # and hardly any arrived after it had given up waiting.
    assert reorder["held"] > 0, reorder
    assert reorder["late"] <= 0.01 * packets, reorder
    assert reorder["holding"] <= 4096, reorder
