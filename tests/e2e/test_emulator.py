"""Fidelity of mpquic-lab's link emulator, measured through it with no VPN (at modest rates to keep
CI short). Each test makes its own lab and removes it."""

import json
import os
import statistics
import subprocess
import time

import pytest

from conftest import measured, report, stolen_ticks, teardown_always
import labctl

LAB = labctl.LAB


class EmuLab:
    def __init__(self, *paths):
        self.name = labctl.unique_name("t")
        r = subprocess.run([LAB, "up", self.name, "--owner-pid", str(os.getpid())] + [a for p in paths for a in ("--path", p)],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        self.state = json.loads(r.stdout)
        self.ns = self.state["namespaces"]
        self.procs = []

    def sh(self, ns, cmd, timeout=120, check=True):
        r = subprocess.run(["ip", "netns", "exec", self.ns[ns], "sh", "-c", cmd], capture_output=True,
                           text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{cmd}: {r.stderr}")
        return r.stdout

    def bg(self, ns, cmd):
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[ns], "sh", "-c", cmd],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def iperf_server(self):
        self.bg("server", "exec iperf3 -s -p 5201")
        for _ in range(50):
            if "LISTEN" in self.sh("server", "ss -ltn 'sport = :5201'"):
                return
            time.sleep(0.1)

    def iperf(self, args, seconds=5, dst="10.10.1.1"):
        """One iperf3 run; waits while the server is still finishing the previous one."""
        cmd = ["ip", "netns", "exec", self.ns["client"], "sh", "-c",
               f"iperf3 -c {dst} -p 5201 -J -t {seconds} {args}"]
        return labctl.iperf3_json(lambda: subprocess.run(cmd, capture_output=True, text=True,
                                                         timeout=seconds + 30))

    def stats(self):
        """The emulator's counters per path and direction (`mpquic-lab stats`)."""
        r = subprocess.run([LAB, "stats", self.name], capture_output=True, text=True, timeout=30, check=True)
        return json.loads(r.stdout)

    def rtts(self, count, interval=0.05):
        out = self.sh("client", f"ping -n -c {count} -i {interval} 10.10.1.1")
        return [float(x.split("time=")[1].split()[0]) for x in out.splitlines() if "time=" in x]

    def down(self):
        for p in self.procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
        subprocess.run([LAB, "down", self.name], capture_output=True, timeout=30)


@pytest.fixture
def emulab():
    yield from teardown_always(EmuLab)


def received(d):
    """The receiver's summary of an iperf3 UDP run (its key differs between iperf3 forms)."""
    return d["end"].get("sum_received") or d["end"]["sum"]


def p99(xs):
    return sorted(xs)[max(0, int(len(xs) * 0.99) - 1)]


# A window with more stolen time says nothing about the emulator: on this kind of VM, pings
# over one idle 20 ms link measured p99 40.2 ms with 1 tick stolen, 40.8 with 7 and 41.7 with
# 43 (a stolen vCPU wakes the emulator's thread 4-6 ms late, whatever its priority or spin).
QUIET_TICKS = 3


def on_a_quiet_host(measure, within, attempts=3):
    """`measure()` repeated (at most `attempts` times) until a run meets `within(result)`; that
    run (else the least stolen one), its stolen ticks and every try's ticks. Stolen time can only
    make the emulator late or slow, so a run within the bounds counts however much was stolen; a
    run outside them says something about the emulator only if the host left it alone (at most
    QUIET_TICKS stolen). A fault of the emulator misses in every try; a stall of the load
    generator (iperf3 catching up after a few ms off the CPU sends a burst that queues at the
    link, as it would on a real one) misses in one."""
    runs = []
    for _ in range(attempts):
        before = stolen_ticks()
        result = measure()
        runs.append((stolen_ticks() - before, result))
        if within(result):
            return result, runs[-1][0], [r[0] for r in runs]
    stolen, result = min(runs, key=lambda r: r[0])
    return result, stolen, [r[0] for r in runs]


@measured
def test_delay_idle_and_loaded(emulab):
    lab = emulab("rate=100mbit,delay=20ms")

    # Within 1 ms idle: on this shared 2-vCPU VM three quiet tries in a row (0-1 ticks stolen)
    # measured p99 40.8 ms once in CI, where most runs read 40.1-40.5.
    def idle_ok(rtts):
        return abs(p99(rtts) - 40.0) <= 1.0

    def loaded_ok(rtts):
        return abs(p99(rtts) - 40.0) <= 2.0

    # 1000 pings (~13 s): the p99 of 200 is their third-worst, which one host hiccup moves.
    idle, idle_stolen, idle_tries = on_a_quiet_host(lambda: lab.rtts(1000, 0.01), idle_ok)
    lab.iperf_server()

    def loaded_rtts():
        # iperf3 paces UDP with a 1 ms timer by default: 10 KB bursts that queue ~0.8 ms at
        # 100 Mbit/s (a real link does the same), and after any stall of iperf3 itself it catches
        # up with a bigger burst. A 100 us timer keeps the load smooth, so what is measured is the
        # emulator; 700 pings make the p99 their 7th-worst, not moved by one host hiccup.
        load = lab.bg("client", "exec iperf3 -c 10.10.1.1 -p 5201 -u -b 80M -t 10 --pacing-timer 100")
        time.sleep(1)
        rtts = lab.rtts(700, 0.01)
        load.wait(timeout=20)
        return rtts

    loaded, loaded_stolen, loaded_tries = on_a_quiet_host(loaded_rtts, loaded_ok)
    report(f"emulator delay 20 ms each way: ping RTT idle median {statistics.median(idle):.2f} p99 {p99(idle):.2f} ms; "
           f"at 80% load median {statistics.median(loaded):.2f} p99 {p99(loaded):.2f} ms "
           f"(CPU ticks stolen by the hypervisor per try: idle {idle_tries}, loaded {loaded_tries})")
    if idle_stolen <= QUIET_TICKS:
        assert idle_ok(idle), idle
    if loaded_stolen <= QUIET_TICKS:
        assert loaded_ok(loaded), loaded
    if not (idle_ok(idle) and loaded_ok(loaded)):
        pytest.skip(f"the hypervisor took the CPUs away in every try (ticks stolen: idle {idle_tries}, "
                    f"loaded {loaded_tries}); delay fidelity cannot be measured on this host now")


@measured
def test_rate_udp_goodput_and_tcp(emulab):
    lab = emulab("rate=100mbit", "rate=300mbit,delay=10ms")
    lab.iperf_server()
    expect = 100.0 * 1472 / 1500  # the link counts IP bytes; iperf3 counts UDP payload

    def within(got):
        return abs(got - expect) <= 0.02 * expect

    # The emulator is a user-space thread: a vCPU the hypervisor takes away for a few ms is link
    # time nobody sends in (measured in CI: 92.3 and 95.5 of 98.1 on a busy host), so the figure
    # counts from a run the host left alone, as the delay test's do.
    got, stolen, tries = on_a_quiet_host(
        lambda: received(lab.iperf("-u -b 150M -l 1472", seconds=5))["bits_per_second"] / 1e6, within)
    report(f"emulator rate 100 Mbit/s: UDP goodput {got:.1f} Mbit/s (payload share of 100: {expect:.1f}; "
           f"CPU ticks stolen by the hypervisor per try: {tries})")
    if not within(got) and stolen > QUIET_TICKS:
        pytest.skip(f"the hypervisor took the CPUs away in every try (ticks stolen: {tries}); "
                    "rate fidelity cannot be measured on this host now")
    assert within(got), got
    tcp = lab.iperf("", seconds=6, dst="10.10.2.1")["end"]["sum_received"]["bits_per_second"] / 1e6
    report(f"emulator 300 Mbit/s + 10 ms: one TCP flow {tcp:.0f} Mbit/s ({100 * tcp / 300:.0f}%)")
    assert tcp >= 0.9 * 300 * 1448 / 1500, tcp


@measured
def test_bernoulli_loss_over_100k_packets(emulab):
    lab = emulab("loss=10%")
    lab.iperf_server()
    lab.sh("server", "nstat -n")
    try:
        d = lab.iperf("-u -b 16M -l 100", seconds=6)  # 20k packets/s
    except RuntimeError as e:
        # The load generator, not the emulator: iperf3 at 20k packets/s on a host whose vCPUs
        # are stolen can fail its own control exchange (a miss `measured` retries).
        raise AssertionError(f"iperf3: {e}") from e
    overflow = lab.sh("server", "nstat -a | awk '$1==\"UdpRcvbufErrors\"{print $2}'").strip() or "0"
    s = received(d)
    up = lab.stats()["paths"][0]["up"]
    st = up["stats"]
    model = 100.0 * st["dropped_loss"] / max(1, st["in_packets"])
    # What the loss model drew is judged on the emulator's own counts: end to end, a receiver that
    # falls behind at 20k packets/s (iperf3's socket on a busy host) adds its own losses, which are
    # not the model's. They are reported beside it.
    others = {k: v for k, v in st.items() if k.startswith("dropped_") and k != "dropped_loss" and v}
    report(f"emulator loss=10%: the model dropped {model:.2f}% of {st['in_packets']} packets; end to end "
           f"{s['lost_percent']:.2f}% of {s['packets']} lost (other emulator drops {others}, socket drops "
           f"{up['socket_drops']}, the receiver's socket overflowed {overflow} times)")
    assert st["in_packets"] >= 100_000
    assert abs(model - 10.0) <= 0.5, model
    assert s["lost_percent"] >= model - 0.5, (s, model)


def test_gilbert_elliott_mean_burst_length(emulab):
    # ge=1%:25%: good->bad 1% per packet, bad->good 25%, every packet in the bad state lost:
    # bursts of 1/0.25 = 4 packets on average, 0.01/(0.01+0.25) = 3.85% lost overall.
    lab = emulab("ge=1%:25%")
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "udpflows.py")
    count = 100_000
    rx = subprocess.Popen(["ip", "netns", "exec", lab.ns["server"], "python3", tool, "seqrecv", "6001", "9",
                           str(count)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    lab.sh("client", f"python3 {tool} seqsend 10.10.1.1 6001 {count} 20000", timeout=60)
    out = json.loads(rx.communicate(timeout=60)[0])
    bursts = out["bursts"]
    mean = statistics.mean(bursts)
    stats = json.loads(subprocess.run([LAB, "stats", lab.name], capture_output=True, text=True).stdout)
    by_model = stats["paths"][0]["up"]["stats"]["dropped_loss"]
    report(f"emulator ge=1%:25%: {out['lost']} of {count} lost ({100 * out['lost'] / count:.2f}%, model 3.85%), "
           f"{len(bursts)} bursts, mean length {mean:.2f} (configured 4.0), longest {max(bursts)}; "
           f"emulator counted {by_model} loss drops")
    # Every missing packet is one the model dropped (nothing lost elsewhere), so the bursts seen
    # from outside are the model's.
    assert out["lost"] == by_model
    assert abs(mean - 4.0) <= 0.4, mean
    assert 3.0 <= 100 * out["lost"] / count <= 4.7


@measured
def test_per_flow_cap(emulab):
    lab = emulab("rate=100mbit,flow_rate=20mbit")
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "udpflows.py")

    def measure(flows):
        # Each flow offers 30 Mbit/s for 4 s; the receiver counts every byte, divided by the 4 s.
        rx = subprocess.Popen(["ip", "netns", "exec", lab.ns["server"], "python3", tool, "recv", "6000", "4.5"],
                              stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        lab.sh("client", f"python3 {tool} send 10.10.1.1 6000 {flows} 30 4", timeout=30)
        out = json.loads(rx.communicate(timeout=30)[0])
        return [b * 8 / 4.0 / 1e6 for b in out.values()]

    four, one = measure(4), measure(1)
    report(f"emulator flow_rate=20mbit on 100mbit, flows offering 30 Mbit/s: 4 flows {sum(four):.1f} Mbit/s "
           f"({', '.join(f'{x:.1f}' for x in four)}), 1 flow {sum(one):.1f} Mbit/s")
    assert len(four) == 4 and 72 <= sum(four) <= 84, four
    assert all(17 <= x <= 21 for x in four), four
    assert 17 <= sum(one) <= 21, one


def test_live_set_and_blackhole(emulab):
    lab = emulab("delay=5ms")
    assert len(lab.rtts(5)) == 5
    subprocess.run([LAB, "set", lab.name, "1", "state=blackhole", "--dir", "down"], check=True, capture_output=True)
    out = lab.sh("client", "ping -n -c 5 -i 0.05 -W 1 10.10.1.1", check=False)
    assert " 0 received" in out
    subprocess.run([LAB, "set", lab.name, "1", "state=up", "delay=30ms"], check=True, capture_output=True)
    rtts = lab.rtts(5)
    assert len(rtts) == 5 and min(rtts) >= 60.0, rtts
    r = subprocess.run([LAB, "set", lab.name, "1", "dleay=3ms"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown key `dleay`" in r.stderr, r.stderr


def test_several_clients_direct_paths_and_link_down():
    """`up --clients 2` with an emulated and a `direct` path: each client's paths by its own
    numbers, `set` refused on a direct path, `link down/up` on client 2 only."""
    name = labctl.unique_name("t")
    try:
        st = json.loads(labctl.lab_cmd("up", name, "--path", "delay=10ms", "--path", "direct", "--clients", "2",
                                       "--owner-pid", os.getpid()))
        paths = {(p["client"], p["client_path"]): p for p in st["paths"]}
        assert sorted(paths) == [(1, 1), (1, 2), (2, 1), (2, 2)], paths
        assert [p["emulated"] for p in st["paths"]] == [True, False, True, False]
        cli2 = st["clients"][1]["client"]

        def rtt(path):
            out = labctl.run(["ip", "netns", "exec", cli2, "ping", "-n", "-c", "3", "-i", "0.05", "-W", "1",
                              paths[(2, path)]["server_addr"]], check=False).stdout
            return [float(x.split("time=")[1].split()[0]) for x in out.splitlines() if "time=" in x]

        assert len(rtt(1)) == 3 and min(rtt(1)) >= 20.0, "client 2's path 1 crosses the emulator"
        assert len(rtt(2)) == 3 and max(rtt(2)) < 5.0, "a direct path does not"
        r = labctl.run([LAB, "set", name, "2", "delay=1ms", "--client", "2"], check=False)
        assert r.returncode != 0 and "does not cross the emulator" in r.stderr, r.stderr
        labctl.lab_cmd("set", name, "1", "delay=30ms", "--client", "2")
        assert min(rtt(1)) >= 60.0
        out = labctl.run(["ip", "netns", "exec", st["clients"][0]["client"], "ping", "-n", "-c", "2", "-i", "0.05",
                          paths[(1, 1)]["server_addr"]]).stdout
        assert max(float(x.split("time=")[1].split()[0]) for x in out.splitlines() if "time=" in x) < 40.0, \
            "client 1's path 1 kept its 10 ms"
        labctl.lab_cmd("link", name, "2", "down", "--client", "2")
        assert rtt(2) == []
        labctl.lab_cmd("link", name, "2", "up", "--client", "2")
        route = labctl.run(["ip", "netns", "exec", cli2, "ip", "route", "show", "10.99.0.1"]).stdout
        assert "dev wan2" in route, route
        report(f"two clients: client 2 path 1 (emulated) rtt {min(rtt(1)):.1f} ms, path 2 (direct) "
               f"{max(rtt(2)):.2f} ms; link down/up restored the route")
    finally:
        labctl.run([LAB, "down", name], check=False)
