//! Starting the systems under test in a lab: mpquic from the configurations `mpquic_conf` writes,
//! or another VPN from its command file (bench/vpns/); then the same routing for both, so the LAN
//! host reaches the internet host through the tunnel.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::mpquic_conf::{self, mpquic_bin};
use crate::scenario::{MpquicOpts, NsCmd, VpnDef};
use crate::topo::{self, LabState};

/// Processes this run started; SIGTERM on drop.
#[derive(Default)]
pub(crate) struct Procs(pub(crate) Vec<Child>);
impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // SAFETY: signalling a child we started.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// How long a daemon's `ready` check may keep failing.
const DAEMON_READY_TIMEOUT: Duration = Duration::from_secs(10);

/// `ip netns exec NS ARGS...`.
pub(crate) fn ns_cmd(ns: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    c
}

/// The system's processes, by name (`mpquic server`, `client: wireguard-go`...), for sampling.
pub(crate) type Named = Vec<(String, u32)>;

/// PKI and configs (`mpquic_conf`), server and client 1 started; waits until the tunnel is up.
pub(crate) fn start_mpquic(
    m: &MpquicOpts,
    lab: &LabState,
    dir: &Path,
    procs: &mut Procs,
) -> Result<Named> {
    let bin = mpquic_bin();
    let files = mpquic_conf::write(lab, m, dir)?;
    let client = files
        .clients
        .first()
        .ok_or_else(|| anyhow!("the lab has no client"))?;
    let mut pids = Vec::new();
    for (who, inst) in [("server", &files.server), ("client", client)] {
        let log = std::fs::File::create(dir.join(format!("{who}.log")))?;
        let child = ns_cmd(&inst.ns, &[])
            .arg(&bin)
            .arg("--config")
            .arg(&inst.config)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        pids.push((format!("mpquic {who}"), child.id()));
        procs.0.push(child);
        if who == "server" {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    let t0 = Instant::now();
    loop {
        let o = Command::new(&bin)
            .args(["status", "--json", "--socket"])
            .arg(&client.socket)
            .output()?;
        let status = o.status.success().then(|| {
            serde_json::from_slice::<mpquic_status::StatusReport>(&o.stdout)
                .with_context(|| format!("`mpquic status --json` of {}", client.name))
        });
        if status.transpose()?.is_some_and(|s| s.first_tunnel_up()) {
            break;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let log = std::fs::read_to_string(dir.join("client.log")).unwrap_or_default();
            bail!("tunnel not up within 20 s; client log:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(pids)
}

/// Make client `c`'s LAN host reach the internet host through the client's tunnel interface: a
/// route to the internet subnet over the tunnel, the LAN masqueraded behind the client's tunnel
/// address (table `labnat`; not with `masquerade: false`, for a routed site LAN, whose way back
/// is the server's route), and the internet host's way back to the tunnel subnet via the
/// server. The same for every VPN; running it again changes nothing.
pub fn route_lan_through(
    lab: &LabState,
    c: usize,
    tun_if: &str,
    tunnel_net: &str,
    masquerade: bool,
) -> Result<()> {
    let (inet_net, gw) = (topo::INTERNET_NET, topo::INTERNET_GW);
    let ns = lab.client(c)?.client;
    topo::ns_run(&ns, &format!("ip route replace {inet_net} dev {tun_if}"))?;
    if masquerade {
        topo::ns_run(
            &ns,
            &format!("nft list table ip labnat >/dev/null 2>&1 || nft -f - <<'EOF'\nadd table ip labnat\nadd chain ip labnat post {{ type nat hook postrouting priority 100 ; }}\nadd rule ip labnat post oifname {tun_if} masquerade\nEOF"),
        )?;
    }
    topo::ns_run(
        &lab.namespaces.internet,
        &format!("ip route replace {tunnel_net} via {gw}"),
    )?;
    Ok(())
}

/// Kernel MPTCP over every path of client 1, with no VPN (the `mptcp` system: the reference for
/// one flow over several links, with the kernel's own scheduler): the server announces its
/// address on paths 2.. (`signal`), the client opens a subflow from its own address on each
/// (`subflow`); path 1 carries the first subflow. The endpoints go with the namespaces.
pub(crate) fn mptcp_endpoints(lab: &LabState) -> Result<()> {
    let (client, server) = (lab.client(1)?.client, lab.namespaces.server.clone());
    for ns in [&client, &server] {
        topo::ns_run(ns, "sysctl -qw net.mptcp.enabled=1")?;
        topo::ns_run(ns, "ip mptcp limits set subflow 8 add_addr_accepted 8")?;
    }
    let bare = |a: &str| a.split('/').next().unwrap_or(a).to_string();
    for p in lab.client_paths(1).skip(1) {
        topo::ns_run(
            &server,
            &format!(
                "ip mptcp endpoint add {} dev {} signal",
                bare(&p.server_addr),
                p.server_if
            ),
        )?;
        topo::ns_run(
            &client,
            &format!(
                "ip mptcp endpoint add {} dev {} subflow",
                bare(&p.client_addr),
                p.client_if
            ),
        )?;
    }
    Ok(())
}

/// The LAN host reaches the internet host (only possible through a tunnel: the client router has
/// no other route to it), within 20 s.
pub(crate) fn wait_reachable(lab: &LabState) -> Result<()> {
    let t0 = Instant::now();
    let ping = format!("ping -n -c 1 -W 1 {}", lab.hosts.internet_addr);
    while topo::ns_run(&lab.namespaces.lan, &ping).is_err() {
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("the internet host is not reachable from the LAN host through the tunnel within 20 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// A daemon's name in the report: its namespace and program (`client: wireguard-go`), and the
/// configuration file's name when it has one (`client: mpquic bulk.yaml`), which tells several
/// instances of one program apart.
fn daemon_name(c: &NsCmd, vars: &[(String, String)]) -> String {
    let cmd = fill(&c.cmd, vars).unwrap_or_else(|_| c.cmd.clone());
    let words: Vec<&str> = cmd.split_whitespace().collect();
    let base = |w: &str| w.rsplit('/').next().unwrap_or(w).to_string();
    let prog = words.first().map_or("daemon".into(), |w| base(w));
    match words.iter().position(|w| *w == "--config" || *w == "-c") {
        Some(i) if i + 1 < words.len() => format!("{}: {prog} {}", c.ns, base(words[i + 1])),
        _ => format!("{}: {prog}", c.ns),
    }
}

/// The values a VPN definition's `{{name}}` placeholders may use.
pub(crate) fn vpn_vars(lab: &LabState, def: &VpnDef, dir: &Path, id: u32) -> Vec<(String, String)> {
    let mut v = vec![
        ("mpquic".to_string(), mpquic_bin().display().to_string()),
        ("vpn_dir".into(), def.dir.display().to_string()),
        ("id".into(), id.to_string()),
        ("dir".into(), dir.display().to_string()),
        ("server_addr".into(), lab.hosts.server_service_addr.clone()),
        ("lan_addr".into(), lab.hosts.lan_addr.clone()),
        ("internet_addr".into(), lab.hosts.internet_addr.clone()),
        ("internet_net".into(), topo::INTERNET_NET.into()),
    ];
    for p in lab.client_paths(1) {
        let k = p.client_path;
        v.push((format!("path{k}_if"), p.client_if.clone()));
        v.push((format!("path{k}_addr"), p.client_addr.clone()));
        v.push((format!("path{k}_server_addr"), p.server_addr.clone()));
    }
    v
}

/// `template` with every `{{name}}` replaced; an unknown name is an error that lists the known.
pub(crate) fn fill(template: &str, vars: &[(String, String)]) -> Result<String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(i) = rest.find("{{") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| anyhow!("unclosed `{{{{` in `{template}`"))?;
        let key = after[..end].trim();
        let val = vars.iter().find(|(k, _)| k == key).ok_or_else(|| {
            let known: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
            anyhow!(
                "unknown placeholder `{{{{{key}}}}}` (known: {})",
                known.join(", ")
            )
        })?;
        out.push_str(&val.1);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// A VPN from its definition: setup commands, daemons (started in their namespaces, logs in
/// DIR/daemon-N.log), configure commands. Each command is its own named step.
pub(crate) fn start_vpn(
    def: &VpnDef,
    lab: &LabState,
    dir: &Path,
    id: u32,
    procs: &mut Procs,
) -> Result<Named> {
    let vars = vpn_vars(lab, def, dir, id);
    let ns_of = |c: &NsCmd| match c.ns.as_str() {
        "lan" => lab.namespaces.lan.clone(),
        "client" => lab.namespaces.client.clone(),
        "server" => lab.namespaces.server.clone(),
        _ => lab.namespaces.internet.clone(),
    };
    let one_off = |what: &str, cmds: &[NsCmd]| -> Result<()> {
        for (i, c) in cmds.iter().enumerate() {
            step(&format!("{what}[{i}] ({}: {})", c.ns, c.cmd), || {
                let o = ns_cmd(&ns_of(c), &["sh", "-c", &fill(&c.cmd, &vars)?])
                    .envs(&c.env)
                    .output()?;
                if !o.status.success() {
                    bail!(
                        "exit {}: {}",
                        o.status,
                        String::from_utf8_lossy(&o.stderr).trim()
                    );
                }
                Ok(())
            })?;
        }
        Ok(())
    };
    one_off("setup", &def.setup)?;
    let mut pids = Vec::new();
    for (i, c) in def.daemons.iter().enumerate() {
        let child = step(&format!("daemons[{i}] ({}: {})", c.ns, c.cmd), || {
            let log = std::fs::File::create(dir.join(format!("daemon-{i}.log")))?;
            // `exec` so that the PID sampled for CPU and RSS is the daemon's own.
            let cmd = format!("exec {}", fill(&c.cmd, &vars)?);
            Ok(ns_cmd(&ns_of(c), &["sh", "-c", &cmd])
                .envs(&c.env)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?)
        })?;
        pids.push((daemon_name(c, &vars), child.id()));
        procs.0.push(child);
    }
    // Daemons that create their interfaces need a moment; one that exits at once is an error.
    std::thread::sleep(Duration::from_millis(500));
    for (i, child) in procs.0.iter_mut().rev().take(def.daemons.len()).enumerate() {
        if let Ok(Some(status)) = child.try_wait() {
            let k = def.daemons.len() - 1 - i;
            let log =
                std::fs::read_to_string(dir.join(format!("daemon-{k}.log"))).unwrap_or_default();
            bail!(
                "step `daemons[{k}]` failed: exited at once ({status}): {}",
                log.trim()
            );
        }
    }
    for (i, c) in def.daemons.iter().enumerate() {
        let Some(ready) = &c.ready else { continue };
        let ready = fill(ready, &vars)?;
        let t0 = std::time::Instant::now();
        while !ns_cmd(&ns_of(c), &["sh", "-c", &ready])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            if t0.elapsed() > DAEMON_READY_TIMEOUT {
                bail!("step `daemons[{i}]` failed: not ready within {DAEMON_READY_TIMEOUT:?} (`{ready}` kept failing)");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    one_off("configure", &def.configure)?;
    Ok(pids)
}

/// Run one named step of a system's run; its error says which step failed.
pub(crate) fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    f().with_context(|| format!("step `{name}` failed"))
}

#[cfg(test)]
mod tests {
    use super::fill;

    #[test]
    fn placeholders_are_filled_and_unknown_ones_refused() {
        let vars = vec![("id".to_string(), "42".to_string())];
        assert_eq!(
            fill("wg set wgc{{id}} x {{ id }}; nft { type nat ; }", &vars).unwrap(),
            "wg set wgc42 x 42; nft { type nat ; }"
        );
        let e = fill("{{idd}}", &vars).unwrap_err().to_string();
        assert!(
            e.contains("unknown placeholder `{{idd}}`") && e.contains("known: id"),
            "{e}"
        );
        assert!(fill("{{id", &vars).is_err());
    }
}
