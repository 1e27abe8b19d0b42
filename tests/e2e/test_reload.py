"""Live reload (SIGHUP, `mpquic reload`): paths changed under traffic without a gap on the
paths that did not change; broken files refused with the running configuration kept; the
server's `clients:` rules swapped (LAN routes in and out of the kernel)."""

import re
import signal
import subprocess
import threading
import time

from conftest import report
import labctl


def without_path(yaml, name):
    return re.sub(rf"- name: {name}\n(  .*\n)*", "", yaml)


def paths(st, tunnel=0):
    return {p["name"]: p for p in st["tunnels"][tunnel]["paths"]}


def test_sighup_changes_paths_under_traffic_without_a_gap(make_lab):
    """Acceptance: iperf3 through path 1 keeps running (no gap > 100 ms) while path 2's weight
    and a third path are changed by SIGHUP; a broken file on reload leaves the tunnel untouched
    and the error in the log and in `mpquic status`."""
    lab = make_lab(paths=3, policy="failover")
    lab.start_tunnel(client=lambda y: without_path(y, "wan3"))
    full = lab.client_yaml()
    cfg = f"{lab.dir}/client0-run.yaml"
    assert set(paths(lab.status("client0"))) == {"wan1", "wan2"}

    lab.iperf_server()
    lab.spawn("ping", lab.lan_ns(0), ["ping", "-D", "-n", "-i", "0.01", "-W", "1", lab.inet_addr])
    result = {}
    iperf = threading.Thread(target=lambda: result.update(
        data=lab.iperf(seconds=10, rate_mbit=20, interval=0.1)))
    iperf.start()
    time.sleep(2)

    # Path 2's weight and a third path, by SIGHUP.
    changed = re.sub(r"(- name: wan2\n(?:  .*\n)*?)  weight: 1\n", r"\1  weight: 3\n", full)
    assert "weight: 3" in changed, changed
    with open(cfg, "w") as f:
        f.write(changed)
    lab.procs["client0"].send_signal(signal.SIGHUP)
    labctl.wait_until("wan3 up and wan2 at weight 3 on both sides", lambda: all(
        paths(lab.status(who)).get("wan3", {}).get("state") == "up"
        and paths(lab.status(who))["wan2"]["weight"] == 3 for who in ("client0", "server")))
    st = lab.status("client0")
    assert st["last_reload"]["ok"], st["last_reload"]
    assert "added wan3; changed wan2" in st["last_reload"]["message"], st["last_reload"]
    time.sleep(1.5)

    # A broken file: refused, nothing touched, the error in the log and in status.
    with open(cfg, "w") as f:
        f.write(changed.replace("multipath_paths:", "multipath_pathz:"))
    lab.procs["client0"].send_signal(signal.SIGHUP)
    st = labctl.wait_until("the refusal in status", lambda: (
        lambda s: s if not s["last_reload"]["ok"] else None)(lab.status("client0")))
    assert "multipath_pathz" in st["last_reload"]["message"], st["last_reload"]
    assert "configuration reload refused" in lab.log("client0"), lab.log("client0")
    table = lab.sh(lab.client_ns(0), [labctl.BIN, "status", "--socket", lab.sock("client0")]).stdout
    assert "REFUSED" in table and "multipath_pathz" in table, table

    iperf.join(timeout=40)
    lab.stop("ping", sig=signal.SIGINT)
    ping_log = lab.log("ping")

    # Path 1 carried everything, was never reconnected; no gap in the pings or in iperf3.
    st = lab.status("client0")
    p = paths(st)
    assert p["wan1"]["connects"] == 1, p["wan1"]
    assert set(p) == {"wan1", "wan2", "wan3"}
    assert all(x["state"] == "up" for x in p.values()), p
    stamps = [float(m) for m in re.findall(r"^\[(\d+\.\d+)\] .*icmp_seq=", ping_log, re.M)]
    assert len(stamps) > 500, ping_log[-500:]
    longest = max(b - a for a, b in zip(stamps, stamps[1:]))
    ivs = [i["sum"]["bits_per_second"] for i in result["data"]["intervals"]]
    rate = result["data"]["end"]["sum_received"]["bits_per_second"] / 1e6
    report(f"reload under traffic: longest ping gap {longest * 1000:.0f} ms over {len(stamps)} replies; "
           f"iperf3 {rate:.1f} Mbit/s, slowest 100 ms interval {min(ivs) / 1e6:.1f} Mbit/s; wan1 connects 1")
    assert longest <= 0.1, f"gap of {longest * 1000:.0f} ms"
    assert min(ivs) > 0, ivs

    # `mpquic reload` answers with what it did: wan3 removed, retired on both sides.
    with open(cfg, "w") as f:
        f.write(without_path(changed, "wan3"))
    out = lab.sh(lab.client_ns(0), [labctl.BIN, "reload", "--socket", lab.sock("client0")]).stdout
    assert "reloaded: paths: removed wan3" in out, out
    labctl.wait_until("wan3 removed on both sides", lambda: all(
        paths(lab.status(who))["wan3"]["state"] == "removed" for who in ("client0", "server")))
    assert len(lab.ping(count=5, interval=0.05)["received"]) == 5


def test_server_reload_swaps_client_rules_and_lan_routes(make_lab):
    """The server's `clients:` list on reload: a LAN no longer allowed has its kernel route
    taken out and its session closed (the client, now refused, says why); allowed again, the
    route is back and the client is served; other sessions are not touched."""
    lab = make_lab(paths=1, clients=2)
    lab.pki()
    net = lab.lan_addr(0).rsplit(".", 1)[0] + ".0/24"
    allowed = f"clients:\n- name: site1\n  routes: [{net}]\n"
    lab.extra_yaml = allowed
    lab.start_server()
    lab.extra_yaml = ""
    lab.start_client(0, yaml=lab.client_yaml(0) + f"lan_prefixes: [{net}]\n")
    lab.start_client(1)
    lab.wait_tunnel(0, routed=True)
    lab.wait_tunnel(1)
    server_cfg = f"{lab.dir}/server-run.yaml"
    route = lambda: lab.sh(lab.server_ns, f"ip -4 route show {net}").stdout  # noqa: E731
    assert "dev" in route(), route()

    def site2_connects():
        t = [t for t in lab.status("server")["tunnels"] if t["peer"].startswith("site2")]
        return t[0]["paths"][0]["connects"]

    before = site2_connects()

    def reload_server():
        r = lab.sh(lab.server_ns, [labctl.BIN, "reload", "--socket", lab.sock("server")], check=False)
        return r.stdout + r.stderr

    # A change to a key fixed at start is refused whole.
    with open(server_cfg, "w") as f:
        f.write(re.sub(r"^tun_name: (\S+)", r"tun_name: \1x", lab.server_yaml() + allowed, flags=re.M))
    out = reload_server()
    assert "reload refused" in out and "tun_name" in out, out
    assert route(), "route gone after a refused reload"

    # site1's LAN no longer allowed: route out, session closed, the client refused.
    with open(server_cfg, "w") as f:
        f.write(lab.server_yaml())
    out = reload_server()
    assert f"LAN routes removed {net}" in out and "rejoining" in out, out
    assert route().strip() == "", route()
    labctl.wait_until("site1 refused", lambda: "is not allowed" in lab.log("client0"))
    # site2 was not touched.
    assert site2_connects() == before
    assert len(lab.ping(count=3, interval=0.1, c=1)["received"]) == 3

    # Allowed again: the route is back and site1 is served once it starts again.
    with open(server_cfg, "w") as f:
        f.write(lab.server_yaml() + allowed)
    out = reload_server()
    assert f"LAN routes added {net}" in out, out
    assert route(), route()
    lab.stop("client0")
    lab.start_client(0, yaml=lab.client_yaml(0) + f"lan_prefixes: [{net}]\n")
    lab.wait_tunnel(0, routed=True)
    assert len(lab.ping(count=3, interval=0.1)["received"]) == 3
    report(f"server reload: {net} route removed and re-added with the clients: list; site2 untouched")


def test_revocation_closes_sessions_and_a_rotated_server_certificate_is_served(make_lab):
    """Reload re-reads the server's TLS files and its `revoked:` list: a certificate rotated on
    disk is what the next handshakes get (running sessions keep going); a client revoked by
    name or by serial has its session closed within 1 s and every later handshake refused
    (counted `revoked`, the client's log says why). Status shows each certificate's serial and
    expiry."""
    lab = make_lab(paths=1, clients=2)
    lab.start_all()
    pki = lab.files["pki"]
    server_cfg = f"{lab.dir}/server-run.yaml"

    def reload_server():
        r = lab.sh(lab.server_ns, [labctl.BIN, "reload", "--socket", lab.sock("server")], check=False)
        return r.stdout + r.stderr

    def certs(role, name=None):
        return [c for c in lab.status("server")["tls"]["certificates"]
                if c["role"] == role and (name is None or c["name"] == name)]

    old = certs("certificate")[0]
    assert old["expires_unix"] > time.time() + 30 * 86400, old
    assert certs("ca") and certs("client", "site1") and certs("client", "site2")
    assert f"server_serial={old['serial']}" in lab.log("client1"), lab.log("client1")[-2000:]

    # Rotation: a new server certificate written over the old files, then a reload.
    labctl.run([labctl.BIN, "pki", "server", "--dir", pki, "--name", "mpquic-server", "--san", labctl.SERVER_IP])
    out = reload_server()
    assert "TLS certificate, key and CA read again" in out, out
    new = certs("certificate")[0]
    assert new["serial"] != old["serial"], (old, new)
    lab.stop("client1")
    lab.start_client(1)
    lab.wait_tunnel(1)
    assert f"server_serial={new['serial']}" in lab.log("client1"), lab.log("client1")[-2000:]
    # site1's session was not touched by the rotation.
    assert lab.status("client0")["tunnels"][0]["paths"][0]["connects"] == 1
    # A client's certificate, rotated the same way, is what its next connections present.
    mine = lambda: [c for c in lab.status("client0")["tls"]["certificates"] if c["role"] == "certificate"][0]  # noqa: E731
    before = mine()["serial"]
    labctl.run([labctl.BIN, "pki", "client", "--dir", pki, "--name", "site1"])
    r = lab.sh(lab.client_ns(0), [labctl.BIN, "reload", "--socket", lab.sock("client0")])
    assert "TLS certificate, key and CA read again" in r.stdout, r.stdout
    assert mine()["serial"] != before, mine()
    assert len(lab.ping(count=3, interval=0.1)["received"]) == 3

    # Revocation: site1 by name, site2 by the serial status shows (in openssl's spelling).
    serial2 = certs("client", "site2")[0]["serial"]
    with open(server_cfg, "w") as f:
        f.write(lab.server_yaml() + f"revoked:\n- site1\n- 'serial:{serial2.upper()}'\n")
    t0 = time.monotonic()
    out = reload_server()
    assert "certificate revoked or token taken out: " in out and "site1" in out and "site2" in out, out
    labctl.wait_until("both sessions gone", lambda: not lab.status("server")["tunnels"], timeout=1.0)
    gone = time.monotonic() - t0
    labctl.wait_until("a revoked handshake refused", lambda: lab.status("server")["refused"].get("revoked", 0) >= 2)
    assert "revoked" in lab.log("client0").lower(), lab.log("client0")[-2000:]
    assert "revoked certificate refused" in lab.log("server"), lab.log("server")[-2000:]
    assert len(lab.ping(count=2, interval=0.1)["received"]) == 0
    report(f"revocation: both sessions closed {gone * 1000:.0f} ms after the reload; server certificate "
           f"{old['serial']} -> {new['serial']} served to the next handshake without a restart")
