"""FEC end to end: a path with random loss, UDP through the tunnel both ways, and FEC rebuilding
what the link lost (the server sends with the FEC the client asked for)."""

import time

from conftest import measured, report


def udp_iperf(lab, retries, **kw):
    """iperf3 UDP; a run whose setup failed is tried again (its UDP handshake is one datagram
    each way and iperf3 gives up on the first loss, which FEC makes rare, not impossible: seen
    about once in ten runs here; and a server whose previous test's end was lost on the lossy
    link stays "busy" for a moment). The retries are counted and reported."""
    transient = ("unable to read from stream socket", "the server is busy")
    for attempt in range(3):
        try:
            return lab.iperf(udp_mbit=10, length=1200, **kw)
        except RuntimeError as e:
            if not any(t in str(e) for t in transient) or attempt == 2:
                raise
            retries.append(str(e)[:80])
            time.sleep(1)


@measured
def test_fec_auto_rebuilds_random_loss_both_ways(make_lab):
    # A loss-tolerant outer controller: with cubic the tunnel itself would collapse at 5% loss.
    lab = make_lab(paths=1, rates_mbit=[50], congestion="bbr")
    lab.start_tunnel(client_extra="fec: auto\n")
    st = lab.status("client0")
    assert st["tunnels"][0]["fec"] == "auto"
    clean = lab.path_status("client0", "wan1")
    assert clean["fec_parity"] == 0, "auto adds nothing on a clean path"

    lab.set_link(0, "loss=5%")
    lab.iperf_server()
    # auto needs to have measured the loss (probes, then its own packets) before a test whose
    # setup hangs on one lost datagram (iperf3's UDP handshake) starts.
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        lab.ping(count=20, interval=0.01)
        if all(lab.path_status(k, "wan1")["fec_parity"] >= 2 for k in ("client0", "server")):
            break
    retries = []
    udp_iperf(lab, retries, seconds=2)
    for reverse, key in ((False, "client0"), (True, "server")):
        r = udp_iperf(lab, retries, seconds=5, reverse=reverse)
        lost = r["end"]["sum"]["lost_percent"]
        sender = lab.path_status(key, "wan1")
        receiver = lab.path_status("server" if key == "client0" else "client0", "wan1")
        report(f"FEC auto, 5% loss, UDP 10 Mbit/s {'down' if reverse else 'up'}: {lost:.2f}% lost; "
               f"sender repair {sender['fec_parity']:.0f}/group at {sender['fec_loss_pct']:.1f}% "
               f"measured loss, overhead {sender['fec_overhead_pct']:.0f}%; receiver rebuilt "
               f"{receiver['fec_recovered']}, unrecoverable {receiver['fec_unrecovered_packets']}; "
               f"sender drops { {k: v for k, v in sender['drops'].items() if v} }, receiver drops "
               f"{ {k: v for k, v in receiver['drops'].items() if v} }")
        assert sender["fec_parity"] >= 2 and sender["fec_repair_sent"] > 0
        assert receiver["fec_recovered"] > 0
        # The link loses 5%; FEC leaves a small fraction of that (residual ~0.02% in these
        # runs). What FEC itself could not rebuild is checked tightly; iperf3's own figure
        # also counts a stalled receiver on this shared machine (once 1.4% with nothing
        # unrecoverable), so it gets more room.
        assert receiver["fec_unrecovered_packets"] < 0.005 * sender["fec_protected_packets"]
        assert lost < 2.0, lost
    report(f"FEC auto: iperf3 setups tried again: {len(retries)}")
