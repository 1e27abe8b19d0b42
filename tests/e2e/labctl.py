"""The end-to-end tests' (and bench/throughput.py's) handle on an mpquic-lab lab.

Everything about the lab itself comes from `mpquic-lab` (crates/lab, docs/LAB.md): the topology
(`up --clients N`, paths emulated or `direct`), link changes and outages (`set`, `link`), the PKI
and mpquic configurations (`configs`) and the routing of a site's LAN through its tunnel
(`route`). This module only starts and stops the processes a test runs in the lab (mpquic,
iperf3, ping), remembers them, and parses what they print.

    lan --- client ==wan1== [emulator] == server --- inet
                   ==wan2==

Client numbers here are 0-based (`client0` is mpquic-lab's client 1), path numbers too.
Lab names carry the creating PID, so `mpquic-lab down --stale` finds the leftovers of a crashed
run; everything is removed by `down()`, also on exceptions and at exit.
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("MPQUIC_BIN", os.path.join(REPO, "target", "release", "mpquic"))
LAB = os.environ.get("MPQUIC_LAB_BIN", os.path.join(REPO, "target", "release", "mpquic-lab"))
SERVER_IP = "10.99.0.1"
# The server's CONNECT-IP port in the labs, and its IPv6 tunnel address when dual-stack.
MASQUE_PORT = 8443
SERVER_TUN6 = "fd00:17::fe"
_counter = itertools.count(1)
_live = []


def run(cmd, check=True, timeout=60, capture=True):
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=capture, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {cmd}\n{r.stdout}\n{r.stderr}")
    return r


def lab_cmd(*args, timeout=60):
    """One mpquic-lab command; its stdout."""
    return run([LAB, *[str(a) for a in args]], timeout=timeout).stdout


def new_token(name):
    """`mpquic pki token NAME`: the token and the server's `masque_tokens` entry."""
    out = run([BIN, "pki", "token", name]).stdout
    token = re.search(r"^(mpq_[0-9a-f]+)$", out, re.M).group(1)
    return token, out[out.index("- name:"):].strip()


def unique_name(prefix="e"):
    """A lab name no other run uses at the same time (mpquic-lab names: <= 24 characters)."""
    return f"{prefix}{os.getpid()}x{next(_counter)}"


def _cleanup_all():
    for lab in list(_live):
        lab.down()


atexit.register(_cleanup_all)


class Lab:
    """`paths` WAN links per client: `rates_mbit[p]` shapes path p in the emulator (None:
    unlimited), or `specs[p]` gives its whole emulator spec ("rate=100mbit,delay=5ms");
    `emulated=False` makes every path a plain veth pair instead (throughput benchmarks, where
    the emulator would cost as much CPU as the tunnel). `mode` and `congestion` None leave
    mpquic's defaults; `pipes` and `transport` are per path (mpquic-lab configs)."""

    def __init__(self, paths=2, clients=1, rates_mbit=None, mode="datagram", policy="failover",
                 weights=None, priorities=None, congestion="cubic", keep_dir=False, extra_yaml="",
                 emulated=True, specs=None, pipes=None, transport=None):
        self.name = unique_name()
        self.npaths = paths
        self.nclients = clients
        self.rates = rates_mbit or [None] * paths
        self.mode = mode
        self.policy = policy
        self.weights = weights or [1] * paths
        self.priorities = priorities or list(range(1, paths + 1))
        self.congestion = congestion
        self.emulated = emulated
        self.specs = specs
        self.pipes = pipes
        self.transport = transport
        self.dir = tempfile.mkdtemp(prefix=f"{self.name}-")
        self.keep_dir = keep_dir
        self.procs = {}
        self.logs = {}
        self.state = None
        self.files = None
        # Extra top-level YAML for both server and client files (e.g. "worker_threads: 2\n"),
        # read when an instance starts.
        self.extra_yaml = extra_yaml

    # -- names -------------------------------------------------------------------------------
    def client_ns(self, i=0):
        return self.state["clients"][i]["client"]

    def lan_ns(self, i=0):
        return self.state["clients"][i]["lan"]

    @property
    def server_ns(self):
        return self.state["namespaces"]["server"]

    @property
    def inet_ns(self):
        return self.state["namespaces"]["internet"]

    def lan_addr(self, i=0):
        return self.state["clients"][i]["lan_addr"]

    @property
    def inet_addr(self):
        return self.state["hosts"]["internet_addr"]

    def sock(self, who):
        """The control socket of `server` or `clientN`."""
        return self._instance(who)["socket"]

    def _instance(self, who):
        if who == "server":
            return self.files["server"]
        return self.files["clients"][int(who.removeprefix("client"))]

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
            specs = []
            for p in range(self.npaths):
                rate = self.rates[p]
                spec = f"rate={rate}mbit" if rate else ("rate=none" if self.emulated else "direct")
                specs += ["--path", self.specs[p] if self.specs else spec]
            self.state = json.loads(lab_cmd("up", self.name, *specs, "--clients", self.nclients,
                                            "--owner-pid", os.getpid()))
        except BaseException:
            self.down()
            raise
        return self

    def shape(self, c, p, mbit):
        """Rate of path p of client c in both directions (None: unlimited)."""
        lab_cmd("set", self.name, p + 1, f"rate={mbit}mbit" if mbit else "rate=none", "--client", c + 1)

    def set_link(self, p, spec, c=0):
        """Change path p of client c in both directions (an emulator spec, e.g. "loss=5%")."""
        lab_cmd("set", self.name, p + 1, spec, "--client", c + 1)

    # -- faults -----------------------------------------------------------------------------
    def link_down(self, p, c=0):
        lab_cmd("link", self.name, p + 1, "down", "--client", c + 1)

    def link_up(self, p, c=0):
        lab_cmd("link", self.name, p + 1, "up", "--client", c + 1)

    def block(self, p, direction="both", c=0):
        """Path p drops everything: both ways, or only server -> client ("down"), or only client ->
        server ("up")."""
        lab_cmd("set", self.name, p + 1, "state=blackhole", "--dir", direction, "--client", c + 1)

    def unblock(self, p, c=0):
        lab_cmd("set", self.name, p + 1, "state=up", "--client", c + 1)

    def nat(self, p, action="on", c=0, timeout=None):
        """Path p of client c behind a carrier-grade NAT in the emulator: `on`, `off`, or `rebind`
        (every mapping forgotten: the client's next packet gets a new external port, packets to
        the old one are dropped)."""
        extra = ["--timeout", timeout] if timeout else []
        lab_cmd("nat", self.name, p + 1, action, "--client", c + 1, *extra)

    def nat_stats(self, p, c=0):
        """The NAT's counters of path p of client c (mappings, rebinds, unmapped_drops, expired)."""
        k = c * self.npaths + p + 1  # the emulator numbers paths over all clients
        for x in json.loads(lab_cmd("stats", self.name))["paths"]:
            if x["index"] == k:
                return x["nat"]
        raise KeyError(p)

    # -- mpquic -----------------------------------------------------------------------------
    def pki(self):
        """PKI and configurations for every client (mpquic-lab configs); returns the PKI dir."""
        args = ["configs", self.name, "--dir", self.dir, "--policy", self.policy,
                "--weights", ",".join(map(str, self.weights)),
                "--priorities", ",".join(map(str, self.priorities))]
        for flag, value in (("--mode", self.mode), ("--congestion", self.congestion)):
            if value:
                args += [flag, value]
        for flag, values in (("--pipes", self.pipes), ("--transport", self.transport)):
            if values:
                args += [flag, ",".join(map(str, values))]
        self.files = json.loads(lab_cmd(*args))
        return self.files["pki"]

    def _config_text(self, who):
        with open(self._instance(who)["config"]) as f:
            return f.read() + self.extra_yaml

    def server_yaml(self):
        return self._config_text("server")

    def client_yaml(self, c=0, cert=True, request=True):
        """Client c's configuration; without its certificate lines, or without its address request."""
        lines = self._config_text(f"client{c}").splitlines(keepends=True)
        if not cert:
            lines = [l for l in lines if not l.startswith(("tls_cert_file:", "tls_key_file:"))]
        if not request:
            lines = [l for l in lines if not l.startswith("tun_cidr:")]
        return "".join(lines)

    def masque_server_yaml(self, entries, dual_stack=False):
        """The server's configuration with CONNECT-IP on MASQUE_PORT and these `masque_tokens`
        entries (`new_token`); `dual_stack`: IPv6 in the tunnel too (SERVER_TUN6)."""
        yaml = self.server_yaml()
        if dual_stack:
            yaml = re.sub(r"^tun_cidr: (.*)$", rf"tun_cidr: \1, {SERVER_TUN6}/64", yaml, flags=re.M)
        yaml += f"masque_listen: 0.0.0.0:{MASQUE_PORT}\nmasque_tokens:\n"
        return yaml + "".join("\n".join("  " + l for l in e.splitlines()) + "\n" for e in entries)

    def masque_client_yaml(self, token, c=0):
        """Client c's configuration speaking CONNECT-IP to the server's MASQUE_PORT with a
        token and no certificate."""
        yaml = self.client_yaml(c, cert=False).replace("remote_port: 45017", f"remote_port: {MASQUE_PORT}")
        return yaml + f"protocol: masque\nmasque_token: {token}\n"

    def start_server_and_client(self, masque=False):
        """The server and client 0 (after `pki`): on the native protocol, or with `masque` over
        CONNECT-IP (a new token, the client without a certificate)."""
        if masque:
            token, entry = new_token("site1")
            self.start_server(yaml=self.masque_server_yaml([entry]))
            self.start_client(yaml=self.masque_client_yaml(token))
        else:
            self.start_server()
            self.start_client()

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def start_server(self, yaml=None):
        cfg = self.write("server-run.yaml", yaml or self.server_yaml())
        self.spawn("server", self.server_ns, [BIN, "--config", cfg])
        self._wait_file(self.sock("server"), "server", 10)

    def start_client(self, c=0, yaml=None, key=None):
        key = key or f"client{c}"
        cfg = self.write(f"{key}-run.yaml", yaml or self.client_yaml(c))
        try:
            os.unlink(self.sock(f"client{c}"))
        except FileNotFoundError:
            pass
        self.spawn(key, self.client_ns(c), [BIN, "--config", cfg])
        return key

    def start_tunnel(self, server_extra="", client_extra="", client=None, **wait):
        """PKI and configurations, the server, client 0, its tunnel up: what most tests start
        with. `server_extra` / `client_extra`: YAML added to each file; `client`: a function
        of client 0's file that returns the one to run; `wait`: `wait_tunnel`'s arguments.
        Returns the client's status once its tunnel is up."""
        self.pki()
        self.start_server(yaml=self.server_yaml() + server_extra)
        yaml = self.client_yaml() + client_extra
        self.start_client(yaml=client(yaml) if client else yaml)
        return self.wait_tunnel(**wait)

    def start_all(self, server_yaml="", client_yaml=""):
        """PKI and configurations, the server, then every client with its tunnel up; extra
        top-level YAML per role (e.g. the server's "worker_threads: 2\n")."""
        self.pki()
        self.extra_yaml = server_yaml
        self.start_server()
        self.extra_yaml = client_yaml
        for c in range(self.nclients):
            self.start_client(c)
        for c in range(self.nclients):
            self.wait_tunnel(c)

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

    def wait_tunnel(self, c=0, timeout=15, dev="mpq0", routed=False, up=None):
        """Wait until client c has its address and all paths up (or those named in `up`); then
        route its LAN through the tunnel (mpquic-lab route; `dev`: the client's TUN device;
        `routed`: no masquerade, the LAN is a routed site LAN)."""
        key = f"client{c}"
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            p = self.procs.get(key)
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"{key} exited with {p.returncode}:\n{self.log(key)}")
            try:
                st = self.status(key)
                t = st["tunnels"][0]
                if t["address"] and all(x["state"] == "up" for x in t["paths"]
                                        if up is None or x["name"] in up):
                    break
            except Exception:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"tunnel of {key} not up within {timeout}s:\n{self.log(key)}\n--- server\n{self.log('server')}")
        lab_cmd("route", self.name, "--client", c + 1, "--dev", dev, *(["--routed"] if routed else []))
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
              dst=None, timeout=None, src_ns=None, window=None, rate_mbit=None, interval=None,
              congestion=None):
        cmd = ["iperf3", "-c", dst or self.inet_addr, "-p", str(port), "-t", str(seconds), "-P", str(streams), "-J"]
        if congestion:
            cmd += ["-C", congestion]
        if interval:
            cmd += ["-i", str(interval)]
        if reverse:
            cmd.append("-R")
        if udp_mbit:
            cmd += ["-u", "-b", f"{udp_mbit}M"]
        elif rate_mbit:
            cmd += ["-b", f"{rate_mbit}M"]  # TCP paced by iperf3
        if length:
            cmd += ["-l", str(length)]
        if window:
            cmd += ["-w", window]
        if dst is None:
            self.wait_iperf_server_idle(port)
        return iperf3_json(lambda: self.sh(src_ns or self.lan_ns(c), cmd,
                                           timeout=timeout or seconds + 30, check=False))

    def wait_iperf_server_idle(self, port=5201, timeout=10, ns=None):
        """Until the iperf3 server (the internet host's unless `ns` names another namespace)
        has no test connection left (bounded; then
        the run goes ahead and iperf3 says what is wrong). An iperf3 server serves one test at a
        time, and the client of the previous test exits once it has sent its last message: if
        that message is still on its way (a retransmission behind the next test's SYN, as on any
        lossy path), the server refuses the new test and resets its control connection."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            r = self.sh(ns or self.inet_ns, f"ss -Htn state established '( sport = :{port} )'",
                        check=False)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(0.1)

    def ping(self, count=5, interval=0.2, c=0, dst=None, src_ns=None, timeout=None):
        ns = src_ns or self.lan_ns(c)
        r = self.sh(ns, ["ping", "-n", "-c", str(count), "-i", str(interval), "-W", "1", dst or self.inet_addr],
                    check=False, timeout=timeout or count * interval + 10)
        return parse_ping(r.stdout)

    def start_ping(self, key, interval=0.01, c=0, dst=None, count=None, stamped=False):
        """Ping from client `c`'s LAN until stopped, or `count` times (then ping waits up to 1 s
        for the last reply and exits). `stamped`: each reply with its wall-clock time
        (`ping -D`, read by `ping_sends`)."""
        counted = ["-c", str(count)] if count else []
        stamp = ["-D"] if stamped else []
        return self.spawn(key, self.lan_ns(c), ["ping", "-n", *stamp, "-i", str(interval), "-W", "1",
                                                *counted, dst or self.inet_addr])

    # -- teardown ---------------------------------------------------------------------------
    def down(self):
        for key in list(self.procs):
            self.stop(key, timeout=3)
        # mpquic-lab down also kills whatever still runs in the lab's namespaces.
        run([LAB, "down", self.name], check=False, timeout=60)
        if self in _live:
            _live.remove(self)
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()


def parse_ping(text):
    """Received sequence numbers, and summary figures, from ping output. `interval`: the seconds
    between two pings as ping really sent them (its summary's elapsed time over the pings sent),
    or None without a summary: `-i` is a floor, and on this host `-i 0.01` sends every 15-16 ms
    (idle loopback) or ~14.5 ms (under load), so a run of lost pings counted at the asked
    interval understates the gap by a third."""
    seqs = [int(m.group(1)) for m in re.finditer(r"icmp_seq=(\d+)", text)]
    rtts = [float(m.group(1)) for m in re.finditer(r"time=([\d.]+) ms", text)]
    sent = interval = None
    m = re.search(r"(\d+) packets transmitted", text)
    if m:
        sent = int(m.group(1))
    m = re.search(r"packets transmitted, .* time (\d+)ms", text)
    if m and sent and sent > 1:
        interval = int(m.group(1)) / 1000 / (sent - 1)
    return {"received": sorted(set(seqs)), "rtts": rtts, "sent": sent, "interval": interval}


def ping_sends(text):
    """(wall-clock time it was sent, sequence number, round trip in ms) of each answered ping in
    `ping -D` output (`start_ping(stamped=True)`): its reply's time less its round trip. A ping's
    sequence number says little of when it was sent: `-i 0.01` is a floor, and on this host ping
    sends every ~14 ms under load, so a sequence window drifts by seconds over a run."""
    pattern = r"\[([\d.]+)\] \d+ bytes from \S+ icmp_seq=(\d+) ttl=\d+ time=([\d.]+) ms"
    return [(float(m.group(1)) - float(m.group(3)) / 1000, int(m.group(2)), float(m.group(3)))
            for m in re.finditer(pattern, text)]


def iperf3_json(run, tries=20):
    """The JSON report of an iperf3 client run (`run()`: its finished process), run again while
    the server says it is busy finishing the previous test; an error otherwise."""
    for _ in range(tries):
        r = run()
        try:
            data = json.loads(r.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(f"iperf3 failed: {r.stdout}\n{r.stderr}")
        if "busy" not in data.get("error", ""):
            break
        time.sleep(0.5)
    if "error" in data:
        raise RuntimeError(f"iperf3 error: {data['error']}")
    return data


def wait_until(what, ok, timeout=10):
    """Poll `ok()` every 0.1 s until it returns something true (returned), for at most
    `timeout` seconds; then fail naming `what`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = ok()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def gaps(received, sent, interval):
    """Lost sequence numbers and the longest run of consecutive losses in seconds, each lost ping
    counted at `interval` (pass `parse_ping`'s measured one where there is one: `ping_gaps`)."""
    got = set(received)
    lost = [s for s in range(1, (sent or (max(received) if received else 0)) + 1) if s not in got]
    longest = run_len = 0
    prev = None
    for s in lost:
        run_len = run_len + 1 if prev is not None and s == prev + 1 else 1
        longest = max(longest, run_len)
        prev = s
    return lost, longest * interval


def sent_interval(ping, asked):
    """The interval a parsed ping run really sent at, or `asked` when it printed no summary."""
    return ping["interval"] or asked


def stop_ping_counted(lab, key, interval):
    """Stop the pings started as `key` and count them: (parsed ping, pings lost, duplicate
    replies). The last ping may still have been on its way when ping was stopped."""
    lab.stop(key, sig=signal.SIGINT)
    text = lab.log(key)
    ping = parse_ping(text)
    lost = len(ping_gaps(ping, interval, unanswered_tail=0.1)[0])
    return ping, lost, text.count("DUP!")


def ping_gaps(ping, asked, unanswered_tail=0.0):
    """`gaps` of a parsed ping run at the interval ping really sent at (`sent_interval`); the
    pings of its last `unanswered_tail` seconds (still in flight when ping was stopped) are not
    counted as lost."""
    interval = sent_interval(ping, asked)
    sent = ping["sent"] - int(unanswered_tail / interval) if ping["sent"] else None
    return gaps(ping["received"], sent, interval)
