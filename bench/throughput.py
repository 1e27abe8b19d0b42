"""Single-path tunnel throughput, side by side in one run (this machine is shared and noisy: compare
ratios within a run, not absolute numbers across runs).

Rows: direct (no tunnel, the same veth), mpquic with its defaults (`transport_mode: auto`),
mpquic datagram, mpquic reliable, wireguard-go built from
its newest source (`go install golang.zx2c4.com/wireguard@latest`, cached in
~/.cache/mpquic-bench; its GSO/GRO offloads make it the reference to beat) and Debian's
wireguard-go (0.0.20220316, no offloads), userspace, same topology. For each: TCP with 1 and 4
flows, upload (LAN -> internet) and download, and one flow up paced at 1 Gbit/s (CPU per Gbit/s
of client + server at the same load for every tunnel); with `--udp`, the most UDP delivered upward below 1%
loss for 1400-byte and 160-byte IP packets. Reported alongside: CPU of the tunnel's client and
server processes (% of one core, over the iperf3 run) and their RSS idle and peak.

Row `many_clients` (`--clients 16 --server-threads 2`): that many mpquic clients (datagram mode)
through one server, one TCP flow each, all at once, beside one client alone; the server's CPU
per thread. `many_clients_default`: the same with mpquic's defaults (`auto`).
Rows `many_clients_wireguard_go_latest` and `many_clients_direct`: the same with the newest
wireguard-go and with no tunnel, the references for what this machine does with that many
clients on its cores.

    sudo python3 bench/throughput.py [--seconds 8] [--udp] [--rows ...,many_clients] [--out bench/results/throughput.json]
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

# The lab handle the end-to-end tests use (mpquic-lab underneath).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))

import labctl  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def stat_cpu_seconds(path):
    """User + system CPU seconds from a /proc stat file (a process's or a thread's)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_seconds(pid):
    return stat_cpu_seconds(f"/proc/{pid}/stat")


def mem_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


# The rate at which tunnels' CPU is compared (one TCP flow up, paced by iperf3): below what
# every tunnel reaches here, so all of them carry the same load.
FIXED_MBIT = 1000


def measure(lab, procs, seconds, streams, reverse, dst, src_ns=None, mbit=None):
    before = {k: cpu_seconds(p) for k, p in procs.items()}
    t0 = time.monotonic()
    d = lab.iperf(seconds=seconds, streams=streams, reverse=reverse, dst=dst, src_ns=src_ns, rate_mbit=mbit)
    wall = time.monotonic() - t0
    cpu = {k: round(100 * (cpu_seconds(p) - before[k]) / wall, 1) for k, p in procs.items()}
    end = d["end"]
    return {
        "mbit": round(end["sum_received"]["bits_per_second"] / 1e6, 1),
        "retransmits": end["sum_sent"].get("retransmits"),
        "cpu_pct": cpu,
        "iperf_cpu": {"sender": round(end["cpu_utilization_percent"]["host_total"], 1),
                      "receiver": round(end["cpu_utilization_percent"]["remote_total"], 1)},
    }


def runs(lab, procs, seconds, dst, src_ns=None):
    out = {}
    for streams in (1, 4):
        for reverse in (False, True):
            key = f"{streams}flow_{'down' if reverse else 'up'}"
            out[key] = measure(lab, procs, seconds, streams, reverse, dst, src_ns)
            print(f"    {key}: {out[key]['mbit']} Mbit/s cpu {out[key]['cpu_pct']}", flush=True)
    if procs:
        out["fixed_up"] = measure(lab, procs, seconds, 1, False, dst, src_ns, mbit=FIXED_MBIT)
        r = out["fixed_up"]
        per = sum(r["cpu_pct"].values()) / max(r["mbit"] / 1000, 1e-9)
        r["cpu_pct_per_gbit"] = round(per, 1)
        print(f"    1 flow up paced at {FIXED_MBIT} Mbit/s: {r['mbit']} Mbit/s cpu {r['cpu_pct']} "
              f"= {per:.0f}% of a core per Gbit/s (client + server)", flush=True)
    return out


# UDP sizes as IP packets (iperf3's payload is 28 bytes less); the tunnels' inner MTU (1420 for
# wireguard-go, more for mpquic) carries 1400 unfragmented.
UDP_SIZES = (1400, 160)
UDP_LOSS = 1.0  # percent: the most delivered below this
UDP_STEP = 3  # seconds per rate tried


def udp_try(lab, mbit, size, dst, src_ns=None):
    """(delivered Mbit/s, loss %) of one UDP run upward at `mbit` Mbit/s offered. iperf3 3.12
    now and then fails a UDP test at setup ("unable to read from stream socket"): tried again
    once, then counted as a total loss."""
    for attempt in range(2):
        try:
            d = lab.iperf(seconds=UDP_STEP, udp_mbit=mbit, length=size - 28, dst=dst, src_ns=src_ns, window="4M")
            break
        except RuntimeError as e:
            print(f"    udp {size} B at {mbit}M: {str(e).strip()[:120]}", flush=True)
            time.sleep(1)
    else:
        return 0.0, 100.0
    s = d["end"]["sum"]
    loss = float(s.get("lost_percent", 0.0))
    return round(s["bits_per_second"] * (1 - loss / 100) / 1e6, 1), round(loss, 2)


def udp_max(lab, procs, size, dst, src_ns=None):
    """The most UDP delivered below UDP_LOSS: offered rates doubled from a start until one loses
    more, then three halvings between the last good and the first bad rate (to within 1/16 of
    the last doubling)."""
    before = {k: cpu_seconds(p) for k, p in procs.items()}
    t0 = time.monotonic()
    tried = []
    good, bad = None, None
    rate = 50 if size < 500 else 200
    while rate <= 20000:
        got, loss = udp_try(lab, rate, size, dst, src_ns)
        tried.append({"offered": rate, "mbit": got, "loss": loss})
        if loss >= UDP_LOSS:
            bad = rate
            break
        good = (rate, got)
        rate *= 2
    lo = good[0] if good else 0
    for _ in range(3):
        if bad is None or bad - lo < 10:
            break
        mid = (lo + bad) // 2
        got, loss = udp_try(lab, mid, size, dst, src_ns)
        tried.append({"offered": mid, "mbit": got, "loss": loss})
        if loss >= UDP_LOSS:
            bad = mid
        else:
            lo, good = mid, (mid, got)
    wall = time.monotonic() - t0
    cpu = {k: round(100 * (cpu_seconds(p) - before[k]) / wall, 1) for k, p in procs.items()}
    best = good[1] if good else 0.0
    print(f"    udp {size} B: {best} Mbit/s below {UDP_LOSS}% loss ({len(tried)} rates) cpu {cpu}", flush=True)
    return {"mbit": best, "kpps": round(best * 1e3 / (size * 8), 1), "tried": tried, "cpu_pct": cpu}


def udp_runs(lab, procs, dst, src_ns=None):
    return {f"udp_{size}": udp_max(lab, procs, size, dst, src_ns) for size in UDP_SIZES}


def mpquic_row(mode, seconds, threads=1, udp=False, masque=False):
    """`masque`: the client speaks CONNECT-IP (`protocol: masque`, a token) to the server's
    CONNECT-IP port; otherwise the native protocol in `mode` (None: the default)."""
    with labctl.Lab(paths=1, mode=mode, extra_yaml=f"worker_threads: {threads}\n", emulated=False) as lab:
        lab.pki()
        lab.start_server_and_client(masque)
        lab.wait_tunnel()
        lab.iperf_server()
        procs = {"client": lab.procs["client0"].pid, "server": lab.procs["server"].pid}
        time.sleep(1)
        idle = {k: mem_kib(p, "VmRSS") for k, p in procs.items()}
        r = runs(lab, procs, seconds, lab.inet_addr)
        if udp:
            r.update(udp_runs(lab, procs, lab.inet_addr))
        peak = {k: mem_kib(p, "VmHWM") for k, p in procs.items()}
        return {"results": r, "rss_idle_kib": idle, "rss_peak_kib": peak}


def direct_row(seconds, udp=False):
    with labctl.Lab(paths=1, emulated=False) as lab:
        # iperf3 from the client router straight to the server over the WAN veth. Bound to the
        # server's address (on its loopback): unbound, iperf3's UDP replies left from the WAN
        # address and the client's connected socket refused them ("unable to read from stream
        # socket").
        lab.spawn("iperf-direct", lab.server_ns, ["iperf3", "-s", "-p", "5201", "-B", labctl.SERVER_IP], log=False)
        time.sleep(0.5)
        r = runs(lab, {}, seconds, labctl.SERVER_IP, src_ns=lab.client_ns(0))
        if udp:
            r.update(udp_runs(lab, {}, labctl.SERVER_IP, src_ns=lab.client_ns(0)))
        return {"results": r}


def wg(lab, ns, *args):
    return lab.sh(ns, ["wg", *args]).stdout.strip()


TOOLS = os.environ.get("MPQUIC_BENCH_TOOLS", os.path.expanduser("~/.cache/mpquic-bench"))


def go_tool():
    """The go command (sudo's PATH often lacks /usr/local/go/bin), or None."""
    found = shutil.which("go")
    if found:
        return found
    return "/usr/local/go/bin/go" if os.path.exists("/usr/local/go/bin/go") else None


def wireguard_go_latest():
    """(binary, version) of wireguard-go built from its newest source, built once into TOOLS
    (delete TOOLS to rebuild); (None, why) when it cannot be built."""
    go = go_tool()
    if go is None:
        return None, "go not installed (needed to build wireguard-go from its source)"
    gobin = os.path.join(TOOLS, "bin")
    binary = os.path.join(gobin, "wireguard")
    if not os.path.exists(binary):
        print("    building wireguard-go from its newest source (go install golang.zx2c4.com/wireguard@latest)", flush=True)
        r = subprocess.run([go, "install", "golang.zx2c4.com/wireguard@latest"], capture_output=True, text=True,
                           env=dict(os.environ, GOBIN=gobin, CGO_ENABLED="0"))
        if r.returncode != 0:
            return None, f"go install failed: {r.stderr.strip()[-300:]}"
    info = subprocess.run([go, "version", "-m", binary], capture_output=True, text=True).stdout
    version = next((l.split()[2] for l in info.splitlines() if l.strip().startswith("mod")), "unknown")
    return binary, version


def wireguard_binary(latest):
    """(binary, version) of the newest wireguard-go (`latest`) or Debian's; (None, why) if missing."""
    if latest:
        return wireguard_go_latest()
    if subprocess.run(["which", "wireguard-go"], capture_output=True).returncode != 0:
        return None, "wireguard-go not installed (apt-get install --no-install-recommends wireguard-go wireguard-tools)"
    return "wireguard-go", subprocess.run(["dpkg-query", "-W", "-f=${Version}", "wireguard-go"], capture_output=True,
                                          text=True).stdout


def wireguard_up(lab, binary):
    """A wireguard-go server in the lab's server namespace and one wireguard-go client per lab
    client (tunnel addresses 10.201.0.C+1/24, the server .254), each client's LAN routed through
    its tunnel; False if a tunnel did not come up. Processes go to `lab.procs` ("wg-srv",
    "wg-cli0", ...), so the lab stops them."""
    def keypair(side):
        priv = subprocess.run(["wg", "genkey"], capture_output=True, text=True).stdout.strip()
        pub = subprocess.run(["wg", "pubkey"], input=priv, capture_output=True, text=True).stdout.strip()
        return lab.write(f"wg-{side}.key", priv + "\n"), pub

    env = dict(os.environ, WG_PROCESS_FOREGROUND="1")
    # wireguard-go's control socket (/var/run/wireguard/NAME.sock) is not per namespace: every
    # end needs its own interface name (at most 15 characters).
    tag = os.getpid() % 10000
    ends = [("srv", lab.server_ns, f"wgs{tag}")] + [(f"cli{c}", lab.client_ns(c), f"wgc{tag}x{c}")
                                                   for c in range(lab.nclients)]
    keys = {side: keypair(side) for side, _, _ in ends}
    for side, ns, dev in ends:
        lab.procs[f"wg-{side}"] = subprocess.Popen(["ip", "netns", "exec", ns, binary, "-f", dev], env=env,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    _, srv_ns, srv_dev = ends[0]
    peers = " ".join(f"peer {keys[f'cli{c}'][1]} allowed-ips 10.201.0.{c + 1}/32" for c in range(lab.nclients))
    lab.sh(srv_ns, f"wg set {srv_dev} private-key {keys['srv'][0]} listen-port 51820 {peers}")
    lab.sh(srv_ns, f"ip addr add 10.201.0.254/24 dev {srv_dev} && ip link set {srv_dev} up")
    for c, (side, ns, dev) in enumerate(ends[1:]):
        lab.sh(ns, f"wg set {dev} private-key {keys[side][0]} peer {keys['srv'][1]} allowed-ips 0.0.0.0/0 "
                   f"endpoint {labctl.SERVER_IP}:51820")
        lab.sh(ns, f"ip addr add 10.201.0.{c + 1}/24 dev {dev} && ip link set {dev} mtu 1420 up")
        labctl.lab_cmd("route", lab.name, "--client", c + 1, "--dev", dev, "--tunnel-net", "10.201.0.0/24")
    for c in range(lab.nclients):
        r = lab.sh(lab.lan_ns(c), f"ping -c 3 -i 0.2 -W 1 {lab.inet_addr}", check=False)
        if " 0 received" in r.stdout:
            return False
    return True


def wireguard_row(seconds, latest=False, udp=False):
    binary, version = wireguard_binary(latest)
    if binary is None:
        return {"skipped": version}
    with labctl.Lab(paths=1, emulated=False) as lab:
        if not wireguard_up(lab, binary):
            return {"skipped": "wireguard-go tunnel did not come up"}
        lab.iperf_server()
        procs = {"client": lab.procs["wg-cli0"].pid, "server": lab.procs["wg-srv"].pid}
        idle = {k: mem_kib(p, "VmRSS") for k, p in procs.items()}
        res = runs(lab, procs, seconds, lab.inet_addr)
        if udp:
            res.update(udp_runs(lab, procs, lab.inet_addr))
        peak = {k: mem_kib(p, "VmHWM") for k, p in procs.items()}
        return {"results": res, "rss_idle_kib": idle, "rss_peak_kib": peak, "version": version}


def thread_cpu_seconds(pid):
    """{thread id: (name, CPU seconds)} of a process's threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu = stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:
            continue  # the thread ended
        out[tid] = (name, cpu)
    return out


def machine_busy():
    """(busy, total) jiffies of the whole machine so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def all_at_once(lab, seconds, server, clients, dst, src_ns, iperf_ns, bind=None):
    """One TCP flow per lab client, all at once, up and then down, each beside client 0 alone
    (the ratio the many-clients rows are about). `server`: the tunnel server's PID (its CPU per
    thread shows whether its cores are used; None without a tunnel), `clients`: the tunnel
    clients' PIDs, `src_ns(c)`: where client c's iperf3 runs, the iperf3 servers (one port per
    client) in `iperf_ns`, bound to `bind` if given."""
    n = lab.nclients
    ports = [5201 + c for c in range(n)]
    for port in ports:
        lab.spawn(f"iperf{port}", iperf_ns, ["iperf3", "-s", "-p", str(port)] + (["-B", bind] if bind else []),
                  log=False)
    for _ in range(50):
        listening = lab.sh(iperf_ns, "ss -ltnH", check=False).stdout
        if all(f":{port} " in listening for port in ports):
            break
        time.sleep(0.1)
    time.sleep(1)
    res = {}
    for reverse in (False, True):
        d = "down" if reverse else "up"
        one = lab.iperf(seconds=seconds, reverse=reverse, port=ports[0], dst=dst, src_ns=src_ns(0))
        res[f"one_{d}"] = round(one["end"]["sum_received"]["bits_per_second"] / 1e6, 1)
        before, t0 = thread_cpu_seconds(server) if server else {}, time.monotonic()
        cbefore, mbefore = sum(cpu_seconds(p) for p in clients), machine_busy()
        cmds = [["ip", "netns", "exec", src_ns(c), "iperf3", "-c", dst, "-p", str(ports[c]),
                 "-t", str(seconds), "-J"] + (["-R"] if reverse else []) for c in range(n)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for cmd in cmds]
        outs = [p.communicate(timeout=seconds + 60)[0] for p in procs]
        wall = time.monotonic() - t0
        after = thread_cpu_seconds(server) if server else {}
        cafter, mafter = sum(cpu_seconds(p) for p in clients), machine_busy()
        res[f"clients_cpu_{d}"] = round(100 * (cafter - cbefore) / wall, 1)
        res[f"machine_busy_{d}"] = round(100 * (mafter[0] - mbefore[0]) / max(1, mafter[1] - mbefore[1]), 1)
        per = [json.loads(o)["end"]["sum_received"]["bits_per_second"] / 1e6 for o in outs]
        threads = {f"{after[t][0]}-{t}": round(100 * (after[t][1] - before.get(t, (None, 0))[1]) / wall, 1)
                   for t in after}
        busy = {k: v for k, v in threads.items() if v >= 1}
        res[f"all_{d}"] = round(sum(per), 1)
        res[f"all_{d}_min_client"] = round(min(per), 1)
        res[f"all_{d}_max_client"] = round(max(per), 1)
        res[f"server_thread_cpu_{d}"] = busy
        print(f"    {n} clients {d}: {sum(per):.0f} Mbit/s (one client alone {res[f'one_{d}']:.0f}; "
              f"per client {min(per):.0f}-{max(per):.0f}); server threads % {busy}, clients together "
              f"{res[f'clients_cpu_{d}']}%, machine {res[f'machine_busy_{d}']}% busy", flush=True)
    return res


def many_clients_row(n, seconds, server_threads, mode="datagram"):
    """n mpquic clients (one path each) through one server with `server_threads` runtime threads,
    in `mode` (`None`: the default, `auto`)."""
    with labctl.Lab(paths=1, clients=n, mode=mode, emulated=False) as lab:
        lab.start_all(server_yaml=f"worker_threads: {server_threads}\n", client_yaml="worker_threads: 1\n")
        server = lab.procs["server"].pid
        res = all_at_once(lab, seconds, server, [lab.procs[f"client{c}"].pid for c in range(n)], lab.inet_addr,
                          lab.lan_ns, lab.inet_ns)
        return {"clients": n, "server_threads": server_threads, "results": res,
                "server_rss_peak_kib": mem_kib(server, "VmHWM")}


def many_clients_wireguard_row(n, seconds):
    """The same with the newest wireguard-go: whether a userspace VPN on this machine keeps its
    one-client figure with n clients beside it (the reference for mpquic's ratio)."""
    binary, version = wireguard_go_latest()
    if binary is None:
        return {"skipped": version}
    with labctl.Lab(paths=1, clients=n, emulated=False) as lab:
        if not wireguard_up(lab, binary):
            return {"skipped": "wireguard-go tunnel did not come up"}
        server = lab.procs["wg-srv"].pid
        res = all_at_once(lab, seconds, server, [lab.procs[f"wg-cli{c}"].pid for c in range(n)], lab.inet_addr,
                          lab.lan_ns, lab.inet_ns)
        return {"clients": n, "results": res, "version": version, "server_rss_peak_kib": mem_kib(server, "VmHWM")}


def many_clients_direct_row(n, seconds):
    """The same with no tunnel: iperf3 from each client router to the server over its WAN veth
    (what the kernel and iperf3 alone do with n flows on this machine)."""
    with labctl.Lab(paths=1, clients=n, emulated=False) as lab:
        res = all_at_once(lab, seconds, None, [], labctl.SERVER_IP, lab.client_ns, lab.server_ns,
                          bind=labctl.SERVER_IP)
        return {"clients": n, "results": res}


def table(report):
    rows = [("direct (no tunnel)", "direct"), ("mpquic default (auto)", "mpquic_default"),
            ("mpquic datagram", "mpquic_datagram"),
            ("mpquic over CONNECT-IP (protocol: masque)", "mpquic_masque"),
            ("mpquic reliable", "mpquic_reliable"), ("mpquic datagram, worker_threads: 2", "mpquic_datagram_2threads"),
            ("wireguard-go (newest source)", "wireguard_go_latest"), ("wireguard-go (Debian)", "wireguard_go")]
    cols = ["1flow_up", "1flow_down", "4flow_up", "4flow_down"]
    udp = any(f"udp_{s}" in r.get("results", {}) for r in report["rows"].values() for s in UDP_SIZES)
    ucols = [f"udp_{s}" for s in UDP_SIZES] if udp else []
    head = "| tunnel | 1 flow up | 1 flow down | 4 flows up | 4 flows down | "
    head += "".join(f"UDP {s} B up < {UDP_LOSS:g}% loss (kpps) | " for s in UDP_SIZES) if udp else ""
    lines = [head + f"CPU client/server (1 flow up) | CPU per Gbit/s at {FIXED_MBIT} Mbit/s (client + server) | RSS idle / peak client, server |",
             "|---|---|---|---|---|" + "---|" * len(ucols) + "---|---|---|"]
    labels = dict((k, l) for l, k in rows)
    for key, row in report["rows"].items():
        if key.startswith("many_clients"):
            continue
        base, _, nth = key.partition("#")
        label = labels.get(base, base) + (f" (run {nth})" if nth else "")
        if "skipped" in row or "results" not in row:
            lines.append(f"| {label} | {row.get('skipped', 'not run')} |" + " |" * (6 + len(ucols)))
            continue
        r = row["results"]
        cells = [f"{r[c]['mbit']:.0f}" for c in cols]
        cells += [f"{r[c]['mbit']:.0f} ({r[c]['kpps']:.0f})" if c in r else "-" for c in ucols]
        cpu = r["1flow_up"]["cpu_pct"]
        cpu_s = f"{cpu['client']:.0f}% / {cpu['server']:.0f}%" if cpu else "-"
        if "rss_idle_kib" in row:
            i, p = row["rss_idle_kib"], row["rss_peak_kib"]
            mem = f"{i['client'] / 1024:.1f} / {p['client'] / 1024:.1f} MiB, {i['server'] / 1024:.1f} / {p['server'] / 1024:.1f} MiB"
        else:
            mem = "-"
        fixed = r.get("fixed_up")
        fixed_s = f"{fixed['cpu_pct_per_gbit']:.0f}% ({fixed['mbit']:.0f} Mbit/s)" if fixed else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {cpu_s} | {fixed_s} | {mem} |")
    many = [(k, r) for k, r in report["rows"].items() if k.startswith("many_clients") and "results" in r]
    if many:
        lines += ["", "| N clients x 1 TCP flow, through one server | up: all / one alone | down: all / one alone | "
                      "server CPU per thread, up | clients' CPU together, up | machine busy, up | server RSS peak |",
                  "|---|---|---|---|---|---|---|"]
        for key, row in many:
            r = row["results"]
            base, _, nth = key.partition("#")
            what = {"many_clients": f"mpquic datagram, server worker_threads: {row.get('server_threads')}",
                    "many_clients_default": f"mpquic default (auto), server worker_threads: {row.get('server_threads')}",
                    "many_clients_wireguard_go_latest": "wireguard-go (newest source)",
                    "many_clients_direct": "direct (no tunnel)"}.get(base, base) + (f" (run {nth})" if nth else "")
            cpu = ", ".join(f"{v:.0f}%" for v in sorted(r["server_thread_cpu_up"].values(), reverse=True)) or "-"
            rss = f"{row['server_rss_peak_kib'] / 1024:.1f} MiB" if "server_rss_peak_kib" in row else "-"
            lines.append(f"| {row['clients']} clients, {what} | "
                         f"{r['all_up']:.0f} / {r['one_up']:.0f} ({r['all_up'] / r['one_up']:.2f}x) | "
                         f"{r['all_down']:.0f} / {r['one_down']:.0f} ({r['all_down'] / r['one_down']:.2f}x) | "
                         f"{cpu} | {r['clients_cpu_up']:.0f}% | {r['machine_busy_up']:.0f}% | {rss} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(labctl.REPO, "bench", "results", "throughput.json"))
    ap.add_argument("--rows", default="direct,mpquic_default,mpquic_datagram,mpquic_reliable,wireguard_go_latest,wireguard_go")
    ap.add_argument("--udp", action="store_true", help="also the most UDP delivered below 1%% loss, 1400 and 160 B")
    ap.add_argument("--clients", type=int, default=16, help="clients of the many_clients row")
    ap.add_argument("--server-threads", type=int, default=2, help="the server's worker_threads in the many_clients row")
    args = ap.parse_args()
    labctl.run([labctl.LAB, "down", "--stale"], check=False)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                 "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")},
        "commit": subprocess.run(["git", "-C", labctl.REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "seconds": args.seconds,
        "rows": {},
    }
    wanted = args.rows.split(",")
    makers = {"direct": lambda: direct_row(args.seconds, udp=args.udp),
              "mpquic_default": lambda: mpquic_row(None, args.seconds, udp=args.udp),
              "mpquic_datagram": lambda: mpquic_row("datagram", args.seconds, udp=args.udp),
              "mpquic_masque": lambda: mpquic_row(None, args.seconds, udp=args.udp, masque=True),
              "mpquic_reliable": lambda: mpquic_row("reliable", args.seconds, udp=args.udp),
              "mpquic_datagram_2threads": lambda: mpquic_row("datagram", args.seconds, threads=2, udp=args.udp),
              "wireguard_go_latest": lambda: wireguard_row(args.seconds, latest=True, udp=args.udp),
              "wireguard_go": lambda: wireguard_row(args.seconds, udp=args.udp),
              "many_clients": lambda: many_clients_row(args.clients, args.seconds, args.server_threads),
              "many_clients_default": lambda: many_clients_row(args.clients, args.seconds, args.server_threads, None),
              "many_clients_wireguard_go_latest": lambda: many_clients_wireguard_row(args.clients, args.seconds),
              "many_clients_direct": lambda: many_clients_direct_row(args.clients, args.seconds)}
    for i, key in enumerate(wanted):
        if key not in makers:
            sys.exit(f"--rows: unknown row {key!r} (known: {', '.join(makers)})")
        print(f"== {key}", flush=True)
        # A row given twice (interleaved A/B) keeps both: the second as KEY#2.
        name = key if key not in report["rows"] else f"{key}#{wanted[:i].count(key) + 1}"
        report["rows"][name] = makers[key]()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print()
    print(table(report))
    print(f"\n(results in {args.out})")


if __name__ == "__main__":
    main()
