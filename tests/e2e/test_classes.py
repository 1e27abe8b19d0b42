"""Traffic classes: classes in one client (lanes of one tunnel over shared paths), and the seed's
layout of one instance per class (its own TUN device) sharing one certificate, one server port
and one subnet."""

import re

from conftest import report
import labctl

CLASSES = """classes:
- name: critical
  multipath_policy: redundant
  transport_mode: datagram
  match:
  - protocol: icmp
- name: default
- name: bulk
  match:
  - port: 5201
"""


def by_class(st):
    """The classes of the instance's one tunnel (a client) or of its first session (server)."""
    return {c["name"]: c for c in st["tunnels"][0].get("classes", [])}


def test_classes_in_one_client(make_lab):
    lab = make_lab(paths=2, mode="reliable", policy="failover", priorities=[1, 1],
                   extra_yaml="metrics_listen: 127.0.0.1:9464\n")
    lab.start_tunnel(client_extra=CLASSES)
    ping = lab.ping(count=20, interval=0.02)
    assert len(ping["received"]) == 20, ping
    lab.iperf_server()
    up = lab.iperf(seconds=3)["end"]["sum_received"]["bits_per_second"] / 1e6
    # Something no rule matches: UDP to port 9 goes in the default class, counted as unmatched.
    send = ("import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
            "[s.sendto(b'x'*100,('%s',9)) for _ in range(30)]" % lab.inet_addr)
    lab.sh(lab.lan_ns(0), ["python3", "-c", send])

    cst, sst = lab.status("client0"), lab.status("server")
    cli, srv = by_class(cst), by_class(sst)
    assert list(cli) == ["critical", "default", "bulk"], list(cli)
    assert list(srv) == ["critical", "default", "bulk"], list(srv)
    report(f"classes: ping 20/20, TCP up {up:.0f} Mbit/s in bulk; client packets critical "
           f"{cli['critical']['classified_packets']}, bulk {cli['bulk']['classified_packets']}, "
           f"default unmatched {cli['default']['unmatched_packets']}; server sent critical "
           f"{srv['critical']['classified_packets']}, bulk {srv['bulk']['classified_packets']}")
    assert cli["critical"]["classified_packets"] >= 20
    assert cli["critical"]["policy"] == "redundant" and cli["critical"]["mode"] == "datagram"
    assert cli["bulk"]["mode"] == "reliable"
    assert cli["bulk"]["classified_packets"] > 1000 and up > 20
    assert cli["default"]["unmatched_packets"] >= 30 and cli["default"]["classified_packets"] == 0
    # The server sends each flow's answers in the class the flow arrived in.
    assert srv["critical"]["classified_packets"] >= 20
    assert srv["bulk"]["classified_packets"] > 100
    # The classes share the paths: one tunnel per side, one connection per path, all up.
    for st in (cst, sst):
        assert len(st["tunnels"]) == 1, st["tunnels"]
        paths = st["tunnels"][0]["paths"]
        assert sorted(p["name"] for p in paths) == ["wan1", "wan2"]
        assert all(p["state"] == "up" and p["connects"] == 1 for p in paths), paths
    assert sst["tunnels"][0]["peer"] == "site1/mpq0"
    # Each side's status says which controller each tunnel runs (this lab configures cubic,
    # which has no yielding form; with bbr a tunnel with classes shows `bbr (yielding)`).
    assert cst["tunnels"][0]["congestion"] == sst["tunnels"][0]["congestion"] == sst["congestion"]
    # redundant: every ping went on both paths (of the same priority): its 20+ packets are
    # counted once in its class, and both paths carried at least that many.
    assert cli["critical"]["tx_packets"] >= 20
    assert all(p["tx_packets"] >= 20 for p in cst["tunnels"][0]["paths"])

    table = labctl.run([labctl.BIN, "status", "--socket", lab.sock("client0")]).stdout
    assert re.search(r"class critical \(\d+ packets\)  policy redundant  mode datagram", table), table
    assert re.search(r"class default \(0 packets, \d+ unmatched\)", table), table
    fetch = ("import urllib.request;"
             "print(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode())")
    text = lab.sh(lab.server_ns, ["python3", "-c", fetch]).stdout
    assert 'mpquic_path_up{tunnel="site1/mpq0",path="wan1"} 1' in text, text[:3000]
    assert re.search(r'mpquic_class_packets_total\{tunnel="site1/mpq0",class="critical",how="matched"\} [1-9]',
                     text), text[:3000]


def test_seed_layout_three_instances_one_certificate(make_lab):
    """Seed 000 section 4: cr2, br2, df2 on one site, each its own instance and TUN device with
    its own address in the server's one subnet, all with the site's one certificate."""
    lab = make_lab(paths=1, mode="reliable")
    lab.pki()
    lab.start_server()
    base = lab.client_yaml(0)
    sock = lab.sock("client0")
    instances = [("cr2", "10.200.17.1"), ("br2", "10.200.17.5"), ("df2", "10.200.17.9")]
    for name, addr in instances:
        y = (base.replace("tun_name: mpq0", f"tun_name: {name}")
                 .replace("tun_cidr: 10.200.17.1/24", f"tun_cidr: {addr}/24")
                 .replace(sock, sock.replace(".sock", f"-{name}.sock")))
        assert f"tun_name: {name}" in y and f"{addr}/24" in y
        lab.spawn(name, lab.client_ns(0), [labctl.BIN, "--config", lab.write(f"{name}.yaml", y)])
    server = {}
    for _ in range(100):
        server = {t["peer"]: t for t in lab.status("server")["tunnels"]}
        if len(server) == 3 and all(p["state"] == "up" for t in server.values() for p in t["paths"]):
            break
        labctl.time.sleep(0.1)
    assert sorted(server) == ["site1/br2", "site1/cr2", "site1/df2"], server.keys()
    for name, addr in instances:
        assert server[f"site1/{name}"]["address"] == f"{addr}/24"
    # The seed's ping test: through each tunnel in turn (bound to its device: the three share
    # one subnet, so the route alone would send all of them through the first).
    for name, addr in instances:
        r = lab.sh(lab.client_ns(0), ["ping", "-n", "-c", "10", "-i", "0.02", "-W", "1", "-I", name,
                                      "10.200.17.254"], check=False)
        got = labctl.parse_ping(r.stdout)
        assert len(got["received"]) == 10, (name, r.stdout, lab.log(name))
    rx = {t["peer"]: sum(p["rx_packets"] for p in t["paths"]) for t in lab.status("server")["tunnels"]}
    report(f"seed layout: three instances of site1, packets received by the server per instance {rx}")
    assert all(n >= 10 for n in rx.values()), rx
    # Seed tests 1-2 on this layout: 10% loss on the link (all three cross it; the seed put it on
    # br2's device only). Reliable mode (these instances' default) retransmits: no ping lost.
    lab.set_link(0, "loss=10%")
    # `-w`: ping waits up to 10 s for 50 replies, sending on (every 20 ms) until it has them:
    # lost are the requests before the last one answered that got no answer (one stream each
    # way keeps them in order), not those still on their way when it exits.
    # Without `-w` ping waits only two of its longest round trips for the last reply (`-W`
    # counts only while nothing came back), and a last reply lost on the link comes a
    # retransmission timeout later: once in ~15 runs a reply the tunnel delivered was counted
    # lost (always the last sequence number, no drop counted anywhere).
    lost = {}
    for name, _ in instances:
        r = lab.sh(lab.client_ns(0), ["ping", "-n", "-c", "50", "-i", "0.02", "-w", "10", "-I", name,
                                      "10.200.17.254"], check=False, timeout=60)
        got = labctl.parse_ping(r.stdout)["received"]
        assert len(got) >= 50, (name, r.stdout)
        lost[name] = got[-1] - len(got)
    report(f"seed layout, 10% loss on the link: pings lost per instance (of 50) {lost}")
    assert all(n == 0 for n in lost.values()), (lost, {n: lab.log(n)[-3000:] for n in lost if lost[n]})


def test_class_with_its_own_tun_device(make_lab):
    """A class with its own TUN device (`tun_name` in the class: sites that route a VLAN into a
    class): what the device reads goes in that class, the answers come back on it."""
    lab = make_lab(paths=1, mode="reliable")
    classes = ("classes:\n- name: critical\n  match:\n  - protocol: icmp\n- name: default\n"
               "- name: bulk\n  tun_name: blk0\n")
    lab.start_tunnel(client_extra=classes)
    r = lab.sh(lab.client_ns(0), ["ping", "-n", "-c", "10", "-i", "0.02", "-W", "1", "-I", "blk0",
                                  "10.200.17.254"], check=False)
    got = labctl.parse_ping(r.stdout)
    assert len(got["received"]) == 10, (r.stdout, lab.log("client0"))
    cli = by_class(lab.status("client0"))
    srv = by_class(lab.status("server"))
    report(f"class bulk on its own device blk0: ping 10/10; client bulk {cli['bulk']['classified_packets']} "
           f"packets, critical {cli['critical']['classified_packets']}; server bulk "
           f"{srv['bulk']['classified_packets']}")
    # The device is the rule: ICMP read from blk0 is bulk, not critical.
    assert cli["bulk"]["classified_packets"] >= 10
    assert srv["bulk"]["classified_packets"] >= 10
    addr = lab.sh(lab.client_ns(0), ["ip", "-4", "-o", "addr", "show", "dev", "blk0"]).stdout
    assert "10.200.17.1/24" in addr, addr
