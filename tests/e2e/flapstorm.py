"""A flap storm: the lab's paths black-holed one at a time at random (holes and gaps of 0.2-2 s,
the way a dish drops out) under TCP load, and what the instances hold before and after it.
Shared by the end-to-end test (test_flap.py, a short storm) and the benchmark (bench/flap.py,
300 s per variant).

    baseline  tunnel up, a warm-up upload, then idle: fds, threads, RSS of client and server
    storm     4 TCP uploads through the tunnel while the paths flap (one hole at a time)
    repair    every path `up` on both ends (seconds after the last repair)
    settle    20 s after the storm: fds, threads, tasks, RSS again; each path's packet size
    carry     each path alone (the others black-holed) answers pings through the tunnel
"""

import json
import os
import random
import signal
import time

import labctl

# The paths of the reported runs: unlike rates and delays (one way).
SPECS = ["rate=100mbit,delay=5ms", "rate=50mbit,delay=10ms"]
UPLOAD_STREAMS = 4
# The "after" figures are taken this long after the storm: beyond the QUIC idle timeout (15 s),
# which is what ends a connection whose peer gave it up inside a hole (its close was lost); at
# 10 s the server can still hold such a connection's tasks (seen: 23 tasks for 22 at 10 s, 22
# from 12 s on).
SETTLE_S = 20.0
# Every path up within this long of the last repair: a path that was down reconnects after
# at most one reconnect backoff (2 s) plus a handshake.
UP_WITHIN_S = 5.0


def snapshot(pid):
    """What process `pid` holds: open fds (by kind), threads, RSS (KiB)."""
    kinds = {}
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        kind = target.split(":", 1)[0] if ":" in target else target
        kinds[kind] = kinds.get(kind, 0) + 1
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return {
        "fds": sum(kinds.values()),
        "fd_kinds": kinds,
        "threads": int(status["Threads"]),
        "rss_kib": int(status["VmRSS"].split()[0]),
    }


def holdings(lab, key, pid):
    """`snapshot(pid)` of instance `key` (server or clientN) plus what its status counts: runtime
    tasks, the peer's streams its paths read (two tasks each while they last: a lane's stream
    opens with its first packet, so a reconnected path may read one more or one fewer than the
    connection it replaced), and for the server its sessions."""
    out = snapshot(pid)
    st = lab.status(key)
    out["tasks"] = st["process"]["tasks"]
    out["streams_in"] = sum(p.get("streams_in") or 0 for t in st["tunnels"] for p in t["paths"])
    out["heap_in_use_kib"] = st["process"].get("heap_in_use_bytes", 0) // 1024
    if key == "server":
        out["sessions"] = len(st["tunnels"])
    return out


# The lab's process key of each side.
INSTANCE = {"client": "client0", "server": "server"}


def pids(lab):
    # `ip netns exec` execs the command: the spawned process is mpquic itself.
    return {who: lab.procs[key].pid for who, key in INSTANCE.items()}


def upload(lab, key, seconds):
    """TCP uploads from the LAN host through the tunnel, in the background."""
    return lab.spawn(key, lab.lan_ns(0), ["iperf3", "-c", lab.inet_addr, "-t", str(seconds),
                                          "-P", str(UPLOAD_STREAMS), "-J"])


def wait_done(lab, key, timeout):
    p = lab.procs[key]
    p.wait(timeout=timeout)
    lab.procs.pop(key, None)
    try:
        data = json.loads(lab.log(key))
        return data["end"]["sum_received"]["bits_per_second"] / 1e6
    except (ValueError, KeyError):
        return None


def flap(lab, seconds, rng, hole=(0.2, 2.0), gap=(0.2, 2.0)):
    """Black-hole the paths one at a time, alternating, for `seconds`: a hole, then a gap with
    every path up. Returns the holes as (path, start, length) from the storm's start."""
    t0 = time.monotonic()
    holes = []
    p = 0
    while time.monotonic() - t0 < seconds:
        length = rng.uniform(*hole)
        start = time.monotonic() - t0
        lab.block(p)
        time.sleep(length)
        lab.unblock(p)
        holes.append((p, round(start, 3), round(length, 3)))
        time.sleep(rng.uniform(*gap))
        p = (p + 1) % lab.npaths
    return holes


def all_up(lab):
    """Whether every path is up on the client and on the server."""
    for who in ("client0", "server"):
        t = lab.status(who)["tunnels"][0]
        if len(t["paths"]) < lab.npaths or any(p["state"] != "up" for p in t["paths"]):
            return False
    return True


def path_sizes(lab):
    """Per instance and path: UDP payload now, and the link's (the most it is ever tried at)."""
    out = {}
    for who in ("client0", "server"):
        for p in lab.status(who)["tunnels"][0]["paths"]:
            out[f"{who}/{p['name']}"] = {"udp_payload": p.get("udp_payload"),
                                        "udp_payload_max": p.get("udp_payload_max"),
                                        "mtu_changes": p.get("mtu_changes")}
    return out


def settled(lab):
    """Every path up on both ends, and the client's at its link's full packet size (a path
    that reconnected at the smallest size after an outage is reconnected at full size at once:
    make before break, but a moment to wait for before a path is tested alone)."""
    if not all_up(lab):
        return False
    return all(s["udp_payload"] == s["udp_payload_max"] for k, s in path_sizes(lab).items()
               if k.startswith("client0"))


def each_path_carries(lab, count=10, interval=0.1):
    """For each path: the others black-holed, pings through the tunnel; answers per path."""
    answered = {}
    for p in range(lab.npaths):
        deadline = time.monotonic() + UP_WITHIN_S + 5
        while not settled(lab) and time.monotonic() < deadline:
            time.sleep(0.2)
        others = [q for q in range(lab.npaths) if q != p]
        for q in others:
            lab.block(q)
        # The client leaves the dark paths within ~0.4 s (health); give it a second.
        time.sleep(1.5)
        r = lab.ping(count=count, interval=interval)
        answered[f"wan{p + 1}"] = len(r["received"])
        for q in others:
            lab.unblock(q)
    return answered


def mtu_log_lines(lab):
    """Lines where the client's MTU watch reduced a path's packet size."""
    return [l for l in lab.log("client0").splitlines() if "path MTU fell" in l]


def run(lab, seconds, seed, warmup_s=5.0, inspect=None):
    """The whole sequence on a lab whose instances run (client0 and server); returns the figures
    (see the module's docstring). `inspect(moment, pids)`, if given, is called where the
    snapshots are taken ("before", "after"), e.g. to have a debugger print the heap's state."""
    rng = random.Random(seed)
    who = pids(lab)
    lab.iperf_server()
    upload(lab, "warmup", warmup_s)
    wait_done(lab, "warmup", warmup_s + 30)
    time.sleep(3.0)
    before = {k: holdings(lab, INSTANCE[k], pid) for k, pid in who.items()}
    if inspect:
        inspect("before", who)

    upload(lab, "storm-load", int(seconds) + 1)
    holes = flap(lab, seconds, rng)
    storm_end = time.monotonic()
    mbit = wait_done(lab, "storm-load", 60)
    up_after = None
    while time.monotonic() - storm_end < UP_WITHIN_S * 4:
        if all_up(lab):
            up_after = time.monotonic() - storm_end
            break
        time.sleep(0.1)
    time.sleep(max(0.0, SETTLE_S - (time.monotonic() - storm_end)))
    after = {k: holdings(lab, INSTANCE[k], pid) for k, pid in who.items()}
    if inspect:
        inspect("after", who)
    sizes = path_sizes(lab)
    carried = each_path_carries(lab)
    return {
        "seconds": seconds,
        "seed": seed,
        "holes": len(holes),
        "hole_list": holes,
        "upload_mbit": mbit,
        "before": before,
        "after": after,
        "all_up_after_s": up_after,
        "sizes": sizes,
        "pings_answered": carried,
        "pings_sent": 10,
        "mtu_log": mtu_log_lines(lab),
        "connects": {f"{w}/{p['name']}": p["connects"] for w in ("client0", "server")
                     for p in lab.status(w)["tunnels"][0]["paths"]},
    }


def restarts(lab, n):
    """Restart the client `n` times (SIGKILL and SIGTERM in turn, each time until its tunnel is
    up and a ping answered), seen from the server: its fds, threads, RSS and runtime tasks (its
    status) before the first and 20 s after the last."""
    server = lab.procs["server"].pid
    lab.ping(count=3, interval=0.1)
    time.sleep(3.0)
    before = holdings(lab, "server", server)
    t0 = time.monotonic()
    for i in range(n):
        lab.stop("client0", sig=signal.SIGKILL if i % 2 == 0 else signal.SIGTERM)
        lab.start_client()
        lab.wait_tunnel()
        lab.ping(count=1, interval=0.1)
    took = time.monotonic() - t0
    time.sleep(SETTLE_S)
    after = holdings(lab, "server", server)
    return {"restarts": n, "seconds": round(took, 1), "before": before, "after": after,
            "server_sessions": after["sessions"]}


def own_tasks(h):
    """The runtime tasks of `holdings` `h` that are not a stream's (each stream read is two
    tasks, `stream_rx`)."""
    return h.get("tasks", 0) - 2 * h.get("streams_in", 0)


def differences(who, b, a, rss_slack_kib):
    """What process `who` holds after (`a`) that it did not before (`b`), two `holdings`: fds,
    threads, runtime tasks, or RSS beyond the slack; as readable lines."""
    out = []
    if a["fds"] != b["fds"]:
        out.append(f"{who}: fds {b['fds']} -> {a['fds']} ({b['fd_kinds']} -> {a['fd_kinds']})")
    if a["threads"] != b["threads"]:
        out.append(f"{who}: threads {b['threads']} -> {a['threads']}")
    if own_tasks(a) != own_tasks(b):
        out.append(f"{who}: runtime tasks {b.get('tasks')} -> {a.get('tasks')} (streams read "
                   f"{b.get('streams_in')} -> {a.get('streams_in')})")
    if a["rss_kib"] > b["rss_kib"] + rss_slack_kib:
        out.append(f"{who}: RSS {b['rss_kib']} -> {a['rss_kib']} KiB")
    return out


def problems(r, rss_slack_kib=2048):
    """What the figures of `run` show wrong, as readable lines (none: the storm left no trace)."""
    out = []
    for who in ("client", "server"):
        out += differences(who, r["before"][who], r["after"][who], rss_slack_kib)
    if r["all_up_after_s"] is None or r["all_up_after_s"] > UP_WITHIN_S:
        out.append(f"paths not all up within {UP_WITHIN_S} s of the storm's end: {r['all_up_after_s']}")
    for path, s in r["sizes"].items():
        if path.startswith("client0") and s["udp_payload"] != s["udp_payload_max"]:
            out.append(f"{path}: UDP payload {s['udp_payload']} of {s['udp_payload_max']}")
    client_max = {k.split("/", 1)[1]: s["udp_payload_max"] for k, s in r["sizes"].items()
                  if k.startswith("client0")}
    for path, s in r["sizes"].items():
        if path.startswith("server") and s["udp_payload"] != client_max.get(path.split("/", 1)[1]):
            out.append(f"{path}: UDP payload {s['udp_payload']}, the client's link {client_max}")
    if r["mtu_log"]:
        out.append(f"{len(r['mtu_log'])} packet-size reductions logged: {r['mtu_log'][:3]}")
    for path, n in r["pings_answered"].items():
        if n < r["pings_sent"] - 2:
            out.append(f"{path} alone: {n} of {r['pings_sent']} pings answered")
    return out


def summary(label, r):
    b, a = r["before"], r["after"]
    return (f"{label}: {r['holes']} holes in {r['seconds']} s, upload {r['upload_mbit'] or 0:.1f} Mbit/s; "
            f"client fds {b['client']['fds']}->{a['client']['fds']} threads {b['client']['threads']}->{a['client']['threads']} "
            f"tasks {b['client']['tasks']}->{a['client']['tasks']} (streams read {b['client']['streams_in']}->{a['client']['streams_in']}) "
            f"RSS {b['client']['rss_kib'] / 1024:.1f}->{a['client']['rss_kib'] / 1024:.1f} MiB; "
            f"server fds {b['server']['fds']}->{a['server']['fds']} threads {b['server']['threads']}->{a['server']['threads']} "
            f"tasks {b['server']['tasks']}->{a['server']['tasks']} (streams read {b['server']['streams_in']}->{a['server']['streams_in']}) "
            f"RSS {b['server']['rss_kib'] / 1024:.1f}->{a['server']['rss_kib'] / 1024:.1f} MiB; "
            f"all up {r['all_up_after_s']} s after; pings per path {r['pings_answered']}")
