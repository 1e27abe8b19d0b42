//! Lab topologies: network namespaces for a LAN host, the client router, the emulator, the server
//! (VPS) and an internet host; one WAN path per `--path SPEC`, each crossing the emulator.
//!
//! ```text
//!   lan --- client =wan1= [c1 emulator s1] =wan1= server --- internet
//!                  =wan2= [c2          s2] =wan2=
//!   lan2 -- cli2   =wan1= [c3          s3] =wan3=      (--clients 2)
//! ```
//!
//! The emulator bridges c<i> and s<i> at layer 2, so a client's WAN interface (10.10.i.2) and
//! server wan<i> (10.10.i.1) share a subnet; `i` numbers the emulator's paths over all clients,
//! while each client names its own WAN interfaces wan1, wan2... Every path also reaches the
//! server's service address 10.99.0.1 (on its loopback) through its own interface, as on a real
//! multi-WAN site. State lives in /run/mpquic-lab/NAME/ (state.json, emulator pid, control
//! socket, log).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::emu::LinkSpec;

pub const STATE_ROOT: &str = "/run/mpquic-lab";
/// The path spec for a plain veth link that bypasses the emulator.
pub const DIRECT: &str = "direct";
pub const SERVER_SERVICE_ADDR: &str = "10.99.0.1";
pub const LAN_ADDR: &str = "192.168.10.2";
pub const INTERNET_ADDR: &str = "172.16.50.2";
/// The internet host's subnet, and the server's address on it.
pub const INTERNET_NET: &str = "172.16.50.0/24";
pub const INTERNET_GW: &str = "172.16.50.1";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Namespaces {
    pub lan: String,
    pub client: String,
    pub emulator: String,
    pub server: String,
    pub internet: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PathInfo {
    /// The emulator's path number (1..), over all clients.
    pub index: usize,
    /// The client (1..) this path belongs to, and its number among that client's paths (1..).
    pub client: usize,
    pub client_path: usize,
    pub client_if: String,
    pub client_addr: String,
    pub server_if: String,
    pub server_addr: String,
    /// The spec as given (`key=value,...`, or `direct`); `spec` is its parsed form.
    pub spec_text: String,
    pub spec: serde_json::Value,
    /// False for a `direct` path: a plain veth pair between client and server, not crossing the
    /// emulator (nothing to `set` on it).
    pub emulated: bool,
}

/// One site: its LAN host and client router. Client 1's are also `namespaces.lan`/`.client`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClientHosts {
    pub lan: String,
    pub client: String,
    pub lan_addr: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hosts {
    pub lan_addr: String,
    pub internet_addr: String,
    pub server_service_addr: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabState {
    pub name: String,
    pub namespaces: Namespaces,
    /// Every emulated path, client 1's first.
    pub paths: Vec<PathInfo>,
    pub hosts: Hosts,
    /// Every client (site), client 1 first.
    pub clients: Vec<ClientHosts>,
    pub emulator_pid: Option<u32>,
    /// The process the lab belongs to (a scenario run); the lab is stale once it is gone.
    /// `None` for labs made with `mpquic-lab up`, which live until `down`.
    #[serde(default)]
    pub owner_pid: Option<u32>,
    pub control_socket: String,
    pub log: String,
}

impl LabState {
    /// Client `c`'s (1..) paths, in order.
    pub fn client_paths(&self, c: usize) -> impl Iterator<Item = &PathInfo> {
        self.paths.iter().filter(move |p| p.client == c)
    }

    /// Client `c`'s hosts (1..).
    pub fn client(&self, c: usize) -> Result<ClientHosts> {
        self.clients.get(c.wrapping_sub(1)).cloned().ok_or_else(|| {
            anyhow!(
                "no client {c} in lab `{}` (clients 1..{})",
                self.name,
                self.clients.len()
            )
        })
    }

    /// Client `c`'s path `p` (both 1..).
    pub fn path(&self, c: usize, p: usize) -> Result<&PathInfo> {
        self.paths
            .iter()
            .find(|x| x.client == c && x.client_path == p)
            .ok_or_else(|| anyhow!("lab `{}` has no path {p} on client {c}", self.name))
    }

    /// The emulator's path number of client `c`'s path `p` (both 1..).
    pub fn emulator_path(&self, c: usize, p: usize) -> Result<usize> {
        let info = self.path(c, p)?;
        if !info.emulated {
            bail!("path {p} of client {c} is `{DIRECT}`: it does not cross the emulator");
        }
        Ok(info.index)
    }
}

pub fn state_dir(name: &str) -> PathBuf {
    PathBuf::from(STATE_ROOT).join(name)
}

pub fn namespaces(name: &str) -> Namespaces {
    let ns = |r: &str| format!("mql-{name}-{r}");
    Namespaces {
        lan: ns("lan"),
        client: ns("cli"),
        emulator: ns("emu"),
        server: ns("srv"),
        internet: ns("inet"),
    }
}

pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 24
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with('_');
    if !ok {
        bail!("lab name `{name}`: use 1-24 letters, digits or '_' (it becomes part of namespace names)");
    }
    Ok(())
}

/// Run a command, failing with its output.
pub fn run(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("cannot run {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn ns_run(ns: &str, cmd: &str) -> Result<String> {
    run(&["ip", "netns", "exec", ns, "sh", "-c", cmd])
}

fn veth(ns_a: &str, if_a: &str, ns_b: &str, if_b: &str) -> Result<()> {
    ns_run(
        ns_a,
        &format!("ip link add {if_a} type veth peer name {if_b} netns {ns_b}"),
    )?;
    ns_run(ns_a, &format!("ip link set {if_a} up"))?;
    ns_run(ns_b, &format!("ip link set {if_b} up"))?;
    Ok(())
}

/// Segmentation offloads would hand the emulator 64 KB super-frames, and checksum offload frames
/// whose TCP/UDP checksum is not filled in (it would arrive invalid after the userspace bridge):
/// every frame must be one complete packet.
fn no_offloads(ns: &str, dev: &str) -> Result<()> {
    ns_run(
        ns,
        &format!("ethtool -K {dev} tx off rx off tso off gso off gro off >/dev/null 2>&1"),
    )
    .with_context(|| format!("disabling offloads on {dev} (is ethtool installed?)"))?;
    ns_run(
        ns,
        &format!("sysctl -qw net.ipv6.conf.{dev}.disable_ipv6=1 || true"),
    )?;
    Ok(())
}

/// Clients one lab holds at most.
pub const MAX_CLIENTS: usize = 64;

/// Client `c`'s (1..) namespaces: client 1 keeps the plain names.
fn client_namespaces(name: &str, c: usize) -> (String, String) {
    let sfx = if c == 1 { String::new() } else { c.to_string() };
    (
        format!("mql-{name}-lan{sfx}"),
        format!("mql-{name}-cli{sfx}"),
    )
}

/// Build the namespaces and links (every client gets every spec as its paths); the emulator is
/// started by the caller.
pub fn build(name: &str, specs: &[(String, Option<LinkSpec>)], clients: usize) -> Result<LabState> {
    // Client c's LAN is 192.168.(9 + c).0/24 and its tunnel address 10.200.17.c: 64 leaves
    // room in both (the churn benchmark's many-clients run starts 64 at once).
    if clients == 0 || clients > MAX_CLIENTS {
        bail!("--clients {clients}: use 1 to {MAX_CLIENTS}");
    }
    if specs.is_empty() || specs.len() * clients > 250 {
        bail!(
            "{} paths x {clients} clients: use 1 to 250 emulated paths",
            specs.len()
        );
    }
    let ns = namespaces(name);
    for n in [&ns.emulator, &ns.server, &ns.internet] {
        add_ns(n)?;
    }
    ns_run(
        &ns.server,
        &format!("sysctl -qw net.ipv4.ip_forward=1 && ip addr add {SERVER_SERVICE_ADDR}/32 dev lo"),
    )?;
    veth(&ns.server, "inet", &ns.internet, "eth0")?;
    ns_run(
        &ns.server,
        &format!("ip addr add {INTERNET_GW}/24 dev inet"),
    )?;
    ns_run(
        &ns.internet,
        &format!(
            "ip addr add {INTERNET_ADDR}/24 dev eth0 && ip route add default via {INTERNET_GW}"
        ),
    )?;
    let mut paths = Vec::new();
    let mut hosts = Vec::new();
    for c in 1..=clients {
        let (lan, cli) = client_namespaces(name, c);
        add_ns(&lan)?;
        add_ns(&cli)?;
        ns_run(&cli, "sysctl -qw net.ipv4.ip_forward=1")?;
        veth(&cli, "lan", &lan, "eth0")?;
        let net = 9 + c;
        let lan_addr = format!("192.168.{net}.2");
        ns_run(&cli, &format!("ip addr add 192.168.{net}.1/24 dev lan"))?;
        ns_run(
            &lan,
            &format!(
                "ip addr add {lan_addr}/24 dev eth0 && ip route add default via 192.168.{net}.1"
            ),
        )?;
        for (j, (text, spec)) in specs.iter().enumerate() {
            let (p, k) = (j + 1, paths.len() + 1);
            let (cif, eci, esi, sif) = (
                format!("wan{p}"),
                format!("c{k}"),
                format!("s{k}"),
                format!("wan{k}"),
            );
            if spec.is_some() {
                veth(&cli, &cif, &ns.emulator, &eci)?;
                veth(&ns.emulator, &esi, &ns.server, &sif)?;
                for (n, d) in [
                    (&cli, &cif),
                    (&ns.emulator, &eci),
                    (&ns.emulator, &esi),
                    (&ns.server, &sif),
                ] {
                    no_offloads(n, d)?;
                }
            } else {
                // A plain veth pair (offloads on): the fastest link the kernel has, for
                // throughput benchmarks where an emulator would cost as much as the tunnel.
                veth(&cli, &cif, &ns.server, &sif)?;
            }
            let (caddr, saddr) = (format!("10.10.{k}.2"), format!("10.10.{k}.1"));
            ns_run(&cli, &format!("ip addr add {caddr}/24 dev {cif}"))?;
            ns_run(&ns.server, &format!("ip addr add {saddr}/24 dev {sif}"))?;
            let info = PathInfo {
                index: k,
                client: c,
                client_path: p,
                client_if: cif,
                client_addr: caddr,
                server_if: sif,
                server_addr: saddr,
                spec_text: text.clone(),
                spec: serde_json::to_value(spec)?,
                emulated: spec.is_some(),
            };
            route_to_server(&cli, &info)?;
            paths.push(info);
        }
        hosts.push(ClientHosts {
            lan,
            client: cli,
            lan_addr,
        });
    }
    let dir = state_dir(name);
    Ok(LabState {
        name: name.to_string(),
        namespaces: ns,
        paths,
        hosts: Hosts {
            lan_addr: LAN_ADDR.into(),
            internet_addr: INTERNET_ADDR.into(),
            server_service_addr: SERVER_SERVICE_ADDR.into(),
        },
        clients: hosts,
        emulator_pid: None,
        owner_pid: None,
        control_socket: dir.join("emu.sock").display().to_string(),
        log: dir.join("emu.log").display().to_string(),
    })
}

fn add_ns(n: &str) -> Result<()> {
    run(&["ip", "netns", "add", n]).with_context(|| format!("creating namespace {n}"))?;
    ns_run(n, "ip link set lo up")?;
    Ok(())
}

/// The client's route to the server's service address over one WAN interface (metric by path
/// number: the first path is the default). IPv4 removes a route when its device goes down, so
/// whoever brings a WAN interface back up puts this back, as a site router would.
pub fn route_to_server(client_ns: &str, p: &PathInfo) -> Result<()> {
    ns_run(
        client_ns,
        &format!(
            "ip route replace {SERVER_SERVICE_ADDR}/32 via {} dev {} metric {}",
            p.server_addr,
            p.client_if,
            10 * p.client_path
        ),
    )?;
    Ok(())
}

/// Take client `c`'s WAN interface of path `p` down or up (a cable pulled, a modem rebooted:
/// unlike an emulated outage, the client sees the interface go).
pub fn set_link(st: &LabState, c: usize, p: usize, up: bool) -> Result<()> {
    let ns = st.client(c)?.client;
    let info = st.path(c, p)?;
    ns_run(
        &ns,
        &format!(
            "ip link set {} {}",
            info.client_if,
            if up { "up" } else { "down" }
        ),
    )?;
    if up {
        route_to_server(&ns, info)?;
    }
    Ok(())
}

pub fn load(name: &str) -> Result<LabState> {
    let p = state_dir(name).join("state.json");
    let text = std::fs::read_to_string(&p)
        .map_err(|_| anyhow!("no lab named `{name}` (no {})", p.display()))?;
    Ok(serde_json::from_str(&text)?)
}

pub fn save(state: &LabState) -> Result<()> {
    let dir = state_dir(&state.name);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("state.json"), serde_json::to_string_pretty(state)?)?;
    Ok(())
}

/// Running (not exited, not a zombie waiting to be reaped: a killed emulator whose parent died
/// stays a zombie until PID 1 reaps it, and `kill(pid, 0)` would still call it alive).
fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Remove everything lab `name` made: emulator, processes in its namespaces, namespaces, state.
/// Works from the names alone, so it also cleans a lab whose state file is missing.
pub fn teardown(name: &str) -> Vec<String> {
    let mut removed = Vec::new();
    if let Ok(st) = load(name) {
        if let Some(pid) = st.emulator_pid.filter(|p| pid_alive(*p)) {
            // SAFETY: signalling a process this lab started.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
    }
    for n in &lab_namespaces(name) {
        if let Ok(pids) = run(&["ip", "netns", "pids", n]) {
            for pid in pids
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                // SAFETY: processes inside a namespace this lab created.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            if run(&["ip", "netns", "del", n]).is_ok() {
                removed.push(n.clone());
            }
        }
    }
    let _ = std::fs::remove_dir_all(state_dir(name));
    removed
}

/// Every namespace lab `name` has (any number of clients), from the system's list.
fn lab_namespaces(name: &str) -> Vec<String> {
    let prefix = format!("mql-{name}-");
    let list = run(&["ip", "netns", "list"]).unwrap_or_default();
    list.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| {
            n.strip_prefix(&prefix)
                .is_some_and(|role| !role.is_empty() && !role.contains('-'))
        })
        .map(str::to_string)
        .collect()
}

/// Labs left by crashed runs: a state directory whose emulator or owner is gone, or namespaces
/// of a lab with no state directory.
pub fn stale() -> Vec<String> {
    let mut names = std::collections::BTreeSet::new();
    if let Ok(dir) = std::fs::read_dir(STATE_ROOT) {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let alive = load(&name).is_ok_and(|s| {
                s.emulator_pid.is_some_and(pid_alive) && s.owner_pid.is_none_or(pid_alive)
            });
            if !alive {
                names.insert(name);
            }
        }
    }
    if let Ok(list) = run(&["ip", "netns", "list"]) {
        for line in list.lines() {
            let n = line.split_whitespace().next().unwrap_or("");
            if let Some(rest) = n.strip_prefix("mql-") {
                if let Some((name, _role)) = rest.rsplit_once('-') {
                    if !state_dir(name).exists() {
                        names.insert(name.to_string());
                    }
                }
            }
        }
    }
    names.into_iter().collect()
}

/// Create lab `name` with one path per spec and start its emulator (this executable's `emu`
/// command inside the emulator namespace). On any failure everything made so far is removed.
pub fn up(
    name: &str,
    paths: &[String],
    clients: usize,
    seed: u64,
    owner_pid: Option<u32>,
) -> Result<LabState> {
    check_name(name)?;
    if state_dir(name).exists() {
        bail!("a lab named `{name}` exists; `mpquic-lab down {name}` first");
    }
    let specs = paths
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let spec = if p == DIRECT {
                Ok(None)
            } else {
                LinkSpec::parse_both(p).map(|(up, _)| Some(up))
            };
            spec.map(|s| (p.clone(), s))
                .map_err(|e| anyhow!("path {} ({p}): {e}", i + 1))
        })
        .collect::<Result<Vec<_>>>()?;
    let result = (|| {
        let mut st = build(name, &specs, clients).context("building the topology")?;
        st.owner_pid = owner_pid;
        save(&st)?;
        let log = std::fs::File::create(&st.log)?;
        let child = Command::new("ip")
            .args(["netns", "exec", &st.namespaces.emulator])
            .arg(std::env::current_exe()?)
            .args(["emu", name, "--seed", &seed.to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting the emulator")?;
        st.emulator_pid = Some(child.id());
        save(&st)?;
        let t0 = std::time::Instant::now();
        while std::os::unix::net::UnixStream::connect(&st.control_socket).is_err() {
            if t0.elapsed() > std::time::Duration::from_secs(5) {
                let log = std::fs::read_to_string(&st.log).unwrap_or_default();
                bail!("the emulator did not start: {log}");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        anyhow::Ok(st)
    })();
    result.map_err(|e| {
        teardown(name);
        e.context(format!(
            "lab `{name}` not created (everything it made was removed)"
        ))
    })
}

/// One request to a lab's emulator over its control socket: `stats`, or
/// `set PATH up|down|both key=value,...`.
pub fn control(name: &str, line: &str) -> Result<String> {
    use std::io::{BufRead, BufReader, Write};
    let st = load(name)?;
    let mut s = std::os::unix::net::UnixStream::connect(&st.control_socket)
        .with_context(|| format!("cannot reach the emulator of lab `{name}`"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    writeln!(s, "{line}")?;
    let mut resp = String::new();
    BufReader::new(s).read_line(&mut resp)?;
    let resp = resp.trim_end().to_string();
    match resp.strip_prefix("error: ") {
        Some(e) => bail!("{e}"),
        None => Ok(resp),
    }
}
