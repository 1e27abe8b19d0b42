"""The Debian package (scripts/package.sh, cargo-deb): built, installed with dpkg -i on this
machine, its unit's commands run for an instance NAME as systemd runs them, removed again."""

import glob
import os
import re
import shutil
import subprocess

import pytest

from conftest import report
import labctl


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def test_deb_installs_a_working_instance(make_lab):
    if shutil.which("dpkg") is None:
        pytest.skip("no dpkg")
    if sh(["dpkg", "-s", "mpquic"]).returncode == 0:
        pytest.skip("an mpquic package is installed on this machine; not touching it")
    r = sh([os.path.join(labctl.REPO, "scripts", "package.sh")], timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    deb = [d for d in glob.glob(os.path.join(labctl.REPO, "target", "debian", "mpquic_*.deb"))]
    assert len(deb) == 1, deb
    files = sh(["dpkg", "-c", deb[0]]).stdout
    for f in ("./usr/bin/mpquic", "./lib/systemd/system/mpquic@.service", "./usr/share/man/man1/mpquic.1.gz",
              "./usr/share/man/man1/mpquic-status.1.gz",
              "./usr/share/doc/mpquic/examples/client.yaml", "./usr/share/doc/mpquic/CONFIG.md"):
        assert f in files, files
    assert glob.glob(os.path.join(labctl.REPO, "target", "debian", "mpquic-lab_*.deb"))

    name = f"e2e{os.getpid()}"
    instance = f"/etc/mpquic/instances/{name}.yaml"
    had_etc = os.path.exists("/etc/mpquic")
    lab = make_lab(paths=1)
    lab.pki()
    try:
        r = sh(["dpkg", "-i", deb[0]])
        assert r.returncode == 0, r.stdout + r.stderr
        version = sh(["/usr/bin/mpquic", "--version"]).stdout.strip()
        assert version.startswith("mpquic "), version
        assert os.stat("/etc/mpquic/instances").st_mode & 0o777 == 0o700
        if shutil.which("man"):
            page = sh(["man", "-l", "/usr/share/man/man1/mpquic.1.gz"], env={**os.environ, "MANPAGER": "cat"}).stdout
            assert "check-config" in page, page[:1000]
        verify = sh(["systemd-analyze", "verify", f"mpquic@{name}.service"]) if shutil.which("systemd-analyze") else None

        # The unit's commands for instance NAME, as systemd would run them (%i = NAME): the
        # client's configuration from the lab as /etc/mpquic/instances/NAME.yaml, run in the
        # lab client's namespace (where its WAN interfaces are). `systemctl start` itself needs
        # systemd as PID 1, which this machine (and CI) does not have.
        with open("/lib/systemd/system/mpquic@.service") as f:
            unit = f.read()
        pre = re.search(r"^ExecStartPre=(.*)$", unit, re.M).group(1).replace("%i", name).split()
        start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1).replace("%i", name).split()
        assert start[0] == "/usr/bin/mpquic", start
        shutil.copy(lab._instance("client0")["config"], instance)
        lab.start_server()
        r = sh(["ip", "netns", "exec", lab.client_ns(0)] + pre)
        assert r.returncode == 0, r.stdout + r.stderr
        lab.spawn("client0", lab.client_ns(0), start)
        lab.wait_tunnel()
        assert len(lab.ping(count=5, interval=0.05)["received"]) == 5
        report(f"package {os.path.basename(deb[0])}: dpkg -i ok, {version}, unit verify "
               f"{'rc ' + str(verify.returncode) + ' ' + (verify.stderr.strip()[:200]) if verify else 'not run'}; "
               f"ExecStart for mpquic@{name} brought the tunnel up (systemctl itself needs systemd as PID 1: "
               f"{'present' if os.path.isdir('/run/systemd/system') else 'absent here'})")
    finally:
        lab.stop("client0")
        if os.path.exists(instance):
            os.unlink(instance)
        sh(["dpkg", "--purge", "mpquic"])
        if not had_etc:
            shutil.rmtree("/etc/mpquic", ignore_errors=True)
