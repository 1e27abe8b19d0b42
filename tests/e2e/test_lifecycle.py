"""Restarts and shutdown: server restart, client killed and restarted, SIGTERM."""

import re
import signal
import time

from conftest import report
import labctl


def first_reply_after(ping_log, t):
    """Unix time of the first ping reply (ping -D) at or after `t`."""
    for m in re.finditer(r"^\[(\d+\.\d+)\] .*icmp_seq=", ping_log, re.M):
        ts = float(m.group(1))
        if ts >= t:
            return ts
    return None


def setup(make_lab):
    lab = make_lab(paths=2)
    lab.start_tunnel()
    return lab


def test_server_restart_traffic_resumes(make_lab):
    lab = setup(make_lab)
    lab.spawn("ping", lab.lan_ns(0), ["ping", "-D", "-n", "-i", "0.02", "-W", "1", lab.inet_addr])
    time.sleep(1)
    for how in (signal.SIGTERM, signal.SIGKILL):
        lab.stop("server", sig=how)
        t_restart = time.time()
        lab.start_server()
        deadline = time.time() + 10
        resumed = None
        while time.time() < deadline and resumed is None:
            time.sleep(0.1)
            resumed = first_reply_after(lab.log("ping"), t_restart)
        delay = None if resumed is None else resumed - t_restart
        report(f"server restart after {signal.Signals(how).name}: traffic resumed {delay if delay is None else f'{delay:.2f} s'} after the new server started")
        assert delay is not None and delay < 3.0, (delay, lab.log("client0")[-2000:])
        time.sleep(0.5)
    lab.stop("ping", sig=signal.SIGINT)


def test_client_killed_and_restarted_works_at_once(make_lab):
    lab = setup(make_lab)
    lab.stop("client0", sig=signal.SIGKILL)
    t0 = time.monotonic()
    lab.start_client()
    lab.wait_tunnel(timeout=5)
    p = lab.ping(count=1, interval=0.05)
    while not p["received"] and time.monotonic() - t0 < 5:
        p = lab.ping(count=1, interval=0.05)
    took = time.monotonic() - t0
    report(f"client SIGKILL + restart: tunnel up and ping answered {took:.2f} s after the restart")
    assert p["received"] and took < 3.0
    srv = lab.status("server")
    assert [t["peer"] for t in srv["tunnels"]] == ["site1/mpq0"], "the old session was replaced, not duplicated"
    assert all(x["connects"] == 1 for x in srv["tunnels"][0]["paths"]), srv
    assert "client restarted; replacing its old session" in lab.log("server")


def test_sigterm_is_fast_and_clean(make_lab):
    lab = setup(make_lab)
    took = lab.stop("client0", sig=signal.SIGTERM)
    assert labctl.run(["ip", "netns", "exec", lab.client_ns(0), "ip", "link", "show", "mpq0"], check=False).returncode != 0, \
        "TUN device removed"
    # The server was told: the session ends at once (its next housekeeping second), not after
    # an idle timeout and the linger kept for clients that drop out.
    t0 = time.monotonic()
    while lab.status("server")["tunnels"] and time.monotonic() - t0 < 3.0:
        time.sleep(0.05)
    gone = time.monotonic() - t0
    report(f"client SIGTERM: exited in {took:.3f} s; its session ended on the server {gone:.2f} s later")
    assert took < 1.0
    assert lab.status("server")["tunnels"] == [], "the session of a stopped client ended"
    assert gone < 1.5
    assert "session ended: the client stopped" in lab.log("server")
    took = lab.stop("server", sig=signal.SIGINT)
    report(f"server SIGINT: exited in {took:.3f} s")
    assert took < 1.0
    assert labctl.run(["ip", "netns", "exec", lab.server_ns, "ip", "link", "show", "mpq0"], check=False).returncode != 0


def test_server_sigterm_under_load_ends_within_a_second_and_tells_the_clients(make_lab):
    """SIGTERM to a server carrying two clients' uploads: it exits within 1 s, and each
    client hears at once that its paths were closed (no idle timeout to wait for)."""
    lab = make_lab(paths=2, clients=2, mode=None, congestion=None)
    lab.start_all()
    lab.iperf_server()
    lab.iperf_server(port=5202)
    for c, port in ((0, 5201), (1, 5202)):
        lab.spawn(f"up{c}", lab.lan_ns(c), ["iperf3", "-c", lab.inet_addr, "-p", str(port), "-t", "30"], log=False)
    time.sleep(2)
    took = lab.stop("server", sig=signal.SIGTERM)
    time.sleep(0.5)
    heard = {}
    for c in (0, 1):
        for line in lab.log(f"client{c}").splitlines():
            if "path connection closed" in line and "shutting down" in line:
                heard.setdefault(c, []).append(line)
    report(f"server SIGTERM under two uploads: exited in {took:.3f} s; clients told on "
           f"{[len(heard.get(c, [])) for c in (0, 1)]} of 2 paths each")
    for c in (0, 1):
        lab.stop(f"up{c}")
    assert took < 1.0, took
    assert all(len(heard.get(c, [])) == 2 for c in (0, 1)), {c: lab.log(f"client{c}")[-1500:] for c in (0, 1)}
