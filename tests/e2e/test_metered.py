"""Metered and backup links: a path's `rate_limit` holds both ways, a `role: backup` path stays
idle while the primary carries and takes over when it fails, and a `data_budget` used up makes
its path a backup, warns first, and survives a restart (the count is in `state_dir`)."""

import json
import os
import signal
import time

from conftest import measured, report
import labctl

INTERVAL = 0.01


def with_path_keys(yaml, path, keys):
    """The client configuration with `keys` (YAML lines) added to path `path`'s entry."""
    entry = f"- name: {path}\n"
    assert entry in yaml, yaml
    return yaml.replace(entry, entry + "".join(f"  {k}\n" for k in keys), 1)


def tx(lab, key, path):
    return lab.path_status(key, path)["tx_bytes"]


@measured
def test_rate_limit_holds_both_ways(make_lab):
    """The product's defaults and `rate_limit: 5` on a 50 Mbit/s path: one TCP flow each way
    gets no more than the cap (its goodput is below it: the cap counts IP packets whole)."""
    lab = make_lab(paths=1, mode=None, congestion=None, specs=["rate=50mbit,delay=5ms"])
    st = lab.start_tunnel(client=lambda y: with_path_keys(y, "wan1", ["rate_limit: 5"]))
    assert st["tunnels"][0]["paths"][0]["rate_limit_mbit"] == 5.0
    lab.iperf_server()
    got = {}
    for reverse in (False, True):
        d = lab.iperf(seconds=6, reverse=reverse)
        got["down" if reverse else "up"] = d["end"]["sum_received"]["bits_per_second"] / 1e6
    report(f"rate_limit 5 on a 50 Mbit/s path, one TCP flow: up {got['up']:.2f}, down {got['down']:.2f} Mbit/s goodput")
    server = lab.path_status("server", "wan1")
    assert server["rate_limit_mbit"] == 5.0, server
    for direction, mbit in got.items():
        # TCP in QUIC in UDP in IP: ~92% of the link's bytes are the flow's.
        assert 4.0 <= mbit <= 5.05, (direction, mbit)


@measured
def test_a_backup_path_is_idle_until_the_primary_fails(make_lab):
    """wlb would spread over both paths; `role: backup` keeps wan2 out while wan1 is up, takes
    over when wan1 black-holes, and goes idle again when wan1 is back."""
    lab = make_lab(paths=2, policy="wlb", priorities=[1, 1], mode=None, congestion=None,
                   specs=["rate=50mbit,delay=5ms", "rate=50mbit,delay=5ms"])
    lab.start_tunnel(client=lambda y: with_path_keys(y, "wan2", ["role: backup"]), up=["wan1", "wan2"])
    lab.iperf_server()
    before = {k: {p: tx(lab, k, p) for p in ("wan1", "wan2")} for k in ("server", "client0")}
    lab.iperf(seconds=3, reverse=True)
    lab.iperf(seconds=3)
    after = {k: {p: tx(lab, k, p) for p in ("wan1", "wan2")} for k in ("server", "client0")}
    moved = {k: {p: after[k][p] - before[k][p] for p in after[k]} for k in after}
    share = {k: 100.0 * moved[k]["wan2"] / max(1, sum(moved[k].values())) for k in moved}
    assert lab.path_status("server", "wan2")["role"] == "backup"
    # Ping while wan1 black-holes for 3 s, then comes back.
    lab.start_ping("ping", interval=INTERVAL)
    time.sleep(1.0)
    lab.block(0)
    time.sleep(3.0)
    carried = tx(lab, "client0", "wan2") - after["client0"]["wan2"]
    lab.unblock(0)
    time.sleep(3.0)
    idle_from = tx(lab, "client0", "wan2")
    time.sleep(1.0)
    idle = tx(lab, "client0", "wan2") - idle_from
    lab.stop("ping", sig=signal.SIGINT)
    ping = labctl.parse_ping(lab.log("ping"))
    lost, longest = labctl.ping_gaps(ping, INTERVAL)
    report(f"backup path: share while the primary is up {share} %, {carried} bytes on it while the "
           f"primary was down, {idle} bytes in the second from 3 s after the repair; longest ping gap "
           f"{longest:.2f} s")
    for k, s in share.items():
        assert s < 0.1, (k, share)
    assert carried > 0, "the backup took over"
    assert longest <= 1.0, longest
    assert idle < 2000, idle


@measured
def test_a_used_up_budget_makes_the_path_a_backup_and_survives_a_restart(make_lab):
    """wan1 (preferred) has a 5 MB budget: a download uses it up, wan1 warns, then carries only
    as a backup while wan2 takes the traffic; the count is written to `state_dir` and read back
    by the next start."""
    lab = make_lab(paths=2, priorities=[1, 2], mode=None, congestion=None,
                   specs=["rate=50mbit,delay=5ms", "rate=50mbit,delay=5ms"])
    lab.pki()
    lab.start_server()
    state = os.path.join(lab.dir, "state")
    yaml = with_path_keys(lab.client_yaml(), "wan1", ["data_budget: {limit: 5MB, period: day}"])
    yaml += f"state_dir: {state}\n" if "state_dir:" not in yaml else ""
    yaml = "\n".join(f"state_dir: {state}" if l.startswith("state_dir:") else l
                     for l in yaml.splitlines()) + "\n"
    lab.start_client(yaml=yaml)
    lab.wait_tunnel(up=["wan1", "wan2"])
    lab.iperf_server()
    lab.iperf(seconds=4, reverse=True)
    p = lab.path_status("client0", "wan1")
    b = p["budget"]
    moved = tx(lab, "server", "wan2")
    log = lab.log("client0")
    report(f"5 MB budget: status {json.dumps(b)}; role {p['role']}; server sent {moved} bytes on wan2")
    assert b["state"] == "used up" and p["role"] == "backup", p
    assert 5_000_000 <= b["used_bytes"] <= 5_250_000, b
    assert b["left_bytes"] == 0 and b["limit_bytes"] == 5_000_000, b
    assert "past its warning share" in log and "data budget used up" in log, log[-2000:]
    assert lab.path_status("server", "wan1")["role"] == "backup"
    assert moved > 5_000_000, "wan2 carried the rest"
    # A restart reads the count back.
    lab.stop("client0")
    with open(os.path.join(state, "mpq0.budget")) as f:
        line = f.read()
    assert line.startswith("wan1 mpquic-budget 1 "), line
    lab.start_client(yaml=yaml)
    lab.wait_tunnel()
    again = lab.path_status("client0", "wan1")
    assert again["budget"]["used_bytes"] >= b["used_bytes"], (again["budget"], b)
    assert again["budget"]["state"] == "used up" and again["role"] == "backup", again
