"""The Debian package (scripts/package.sh, cargo-deb): built, installed with dpkg -i on this
machine, its unit's commands run for an instance NAME as systemd runs them, removed again; and
installed in a Debian 12 container booted with systemd as PID 1 (this machine has none), where
systemctl starts, reloads and stops instances."""

import glob
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from conftest import report
import labctl


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def build_package():
    """scripts/package.sh; the mpquic package's path."""
    r = sh([os.path.join(labctl.REPO, "scripts", "package.sh")], timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    deb = [d for d in glob.glob(os.path.join(labctl.REPO, "target", "debian", "mpquic_*.deb"))]
    assert len(deb) == 1, deb
    return deb[0]


def test_deb_installs_a_working_instance(make_lab):
    if shutil.which("dpkg") is None:
        pytest.skip("no dpkg")
    if sh(["dpkg", "-s", "mpquic"]).returncode == 0:
        pytest.skip("an mpquic package is installed on this machine; not touching it")
    deb = [build_package()]
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
        # lab client's namespace (where its WAN interfaces are). `systemctl` itself needs systemd
        # as PID 1, which this machine (and CI) does not have: the container test below.
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
               f"ExecStart for mpquic@{name} brought the tunnel up")
    finally:
        lab.stop("client0")
        if os.path.exists(instance):
            os.unlink(instance)
        sh(["dpkg", "--purge", "mpquic"])
        if not had_etc:
            shutil.rmtree("/etc/mpquic", ignore_errors=True)


SERVER_YAML = """role: server
bind_ip: 127.0.0.1
remote_port: 45017
tun_name: mps0
tun_cidr: 10.200.17.254/24, fd00:17::fe/64
tls_cert_file: /etc/mpquic/tls/mpquic-server.crt
tls_key_file: /etc/mpquic/tls/mpquic-server.key
tls_ca_file: /etc/mpquic/tls/ca.crt
"""

CLIENT_YAML = """role: client
tun_name: mpc0
tls_ca_file: /etc/mpquic/tls/ca.crt
tls_cert_file: /etc/mpquic/tls/site1.crt
tls_key_file: /etc/mpquic/tls/site1.key
tls_server_name: mpquic-server
multipath_policy: failover
multipath_paths:
- {name: wan1, bind_ip: 127.0.0.1, remote_addr: 127.0.0.1, remote_port: 45017, priority: 1}
"""


def test_systemctl_starts_reloads_and_stops_instances_in_a_systemd_container():
    """The acceptance's `systemctl start mpquic@NAME` after `dpkg -i`, where systemd is PID 1: a
    minimal Debian 12 (debootstrap) booted by systemd-nspawn with its own network namespace and
    /dev/net/tun. A server and a client instance over the container's loopback: started (active,
    the client's path up with both tunnel addresses), `systemctl reload` after adding a path
    (applied, exit 0) and after a change that needs a restart (refused: reload fails, the
    instance runs on, status says why), stopped (inactive, control sockets gone)."""
    for tool in ("debootstrap", "systemd-nspawn"):
        assert shutil.which(tool), f"{tool} missing: scripts/install-deps.sh --tests installs it"
    deb = build_package()
    root = tempfile.mkdtemp(prefix=f"mpq-nspawn-{os.getpid()}-", dir="/var/tmp")
    machine = f"mpq{os.getpid()}"
    boot = None
    try:
        t0 = time.monotonic()
        # No D-Bus: systemctl as root talks to systemd directly, and dbus.service never finished
        # starting in this container (the boot then stays "starting").
        r = sh(["debootstrap", "--variant=minbase", "--include=systemd,systemd-sysv,iproute2",
                "bookworm", root, "http://deb.debian.org/debian"], timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        made = time.monotonic() - t0
        shutil.copy(deb, os.path.join(root, "root", "mpquic.deb"))
        r = sh(["chroot", root, "dpkg", "-i", "/root/mpquic.deb"])
        assert r.returncode == 0, r.stdout + r.stderr
        for cmd in ("mpquic pki init --dir /etc/mpquic/tls",
                    "mpquic pki server --dir /etc/mpquic/tls --name mpquic-server --san 127.0.0.1",
                    "mpquic pki client --dir /etc/mpquic/tls --name site1"):
            r = sh(["chroot", root] + cmd.split())
            assert r.returncode == 0, r.stdout + r.stderr
        instances = os.path.join(root, "etc", "mpquic", "instances")
        with open(os.path.join(instances, "srv.yaml"), "w") as f:
            f.write(SERVER_YAML)
        cli = os.path.join(instances, "cli.yaml")
        with open(cli, "w") as f:
            f.write(CLIENT_YAML)
        with open(os.path.join(root, "etc", "hostname"), "w") as f:
            f.write(machine + "\n")

        # --register=no --keep-unit: no machined (no systemd on this host) to register with.
        boot = subprocess.Popen(["systemd-nspawn", "-D", root, "-b", "-M", machine, "--register=no",
                                 "--keep-unit", "--private-network", "--bind=/dev/net/tun"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        init, st = None, ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            kids = sh(["pgrep", "-P", str(boot.pid)]).stdout.split()
            if kids:
                init = kids[0]
                r = sh(["nsenter", "-t", init, "-a", "systemctl", "is-system-running"])
                st = (r.stdout + r.stderr).strip()
                if st in ("running", "degraded"):
                    break
            assert boot.poll() is None, "systemd-nspawn exited"
            time.sleep(0.5)
        else:
            raise AssertionError(f"the container's systemd did not come up within 60 s: init {init}, state {st!r}")

        def inside(cmd, check=True):
            r = sh(["nsenter", "-t", init, "-a", "sh", "-c", cmd], timeout=60)
            assert r.returncode == 0 or not check, (cmd, r.stdout, r.stderr)
            return r

        inside("systemctl start mpquic@srv mpquic@cli")

        def client_status(want, timeout=15):
            t = time.monotonic()
            while True:
                r = inside("mpquic status --socket /run/mpquic/mpc0.sock", check=False)
                if r.returncode == 0 and all(w in r.stdout for w in want):
                    return r.stdout
                assert time.monotonic() - t < timeout, (want, r.stdout, r.stderr,
                                                        inside("journalctl -u 'mpquic@*' --no-pager", check=False).stdout[-3000:])
                time.sleep(0.2)

        assert inside("systemctl is-active mpquic@srv mpquic@cli").stdout.split() == ["active", "active"]
        table = client_status(["wan1       up", "10.200.17.1/24 fd00:17::1/64"])

        with open(cli, "a") as f:
            f.write("- {name: wan2, bind_ip: 127.0.0.1, remote_addr: 127.0.0.1, remote_port: 45017, priority: 2}\n")
        inside("systemctl reload mpquic@cli")
        client_status(["applied: paths: added wan2", "wan2       up"])

        with open(cli) as f:
            text = f.read()
        with open(cli, "w") as f:
            f.write(text.replace("multipath_policy: failover", "multipath_policy: wlb"))
        refused = inside("systemctl reload mpquic@cli", check=False)
        assert refused.returncode != 0, refused.stdout
        client_status(["REFUSED", "multipath_policy"])
        assert inside("systemctl is-active mpquic@cli").stdout.strip() == "active"

        inside("systemctl stop mpquic@cli mpquic@srv")
        assert inside("systemctl is-active mpquic@srv mpquic@cli", check=False).stdout.split() == ["inactive", "inactive"]
        assert inside("ls /run/mpquic").stdout.strip() == ""
        report(f"systemd container (debootstrap {made:.0f} s): dpkg -i, systemctl start mpquic@srv mpquic@cli "
               f"(active, client path up with both addresses), reload applied (wan2 added) and refused "
               f"(wlb: reload failed, instance still active), stop (inactive, sockets gone)\n{table}")
    finally:
        if boot is not None and boot.poll() is None:
            # systemd-nspawn powers the container off on SIGTERM.
            boot.terminate()
            try:
                boot.wait(timeout=20)
            except subprocess.TimeoutExpired:
                boot.kill()
                boot.wait()
        shutil.rmtree(root, ignore_errors=True)
