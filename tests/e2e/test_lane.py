"""The MPTCP lane (`tcp_lane: mptcp`): the LAN host's TCP connections are taken by the client
(TPROXY, the destination kept), carried over kernel MPTCP with a subflow on each path (TLS with
the client's certificate inside) to the server, which opens the connection to the destination;
other traffic stays in the tunnel; a destination that refuses is reset to the LAN host."""

import threading
import time

from conftest import measured, report


def lane_yaml(lab):
    return (lab.server_yaml() + "tcp_lane_listen: 0.0.0.0:45018\n",
            lab.client_yaml() + "tcp_lane: mptcp\n")


@measured
def test_tcp_goes_over_the_lane_and_the_rest_through_the_tunnel(make_lab):
    lab = make_lab(paths=2, mode=None, congestion=None,
                   specs=["rate=40mbit,delay=5ms", "rate=40mbit,delay=15ms"])
    lab.pki()
    server, client = lane_yaml(lab)
    lab.start_server(yaml=server)
    lab.start_client(yaml=client)
    lab.wait_tunnel(up=["wan1", "wan2"])
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
    r = lab.sh(lab.lan_ns(), ["python3", "-c",
               f"import socket\ns=socket.create_connection(('{lab.inet_addr}', 7999), timeout=5)\n"
               "try:\n print(s.recv(1))\nexcept ConnectionResetError:\n print('reset')\n"], check=False)
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


def labctl_table(lab):
    """The client's `mpquic status` table."""
    import labctl
    return labctl.run([labctl.BIN, "status", "--socket", lab.sock("client0")]).stdout
