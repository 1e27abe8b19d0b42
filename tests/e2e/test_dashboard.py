"""The live dashboard in a real browser: Debian's headless chromium, driven through chromedriver
(selenium), against a running two-path lab (dashboard_browser.py runs inside the client's
namespace, where the dashboard listens on loopback)."""

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import time

import pytest

from conftest import report

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboard_browser.py")


def read_line(proc, timeout, log):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        with open(log) as f:
            raise AssertionError(f"the browser said nothing within {timeout} s (exit status "
                                 f"{proc.poll()}):\n{f.read()[-3000:]}")
    return line


def fetch(lab, ns, url, token=None):
    """(HTTP status, body) of a GET inside namespace `ns`."""
    code = ("import urllib.request, urllib.error, sys\n"
            f"r = urllib.request.Request({url!r})\n"
            + (f"r.add_header('Authorization', 'Bearer {token}')\n" if token else "")
            + "try:\n    b = urllib.request.urlopen(r, timeout=5).read().decode(); print(200); print(b)\n"
              "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    out = lab.sh(ns, ["python3", "-c", code]).stdout
    status, _, body = out.partition("\n")
    return int(status), body


def test_dashboard_in_headless_chromium(make_lab):
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("chromium and chromedriver not installed (scripts/install-deps.sh --browser)")
    token = "e2e-" + secrets.token_hex(8)
    lab = make_lab(paths=2, extra_yaml=f"dashboard_listen: 127.0.0.1:9480\ndashboard_token: {token}\n")
    lab.start_tunnel()
    assert "dashboard listening" in lab.log("client0")

    # The token is asked for; the server's dashboard lists its client.
    assert fetch(lab, lab.client_ns(0), "http://127.0.0.1:9480/")[0] == 401
    assert fetch(lab, lab.client_ns(0), "http://127.0.0.1:9480/events?token=wrong-token-000000")[0] == 401
    code, body = fetch(lab, lab.server_ns, "http://127.0.0.1:9480/status", token=token)
    assert code == 200 and json.loads(body)["tunnels"][0]["peer"].startswith("site1"), body[:500]

    shots = os.path.join(lab.dir, "dashboard")
    pinger = None
    errors = open(os.path.join(lab.dir, "browser.log"), "w")
    # The browser's profile goes with the lab's directory (removed at teardown).
    profile = os.path.join(lab.dir, "chromium-profile")
    proc = subprocess.Popen(["ip", "netns", "exec", lab.client_ns(0), "python3", HELPER,
                             f"http://127.0.0.1:9480/?token={token}", "wan1", shots, profile],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
                            start_new_session=True)
    try:
        up = read_line(proc, 60, errors.name)
        assert up.startswith("UP wan1 wan2"), up
        # The site has some traffic (5 pings a second), as sites do: an idle tunnel probes its
        # paths every 500 ms and takes ~1.7 s to give up a black-holed one.
        pinger = subprocess.Popen(["ip", "netns", "exec", lab.lan_ns(0), "ping", "-q", "-i", "0.2",
                                   lab.inet_addr], stdout=subprocess.DEVNULL)
        time.sleep(1)
        lab.block(0)
        proc.stdin.write("GO\n")
        proc.stdin.flush()
        down = read_line(proc, 20, errors.name)
        assert down.startswith("DOWN wan1"), down
        seconds = float(down.split()[2])
        events = json.loads(read_line(proc, 20, errors.name).removeprefix("EVENTS "))
        report(f"dashboard in chromium: {up}; wan1 black-holed, shown down after {seconds:.2f} s; "
               f"events {events['events'][:3]}; screenshots {shots}-up.png, {shots}-down.png")
        assert seconds <= 2.0, down
        # Down, or already disconnected (its connection given up) by the next report.
        assert any(("wan1: up \u2192 down" in e or "wan1: up \u2192 disconnected" in e)
                   for e in events["events"]), events
        assert events["conn"] == "live", events
        for s in ("up", "down"):
            with open(f"{shots}-{s}.png", "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("MPQUIC_SCREENSHOT"):  # docs/dashboard.png is made this way
            shutil.copy(f"{shots}-down.png", os.environ["MPQUIC_SCREENSHOT"])
    finally:
        if pinger is not None:
            pinger.kill()
            pinger.wait()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # chromium and chromedriver with it
        proc.wait()
