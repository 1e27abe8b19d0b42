"""The MPTCP lane (`tcp_lane: mptcp`): the LAN host's TCP connections are taken by the client
(TPROXY, the destination kept), carried over kernel MPTCP with a subflow on each path (TLS with
the client's certificate inside) to the server, which opens the connection to the destination;
other traffic stays in the tunnel; a destination that refuses is reset to the LAN host."""

import re
import threading
import time

from conftest import measured, report
from test_metered import with_path_keys
import labctl


SERVER_LANE = "tcp_lane_listen: 0.0.0.0:45018\n"
CLIENT_LANE = "tcp_lane: mptcp\n"


def lane_yaml(lab):
    """The server's and the client's configurations with the lane."""
    return lab.server_yaml() + SERVER_LANE, lab.client_yaml() + CLIENT_LANE


def lane_lab(make_lab, spec, spec2=None):
    """Two paths (`spec`, and `spec2` or the same), the product's defaults, the lane on both ends, the tunnel up: the lab
    and the server's and client's configurations."""
    lab = make_lab(paths=2, mode=None, congestion=None, specs=[spec, spec2 or spec])
    lab.start_tunnel(server_extra=SERVER_LANE, client_extra=CLIENT_LANE, up=["wan1", "wan2"])
    server, client = lane_yaml(lab)
    return lab, server, client


@measured
def test_tcp_goes_over_the_lane_and_the_rest_through_the_tunnel(make_lab):
    lab, server, client = lane_lab(make_lab, "rate=40mbit,delay=5ms", "rate=40mbit,delay=15ms")
    endpoints = lab.sh(lab.client_ns(), "ip mptcp endpoint show").stdout
    assert endpoints.count("subflow") == 2, endpoints
    lab.iperf_server()
    before = lab.status("client0")["tunnels"][0]["paths"]
    got = {}
    t = threading.Thread(target=lambda: got.update(d=lab.iperf(seconds=6)))
    t.start()
    time.sleep(3)
    during = lab.status("client0")["lane"]
    t.join()
    d = got["d"]
    after = lab.status("client0")["tunnels"][0]["paths"]
    tunnel = sum(a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before))
    mbit = d["end"]["sum_received"]["bits_per_second"] / 1e6
    sent = d["end"]["sum_sent"]["bytes"]
    received = d["end"]["sum_received"]["bytes"]
    ping = lab.ping(count=5)
    report(f"MPTCP lane, one TCP flow over 40 + 40 Mbit/s: {mbit:.1f} Mbit/s; {tunnel} bytes through "
           f"the tunnel meanwhile (of {sent} sent); ping through the tunnel {ping['received']}; "
           f"lane status during the transfer {during}")
    assert during["active"] >= 1 and set(during["subflows"]) == {"wan1", "wan2"}, during
    assert tunnel < 0.01 * sent, "the flow went over the lane, not the tunnel"
    assert mbit > 48, "more than one path carries"
    assert len(ping["received"]) == 5, "ICMP stays in the tunnel"
    # A closed port at the destination: the LAN host's connection is reset, not held open.
    r = lab.sh(lab.lan_ns(), ["python3", "-c", RESET_PROBE.format(dst=lab.inet_addr, port=7999)],
               check=False)
    assert r.stdout.strip() == "reset", (r.stdout, r.stderr)
    client, server = lab.status("client0")["lane"], lab.status("server")["lane"]
    assert client["failed"]["refused"] == 1 and server["failed"]["refused"] == 1, (client, server)
    # What the destination received went through the server's lane.
    assert server["connected"] >= 2 and server["bytes_up"] >= received, (server, received)
    assert "MPTCP lane" in labctl_table(lab), "the table says it"
    # The client's kernel setup goes with it.
    lab.stop("client0")
    assert "subflow" not in lab.sh(lab.client_ns(), "ip mptcp endpoint show").stdout
    assert "mpquic_lane" not in lab.sh(lab.client_ns(), "nft list tables").stdout


@measured
def test_the_first_path_removed_under_a_download_moves_the_lane_connection_without_a_reset(make_lab):
    """The seed's handover case: the device of the path that carries the lane connection's first
    subflow is set down under a download; the connection goes on over the other path's subflow,
    not reset, and the transfer stalls for at most 1 s."""
    lab, server, client = lane_lab(make_lab, "rate=40mbit,delay=5ms")
    dev = re.search(r"- name: wan1\n  bind_ip: if:(\S+)", client).group(1)
    lab.iperf_server()
    got = {}
    t = threading.Thread(target=lambda: got.update(d=lab.iperf(seconds=8, reverse=True, interval=0.1)))
    began = time.monotonic()
    t.start()
    labctl.wait_until("both subflows", lambda: lab.status("client0")["lane"].get("subflows", {}).get("wan2", 0) >= 2)
    time.sleep(2)
    # In iperf3's time (to within its start-up, some ms).
    removed = time.monotonic() - began
    lab.sh(lab.client_ns(), f"ip link set {dev} down")
    during = lab.status("client0")["lane"]
    t.join()
    d = got["d"]
    assert not d.get("error"), d.get("error")
    ticks = [(i["sum"]["start"], i["sum"]["bytes"]) for i in d["intervals"]]
    before = [n for at, n in ticks if 1 <= at < removed - 0.2]
    after = [n for at, n in ticks if at > removed + 1.5]
    # The stall: the longest run of 100 ms intervals carrying under a tenth of what they did
    # before, from a second before the removal on.
    low = 0.1 * sum(before) / len(before)
    longest, run = 0.0, 0.0
    for at, n in ticks:
        if at < removed - 1:
            continue
        run = run + 0.1 if n < low else 0.0
        longest = max(longest, run)
    rate = lambda v: sum(v) * 8 / (len(v) * 0.1) / 1e6 if v else 0.0  # noqa: E731
    report(f"MPTCP lane handover: wan1's device set down under a download: no reset, longest stall "
           f"{longest:.1f} s; {rate(before):.1f} Mbit/s before, {rate(after):.1f} after (wan2 alone); "
           f"lane status just after {during}")
    assert longest <= 1.0, ticks
    assert rate(after) > 20, "the other path carries on"


RESPONDER = ("import socket\nl=socket.create_server(('0.0.0.0', 7100))\nwhile True:\n"
             " c,_=l.accept()\n c.recv(1)\n c.sendall(b'y')\n c.close()\n")
FIRST_BYTE = ("import socket,time\nts=[]\nfor _ in range({n}):\n t=time.monotonic()\n"
              " s=socket.create_connection(('{dst}', 7100), timeout=5)\n s.sendall(b'x')\n"
              " assert s.recv(1)==b'y'\n ts.append(time.monotonic()-t)\n s.close()\n time.sleep(0.05)\n"
              "ts.sort()\nprint(ts[len(ts)//2])\n")
# `n` connections at once: each one's time to the first answered byte, the slowest printed.
BURST = ("import socket,threading,time\nts=[]\ndef one():\n t=time.monotonic()\n"
         " s=socket.create_connection(('{dst}', 7100), timeout=5)\n s.sendall(b'x')\n"
         " assert s.recv(1)==b'y'\n ts.append(time.monotonic()-t)\n"
         "th=[threading.Thread(target=one) for _ in range({n})]\n[t.start() for t in th]\n"
         "[t.join() for t in th]\nprint(max(ts))\n")


@measured
def test_lane_connection_setup_against_direct(make_lab):
    """Connection setup: the time from the LAN host's connect to the destination's first byte,
    through the lane, against the same exchange made directly over path 1 (to the server's own
    address, one hop short of the destination: the lane's figure carries that hop too). The LAN
    host's handshake is answered locally; with a lane connection set up ahead the request goes
    at once (one round trip: less than direct's two); a burst beyond those set up ahead waits
    for the lane's own handshakes (MPTCP, TLS 1.3: one round trip more than direct)."""
    lab, server, client = lane_lab(make_lab, "rate=40mbit,delay=25ms")
    remote = re.search(r"- name: wan1\n(?:  .*\n)*?  remote_addr: (\S+)", client).group(1)
    for key, ns in (("resp-inet", lab.inet_ns), ("resp-server", lab.server_ns)):
        lab.spawn(key, ns, ["python3", "-c", RESPONDER], log=False)
    rtt = lab.ping(count=10, interval=0.05, dst=remote, src_ns=lab.client_ns())
    rtt_ms = sorted(rtt["rtts"])[len(rtt["rtts"]) // 2]
    labctl.wait_until("connections set up ahead", lambda: lab.status("client0")["lane"]["ready"] >= 2)

    def ms(ns, dst, script=FIRST_BYTE, n=15):
        return float(lab.sh(ns, ["python3", "-c", script.format(n=n, dst=dst)]).stdout) * 1000

    direct = ms(lab.client_ns(), remote)
    lane = ms(lab.lan_ns(), lab.inet_addr)
    ahead = lab.status("client0")["lane"]["ahead"]
    time.sleep(0.5)
    burst_direct = ms(lab.client_ns(), remote, BURST, 8)
    burst_lane = ms(lab.lan_ns(), lab.inet_addr, BURST, 8)
    report(f"MPTCP lane setup, connect to first answered byte, RTT {rtt_ms:.1f} ms: one at a time "
           f"(median of 15; {ahead} went out on a connection set up ahead) direct {direct:.1f} ms, "
           f"lane {lane:.1f} ms ({(lane - direct) / rtt_ms:+.2f} RTT); 8 at once, the slowest: direct "
           f"{burst_direct:.1f} ms, lane {burst_lane:.1f} ms ({(burst_lane - burst_direct) / rtt_ms:+.2f} RTT)")
    assert ahead >= 14, "one at a time, each found one set up ahead"
    assert lane < direct, "the lane answers sooner than a direct connection"
    assert burst_lane - burst_direct <= 1.5 * rtt_ms, "beyond those set up ahead: about one round trip more"


RESET_PROBE = ("import socket\ns=socket.create_connection(('{dst}', {port}), timeout=5)\n"
               "try:\n s.sendall(b'x')\n print(s.recv(1))\nexcept ConnectionResetError:\n print('reset')\n")


def reload(lab, key, ns):
    r = lab.sh(ns, [labctl.BIN, "reload", "--socket", lab.sock(key)], check=False)
    return r.stdout + r.stderr


@measured
def test_a_reload_moves_the_endpoints_and_a_revocation_closes_lane_connections(make_lab):
    """A reload reaches the lane: a path made a backup gets its endpoint replaced (the other
    is left alone), and a client revoked on the server has its open lane connections closed
    at once and its next one reset to the LAN host."""
    lab, server, client = lane_lab(make_lab, "rate=40mbit,delay=5ms")

    def endpoints():
        return lab.sh(lab.client_ns(), "ip mptcp endpoint show").stdout

    assert endpoints().count("subflow") == 2 and "backup" not in endpoints(), endpoints()
    lab.write("client0-run.yaml", with_path_keys(client, "wan2", ["role: backup"]))
    out = reload(lab, "client0", lab.client_ns())
    assert "MPTCP lane: TLS read again, endpoints 1 removed / 1 added" in out, out
    eps = endpoints()
    assert eps.count("subflow") == 2 and eps.count("backup") == 1, eps

    lab.iperf_server()
    got = {}

    def flow():
        try:
            got["d"] = lab.iperf(seconds=10, timeout=30)
        except RuntimeError as e:
            got["error"] = str(e)
        got["ended"] = time.monotonic()

    t = threading.Thread(target=flow)
    t.start()
    labctl.wait_until("the flow's lane connections", lambda: lab.status("server")["lane"]["connected"] >= 2)
    lab.write("server-run.yaml", server + "revoked:\n- site1\n")
    t0 = time.monotonic()
    out = reload(lab, "server", lab.server_ns)
    # The flow's two, and those the client had set up ahead.
    closed = re.search(r"MPTCP lane connections closed, certificate revoked: (\d+)", out)
    assert closed and int(closed.group(1)) >= 2, out
    t.join()
    gone = got["ended"] - t0
    assert "error" in got, f"the transfer was cut short: {got}"
    assert gone < 1.0, gone
    r = lab.sh(lab.lan_ns(), ["python3", "-c", RESET_PROBE.format(dst=lab.inet_addr, port=5201)],
               check=False)
    assert r.stdout.strip() == "reset", (r.stdout, r.stderr)
    assert lab.status("client0")["lane"]["failed"]["setup_failed"] >= 1
    report(f"MPTCP lane reload: wan2 made a backup, its endpoint replaced; site1 revoked, its "
           f"{closed.group(1)} lane connections closed, iperf3 cut {gone * 1000:.0f} ms after the reload "
           f"({got['error']}); the next connection reset to the LAN host")


def labctl_table(lab):
    """The client's `mpquic status` table."""
    return labctl.run([labctl.BIN, "status", "--socket", lab.sock("client0")]).stdout
