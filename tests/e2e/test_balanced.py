"""Balanced policy: two paths shaped with htb to 100 and 50 Mbit/s, weights 2 and 1."""

import pytest

from conftest import measured, report

RATES = [100, 50]


@pytest.mark.parametrize("reverse", [False, True], ids=["upload", "download"])
@measured
def test_balanced_aggregate_and_shares(make_lab, reverse):
    lab = make_lab(paths=2, policy="balanced", rates_mbit=RATES, weights=[2, 1], priorities=[1, 1])
    lab.start_tunnel()
    lab.iperf_server()
    sender = "server" if reverse else "client0"
    before = {p: lab.path_status(sender, p)["tx_bytes"] for p in ("wan1", "wan2")}
    d = lab.iperf(seconds=10, streams=8, reverse=reverse)
    after = {p: lab.path_status(sender, p)["tx_bytes"] for p in ("wan1", "wan2")}
    agg = d["end"]["sum_received"]["bits_per_second"] / 1e6
    sent = {p: after[p] - before[p] for p in before}
    total = sum(sent.values())
    share = {p: 100.0 * sent[p] / total for p in sent}
    flows = {p: lab.path_status(sender, p)["flows"] for p in ("wan1", "wan2")}
    report(f"balanced {'download' if reverse else 'upload'}: aggregate {agg:.1f} Mbit/s of {sum(RATES)} "
           f"({100 * agg / sum(RATES):.0f}%); shares wan1 {share['wan1']:.1f}% wan2 {share['wan2']:.1f}% "
           f"(weights 66.7/33.3); flows {flows}; retransmits {d['end']['sum_sent'].get('retransmits')}")
    assert agg >= 0.85 * sum(RATES), agg
    assert abs(share["wan1"] - 200 / 3) <= 10, share
    assert abs(share["wan2"] - 100 / 3) <= 10, share
