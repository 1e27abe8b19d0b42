"""A namespace lab for mpquic: a LAN host, client router(s), the server (VPS) and an internet host,
with one veth per WAN path between each client and the server, optionally rate-limited with htb.

    lan --- client ==wan1== server --- inet
                   ==wan2==

Every path reaches the same server address (10.99.0.1, on the server's loopback) through its own
WAN interface, as on a real multi-WAN site; the client binds each path with `bind_ip: if:wanN`.
The LAN is masqueraded into the tunnel on the client, as in the seed's deployment.

Names carry the creating PID so several labs can run at once and leftovers of crashed runs can be
found (`down_stale`). Everything is removed by `down()`, also on exceptions and signals.
"""

import atexit
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("MPQUIC_BIN", os.path.join(REPO, "target", "release", "mpquic"))
PREFIX = "mqlab"
SERVER_IP = "10.99.0.1"
PORT = 45017
TUN_NET = "10.200.17"
INET_NET = "172.16.50"
_counter = itertools.count(1)
_live = []


def run(cmd, check=True, timeout=60, capture=True):
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=capture, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {cmd}\n{r.stdout}\n{r.stderr}")
    return r


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_ns_processes(ns):
    """Processes still running inside a namespace this lab created (iperf3 servers...)."""
    r = run(["ip", "netns", "pids", ns], check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def down_stale():
    """Remove namespaces left by labs whose creating process is gone."""
    removed = []
    r = run(["ip", "netns", "list"], check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{PREFIX}(\d+)x\d+-", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_ns_processes(name)
            run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def _cleanup_all():
    for lab in list(_live):
        lab.down()


atexit.register(_cleanup_all)


class Lab:
    def __init__(self, paths=2, clients=1, rates_mbit=None, mode="datagram", policy="failover",
                 weights=None, priorities=None, congestion="cubic", keep_dir=False, extra_yaml=""):
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.npaths = paths
        self.nclients = clients
        self.rates = rates_mbit or [None] * paths
        self.mode = mode
        self.policy = policy
        self.weights = weights or [1] * paths
        self.priorities = priorities or list(range(1, paths + 1))
        self.congestion = congestion
        self.dir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self.keep_dir = keep_dir
        self.namespaces = []
        self.procs = {}
        self.logs = {}
        # Extra top-level YAML for both server and client files (e.g. "worker_threads: 2\n").
        self.extra_yaml = extra_yaml

    # -- names -------------------------------------------------------------------------------
    def ns(self, role):
        return f"{self.tag}-{role}"

    def client_ns(self, i=0):
        return self.ns("cli" if i == 0 else f"cli{i + 1}")

    def lan_ns(self, i=0):
        return self.ns("lan" if i == 0 else f"lan{i + 1}")

    @property
    def server_ns(self):
        return self.ns("srv")

    @property
    def inet_ns(self):
        return self.ns("inet")

    def lan_addr(self, i=0):
        return f"192.168.{10 + i}.2"

    def client_tun_addr(self, i=0):
        return f"{TUN_NET}.{i + 1}"

    @property
    def inet_addr(self):
        return f"{INET_NET}.2"

    def sock(self, who):
        return os.path.join(self.dir, f"{who}.sock")

    # -- helpers ----------------------------------------------------------------------------
    def sh(self, ns, cmd, check=True, timeout=60):
        if isinstance(cmd, str):
            cmd = ["sh", "-c", cmd]
        return run(["ip", "netns", "exec", ns] + cmd, check=check, timeout=timeout)

    def spawn(self, key, ns, cmd, log=True):
        out = open(os.path.join(self.dir, f"{key}.log"), "w") if log else subprocess.DEVNULL
        p = subprocess.Popen(["ip", "netns", "exec", ns] + cmd, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs[key] = p
        if log:
            self.logs[key] = out.name
        return p

    def stop(self, key, sig=signal.SIGTERM, timeout=5):
        """Stop a process this lab started; returns seconds it took to exit."""
        p = self.procs.pop(key, None)
        if p is None or p.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        p.send_signal(sig)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        return time.monotonic() - t0

    def log(self, key):
        path = self.logs.get(key) or os.path.join(self.dir, f"{key}.log")
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    # -- topology ---------------------------------------------------------------------------
    def up(self):
        _live.append(self)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _addns(self, name):
        run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        self.sh(name, "ip link set lo up")

    def _veth(self, ns_a, if_a, ns_b, if_b):
        self.sh(ns_a, ["ip", "link", "add", if_a, "type", "veth", "peer", "name", if_b, "netns", ns_b])
        self.sh(ns_a, ["ip", "link", "set", if_a, "up"])
        self.sh(ns_b, ["ip", "link", "set", if_b, "up"])

    def _build(self):
        srv, inet = self.server_ns, self.inet_ns
        self._addns(srv)
        self._addns(inet)
        self.sh(srv, f"sysctl -qw net.ipv4.ip_forward=1 && ip addr add {SERVER_IP}/32 dev lo")
        self._veth(srv, "inet", inet, "eth0")
        self.sh(srv, f"ip addr add {INET_NET}.1/24 dev inet")
        self.sh(inet, f"ip addr add {self.inet_addr}/24 dev eth0 && ip route add default via {INET_NET}.1")
        for c in range(self.nclients):
            cli, lan = self.client_ns(c), self.lan_ns(c)
            self._addns(cli)
            self._addns(lan)
            self.sh(cli, "sysctl -qw net.ipv4.ip_forward=1")
            self._veth(cli, "lan", lan, "eth0")
            self.sh(cli, f"ip addr add 192.168.{10 + c}.1/24 dev lan")
            self.sh(lan, f"ip addr add {self.lan_addr(c)}/24 dev eth0 && ip route add default via 192.168.{10 + c}.1")
            for p in range(self.npaths):
                self._wan(c, p)
        for c in range(self.nclients):
            for p in range(self.npaths):
                self.shape(c, p, self.rates[p])

    def wan_if(self, c, p):
        """(client-side name, server-side name) of WAN link p of client c."""
        return f"wan{p + 1}", f"c{c + 1}wan{p + 1}"

    def wan_net(self, c, p):
        return f"10.{10 + c}.{p + 1}"

    def _wan(self, c, p):
        cif, sif = self.wan_if(c, p)
        self._veth(self.client_ns(c), cif, self.server_ns, sif)
        net = self.wan_net(c, p)
        self.sh(self.client_ns(c), f"ip addr add {net}.2/24 dev {cif}")
        self.sh(self.server_ns, f"ip addr add {net}.1/24 dev {sif}")
        self._wan_route(c, p)

    def _wan_route(self, c, p):
        cif, _ = self.wan_if(c, p)
        self.sh(self.client_ns(c),
                f"ip route replace {SERVER_IP}/32 via {self.wan_net(c, p)}.1 dev {cif} metric {10 * (p + 1)}")

    def shape(self, c, p, mbit):
        """Rate-limit WAN link p of client c in both directions with htb (None removes it)."""
        cif, sif = self.wan_if(c, p)
        for ns, dev in ((self.client_ns(c), cif), (self.server_ns, sif)):
            self.sh(ns, f"tc qdisc del dev {dev} root", check=False)
            if mbit:
                self.sh(ns, f"tc qdisc add dev {dev} root handle 1: htb default 10 && "
                            f"tc class add dev {dev} parent 1: classid 1:10 htb rate {mbit}mbit ceil {mbit}mbit "
                            f"burst 64k cburst 64k && "
                            f"tc qdisc add dev {dev} parent 1:10 handle 10: pfifo limit 300")

    # -- faults -----------------------------------------------------------------------------
    def link_down(self, p, c=0):
        self.sh(self.client_ns(c), f"ip link set {self.wan_if(c, p)[0]} down")

    def link_up(self, p, c=0):
        self.sh(self.client_ns(c), f"ip link set {self.wan_if(c, p)[0]} up")
        # IPv4 removes routes through a device that goes down; put ours back like a router would.
        self._wan_route(c, p)

    def block(self, p, direction="both", c=0):
        """Drop the tunnel's UDP on WAN p at the server with nftables ("both" or "down")."""
        _, sif = self.wan_if(c, p)
        table = f"mqblock{p}"
        rules = [f"add table inet {table}",
                 f"add chain inet {table} out {{ type filter hook output priority 0 ; }}",
                 f"add rule inet {table} out oifname {sif} udp sport {PORT} drop"]
        if direction == "both":
            rules += [f"add chain inet {table} in {{ type filter hook input priority 0 ; }}",
                      f"add rule inet {table} in iifname {sif} udp dport {PORT} drop"]
        self.sh(self.server_ns, "nft -f - <<'EOF'\n" + "\n".join(rules) + "\nEOF")

    def unblock(self, p):
        self.sh(self.server_ns, f"nft delete table inet mqblock{p}", check=False)

    # -- mpquic -----------------------------------------------------------------------------
    def pki(self):
        d = os.path.join(self.dir, "pki")
        run([BIN, "pki", "init", "--dir", d])
        run([BIN, "pki", "server", "--dir", d, "--name", "mpquic-server", "--san", SERVER_IP])
        for c in range(self.nclients):
            run([BIN, "pki", "client", "--dir", d, "--name", f"site{c + 1}"])
        return d

    def server_yaml(self):
        d = os.path.join(self.dir, "pki")
        return (f"role: server\nbind_ip: 0.0.0.0\nremote_port: {PORT}\nmulti_conn_enabled: true\n"
                f"tun_name: mpq0\ntun_cidr: {TUN_NET}.254/24\nlog_level: info\n"
                f"tls_cert_file: {d}/mpquic-server.crt\ntls_key_file: {d}/mpquic-server.key\n"
                f"congestion_algorithm: {self.congestion}\ntransport_mode: {self.mode}\n"
                f"control_socket: {self.sock('server')}\n" + self.extra_yaml)

    def client_yaml(self, c=0, name=None, cert=True, request=True):
        d = os.path.join(self.dir, "pki")
        name = name or f"site{c + 1}"
        y = (f"role: client\nmultipath_enabled: true\nmultipath_policy: {self.policy}\ntun_name: mpq0\n"
             + (f"tun_cidr: {self.client_tun_addr(c)}/24\n" if request else "")
             + f"log_level: info\ntls_ca_file: {d}/ca.crt\n"
             + (f"tls_cert_file: {d}/{name}.crt\ntls_key_file: {d}/{name}.key\n" if cert else "")
             + f"tls_server_name: mpquic-server\ntls_insecure_skip_verify: false\n"
             f"congestion_algorithm: {self.congestion}\ntransport_mode: {self.mode}\n"
             f"control_socket: {self.sock(f'client{c}')}\n" + self.extra_yaml + "multipath_paths:\n")
        for p in range(self.npaths):
            y += (f"- name: wan{p + 1}\n  bind_ip: if:{self.wan_if(c, p)[0]}\n  remote_addr: {SERVER_IP}\n"
                  f"  remote_port: {PORT}\n  priority: {self.priorities[p]}\n  weight: {self.weights[p]}\n")
        return y

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def start_server(self):
        cfg = self.write("server.yaml", self.server_yaml())
        self.spawn("server", self.server_ns, [BIN, "--config", cfg])
        self._wait_file(self.sock("server"), "server", 10)

    def start_client(self, c=0, yaml=None, key=None):
        key = key or f"client{c}"
        cfg = self.write(f"{key}.yaml", yaml or self.client_yaml(c))
        try:
            os.unlink(self.sock(f"client{c}"))
        except FileNotFoundError:
            pass
        self.spawn(key, self.client_ns(c), [BIN, "--config", cfg])
        return key

    def _wait_file(self, path, key, timeout):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if os.path.exists(path):
                return
            p = self.procs.get(key)
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"{key} exited with {p.returncode}:\n{self.log(key)}")
            time.sleep(0.05)
        raise RuntimeError(f"{key} did not create {path} within {timeout}s:\n{self.log(key)}")

    def wait_tunnel(self, c=0, timeout=15):
        """Wait until client c has its address and all paths up; then route the inet subnet and
        masquerade the LAN through the tunnel."""
        key = f"client{c}"
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            p = self.procs.get(key)
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"{key} exited with {p.returncode}:\n{self.log(key)}")
            try:
                st = self.status(key)
                t = st["tunnels"][0]
                if t["address"] and all(x["state"] == "up" for x in t["paths"]):
                    break
            except Exception:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"tunnel of {key} not up within {timeout}s:\n{self.log(key)}\n--- server\n{self.log('server')}")
        ns = self.client_ns(c)
        self.sh(ns, f"ip route replace {INET_NET}.0/24 dev mpq0")
        self.sh(ns, "nft list table ip mqnat >/dev/null 2>&1 || nft -f - <<'EOF'\n"
                    "add table ip mqnat\n"
                    "add chain ip mqnat post { type nat hook postrouting priority 100 ; }\n"
                    "add rule ip mqnat post oifname mpq0 masquerade\nEOF")
        self.sh(self.inet_ns, f"ip route replace {TUN_NET}.0/24 via {INET_NET}.1")
        return st

    def status(self, key="server"):
        r = run([BIN, "status", "--socket", self.sock(key), "--json"], timeout=10)
        return json.loads(r.stdout)

    def path_status(self, key, path_name, tunnel=0):
        st = self.status(key)
        for p in st["tunnels"][tunnel]["paths"]:
            if p["name"] == path_name:
                return p
        raise KeyError(path_name)

    # -- traffic ----------------------------------------------------------------------------
    def iperf_server(self, port=5201):
        key = f"iperf{port}"
        self.spawn(key, self.inet_ns, ["iperf3", "-s", "-p", str(port)], log=False)
        for _ in range(50):
            r = self.sh(self.inet_ns, f"ss -ltn 'sport = :{port}' | grep -q LISTEN", check=False)
            if r.returncode == 0:
                return key
            time.sleep(0.1)
        raise RuntimeError("iperf3 server did not start")

    def iperf(self, seconds=5, streams=1, reverse=False, udp_mbit=None, port=5201, c=0, length=None,
              dst=None, timeout=None):
        cmd = ["iperf3", "-c", dst or self.inet_addr, "-p", str(port), "-t", str(seconds), "-P", str(streams), "-J"]
        if reverse:
            cmd.append("-R")
        if udp_mbit:
            cmd += ["-u", "-b", f"{udp_mbit}M"]
        if length:
            cmd += ["-l", str(length)]
        r = self.sh(self.lan_ns(c), cmd, timeout=timeout or seconds + 30, check=False)
        try:
            data = json.loads(r.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(f"iperf3 failed: {r.stdout}\n{r.stderr}")
        if "error" in data:
            raise RuntimeError(f"iperf3 error: {data['error']}")
        return data

    def ping(self, count=5, interval=0.2, c=0, dst=None, src_ns=None, timeout=None):
        ns = src_ns or self.lan_ns(c)
        r = self.sh(ns, ["ping", "-n", "-c", str(count), "-i", str(interval), "-W", "1", dst or self.inet_addr],
                    check=False, timeout=timeout or count * interval + 10)
        return parse_ping(r.stdout)

    def start_ping(self, key, interval=0.01, c=0, dst=None):
        return self.spawn(key, self.lan_ns(c), ["ping", "-n", "-i", str(interval), "-W", "1", dst or self.inet_addr])

    # -- teardown ---------------------------------------------------------------------------
    def down(self):
        for key in list(self.procs):
            self.stop(key, timeout=3)
        for ns in reversed(self.namespaces):
            _kill_ns_processes(ns)
            run(["ip", "netns", "del", ns], check=False)
        self.namespaces = []
        if self in _live:
            _live.remove(self)
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()


def parse_ping(text):
    """Received sequence numbers, and summary figures, from ping output."""
    seqs = [int(m.group(1)) for m in re.finditer(r"icmp_seq=(\d+)", text)]
    rtts = [float(m.group(1)) for m in re.finditer(r"time=([\d.]+) ms", text)]
    sent = None
    m = re.search(r"(\d+) packets transmitted", text)
    if m:
        sent = int(m.group(1))
    return {"received": sorted(set(seqs)), "rtts": rtts, "sent": sent}


def gaps(received, sent, interval):
    """Lost sequence numbers and the longest run of consecutive losses in seconds."""
    got = set(received)
    lost = [s for s in range(1, (sent or (max(received) if received else 0)) + 1) if s not in got]
    longest = run_len = 0
    prev = None
    for s in lost:
        run_len = run_len + 1 if prev is not None and s == prev + 1 else 1
        longest = max(longest, run_len)
        prev = s
    return lost, longest * interval
