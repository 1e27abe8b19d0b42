"""Traffic through the tunnel, several clients, authentication, MTU: real namespaces, TUN, TLS."""

import json
import os
import re
import subprocess
import time

import pytest

from conftest import report
import labctl


@pytest.mark.parametrize("mode", ["datagram", "reliable", "auto"])
def test_ping_tcp_both_directions_and_udp(make_lab, mode):
    lab = make_lab(paths=2, mode=mode)
    lab.start_tunnel()
    up_since = time.monotonic()
    p = lab.ping(count=20, interval=0.05)
    assert len(p["received"]) == 20, p
    lab.iperf_server()
    up = lab.iperf(seconds=4)["end"]["sum_received"]["bits_per_second"] / 1e6
    down = lab.iperf(seconds=4, reverse=True)["end"]["sum_received"]["bits_per_second"] / 1e6
    overflowed = udp_receive_overflows(lab, lab.inet_ns)
    udp = lab.iperf(seconds=4, udp_mbit=100)["end"]["sum"]
    # Datagrams the tunnel delivered that the receiving iperf3 could not read in time (its socket
    # buffer full: the kernel counts them) are not the tunnel's loss. CI once saw 3.2% lost on a
    # host whose hypervisor was taking the vCPUs away (steal) for seconds at a time.
    overflowed = udp_receive_overflows(lab, lab.inet_ns) - overflowed
    tunnel_lost = max(0, udp["lost_packets"] - overflowed) * 100 / max(1, udp["packets"])
    cli = lab.status("client0")["tunnels"][0]
    srv = lab.status("server")["tunnels"][0]
    drops = {k: {r: n for r, n in t["drops"].items() if n} for k, t in (("client", cli), ("server", srv))}
    report(f"{mode}: ping 20/20 rtt avg {sum(p['rtts']) / len(p['rtts']):.2f} ms; TCP up {up:.0f} Mbit/s, "
           f"down {down:.0f} Mbit/s; UDP 100 Mbit/s offered: {udp['bits_per_second'] / 1e6:.0f} Mbit/s, "
           f"lost {udp['lost_percent']:.2f}% ({overflowed} overflowed the receiver's socket, so "
           f"{tunnel_lost:.2f}% in the tunnel); tunnel drops {drops}")
    assert up > 50 and down > 50, (up, down)
    assert tunnel_lost < 2.0, (udp, overflowed, drops)
    if mode == "auto":
        # One path (failover) carries datagrams only where they gain something: clean and
        # above ~50 000 packets/s (the TCP upload, when this host carries it well above that);
        # pings (quiet) and 100 Mbit/s of UDP (a rate the stream carries as well) go on its
        # stream.
        elapsed = time.monotonic() - up_since
        wan1 = cli["paths"][0]
        report(f"auto: wan1 carries {wan1['carry']} ({wan1['carry_why']}) now, "
               f"{wan1['stream_s']:.1f} s of {elapsed:.1f} s on its stream, to the stream "
               f"{wan1['to_stream']} time(s)")
        assert (wan1["carry"], wan1["carry_why"]) in (
            ("datagram", "clean"), ("stream", "quiet"), ("stream", "single"), ("stream", "loss")), wan1
        if up > 1200:
            assert wan1["stream_s"] < elapsed - 1.5, (wan1, elapsed)
    # Every packet is accounted for: the client sent on its paths what the server received.
    assert sum(x["tx_packets"] for x in cli["paths"]) > 0
    assert srv["peer"] == "site1/mpq0" and srv["address"] == "10.200.17.1/24"


def test_keys_update_under_traffic_without_a_lost_packet(make_lab):
    """QUIC changes a connection's keys on its own (the first time after 10-1000 packets, then
    before the cipher's limit): under a TCP upload that fills the path (the product's defaults,
    unshaped: the upload's own packets are refused `queue_full` when the sender falls behind)
    both ends count key updates, and pings every 10 ms across them all arrive (a sparse flow
    passes the upload's backlog)."""
    lab = make_lab(paths=1, mode=None)
    lab.start_tunnel()
    before = {who: lab.status(who)["tls"]["key_updates"] for who in ("client0", "server")}
    lab.iperf_server()
    # Counted, so ping waits for the last reply before it exits: 4 s around a 3 s upload.
    lab.start_ping("ping", interval=0.01, count=400)
    time.sleep(0.5)
    up = lab.iperf(seconds=3)["end"]["sum_received"]["bits_per_second"] / 1e6
    lab.procs["ping"].wait(timeout=15)
    p = labctl.parse_ping(lab.log("ping"))
    after = {who: lab.status(who)["tls"]["key_updates"] for who in ("client0", "server")}
    refused = sum(x["drops"]["queue_full"] for x in lab.status("client0")["tunnels"][0]["paths"])
    report(f"key updates under a {up:.0f} Mbit/s upload: client {before['client0']} -> "
           f"{after['client0']}, server {before['server']} -> {after['server']}; pings "
           f"{len(p['received'])}/{p['sent']}; the upload's packets refused queue_full: {refused}")
    assert all(after[w] > before[w] for w in after), (before, after)
    assert p["sent"] == 400 and len(p["received"]) == p["sent"], p
    table = labctl.run([labctl.BIN, "status", "--socket", lab.sock("client0")]).stdout
    assert f"key updates {after['client0']}" in table, table


def udp_receive_overflows(lab, ns):
    """UDP datagrams the kernel of namespace `ns` dropped because a socket's receive buffer was
    full (RcvbufErrors in /proc/net/snmp), so far."""
    rows = [line.split() for line in lab.sh(ns, "cat /proc/net/snmp").stdout.splitlines()
            if line.startswith("Udp:")]
    return int(dict(zip(rows[0], rows[1]))["RcvbufErrors"])


def test_two_clients_own_addresses_and_spoofed_source_dropped(make_lab):
    lab = make_lab(paths=1, clients=2)
    lab.start_all()
    for c in (0, 1):
        p = lab.ping(count=5, interval=0.05, c=c)
        assert len(p["received"]) == 5, (c, p)
    st = {t["peer"]: t for t in lab.status("server")["tunnels"]}
    assert st["site1/mpq0"]["address"] == "10.200.17.1/24"
    assert st["site2/mpq0"]["address"] == "10.200.17.2/24"
    # site1 sends packets claiming site2's address: dropped by the server, counted.
    ns = lab.client_ns(0)
    # (without the lab's LAN masquerade, which would rewrite the forged source to site1's own)
    lab.sh(ns, "nft delete table ip labnat && ip addr add 10.200.17.2/32 dev lo")
    r = lab.sh(ns, "ping -n -c 5 -i 0.05 -W 1 -I 10.200.17.2 10.200.17.254", check=False)
    assert " 0 received" in r.stdout, r.stdout
    st = {t["peer"]: t for t in lab.status("server")["tunnels"]}
    spoofed = sum(x["drops"]["spoofed_source"] for x in st["site1/mpq0"]["paths"])
    report(f"two clients: site1=10.200.17.1 site2=10.200.17.2; spoofed packets from site1 dropped: {spoofed}")
    assert spoofed >= 5
    assert sum(x["drops"]["spoofed_source"] for x in st["site2/mpq0"]["paths"]) == 0
    # A client asking for an address outside the server's network gets a clear error and stops.
    bad = lab.client_yaml(1).replace("tun_cidr: 10.200.17.2/24", "tun_cidr: 10.99.99.1/24")
    lab.stop("client1")
    key = lab.start_client(1, yaml=bad, key="client1-bad")
    rc = lab.procs[key].wait(timeout=15)
    log = lab.log(key)
    assert rc != 0, log
    assert "not a usable host address" in log, log


def test_ipv6_inside_a_dual_stack_tunnel(make_lab):
    """A dual-stack tun_cidr on the server: the client gets an IPv6 tunnel address too (its IPv4
    host number in the server's IPv6 network); ping6 and a TCP transfer go through the tunnel
    over IPv6; the kernel's own IPv6 chatter adds no spoofed drops; an IPv6 source that is not
    the client's is dropped and counted."""
    lab = make_lab(paths=2)
    lab.pki()
    server = re.sub(r"^tun_cidr: (\S+)$", r"tun_cidr: \1, fd00:17::fe/64", lab.server_yaml(), flags=re.M)
    assert "fd00:17::fe/64" in server, server
    lab.write("server-run.yaml", server)
    lab.spawn("server", lab.server_ns, [labctl.BIN, "--config", f"{lab.dir}/server-run.yaml"])
    lab._wait_file(lab.sock("server"), "server", 10)
    lab.start_client()
    lab.wait_tunnel()
    st = lab.status("client0")
    assert st["tunnels"][0]["address6"] == "fd00:17::1/64", st["tunnels"][0]
    ns = lab.client_ns(0)
    r = lab.sh(ns, "ping -6 -n -c 20 -i 0.05 -W 1 fd00:17::fe", check=False)
    assert " 20 received" in r.stdout, r.stdout
    lab.spawn("iperf6", lab.server_ns, ["iperf3", "-s", "-p", "5206", "-B", "fd00:17::fe"], log=False)
    wait = 'ss -ltn "sport = :5206" | grep -q LISTEN'
    for _ in range(50):
        if lab.sh(lab.server_ns, wait, check=False).returncode == 0:
            break
        time.sleep(0.1)
    tcp = lab.iperf(seconds=3, dst="fd00:17::fe", port=5206, src_ns=ns)
    mbit = tcp["end"]["sum_received"]["bits_per_second"] / 1e6
    down = lab.iperf(seconds=3, dst="fd00:17::fe", port=5206, src_ns=ns, reverse=True)
    mbit_down = down["end"]["sum_received"]["bits_per_second"] / 1e6
    srv = lab.status("server")
    t = srv["tunnels"][0]
    assert t["address6"] == "fd00:17::1/64", t
    spoofed = lambda t: sum(x["drops"]["spoofed_source"] for x in t["paths"])  # noqa: E731
    assert spoofed(t) == 0, t
    # A forged IPv6 source (another address of the tunnel's network) is dropped and counted.
    lab.sh(ns, "ip -6 addr add fd00:17::99/128 dev mpq0 nodad")
    r = lab.sh(ns, "ping -6 -n -c 5 -i 0.05 -W 1 -I fd00:17::99 fd00:17::fe", check=False)
    assert " 0 received" in r.stdout, r.stdout
    forged = spoofed(lab.status("server")["tunnels"][0])
    report(f"IPv6 in the tunnel: 20/20 ping6, TCP up {mbit:.0f} / down {mbit_down:.0f} Mbit/s over IPv6; "
           f"forged IPv6 source: {forged} dropped as spoofed; server drops {srv['drops']}")
    assert mbit > 10 and mbit_down > 10, (mbit, mbit_down)
    assert forged >= 5, forged


def test_server_tun_queue_per_thread_sessions_spread(make_lab):
    """A server with `worker_threads: 2` opens its TUN device with two queues, a reader each;
    its two clients' sessions write to different queues, and the kernel hands each flow's
    packets to the queue that wrote the flow, so both queues (and readers) carry traffic while
    both clients move data both ways at once."""
    lab = make_lab(paths=1, clients=2, emulated=False)
    lab.start_all(server_yaml="worker_threads: 2\n")
    assert "queues=2" in lab.log("server"), lab.log("server")
    for c in (0, 1):
        lab.iperf_server(5201 + c)
    # Client 0 uploads while client 1 downloads, then the other way round: 4 streams each.
    got = {}
    for swap in (False, True):
        procs = []
        for c in (0, 1):
            reverse = (c == 1) != swap
            cmd = ["ip", "netns", "exec", lab.lan_ns(c), "iperf3", "-c", lab.inet_addr, "-p",
                   str(5201 + c), "-t", "3", "-P", "4", "-J"] + (["-R"] if reverse else [])
            procs.append((c, reverse, subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)))
        for c, reverse, proc in procs:
            out = json.loads(proc.communicate(timeout=60)[0])
            got[(c, "down" if reverse else "up")] = out["end"]["sum_received"]["bits_per_second"] / 1e6
    st = lab.status("server")
    queues = st["tun_queue_packets"]
    table = lab.sh(lab.server_ns, f"{labctl.BIN} status --socket {lab.sock('server')}").stdout
    report(f"server with 2 TUN queues: packets read per queue {queues}; Mbit/s "
           + ", ".join(f"site{c + 1} {d} {v:.0f}" for (c, d), v in sorted(got.items())))
    assert len(queues) == 2 and min(queues) > 1000, queues
    assert "tun queues 2" in table, table
    assert all(v > 50 for v in got.values()), got
    assert sum(st["drops"].values()) == 0, st["drops"]


def test_foreign_ca_and_missing_certificate_are_refused(make_lab):
    lab = make_lab(paths=1)
    d = lab.pki()
    other = os.path.join(lab.dir, "other-pki")
    labctl.run([labctl.BIN, "pki", "init", "--dir", other])
    labctl.run([labctl.BIN, "pki", "client", "--dir", other, "--name", "site1"])
    lab.start_server()
    foreign = lab.client_yaml(0).replace(f"{d}/site1.crt", f"{other}/site1.crt").replace(f"{d}/site1.key", f"{other}/site1.key")
    lab.start_client(0, yaml=foreign, key="foreign")
    time.sleep(2.5)
    lab.stop("foreign")
    lab.start_client(0, yaml=lab.client_yaml(0, cert=False), key="nocert")
    time.sleep(2.5)
    lab.stop("nocert")
    srv = lab.log("server")
    st = lab.status("server")
    assert st["tunnels"] == []
    # Each refusal is counted by reason, not only logged (each client retried several times).
    report(f"refused connections counted: {st['refused']}")
    assert st["refused"].get("handshake_failed", 0) >= 2, st["refused"]
    report("server log on refusals: " + " | ".join(l.split("WARN")[-1].strip() for l in srv.splitlines() if "refused" in l)[:600])
    report("foreign client log: " + next((l for l in lab.log("foreign").splitlines() if "failed" in l), "")[-300:])
    report("no-cert client log: " + next((l for l in lab.log("nocert").splitlines() if "failed" in l), "")[-300:])
    refusals = [l for l in srv.splitlines() if "handshake failed; client refused" in l]
    assert any("invalid peer certificate" in l for l in refusals), srv
    assert any("peer sent no certificates" in l for l in refusals), srv
    assert "path connect failed" in lab.log("foreign") and "certificate" in lab.log("foreign").lower()
    assert "path connect failed" in lab.log("nocert") and "certificate" in lab.log("nocert").lower()


def test_oversized_packet_is_counted_not_fatal(make_lab):
    lab = make_lab(paths=1)
    # A TUN MTU larger than the path can carry lets an oversized packet reach the tunnel.
    lab.start_tunnel(client=lambda y: y.replace("log_level: info", "log_level: info\ntun_mtu: 1500"))
    ns = lab.client_ns(0)
    r = lab.sh(ns, "ping -n -c 3 -i 0.1 -W 1 -M do -s 1472 10.200.17.254", check=False)
    assert " 0 received" in r.stdout, r.stdout
    path = lab.path_status("client0", "wan1")
    report(f"oversized: {path['drops']['oversized']} dropped and counted, {path['too_big_sent']} "
           f"answered with ICMP too big; tunnel state {path['state']}; ping said: "
           f"{(r.stdout + r.stderr).strip().splitlines()[1:3]}")
    # The first is refused and answered with the size that fits, so the sender's kernel
    # refuses the next ones itself (ping: "message too long, mtu=...").
    assert path["drops"]["oversized"] >= 1
    assert path["too_big_sent"] == path["drops"]["oversized"]
    out = r.stdout + r.stderr
    assert "Frag needed" in out or "message too long" in out, out
    p = lab.ping(count=5, interval=0.05)
    assert len(p["received"]) == 5


def test_routed_site_lan_without_nat(make_lab):
    """Routed LANs: site1 announces its LAN (lan_prefixes) and the server's `clients:` entry
    allows it; the LAN host reaches the internet host without NAT (the internet host sees the
    LAN host's own address) and is reached back. site2 announces a prefix it is not allowed:
    refused, logged on both sides."""
    lab = make_lab(paths=1, clients=2)
    lab.pki()
    # Each client's LAN is a /24 in the lab (192.168.N.0/24).
    net = [lab.lan_addr(c).rsplit(".", 1)[0] + ".0/24" for c in (0, 1)]
    lab.extra_yaml = f"clients:\n- name: site1\n  routes: [{net[0]}]\n"
    lab.start_server()
    lab.extra_yaml = ""
    assert "site LAN routed into the TUN device" in lab.log("server")
    lab.start_client(0, yaml=lab.client_yaml(0) + f"lan_prefixes: [{net[0]}]\n")
    lab.wait_tunnel(0, routed=True)
    lan = lab.lan_addr(0)
    assert len(lab.ping(count=5, interval=0.05)["received"]) == 5
    # Reached back: the internet host pings the LAN host (only a route can do that).
    back = lab.sh(lab.inet_ns, f"ping -c 3 -i 0.2 -W 1 {lan}", check=False)
    assert " 3 received" in back.stdout, back.stdout
    # No NAT: a TCP connection from the LAN host arrives from the LAN host's address.
    seen = source_seen_by_internet_host(lab, lab.inet_addr)
    assert seen == lan, seen
    st = lab.status("server")
    assert sum(x["drops"]["spoofed_source"] for x in st["tunnels"][0]["paths"]) == 0
    assert st["tunnels"][0]["lans"] == [net[0]], st["tunnels"][0]
    table = lab.sh(lab.server_ns, f"{labctl.BIN} status --socket {lab.sock('server')}").stdout
    assert f"lan {net[0]}" in table, table

    # site2 announces its LAN, which its (absent) clients: entry does not allow.
    lab.start_client(1, yaml=lab.client_yaml(1) + f"lan_prefixes: [{net[1]}]\n")
    t0 = time.monotonic()
    while "not allowed" not in lab.log("client1") and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert f"LAN prefix {net[1]} is not allowed" in lab.log("client1"), lab.log("client1")
    assert "not allowed" in lab.log("server"), lab.log("server")
    report(f"routed LAN: {lan} reached the internet host and was reached back, seen as {seen} (no NAT); "
           f"site2's unallowed {net[1]} refused")


def test_routed_ipv6_site_lan(make_lab):
    """A dual-stack site: the client announces an IPv6 LAN beside its IPv4 one, the server
    allows both and routes them into its TUN device; the LAN host reaches the internet host
    over IPv6 from its own address (no NAT) and is reached back. Without the server's IPv6
    part the same allowance is a configuration error."""
    lab = make_lab(paths=1)
    lab.pki()
    net4 = lab.lan_addr(0).rsplit(".", 1)[0] + ".0/24"
    lan6, inet6 = "fd00:50::/64", "fd00:99::/64"
    clients = f"clients:\n- name: site1\n  routes: [{net4}, {lan6}]\n"
    v4only = lab.server_yaml() + clients
    r = labctl.run([labctl.BIN, "check-config", lab.write("server-v4.yaml", v4only)], check=False)
    assert r.returncode != 0 and "IPv4 only" in r.stderr, r.stderr
    server = re.sub(r"^tun_cidr: (\S+)$", r"tun_cidr: \1, fd00:17::fe/64", lab.server_yaml(), flags=re.M)
    lab.write("server-run.yaml", server + clients)
    lab.spawn("server", lab.server_ns, [labctl.BIN, "--config", f"{lab.dir}/server-run.yaml"])
    lab._wait_file(lab.sock("server"), "server", 10)
    lab.start_client(0, yaml=lab.client_yaml(0) + f"lan_prefixes: [{net4}, {lan6}]\n")
    lab.wait_tunnel(0, routed=True)
    # IPv6 addressing of the lab, by hand (mpquic-lab's topology is IPv4): the LAN host
    # fd00:50::2 behind the client router's fd00:50::1; the internet host fd00:99::2 behind
    # the server's fd00:99::1; the client sends the internet prefix into its tunnel, the
    # internet host sends the LAN prefix to the server, whose route into its TUN device is
    # mpquic's.
    cli, srv = lab.client_ns(0), lab.server_ns
    for ns in (cli, srv):
        lab.sh(ns, "sysctl -qw net.ipv6.conf.all.forwarding=1")
    lab.sh(lab.lan_ns(0), "ip -6 addr add fd00:50::2/64 dev eth0 nodad && ip -6 route add default via fd00:50::1")
    lab.sh(cli, f"ip -6 addr add fd00:50::1/64 dev lan nodad && ip -6 route add {inet6} dev mpq0")
    lab.sh(srv, "ip -6 addr add fd00:99::1/64 dev inet nodad")
    lab.sh(lab.inet_ns, f"ip -6 addr add fd00:99::2/64 dev eth0 nodad && ip -6 route add {lan6} via fd00:99::1")
    routes = lab.sh(srv, "ip -6 route show dev mpq0").stdout
    assert lan6 in routes, routes
    # The first packets wait for neighbour discovery on the fresh veth links.
    for _ in range(50):
        if lab.ping(count=1, dst="fd00:99::2")["received"]:
            break
    got = lab.ping(count=5, interval=0.05, dst="fd00:99::2")
    assert len(got["received"]) == 5, got
    back = lab.sh(lab.inet_ns, "ping -6 -c 3 -i 0.2 -W 1 fd00:50::2", check=False)
    assert " 3 received" in back.stdout, back.stdout
    # No NAT: the internet host sees the LAN host's own IPv6 address.
    seen = source_seen_by_internet_host(lab, "fd00:99::2")
    assert seen == "fd00:50::2", seen
    st = lab.status("server")
    t = st["tunnels"][0]
    assert sorted(t["lans"]) == sorted([net4, lan6]), t
    # Both routers forward IPv6: the kernel's multicast group reports stay off the tunnel
    # (the TUN devices are not multicast), so neither end counts them as drops.
    assert sum(x["drops"]["spoofed_source"] for x in t["paths"]) == 0, t
    assert st["drops"]["no_route"] == 0, st["drops"]
    report(f"routed IPv6 LAN: fd00:50::2 reached fd00:99::2 and was reached back, seen as {seen} (no NAT); "
           f"server routes on mpq0: {' | '.join(l.strip() for l in routes.splitlines())}; "
           f"client drops {lab.status('client0')['drops']}")


def source_seen_by_internet_host(lab, dst):
    """The source address a TCP connection from client 0's LAN host to the internet host's
    address `dst` (IPv4 or IPv6) arrives from: the LAN host's own when nothing NATs it."""
    family = "socket.AF_INET6" if ":" in dst else "socket.AF_INET"
    srv = subprocess.Popen(["ip", "netns", "exec", lab.inet_ns, "python3", "-c",
                            f"import socket;s=socket.socket({family});"
                            "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                            "s.bind(('',7001));s.listen();c,a=s.accept();print(a[0],flush=True)"],
                           stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(50):
            r = lab.sh(lab.lan_ns(0), ["python3", "-c", "import socket;socket.create_connection"
                                       f"(('{dst}',7001),timeout=2)"], check=False)
            if r.returncode == 0:
                break
            time.sleep(0.1)
        return srv.communicate(timeout=10)[0].strip()
    finally:
        srv.kill()
