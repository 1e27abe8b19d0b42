"""Status table, Prometheus metrics, MSS clamping, congestion controllers, fixed client addresses."""

import pytest

from conftest import report
import labctl


def test_status_metrics_and_mss_clamp(make_lab):
    lab = make_lab(paths=2, extra_yaml="metrics_listen: 127.0.0.1:9464\n")
    lab.pki()
    lab.start_server()
    lab.start_client()
    lab.wait_tunnel()
    assert len(lab.ping(count=5, interval=0.05)["received"]) == 5

    table = labctl.run([labctl.BIN, "status", "--socket", lab.sock("client0")]).stdout
    report("mpquic status (client):\n" + table)
    assert "wan1" in table and "wan2" in table and "up" in table and "10.200.17.1/24" in table

    # Metrics: off unless configured; here on 127.0.0.1:9464 inside each instance's namespace.
    fetch = ("import urllib.request;"
             "print(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode())")
    text = lab.sh(lab.server_ns, ["python3", "-c", fetch]).stdout
    assert 'mpquic_path_up{tunnel="site1/mpq0",path="wan1"} 1' in text, text[:2000]
    assert "# TYPE mpquic_path_tx_bytes counter" in text and text.rstrip().endswith("# EOF")
    assert 'mpquic_drops_total{tunnel="site1/mpq0",path="wan1",reason="spoofed_source"} 0' in text
    # The control socket is root-only.
    import os
    import stat
    mode = stat.S_IMODE(os.stat(lab.sock("server")).st_mode)
    assert mode == 0o600, oct(mode)

    # MSS clamping: the LAN host (MTU 1500) ends up with an MSS that fits the tunnel.
    lab.iperf_server()
    probe = ("import socket;s=socket.create_connection(('%s',5201),timeout=5);"
             "print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))" % lab.inet_addr)
    mss = int(lab.sh(lab.lan_ns(0), ["python3", "-c", probe]).stdout.strip())
    mtu = lab.status("client0")["tun_mtu"]
    report(f"TUN MTU {mtu}; MSS seen by a LAN host with MTU 1500: {mss}")
    assert mss <= mtu - 40, (mss, mtu)


@pytest.mark.parametrize("cc,mode", [("bbr", "reliable"), ("bbr3", "reliable"), ("bbr3", "datagram"),
                                   ("quinn-bbr", "datagram"), ("newreno", "datagram")])
def test_other_congestion_controllers(make_lab, cc, mode):
    lab = make_lab(paths=1, congestion=cc, mode=mode)
    lab.pki()
    lab.start_server()
    lab.start_client()
    lab.wait_tunnel()
    lab.iperf_server()
    up = lab.iperf(seconds=3)["end"]["sum_received"]["bits_per_second"] / 1e6
    report(f"{cc} / {mode}: TCP up {up:.0f} Mbit/s")
    assert up > 50


def test_fixed_client_address_from_server_list(make_lab):
    lab = make_lab(paths=1, extra_yaml="")
    lab.pki()
    lab.extra_yaml = "clients:\n- name: site1\n  address: 10.200.17.50\n"
    lab.start_server()
    lab.extra_yaml = ""
    # The client asks for nothing: it gets its reserved address.
    lab.start_client(yaml=lab.client_yaml(0, request=False))
    st = lab.wait_tunnel()
    assert st["tunnels"][0]["address"] == "10.200.17.50/24", st
    assert len(lab.ping(count=3, interval=0.05)["received"]) == 3
    # Asking for another one is a clear error.
    lab.stop("client0")
    key = lab.start_client(yaml=lab.client_yaml(0), key="wrong-addr")
    rc = lab.procs[key].wait(timeout=15)
    assert rc != 0 and "server `clients:` list" in lab.log(key), lab.log(key)
    report("fixed address: site1 got 10.200.17.50; asking for 10.200.17.1 was refused: "
           + next(l for l in lab.log(key).splitlines() if "refused" in l).split("mpquic: ")[-1])
