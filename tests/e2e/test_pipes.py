"""Pipes (`pipes: N`): a path over N UDP sessions (distinct client ports) under one congestion
controller, to get round a carrier's per-session cap, here the emulator's `flow_rate`."""

import re

from conftest import measured, report

CAP = 20  # Mbit/s per UDP session
LINK = f"rate=200mbit,delay=5ms,flow_rate={CAP}mbit"


def with_pipes(yaml, n):
    """The client's configuration with `pipes: n` on its path."""
    return re.sub(r"(\n- name: wan1\n(?:  .*\n)*)", lambda m: m.group(1) + f"  pipes: {n}\n", yaml, count=1)


@measured
def test_four_pipes_get_round_a_per_session_cap(make_lab):
    lab = make_lab(paths=1, mode="datagram", congestion="bbr")  # our bbr, mpquic's default
    lab.set_link(0, LINK)
    lab.start_tunnel(client=lambda y: with_pipes(y, 4))
    lab.iperf_server()
    results = {}
    for reverse in (False, True):
        d = lab.iperf(seconds=8, streams=4, reverse=reverse)
        results["download" if reverse else "upload"] = d["end"]["sum_received"]["bits_per_second"] / 1e6
    pipes = {who: lab.path_status(who, "wan1")["pipes"] for who in ("client0", "server")}
    share = {who: [round(100.0 * p["tx_bytes"] / max(1, sum(q["tx_bytes"] for q in ps)), 1) for p in ps]
             for who, ps in pipes.items()}
    report(f"pipes: 4 over one {LINK} link, 4 TCP streams: up {results['upload']:.1f} Mbit/s, down "
           f"{results['download']:.1f} (one UDP session: at most {CAP}); bytes per pipe % {share}")
    for who, ps in pipes.items():
        assert len(ps) == 4 and len({p["port"] for p in ps}) == 4, (who, ps)
        # Every pipe carried its part.
        assert min(share[who]) >= 12, share
    for direction, mbit in results.items():
        # Four sessions of 20 Mbit/s: well past one (goal 0.9 x 80; the tunnel's own headers
        # count against the cap too).
        assert mbit >= 0.8 * 4 * CAP, (direction, mbit)
