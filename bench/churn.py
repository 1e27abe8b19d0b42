#!/usr/bin/env python3
"""Churn and long uptime: what the server (and a client that stays) holds after paths flapping,
clients restarting, many clients at once and an hour of traffic, against what it held before.

    sudo python3 bench/churn.py flap     [--seconds 600]   a path down and up every 0.2-2 s under 4 TCP uploads
    sudo python3 bench/churn.py restarts [--count 500]     the client killed (SIGKILL, SIGTERM in turn) and back
    sudo python3 bench/churn.py clients  [--clients 64 --seconds 600]   all connect at once, each with a flow
    sudo python3 bench/churn.py soak     [--seconds 3600]  two clients, a cycle of TCP and UDP both ways,
                                                           a path hole every 5 min, a client restart every 10
    sudo python3 bench/churn.py lane     [--seconds 600 --clients 200]   the MPTCP lane: that many LAN
                                                           connections open at once, each opened, echoed,
                                                           held 0-2 s and closed, over and over
    sudo python3 bench/churn.py all                        all of them in turn

Every run uses mpquic's defaults (mpquic-lab configs without mode, congestion or policy keys).
The baseline is taken after a warm-up with traffic (first-use allocations are not a leak), the
final figures 20 s after the load ends (beyond the QUIC idle timeout, 15 s). A run passes when
RSS is back within 1 MiB of the baseline, open fds and runtime tasks (status) are equal to it,
the server holds exactly the sessions of the clients still running with every path `up` on both
ends, and no log says `panicked`. Writes bench/results/churn-KIND.json; exit 1 on any problem.
"""

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "e2e"))

import flapstorm  # noqa: E402
import labctl  # noqa: E402

RSS_SLACK_KIB = 1024
SETTLE_S = flapstorm.SETTLE_S
# A stopped client's session ends within the server's housekeeping second; a killed one's paths
# at the QUIC idle timeout (15 s), its session after the linger for a return (120 s).
GONE_WITHIN_S = 150.0
# Soak cycles before its baseline: every event of the cycle (a hole, a restart) once.
WARMUP_CYCLES = 10


def defaults_lab(**kw):
    """A lab whose instances run mpquic's defaults (mode, congestion and policy keys left out)."""
    return labctl.Lab(mode=None, congestion=None, **kw)


def panics(lab):
    """Lines of any mpquic log in the lab that report a panic."""
    out = []
    for key in lab.logs:
        if key == "server" or key.startswith("client"):
            out += [f"{key}: {l}" for l in lab.log(key).splitlines() if "panicked" in l]
    return out


def stuck_paths(lab, clients):
    """Paths that are not `up` on either end, for the running clients (their lab keys)."""
    out = []
    for key in clients + ["server"]:
        for t in lab.status(key)["tunnels"]:
            for p in t["paths"]:
                if p["state"] != "up":
                    out.append(f"{key}/{t.get('name') or t.get('client') or ''}/{p['name']}: {p['state']}")
    return out


def compare(who, before, after):
    """What differs between two `flapstorm.holdings` beyond the allowed RSS slack."""
    return flapstorm.differences(who, before, after, RSS_SLACK_KIB)


def server_holdings(lab):
    return flapstorm.holdings(lab, "server", lab.procs["server"].pid)


def wait_sessions(lab, n, timeout=GONE_WITHIN_S):
    """Seconds until the server holds exactly `n` sessions (None: not within `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if len(lab.status("server")["tunnels"]) == n:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.2)
    return None


def line(label, r):
    b, a = r["before"]["server"], r["after"]["server"]
    return (f"{label}: server RSS {b['rss_kib'] / 1024:.1f} -> {a['rss_kib'] / 1024:.1f} MiB "
            f"(peak {r.get('server_peak_rss_kib', 0) / 1024:.1f}; heap in use "
            f"{b['heap_in_use_kib'] / 1024:.1f} -> {a['heap_in_use_kib'] / 1024:.1f}), fds {b['fds']} -> {a['fds']}, "
            f"tasks {b['tasks']} -> {a['tasks']}, sessions {b['sessions']} -> {a['sessions']}")


# -- the four runs ---------------------------------------------------------------------------------

def flap(a):
    """tests/e2e/flapstorm.py's storm on two emulated paths for `--seconds`, product defaults."""
    with defaults_lab(paths=2, specs=flapstorm.SPECS) as lab:
        lab.start_all()
        r = flapstorm.run(lab, a.seconds, a.seed)
        r["problems"] = flapstorm.problems(r, rss_slack_kib=RSS_SLACK_KIB)
        if r["after"]["server"]["sessions"] != 1:
            r["problems"].append(f"server holds {r['after']['server']['sessions']} sessions, 1 client runs")
        r["problems"] += panics(lab)
    print(flapstorm.summary("flap", r), flush=True)
    return r


def restarts(a):
    """`--count` client restarts (tests/e2e/flapstorm.py), then the server against its baseline."""
    with defaults_lab(paths=2, specs=flapstorm.SPECS) as lab:
        lab.start_all()
        r = flapstorm.restarts(lab, a.count)
        r["problems"] = compare("server", r["before"], r["after"])
        if r["server_sessions"] != 1:
            r["problems"].append(f"server holds {r['server_sessions']} sessions, 1 client runs")
        r["problems"] += stuck_paths(lab, ["client0"]) + panics(lab)
        r["before"], r["after"] = {"server": r["before"]}, {"server": r["after"]}
    print(line(f"restarts ({a.count} in {r['seconds']} s)", r), flush=True)
    return r


def start_flows(lab, n, seconds, mbit):
    """One paced TCP flow per client for `seconds`, uploads and downloads in turn (client c to
    the internet host's iperf3 on port 5201 + c)."""
    for c in range(n):
        lab.iperf_server(5201 + c)
    for c in range(n):
        cmd = ["iperf3", "-c", lab.inet_addr, "-p", str(5201 + c), "-t", str(seconds),
               "-b", f"{mbit}M", "-J"] + (["-R"] if c % 2 else [])
        lab.spawn(f"flow{c}", lab.lan_ns(c), cmd)


def flow_results(lab, n, timeout):
    """Mbit/s each client's flow received (None where iperf3 failed)."""
    out = []
    deadline = time.monotonic() + timeout
    for c in range(n):
        p = lab.procs.pop(f"flow{c}")
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            data = json.loads(lab.log(f"flow{c}"))
            out.append(round(data["end"]["sum_received"]["bits_per_second"] / 1e6, 2))
        except (subprocess.TimeoutExpired, ValueError, KeyError):
            p.kill()
            out.append(None)
    return out


def cpu_s(pid):
    """CPU seconds process `pid` has used (user + system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def clients_round(lab, n, seconds, mbit, stop_signal):
    """All `n` clients started at once, a paced flow each for `seconds`, then stopped
    (`stop_signal(c)`). Returns the round's figures."""
    server = lab.procs["server"].pid
    t0 = time.monotonic()
    for c in range(n):
        lab.start_client(c)
    for c in range(n):
        lab.wait_tunnel(c, timeout=60)
    all_up_s = round(time.monotonic() - t0, 2)
    start_flows(lab, n, int(seconds), mbit)
    cpu0, t1 = cpu_s(server), time.monotonic()
    peak = 0
    t_end = t1 + seconds
    while time.monotonic() < t_end:
        time.sleep(min(10.0, max(0.0, t_end - time.monotonic())))
        peak = max(peak, server_holdings(lab)["rss_kib"])
    server_cpu = round(100 * (cpu_s(server) - cpu0) / (time.monotonic() - t1), 1)
    during = server_holdings(lab)
    rates = flow_results(lab, n, 60)
    for c in range(n):
        lab.stop(f"iperf{5201 + c}")
    stuck = stuck_paths(lab, [f"client{c}" for c in range(n)])
    for c in range(n):
        lab.stop(f"client{c}", sig=stop_signal(c))
    return {"all_up_s": all_up_s, "rates": rates, "during": during, "peak": peak,
            "server_cpu_pct": server_cpu, "stuck": stuck}


def clients(a):
    """`--clients` clients on one direct path each. A warm-up round at that scale (30 s; the
    server's heap grows to hold that many sessions once, which is not a leak), then the baseline;
    then all of them started at once, a paced flow each for `--seconds`, half stopped with
    SIGTERM and half with SIGKILL, and the server against its baseline once their sessions are
    gone (SIGKILL: after the linger kept for a client's return). Also reported: the server
    before any client came, and its CPU share while the flows ran (the lab host runs the
    clients too: on 2 cores, 64 client processes are what limits the flows)."""
    n = a.clients
    with defaults_lab(paths=1, clients=n, emulated=False) as lab:
        lab.pki()
        lab.start_server()
        time.sleep(2.0)
        first = server_holdings(lab)
        clients_round(lab, n, 30, a.mbit, lambda c: signal.SIGTERM)
        wait_sessions(lab, 0)
        time.sleep(SETTLE_S)
        before = server_holdings(lab)

        rnd = clients_round(lab, n, a.seconds, a.mbit,
                            lambda c: signal.SIGTERM if c % 2 == 0 else signal.SIGKILL)
        left_s = wait_sessions(lab, n // 2, timeout=10)
        gone_s = wait_sessions(lab, 0)
        time.sleep(SETTLE_S)
        after = server_holdings(lab)
        problems = rnd["stuck"] + compare("server", before, after) + panics(lab)
        if left_s is None:
            problems.append("the sessions of the clients stopped with SIGTERM were not ended within 10 s")
        if gone_s is None:
            problems.append(f"sessions still held {GONE_WITHIN_S} s after the clients stopped: "
                            f"{after['sessions']}")
        if rnd["during"]["sessions"] != n:
            problems.append(f"{rnd['during']['sessions']} sessions while {n} clients ran")
        rates = rnd["rates"]
        failed = [c for c, x in enumerate(rates) if not x]
        if failed:
            problems.append(f"flows of clients {failed} failed or carried nothing")
    ok = sorted(x for x in rates if x)
    r = {"clients": n, "seconds": a.seconds, "flow_mbit": a.mbit, "all_up_s": rnd["all_up_s"],
         "flow_received_mbit": rates, "server_cpu_pct": rnd["server_cpu_pct"],
         "sigtermed_sessions_gone_s": left_s, "sessions_gone_s": gone_s,
         "server_during": rnd["during"], "server_peak_rss_kib": rnd["peak"],
         "first": {"server": first}, "before": {"server": before}, "after": {"server": after},
         "problems": problems}
    print(line(f"clients ({n} up in {rnd['all_up_s']} s; flows min/median/max "
               f"{ok[0] if ok else 0}/{ok[len(ok) // 2] if ok else 0}/{ok[-1] if ok else 0} Mbit/s "
               f"of {a.mbit}, server CPU {rnd['server_cpu_pct']}%; sessions gone: SIGTERM {left_s} s, "
               f"SIGKILL {gone_s} s; server RSS before any client {first['rss_kib'] / 1024:.1f} MiB)", r),
          flush=True)
    return r


def soak(a):
    """Two clients, two emulated paths each, for `--seconds`: a one-minute cycle of TCP up and
    down at once (20 s; paced at 20 Mbit/s each, so the hour is a long uptime with traffic,
    not a CPU benchmark), UDP 5 Mbit/s both ways (20 s) and idle (20 s); every 5th cycle one
    path of client0 black-holed for 3 s, every 10th client1 restarted (SIGTERM). The baseline
    after `WARMUP_CYCLES`; the server and client0 sampled every cycle."""
    rng = random.Random(a.seed)
    with defaults_lab(paths=2, clients=2, specs=flapstorm.SPECS) as lab:
        lab.start_all()
        lab.iperf_server(5201)
        lab.iperf_server(5202)

        def cycle(i):
            up = lab.spawn("up", lab.lan_ns(0), ["iperf3", "-c", lab.inet_addr, "-p", "5201", "-t", "20", "-P", "2", "-b", "10M"], log=False)
            down = lab.spawn("down", lab.lan_ns(1), ["iperf3", "-c", lab.inet_addr, "-p", "5202", "-t", "20", "-R", "-b", "20M"], log=False)
            if i % 5 == 4:
                p = rng.randrange(lab.npaths)
                time.sleep(8)
                lab.block(p)
                time.sleep(3)
                lab.unblock(p)
            up.wait(timeout=60)
            down.wait(timeout=60)
            u1 = lab.spawn("udp-up", lab.lan_ns(0), ["iperf3", "-c", lab.inet_addr, "-p", "5201", "-t", "20", "-u", "-b", "5M"], log=False)
            u2 = lab.spawn("udp-down", lab.lan_ns(1), ["iperf3", "-c", lab.inet_addr, "-p", "5202", "-t", "20", "-u", "-b", "5M", "-R"], log=False)
            u1.wait(timeout=60)
            u2.wait(timeout=60)
            if i % 10 == 9:
                lab.stop("client1")
                lab.start_client(1)
                lab.wait_tunnel(1)
            time.sleep(max(0.0, 20 - (3 if i % 10 == 9 else 0)))

        who = {"server": "server", "client": "client0"}
        # Warm-up: ten cycles, so the baseline has seen a hole and a restart too (a one-cycle
        # warm-up gave a baseline ~1 MiB below the hour's level, reached in its first minutes).
        for i in range(WARMUP_CYCLES):
            cycle(i)
        time.sleep(3.0)
        before = {k: flapstorm.holdings(lab, key, lab.procs[key].pid) for k, key in who.items()}
        samples = []
        t0 = time.monotonic()
        i = WARMUP_CYCLES
        while time.monotonic() - t0 < a.seconds:
            cycle(i)
            h = {k: flapstorm.holdings(lab, key, lab.procs[key].pid) for k, key in who.items()}
            samples.append({"t": round(time.monotonic() - t0), "server_rss_kib": h["server"]["rss_kib"],
                            "server_heap_in_use_kib": h["server"]["heap_in_use_kib"],
                            "client_rss_kib": h["client"]["rss_kib"], "server_fds": h["server"]["fds"],
                            "server_tasks": h["server"]["tasks"], "sessions": h["server"]["sessions"]})
            i += 1
        time.sleep(SETTLE_S)
        after = {k: flapstorm.holdings(lab, key, lab.procs[key].pid) for k, key in who.items()}
        problems = []
        for k in who:
            problems += compare(k, before[k], after[k])
        if after["server"]["sessions"] != 2:
            problems.append(f"server holds {after['server']['sessions']} sessions, 2 clients run")
        problems += stuck_paths(lab, ["client0", "client1"]) + panics(lab)
    peak = max(s["server_rss_kib"] for s in samples)
    r = {"seconds": a.seconds, "cycles": i - WARMUP_CYCLES, "warmup_cycles": WARMUP_CYCLES, "before": before, "after": after, "samples": samples,
         "server_peak_rss_kib": peak, "problems": problems}
    print(line(f"soak ({i - WARMUP_CYCLES} cycles in {a.seconds:.0f} s)", r)
          + f"; client0 RSS {before['client']['rss_kib'] / 1024:.1f} -> {after['client']['rss_kib'] / 1024:.1f} MiB",
          flush=True)
    return r


# The lane's churn, run in the LAN host's namespace: `conc` workers, each a connection at a time
# until `secs` pass (open, echo a random 0.1-20 kB, hold 0-2 s, close); prints what it did.
LANE_CHURN = r"""
import asyncio, json, random, sys, time
dst, port, conc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
done, errors, kinds = 0, 0, {}
async def worker(seed):
    global done, errors
    rnd = random.Random(seed)
    end = time.monotonic() + secs
    while time.monotonic() < end:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(dst, port), 10)
            data = rnd.randbytes(rnd.randint(100, 20000))
            w.write(data)
            await w.drain()
            assert await asyncio.wait_for(r.readexactly(len(data)), 10) == data
            await asyncio.sleep(rnd.uniform(0, 2))
            w.close()
            await w.wait_closed()
            done += 1
        except Exception as e:
            errors += 1
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
            await asyncio.sleep(0.1)
async def main():
    await asyncio.gather(*(worker(i) for i in range(conc)))
    print(json.dumps({"connections": done, "errors": errors, "error_kinds": kinds}))
asyncio.run(main())
"""
ECHO = r"""
import asyncio
async def echo(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except ConnectionError:
        pass
    w.close()
async def main():
    s = await asyncio.start_server(echo, "0.0.0.0", 7200, backlog=1024)
    await s.serve_forever()
asyncio.run(main())
"""


def lane(a):
    """`--clients` LAN connections at once over the MPTCP lane for `--seconds` (after 30 s of
    the same as warm-up), two 100 Mbit/s 5 ms paths, both ends' holdings before and after."""
    with defaults_lab(paths=2, specs=["rate=100mbit,delay=5ms"] * 2) as lab:
        lab.pki()
        lab.start_server(yaml=lab.server_yaml() + "tcp_lane_listen: 0.0.0.0:45018\n")
        lab.start_client(yaml=lab.client_yaml() + "tcp_lane: mptcp\n")
        lab.wait_tunnel(up=["wan1", "wan2"])
        lab.spawn("echo", lab.inet_ns, ["python3", "-c", ECHO])
        time.sleep(0.5)
        who = {"client": "client0", "server": "server"}

        def churn(seconds):
            r = lab.sh(lab.lan_ns(), ["python3", "-c", LANE_CHURN, lab.inet_addr, "7200",
                                      str(a.clients), str(seconds)], timeout=seconds + 60)
            return json.loads(r.stdout)

        warm = churn(30)
        time.sleep(SETTLE_S)
        before = {k: flapstorm.holdings(lab, key, lab.procs[key].pid) for k, key in who.items()}
        samples = []
        t0 = time.monotonic()
        proc = subprocess.Popen(["ip", "netns", "exec", lab.lan_ns(), "python3", "-c", LANE_CHURN,
                                 lab.inet_addr, "7200", str(a.clients), str(a.seconds)],
                                stdout=subprocess.PIPE, text=True)
        while proc.poll() is None:
            time.sleep(10)
            h = {k: flapstorm.holdings(lab, key, lab.procs[key].pid) for k, key in who.items()}
            st = lab.status("client0")["lane"]
            samples.append({"t": round(time.monotonic() - t0), "client_rss_kib": h["client"]["rss_kib"],
                            "server_rss_kib": h["server"]["rss_kib"], "client_fds": h["client"]["fds"],
                            "server_fds": h["server"]["fds"], "lane_active": st["active"]})
        out = json.loads(proc.stdout.read())
        time.sleep(SETTLE_S)
        after = {k: flapstorm.holdings(lab, key, lab.procs[key].pid) for k, key in who.items()}
        status = {k: lab.status(key)["lane"] for k, key in who.items()}
        problems = []
        for k in who:
            problems += compare(k, before[k], after[k])
        if out["errors"]:
            problems.append(f"{out['errors']} LAN connections failed: {out['error_kinds']}")
        if status["client"]["active"] != 0:
            problems.append(f"client holds {status['client']['active']} lane connections after the churn")
        problems += panics(lab)
    r = {"seconds": a.seconds, "concurrent": a.clients, "warmup": warm, "churn": out, "before": before,
         "after": after, "samples": samples, "lane_status": status, "problems": problems,
         "peak_rss_kib": {k: max(s[f"{k}_rss_kib"] for s in samples) for k in who},
         "peak_fds": {k: max(s[f"{k}_fds"] for s in samples) for k in who}}
    b, f = before, after
    print(f"lane churn ({a.clients} at once, {a.seconds:.0f} s): {out['connections']} connections, "
          f"{out['errors']} failed; client RSS {b['client']['rss_kib'] / 1024:.1f} -> {f['client']['rss_kib'] / 1024:.1f} "
          f"MiB (peak {r['peak_rss_kib']['client'] / 1024:.1f}), fds {b['client']['fds']} -> {f['client']['fds']} "
          f"(peak {r['peak_fds']['client']}); server RSS {b['server']['rss_kib'] / 1024:.1f} -> "
          f"{f['server']['rss_kib'] / 1024:.1f} MiB (peak {r['peak_rss_kib']['server'] / 1024:.1f}), fds "
          f"{b['server']['fds']} -> {f['server']['fds']} (peak {r['peak_fds']['server']}), tasks "
          f"{b['server']['tasks']} -> {f['server']['tasks']}", flush=True)
    return r


RUNS = {"flap": flap, "restarts": restarts, "clients": clients, "soak": soak, "lane": lane}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=[*RUNS, "all"])
    ap.add_argument("--seconds", type=float, help="flap 600, clients 600, soak 3600")
    ap.add_argument("--count", type=int, default=500, help="restarts")
    ap.add_argument("--clients", type=int, help="clients 64; lane: connections at once, 200")
    ap.add_argument("--mbit", type=float, default=2.0, help="each client's paced flow (clients)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=os.path.join(labctl.REPO, "bench", "results"))
    a = ap.parse_args()
    labctl.run([labctl.LAB, "down", "--stale"], check=False)
    commit = subprocess.run(["git", "-C", labctl.REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    bad = []
    for kind in (RUNS if a.kind == "all" else [a.kind]):
        args = argparse.Namespace(**vars(a))
        if args.seconds is None:
            args.seconds = {"flap": 600, "clients": 600, "soak": 3600, "lane": 600}.get(kind, 0)
        if args.clients is None:
            args.clients = 200 if kind == "lane" else 64
        r = RUNS[kind](args)
        r["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        r["commit"] = commit
        r["config"] = "defaults (mpquic-lab configs, no mode/congestion/policy keys)"
        for p in r["problems"]:
            print(f"  PROBLEM {p}", flush=True)
        if r["problems"]:
            bad.append(kind)
        path = os.path.join(a.out_dir, f"churn-{kind}.json")
        with open(path, "w") as f:
            json.dump(r, f, indent=1)
        print(f"wrote {path}", flush=True)
    print(f"problems in {bad}" if bad else "no run left a trace")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
