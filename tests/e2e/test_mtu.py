"""A route whose MTU falls mid-run (the emulator drops every frame above 1400 bytes, silently,
as a tunnel hop or a mobile core would): the client finds the size that passes, reconnects the
path at that size, and tells inner senders what fits (ICMP too big), so a TCP upload carries on
instead of stalling in a black hole."""

import json
import statistics
import subprocess
import threading
import time

import pytest

from conftest import measured, report
import labctl

ROUTE_MTU = 1400
# UDP payload the route carries: the MTU less the outer IPv4 and UDP headers.
ROUTE_PAYLOAD = ROUTE_MTU - 28


@pytest.mark.parametrize("mode", ["datagram", "reliable"])
@measured
def test_a_route_mtu_fall_is_found_and_followed(make_lab, mode):
    lab = make_lab(paths=1, rates_mbit=[50], mode=mode, congestion="bbr")
    lab.set_link(0, "delay=10ms")
    lab.start_tunnel()
    clean = lab.path_status("client0", "wan1")
    assert clean["udp_payload"] == clean["udp_payload_max"] > ROUTE_PAYLOAD
    assert clean["mtu_changes"] == 0

    lab.iperf_server()
    result = {}

    def upload():
        result["r"] = lab.iperf(seconds=30)

    t = threading.Thread(target=upload)
    t.start()
    time.sleep(4)
    lab.set_link(0, f"mtu={ROUTE_MTU}")
    fell_at = time.monotonic()
    found_after = None
    while t.is_alive():
        time.sleep(0.2)
        p = lab.path_status("client0", "wan1")
        if found_after is None and p["udp_payload"] <= ROUTE_PAYLOAD:
            found_after = time.monotonic() - fell_at
    t.join()

    rates = [iv["sum"]["bits_per_second"] / 1e6 for iv in result["r"]["intervals"]]
    before = statistics.mean(rates[1:4])
    after = statistics.mean(rates[-10:])
    p = lab.path_status("client0", "wan1")
    server = lab.path_status("server", "wan1")
    oversized = p["drops"]["oversized"]
    report(f"MTU fall to {ROUTE_MTU} ({mode}): path at UDP payload {p['udp_payload']} "
           f"(server sends {server['udp_payload']}) {found_after:.1f} s after the fall, "
           f"{p['mtu_changes']} size change(s); upload {before:.1f} Mbit/s before, "
           f"{after:.1f} in the last 10 s; {oversized} inner packets too big, "
           f"{p['too_big_sent']} senders told; per second: {[round(r, 1) for r in rates]}")
    assert found_after is not None and found_after < 15, found_after
    # The largest size that passes, to within the search's granularity, both ways.
    assert ROUTE_PAYLOAD - 40 <= p["udp_payload"] <= ROUTE_PAYLOAD
    assert server["udp_payload"] <= ROUTE_PAYLOAD
    assert p["mtu_changes"] >= 1
    assert after >= 0.6 * before, (before, after)
    if mode == "datagram":
        # Full-size inner packets no longer fit a datagram: refused, counted and answered.
        assert oversized >= 1 and p["too_big_sent"] == oversized
    else:
        # A stream splits packets across QUIC packets of any size: nothing is refused.
        assert oversized == 0
    table = subprocess.run([labctl.BIN, "status", "--socket", lab.sock("client0")],
                           capture_output=True, text=True, timeout=10).stdout
    assert f"mtu wan1   UDP payload {p['udp_payload']} of {p['udp_payload_max']}" in table, table
