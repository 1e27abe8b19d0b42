//! Scenario files (bench/scenarios/*.yaml): the links, the systems under test, the traffic and the
//! timed changes of one experiment. Unknown keys are errors, reported with the line.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use serde::Deserialize;

use crate::emu::spec;
use crate::emu::{Dir, LinkSpec};

/// Features mpquic does not have yet; a scenario that requires one reports "unsupported" for
/// mpquic and still runs its other systems.
pub const NOT_YET: &[&str] = &["ipv6"];

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// One link spec per WAN path (both directions).
    pub paths: Vec<String>,
    /// `direct` (no VPN, path 1 only), `mpquic`, and any VPN named in `vpns`.
    #[serde(default = "default_systems")]
    pub systems: Vec<String>,
    /// Other VPNs as systems under test: name -> definition file (relative to the scenario),
    /// e.g. `wireguard-go: ../vpns/wireguard-go.yaml`.
    #[serde(default)]
    pub vpns: BTreeMap<String, String>,
    /// The loaded `vpns` definitions.
    #[serde(skip)]
    pub vpn_defs: BTreeMap<String, VpnDef>,
    #[serde(default)]
    pub mpquic: MpquicOpts,
    /// Several mpquic configurations side by side: each runs as system `mpquic-LABEL`, with its
    /// fields overriding `mpquic`.
    #[serde(default)]
    pub mpquic_variants: Vec<Variant>,
    pub traffic: Vec<Traffic>,
    #[serde(default)]
    pub schedule: Vec<Change>,
    /// Sampling interval of the per-path counters, CPU and RSS.
    #[serde(default = "default_sample")]
    pub sample: String,
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// How long each system runs before its traffic starts (e.g. `150s`; none by default),
    /// with a ping every 50 ms through it meanwhile: a site's tunnel has been up a while, with
    /// some traffic, when a call starts, and has learnt its links by then (mpquic recognises a
    /// Starlink link at its fourth to eighth reconfiguration with traffic).
    #[serde(default)]
    pub warmup: Option<String>,
}

fn default_systems() -> Vec<String> {
    vec!["direct".into(), "mpquic".into()]
}
fn default_sample() -> String {
    "500ms".into()
}
fn default_seed() -> u64 {
    1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpquicOpts {
    #[serde(default = "d_policy")]
    pub policy: String,
    /// `transport_mode` and `congestion_algorithm`; absent: not written, so mpquic's defaults.
    pub mode: Option<String>,
    pub congestion: Option<String>,
    pub priorities: Option<Vec<u32>>,
    pub weights: Option<Vec<u32>>,
    /// `pipes` per path (mpquic's default, 1, when absent).
    pub pipes: Option<Vec<u32>>,
    /// `transport` per path (`quic`, `stripe`); absent: not written (quic). With a stripe path
    /// the server gets `stripe_enabled: true`.
    #[serde(default)]
    pub transport: Option<Vec<String>>,
    /// Features this scenario needs (see `NOT_YET`).
    #[serde(default)]
    pub requires: Vec<String>,
    /// Top-level YAML added to the server's and every client's configuration as is
    /// (e.g. `"worker_threads: 2\n"`).
    #[serde(default)]
    pub extra_yaml: String,
    /// The clients' `fec` (off, auto, K/M); absent: not written (mpquic's default).
    #[serde(default)]
    pub fec: Option<String>,
    /// The clients' traffic classes, written as their `classes:` (docs/CONFIG.md); absent:
    /// none.
    #[serde(default)]
    pub classes: Option<serde_yaml_ng::Value>,
    /// YAML added to each path's entry, by path (e.g. `["rate_limit: 5", "role: backup"]`;
    /// several keys separated by `; `).
    #[serde(default)]
    pub path_yaml: Option<Vec<String>>,
    /// The MPTCP lane: the clients' TCP over kernel MPTCP (`tcp_lane: mptcp`), the server's
    /// `tcp_lane_listen` on the lane port.
    #[serde(default)]
    pub lane: Option<bool>,
    /// The paths (1-based) the client is configured with; absent: every path. The others stay
    /// in the lab, unused: mpquic over some of the links, in the same run and at the same time
    /// into it as the systems over all of them (what bonding compares with).
    #[serde(default)]
    pub paths: Option<Vec<usize>>,
}

impl Default for MpquicOpts {
    fn default() -> Self {
        MpquicOpts {
            policy: d_policy(),
            mode: None,
            congestion: None,
            priorities: None,
            weights: None,
            pipes: None,
            transport: None,
            requires: Vec::new(),
            extra_yaml: String::new(),
            fec: None,
            classes: None,
            path_yaml: None,
            lane: None,
            paths: None,
        }
    }
}
fn d_policy() -> String {
    "failover".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub label: String,
    pub policy: Option<String>,
    pub mode: Option<String>,
    pub congestion: Option<String>,
    pub fec: Option<String>,
    pub pipes: Option<Vec<u32>>,
    pub transport: Option<Vec<String>>,
    pub classes: Option<serde_yaml_ng::Value>,
    pub path_yaml: Option<Vec<String>>,
    pub lane: Option<bool>,
    pub paths: Option<Vec<usize>>,
    pub weights: Option<Vec<u32>>,
    #[serde(default)]
    pub requires: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub enum Kind {
    Iperf3,
    Ping,
    /// No traffic for `duration`: what the systems cost at rest (CPU per process in the window).
    Idle,
    /// A voice-like call both ways for `duration`: `pps` packets (default 50) of `length` bytes
    /// (default 200) a second each way, judged by loss and lateness beyond 150 ms one way
    /// (`voice.rs`).
    Voice,
    /// Web-like transfers for `duration`: objects of `length` bytes (default 100 000) fetched
    /// from the destination, `streams` at a time (default 1), each on a new TCP connection,
    /// judged by completion time (`web.rs`).
    Web,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    pub kind: Kind,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default = "d_zero")]
    pub start: String,
    pub duration: String,
    /// iperf3: tcp or udp.
    #[serde(default = "d_tcp")]
    pub protocol: String,
    /// iperf3 -P; web: objects fetched at a time.
    #[serde(default = "d_one")]
    pub streams: u32,
    #[serde(default)]
    pub reverse: bool,
    /// iperf3 -b (UDP rate, or a TCP cap), e.g. 100M.
    pub rate: Option<String>,
    /// UDP: a sweep instead of one `rate`: iperf3 at each rate in turn (rising), each for
    /// `duration`, up to the first that loses 1% or more; the result is the most delivered with
    /// less than 1% of what was sent lost.
    #[serde(default)]
    pub rates: Option<Vec<String>>,
    /// iperf3 -l (payload length); voice: each packet's UDP payload (default 200); web: each
    /// object's size in bytes (default 100 000).
    pub length: Option<u32>,
    /// voice: packets a second each way (default 50).
    pub pps: Option<f64>,
    /// ping interval.
    #[serde(default = "d_interval")]
    pub interval: String,
    /// Inner TCP congestion control (iperf3 -C), e.g. cubic; default: the kernel's (bbr here).
    pub tcp_congestion: Option<String>,
    /// iperf3: the inner TCP flows negotiate ECN (RFC 3168): the namespace of the host that
    /// connects asks for it (`net.ipv4.tcp_ecn=1`) while the item runs, and the other end
    /// accepts it (the kernel's default). Other TCP connections that host opens meanwhile ask
    /// for it too. Default: off, as Linux and Windows hosts have it.
    #[serde(default)]
    pub ecn: bool,
}
fn d_zero() -> String {
    "0s".into()
}
fn d_tcp() -> String {
    "tcp".into()
}
fn d_one() -> u32 {
    1
}
fn d_interval() -> String {
    "100ms".into()
}

/// Another VPN, driven by shell commands (see bench/vpns/). Every command runs with `sh -c` in
/// one of the lab's namespaces (`lan`, `client`, `server`, `internet`); `{{name}}` placeholders
/// are filled from the lab (see `runner::vpn_vars`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VpnDef {
    #[serde(default)]
    pub description: String,
    /// One-off commands before the daemons start (keys, configuration files), in order.
    #[serde(default)]
    pub setup: Vec<NsCmd>,
    /// The VPN's long-running processes: their CPU and RSS are sampled, SIGTERM at the end.
    pub daemons: Vec<NsCmd>,
    /// One-off commands once the daemons run (addresses, peers), in order.
    #[serde(default)]
    pub configure: Vec<NsCmd>,
    /// The client's tunnel interface and the tunnel's subnet: the runner routes the LAN host's
    /// traffic for the internet host through it, as it does for mpquic.
    pub tunnel: TunnelDef,
    /// The folder the definition was read from (`{{vpn_dir}}`: scripts beside it).
    #[serde(skip)]
    pub dir: std::path::PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NsCmd {
    pub ns: String,
    pub cmd: String,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Daemons: a command (same namespace) that succeeds once the daemon is ready for the
    /// `configure` steps, e.g. `test -S /var/run/wireguard/NAME.sock`; polled for up to 10 s.
    #[serde(default)]
    pub ready: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunnelDef {
    pub client_if: String,
    pub cidr: String,
}

impl VpnDef {
    pub fn load(path: &Path) -> Result<VpnDef> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let mut d: VpnDef = serde_yaml_ng::from_str(&text).map_err(|e| located(path, &e))?;
        d.dir = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
            .canonicalize()
            .unwrap_or_default();
        for c in d.setup.iter().chain(&d.daemons).chain(&d.configure) {
            if !matches!(c.ns.as_str(), "lan" | "client" | "server" | "internet") {
                bail!(
                    "{}: ns `{}`: lan, client, server or internet",
                    path.display(),
                    c.ns
                );
            }
        }
        if d.daemons.is_empty() {
            bail!("{}: `daemons` is empty", path.display());
        }
        Ok(d)
    }
}

fn located(path: &Path, e: &serde_yaml_ng::Error) -> anyhow::Error {
    let loc = e
        .location()
        .map(|l| format!(":{}:{}", l.line(), l.column()))
        .unwrap_or_default();
    anyhow!("{}{loc}: {e}", path.display())
}

/// A system under test.
#[derive(Debug, Clone)]
pub enum System {
    /// No VPN: client to server over this path (0-based; `direct` is path 1, `direct-N` path N).
    Direct(usize),
    /// No VPN: kernel MPTCP from client to server, a subflow on every path (`mptcp`; iperf3
    /// under `mptcpize`).
    Mptcp,
    Mpquic(MpquicOpts),
    Vpn(VpnDef),
}

/// A timed change of one path: once (`at`) or periodically (`every`, from `from` until `until`),
/// optionally undone after `revert_after` with `revert`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Change {
    pub at: Option<String>,
    pub every: Option<String>,
    pub from: Option<String>,
    pub until: Option<String>,
    pub path: usize,
    #[serde(default = "d_both")]
    pub dir: String,
    pub set: String,
    pub revert_after: Option<String>,
    pub revert: Option<String>,
}
fn d_both() -> String {
    "both".into()
}

/// A change expanded to absolute times (from the start of traffic).
#[derive(Debug, Clone, PartialEq)]
pub struct Timed {
    pub at: Duration,
    pub path: usize,
    pub dir: String,
    pub set: String,
}

/// A duration from a scenario (e.g. `15s`, `200ms`).
pub fn parse_duration(s: &str) -> Result<Duration> {
    spec::parse_duration(s).map_err(|e| anyhow!(e))
}

/// Written in a path's spec, the folder of recorded links (`traces_dir`).
pub const TRACES: &str = "{{traces}}";

impl Scenario {
    /// Where `{{traces}}` points for the scenario at `path`: `$MPQUIC_TRACES`, else
    /// `../shared/traces` beside the repository (the recordings are data from published
    /// measurements, kept outside it).
    pub fn traces_dir(path: &Path) -> std::path::PathBuf {
        match std::env::var_os("MPQUIC_TRACES") {
            Some(d) => d.into(),
            None => {
                let repo = path.parent().unwrap_or(Path::new(".")).join("../..");
                let dir = repo.join("../shared/traces");
                dir.canonicalize().unwrap_or(dir)
            }
        }
    }

    pub fn load(path: &Path) -> Result<Scenario> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let mut s: Scenario = serde_yaml_ng::from_str(&text).map_err(|e| located(path, &e))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let traces = Scenario::traces_dir(path);
        let traces = traces.to_string_lossy();
        for c in &mut s.schedule {
            c.set = c.set.replace(TRACES, &traces);
            c.revert = c.revert.as_ref().map(|r| r.replace(TRACES, &traces));
        }
        for text in &mut s.paths {
            *text = text.replace(TRACES, &traces);
        }
        for (name, file) in &s.vpns {
            let def = VpnDef::load(&base.join(file))
                .map_err(|e| anyhow!("{}: vpns.{name}: {e}", path.display()))?;
            s.vpn_defs.insert(name.clone(), def);
        }
        s.validate()
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(s)
    }

    /// A path replays recordings or wall-clock slots (or a schedule puts them on one): the
    /// runner starts each system on the wall clock's minute (`runner::wait_for_minute`).
    pub fn replays_recordings(&self) -> bool {
        let timed = |text: &str| {
            [
                "delay_trace=",
                "loss_trace=",
                "capacity_trace=",
                "rate_slots=",
            ]
            .iter()
            .any(|k| text.contains(k))
        };
        self.paths.iter().any(|p| timed(p)) || self.schedule.iter().any(|c| timed(&c.set))
    }

    fn validate(&self) -> Result<()> {
        if self.paths.is_empty() {
            bail!("`paths` is empty");
        }
        for (i, p) in self.paths.iter().enumerate() {
            LinkSpec::parse_both(p).map_err(|e| anyhow!("paths[{i}]: {e}"))?;
        }
        for s in &self.systems {
            if let Some(n) = direct_path(s) {
                if n == 0 || n > self.paths.len() {
                    bail!(
                        "systems: `{s}`: the scenario has paths 1 to {}",
                        self.paths.len()
                    );
                }
            } else if s == "mptcp" && self.paths.len() < 2 {
                bail!("systems: `mptcp` needs two paths or more (a subflow on each)");
            } else if s != "mpquic" && s != "mptcp" && !self.vpns.contains_key(s) {
                bail!("systems: unknown `{s}` (direct, direct-N for path N, mptcp, mpquic, or a VPN defined under `vpns`)");
            }
        }
        for name in self.vpns.keys() {
            if name == "direct" || name.starts_with("mpquic") {
                bail!("vpns: `{name}` is reserved (direct, mpquic*)");
            }
        }
        for t in &self.traffic {
            parse_duration(&t.start).map_err(|e| anyhow!("traffic start: {e}"))?;
            parse_duration(&t.duration).map_err(|e| anyhow!("traffic duration: {e}"))?;
            parse_duration(&t.interval).map_err(|e| anyhow!("traffic interval: {e}"))?;
            if !matches!(t.protocol.as_str(), "tcp" | "udp") {
                bail!("traffic protocol `{}`: tcp or udp", t.protocol);
            }
        }
        parse_duration(&self.sample).map_err(|e| anyhow!("sample: {e}"))?;
        self.timeline()?;
        Ok(())
    }

    /// When the traffic ends (the longest start + duration).
    pub fn length(&self) -> Duration {
        self.traffic
            .iter()
            .map(|t| {
                parse_duration(&t.start).unwrap_or_default()
                    + parse_duration(&t.duration).unwrap_or_default()
            })
            .max()
            .unwrap_or_default()
    }

    /// Every change at its absolute time, sorted.
    pub fn timeline(&self) -> Result<Vec<Timed>> {
        let end = self.length();
        let mut out = Vec::new();
        for (i, c) in self.schedule.iter().enumerate() {
            if c.path == 0 || c.path > self.paths.len() {
                bail!(
                    "schedule[{i}]: path {} does not exist (1..{})",
                    c.path,
                    self.paths.len()
                );
            }
            check_change(&c.set, &c.dir).map_err(|e| anyhow!("schedule[{i}].set: {e}"))?;
            let times: Vec<Duration> = match (&c.at, &c.every) {
                (Some(at), None) => vec![parse_duration(at)?],
                (None, Some(every)) => {
                    let every = parse_duration(every)?;
                    if every < Duration::from_millis(10) {
                        bail!("schedule[{i}].every: at least 10ms");
                    }
                    let from = c
                        .from
                        .as_deref()
                        .map(parse_duration)
                        .transpose()?
                        .unwrap_or(every);
                    let until = c
                        .until
                        .as_deref()
                        .map(parse_duration)
                        .transpose()?
                        .unwrap_or(end);
                    let mut v = Vec::new();
                    let mut t = from;
                    while t < until {
                        v.push(t);
                        t += every;
                    }
                    v
                }
                _ => bail!("schedule[{i}]: give exactly one of `at` or `every`"),
            };
            for t in times {
                out.push(Timed {
                    at: t,
                    path: c.path,
                    dir: c.dir.clone(),
                    set: c.set.clone(),
                });
                if let (Some(after), Some(revert)) = (&c.revert_after, &c.revert) {
                    check_change(revert, &c.dir)
                        .map_err(|e| anyhow!("schedule[{i}].revert: {e}"))?;
                    out.push(Timed {
                        at: t + parse_duration(after)?,
                        path: c.path,
                        dir: c.dir.clone(),
                        set: revert.clone(),
                    });
                }
            }
        }
        out.sort_by_key(|t| t.at);
        Ok(out)
    }

    /// The systems to run, by label: `direct` (or `direct-N`: over path N); `mptcp` (kernel
    /// MPTCP over every path, no VPN); `mpquic`, or one
    /// `mpquic-LABEL` per variant; and the other VPNs.
    pub fn systems(&self) -> Vec<(String, System)> {
        let mut out = Vec::new();
        for s in &self.systems {
            if let Some(n) = direct_path(s) {
                out.push((s.clone(), System::Direct(n.saturating_sub(1))));
                continue;
            }
            match s.as_str() {
                "mptcp" => out.push((s.clone(), System::Mptcp)),
                "mpquic" if !self.mpquic_variants.is_empty() => {
                    for v in &self.mpquic_variants {
                        let mut o = self.mpquic.clone();
                        o.policy = v.policy.clone().unwrap_or(o.policy);
                        o.mode = v.mode.clone().or(o.mode);
                        o.congestion = v.congestion.clone().or(o.congestion);
                        o.fec = v.fec.clone().or(o.fec);
                        o.pipes = v.pipes.clone().or(o.pipes);
                        o.transport = v.transport.clone().or(o.transport);
                        o.classes = v.classes.clone().or(o.classes);
                        o.path_yaml = v.path_yaml.clone().or(o.path_yaml);
                        o.lane = v.lane.or(o.lane);
                        o.paths = v.paths.clone().or(o.paths);
                        o.weights = v.weights.clone().or(o.weights);
                        o.requires.extend(v.requires.iter().cloned());
                        out.push((format!("mpquic-{}", v.label), System::Mpquic(o)));
                    }
                }
                "mpquic" => out.push((s.clone(), System::Mpquic(self.mpquic.clone()))),
                vpn => {
                    if let Some(d) = self.vpn_defs.get(vpn) {
                        out.push((s.clone(), System::Vpn(d.clone())));
                    }
                }
            }
        }
        out
    }
}

/// The path (1-based) a `direct` or `direct-N` system runs over; `None` for other systems.
/// A schedule's change, checked for the direction(s) it is for (`up`, `down` or `both`).
fn check_change(set: &str, dir: &str) -> std::result::Result<(), String> {
    let dirs: &[Dir] = match dir {
        "up" => &[Dir::Up],
        "down" => &[Dir::Down],
        "both" => &[Dir::Up, Dir::Down],
        other => return Err(format!("dir `{other}`: use up, down or both")),
    };
    for d in dirs {
        LinkSpec::default().apply_dir(set, Some(*d))?;
    }
    Ok(())
}

fn direct_path(system: &str) -> Option<usize> {
    match system {
        "direct" => Some(1),
        s => s.strip_prefix("direct-")?.parse().ok(),
    }
}

impl MpquicOpts {
    /// The features these options need that mpquic does not have.
    pub fn unsupported(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .requires
            .iter()
            .filter(|r| NOT_YET.contains(&r.as_str()))
            .cloned()
            .collect();
        if mpquic_core::Policy::parse(&self.policy).is_none() {
            v.push(format!("policy {}", self.policy));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starlink_handover_schedule_expands() {
        let s: Scenario = serde_yaml_ng::from_str(
            "name: x\npaths: [\"delay=20ms\"]\ntraffic:\n- {kind: ping, duration: 40s}\nschedule:\n- {every: 15s, path: 1, set: \"delay=40ms,loss=100%\", revert_after: 200ms, revert: \"loss=0%\"}\n- {at: 20s, path: 1, dir: down, set: \"loss=30%\"}\n",
        )
        .unwrap();
        let t = s.timeline().unwrap();
        let at: Vec<u64> = t.iter().map(|c| c.at.as_millis() as u64).collect();
        assert_eq!(at, vec![15000, 15200, 20000, 30000, 30200]);
        assert_eq!(t[2].dir, "down");
        assert!(s.mpquic.unsupported().is_empty());
    }

    #[test]
    fn variants_override_the_common_options() {
        let s: Scenario = serde_yaml_ng::from_str(
            "name: x\npaths: [\"delay=5ms\", \"delay=20ms\"]\nsystems: [mpquic]\nmpquic: {priorities: [1, 1]}\nmpquic_variants:\n- {label: default}\n- {label: alone-2, paths: [2], policy: wlb}\ntraffic:\n- {kind: ping, duration: 1s}\n",
        )
        .unwrap();
        let got: Vec<(String, Option<Vec<usize>>, String)> = s
            .systems()
            .into_iter()
            .map(|(name, sys)| match sys {
                System::Mpquic(o) => (name, o.paths, o.policy),
                _ => panic!("only mpquic here"),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("mpquic-default".into(), None, "failover".into()),
                ("mpquic-alone-2".into(), Some(vec![2]), "wlb".into()),
            ]
        );
    }

    #[test]
    fn vpn_systems_need_a_definition() {
        let dir = std::env::temp_dir().join(format!("mql-scn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let scn = dir.join("s.yaml");
        let base = "name: x\npaths: [\"delay=5ms\"]\ntraffic: []\n";
        std::fs::write(&scn, format!("{base}systems: [direct, wg]\n")).unwrap();
        let e = Scenario::load(&scn).unwrap_err().to_string();
        assert!(e.contains("unknown `wg`"), "{e}");
        std::fs::write(
            dir.join("wg.yaml"),
            "daemons:\n- {ns: router, cmd: x}\ntunnel: {client_if: t, cidr: 10.0.0.0/24}\n",
        )
        .unwrap();
        std::fs::write(
            &scn,
            format!("{base}systems: [wg]\nvpns: {{wg: wg.yaml}}\n"),
        )
        .unwrap();
        let e = Scenario::load(&scn).unwrap_err().to_string();
        assert!(e.contains("vpns.wg") && e.contains("ns `router`"), "{e}");
        std::fs::write(
            dir.join("wg.yaml"),
            "daemons:\n- {ns: client, cmd: x}\ntunnel: {client_if: t, cidr: 10.0.0.0/24}\n",
        )
        .unwrap();
        let s = Scenario::load(&scn).unwrap();
        assert!(matches!(s.systems()[0], (ref n, System::Vpn(_)) if n == "wg"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_schedule_is_refused() {
        let s: Scenario = serde_yaml_ng::from_str(
            "name: x\npaths: [\"delay=20ms\"]\ntraffic: []\nschedule:\n- {at: 1s, path: 3, set: \"loss=1%\"}\n",
        )
        .unwrap();
        assert!(s
            .timeline()
            .unwrap_err()
            .to_string()
            .contains("path 3 does not exist"));
    }
}
