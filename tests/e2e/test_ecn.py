"""ECN through the tunnel: where a path's send queue holds an inner TCP upload long enough to
drop from it, a flow that negotiated ECN has its packets marked "congestion experienced"
instead (crates/core/src/packet/ecn.rs, sendq.rs `pop_marking`); a flow that did not is never
touched. The marks reach the receiving host, and the path counts them (`ce_marked`)."""

from conftest import report

SPEC = "rate=20mbit,delay=10ms"


def ce_seen(lab, key):
    """Packets with CE set that the internet host's capture printed."""
    return [line for line in lab.log(key).splitlines() if " IP " in line]


def test_an_ecn_capable_upload_is_marked_and_one_without_ecn_is_not(make_lab):
    lab = make_lab(paths=1, mode=None, congestion=None, specs=[SPEC])
    lab.start_tunnel(up=["wan1"])
    lab.iperf_server()
    lan = lab.lan_ns()
    # Inner cubic (a loss- and mark-based sender); the internet host accepts ECN when asked
    # (the kernel's default, net.ipv4.tcp_ecn=2), the LAN host asks only in the second run.
    lab.sh(lan, "sysctl -qw net.ipv4.tcp_ecn=0")
    capture = ["tcpdump", "-n", "-l", "-i", "any", "-c", "3", "tcp dst port 5201 and (ip[1] & 3 = 3)"]
    lab.spawn("ce-plain", lab.inet_ns, capture)
    plain = lab.iperf(seconds=6, streams=4, congestion="cubic")
    lab.stop("ce-plain")
    after_plain = lab.path_status("client0", "wan1")
    lab.sh(lan, "sysctl -qw net.ipv4.tcp_ecn=1")
    lab.spawn("ce-ecn", lab.inet_ns, capture)
    ecn = lab.iperf(seconds=6, streams=4, congestion="cubic")
    lab.stop("ce-ecn")
    after_ecn = lab.path_status("client0", "wan1")
    mbit = [d["end"]["sum_received"]["bits_per_second"] / 1e6 for d in (plain, ecn)]
    retx = [d["end"]["sum_sent"]["retransmits"] for d in (plain, ecn)]
    drops = [s["drops"]["queue_full"] for s in (after_plain, after_ecn)]
    report(f"4 cubic uploads over {SPEC}: without ECN {mbit[0]:.1f} Mbit/s, {retx[0]} "
           f"retransmissions, queue_full {drops[0]}, ce_marked {after_plain['ce_marked']}, CE seen "
           f"{len(ce_seen(lab, 'ce-plain'))}; with ECN {mbit[1]:.1f} Mbit/s, {retx[1]} "
           f"retransmissions, queue_full +{drops[1] - drops[0]}, ce_marked "
           f"{after_ecn['ce_marked']}, CE seen {len(ce_seen(lab, 'ce-ecn'))}")
    assert after_plain["ce_marked"] == 0 and not ce_seen(lab, "ce-plain"), after_plain
    assert after_ecn["ce_marked"] > 0, after_ecn
    assert ce_seen(lab, "ce-ecn"), lab.log("ce-ecn")
    assert min(mbit) > 10, mbit
