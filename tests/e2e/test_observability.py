"""Status table (once and --watch), finding the live instance, Prometheus metrics, JSON logs, MSS
clamping, congestion controllers, fixed client addresses."""

import json
import time

import pytest

from conftest import report
import labctl


def test_status_metrics_and_mss_clamp(make_lab):
    lab = make_lab(paths=2, extra_yaml="metrics_listen: 127.0.0.1:9464\n")
    lab.start_tunnel()
    assert len(lab.ping(count=5, interval=0.05)["received"]) == 5

    table = labctl.run([labctl.BIN, "status", "--socket", lab.sock("client0")]).stdout
    report("mpquic status (client):\n" + table)
    assert "wan1" in table and "wan2" in table and "up" in table and "10.200.17.1/24" in table
    # Post-quantum keys by default: every handshake (one per path) negotiated the hybrid, as
    # both sides counted it.
    assert "key exchange post-quantum" in table, table
    for who in ("client0", "server"):
        tls = lab.status(who)["tls"]
        assert tls["post_quantum"] and tls["key_exchanges"].get("X25519MLKEM768", 0) >= 2, (who, tls)
        assert set(tls["key_exchanges"]) == {"X25519MLKEM768"}, (who, tls)

    # Metrics: off unless configured; here on 127.0.0.1:9464 inside each instance's namespace.
    fetch = ("import urllib.request;"
             "print(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode())")
    text = lab.sh(lab.server_ns, ["python3", "-c", fetch]).stdout
    assert 'mpquic_path_up{tunnel="site1/mpq0",path="wan1"} 1' in text, text[:2000]
    assert "# TYPE mpquic_path_tx_bytes counter" in text and text.rstrip().endswith("# EOF")
    assert 'mpquic_drops_total{tunnel="site1/mpq0",path="wan1",reason="spoofed_source"} 0' in text
    assert 'mpquic_tls_handshakes_total{group="X25519MLKEM768"}' in text, text[:2000]
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
    lab.start_tunnel()
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


def test_status_finds_the_live_instance_and_watches(make_lab):
    """Instances with their control sockets in the default directory, /run/mpquic: after SIGTERM
    (socket removed) or SIGKILL (socket left behind) of one of two instances, `mpquic status`
    without flags shows the live one; a restarted instance replaces its stale socket.
    `--watch` refreshes the table (or prints one JSON line per refresh)."""
    import glob
    import os
    import signal
    import socket
    import subprocess

    def live_sockets():
        out = []
        for p in glob.glob("/run/mpquic/*.sock"):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(p)
                out.append(p)
            except OSError:
                pass
            finally:
                s.close()
        return out

    if live_sockets():
        pytest.skip(f"other mpquic instances run on this machine: {live_sockets()}")
    lab = make_lab(paths=1)
    lab.pki()
    socks = {}
    for who in ("server", "client0"):
        inst = lab._instance(who)
        socks[who] = f"/run/mpquic/e2e-{os.getpid()}-{who}.sock"
        with open(inst["config"]) as f:
            text = f.read()
        assert inst["socket"] in text
        with open(inst["config"], "w") as f:
            f.write(text.replace(inst["socket"], socks[who]))
        inst["socket"] = socks[who]

    def status(*args):
        return subprocess.run([labctl.BIN, "status", *args], capture_output=True, text=True, timeout=10)

    try:
        lab.start_server()
        lab.start_client()
        lab.wait_tunnel()
        r = status()
        assert r.returncode != 0 and "several instances are running" in r.stderr, r
        assert socks["server"] in r.stderr and socks["client0"] in r.stderr, r.stderr

        # SIGTERM: the client's socket goes with it; status finds the server alone.
        lab.stop("client0")
        assert not os.path.exists(socks["client0"])
        r = status()
        assert r.returncode == 0 and r.stdout.startswith("mpquic server"), r

        # SIGKILL: the server's socket stays behind, nobody answers on it; status skips it.
        lab.start_client()
        lab.wait_tunnel()
        lab.stop("server", sig=signal.SIGKILL)
        assert os.path.exists(socks["server"])
        r = status()
        report(f"mpquic status after SIGKILL of the server: {r.stdout.splitlines()[:1]} {r.stderr.strip()}")
        assert r.returncode == 0 and r.stdout.startswith("mpquic client"), r

        # A restarted server replaces its stale socket. `start_server` cannot wait for the file
        # (the stale one is there), and a client may be up again before the new server has
        # opened its control socket: wait until the server answers on it.
        lab.start_server()
        t0 = time.monotonic()
        while labctl.run([labctl.BIN, "status", "--socket", socks["server"]], check=False).returncode != 0:
            assert time.monotonic() - t0 < 10, "the restarted server does not answer on its socket"
            time.sleep(0.05)
        lab.wait_tunnel()
        assert "several instances are running" in status().stderr

        # --watch: a refreshing table; with --json one report per line.
        w = subprocess.run(["timeout", "1.5", labctl.BIN, "status", "--watch", "0.2", "--socket", socks["client0"]],
                           capture_output=True, text=True)
        frames = w.stdout.count("Every 0.2s: mpquic status")
        assert w.returncode == 124 and frames >= 3 and w.stdout.count("wan1") >= 3, w
        w = subprocess.run(["timeout", "1.5", labctl.BIN, "status", "--watch", "0.2", "--json", "--socket",
                            socks["server"]], capture_output=True, text=True)
        lines = [json.loads(line) for line in w.stdout.splitlines()]
        assert len(lines) >= 3 and all(x["role"] == "server" for x in lines), w
        r = status("--watch", "0", "--socket", socks["server"])
        assert r.returncode != 0 and "refresh interval" in r.stderr, r
        report(f"status --watch 0.2 for 1.5 s: {frames} tables, --json: {len(lines)} lines")
    finally:
        for who in ("client0", "server"):
            lab.stop(who)
        for p in socks.values():
            if os.path.exists(p):
                os.unlink(p)


def test_json_logs_carry_path_class_and_client_fields(make_lab):
    """`log_format: json`: every line the instances log is one JSON object, with the event's
    fields (path, tunnel, client, class) as keys."""
    lab = make_lab(paths=2, extra_yaml="log_format: json\n")
    lab.start_tunnel()
    events = {}
    for who in ("server", "client0"):
        lines = [l for l in lab.log(who).splitlines() if l.strip()]
        events[who] = [json.loads(l) for l in lines]
        assert events[who] and all({"timestamp", "level", "message"} <= e.keys() for e in events[who])
    connected = [e for e in events["client0"] if e["message"] == "path connected"]
    assert {e["path"] for e in connected} == {"wan1", "wan2"}, connected
    started = [e for e in events["server"] if e["message"] == "client session started"]
    assert started and started[0]["client"] == "site1/mpq0", started  # identity/instance
    report(f"json log line: {json.dumps(connected[0])}")
