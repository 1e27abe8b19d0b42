//! Instance configuration: YAML accepting the seed platform's keys (docs/CONFIG.md).
//!
//! Loading has two stages: serde parses the YAML into `RawConfig` (unknown keys are errors with a
//! "did you mean" hint), then `validate` turns it into a `Config` the rest of the program can
//! trust, reporting every problem with the file, line and column it comes from.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use mpquic_core::Policy;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Client,
    Server,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Congestion {
    Cubic,
    Newreno,
    Bbr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportMode {
    /// Inner packets as QUIC DATAGRAM frames (unreliable, lowest latency).
    Datagram,
    /// Inner packets on one QUIC stream per path, 2-byte length prefix (retransmitted).
    Reliable,
}

impl TransportMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TransportMode::Datagram => "datagram",
            TransportMode::Reliable => "reliable",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPath {
    name: String,
    bind_ip: Option<String>,
    remote_addr: Option<String>,
    remote_port: Option<u16>,
    priority: Option<u32>,
    weight: Option<u32>,
    pipes: Option<u32>,
    transport: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClient {
    name: String,
    address: Ipv4Addr,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    role: Role,
    tun_name: Option<String>,
    tun_cidr: Option<String>,
    tun_mtu: Option<u32>,
    log_level: Option<String>,
    tls_ca_file: Option<PathBuf>,
    tls_cert_file: Option<PathBuf>,
    tls_key_file: Option<PathBuf>,
    tls_server_name: Option<String>,
    #[serde(default)]
    tls_insecure_skip_verify: bool,
    congestion_algorithm: Option<Congestion>,
    transport_mode: Option<TransportMode>,
    bind_ip: Option<String>,
    remote_addr: Option<String>,
    remote_port: Option<u16>,
    /// Seed key: the server always accepts many clients; accepted for compatibility.
    #[allow(dead_code)]
    multi_conn_enabled: Option<bool>,
    multipath_enabled: Option<bool>,
    multipath_policy: Option<String>,
    #[serde(default)]
    multipath_paths: Vec<RawPath>,
    stripe_enabled: Option<bool>,
    stripe_port: Option<u16>,
    stripe_data_shards: Option<u32>,
    stripe_parity_shards: Option<u32>,
    // Keys new in mpquic.
    control_socket: Option<PathBuf>,
    metrics_listen: Option<SocketAddr>,
    worker_threads: Option<usize>,
    #[serde(default)]
    clients: Vec<RawClient>,
}

/// Where a path's UDP socket is bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bind {
    Any,
    Ip(IpAddr),
    /// SO_BINDTODEVICE to this interface, source address taken from it.
    Interface(String),
}

#[derive(Debug, Clone)]
pub struct PathConfig {
    pub name: String,
    pub bind: Bind,
    pub remote_addr: String,
    pub remote_port: u16,
    pub priority: u32,
    pub weight: u32,
}

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub policy: Policy,
    pub paths: Vec<PathConfig>,
    /// The tunnel address this client asks for (the server decides).
    pub requested: Option<(Ipv4Addr, u8)>,
    pub server_name: String,
    pub ca_file: Option<PathBuf>,
    pub insecure_skip_verify: bool,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub tun_addr: Ipv4Addr,
    pub prefix: u8,
    pub client_ca_file: PathBuf,
    /// Fixed tunnel addresses by client name (certificate CN).
    pub clients: Vec<(String, Ipv4Addr)>,
}

#[derive(Debug, Clone)]
pub enum RoleConfig {
    Client(ClientConfig),
    Server(ServerConfig),
}

#[derive(Debug, Clone)]
pub struct Config {
    pub tun_name: String,
    /// `None`: derived from the path MTU at startup.
    pub tun_mtu: Option<u32>,
    pub log_level: String,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub congestion: Congestion,
    pub mode: TransportMode,
    pub control_socket: PathBuf,
    pub metrics_listen: Option<SocketAddr>,
    /// Threads of the async runtime. 1 (the default) measured fastest on a 2-core machine.
    pub worker_threads: usize,
    pub role: RoleConfig,
    /// Non-fatal remarks for the operator (printed by check-config, logged at startup).
    pub warnings: Vec<String>,
}

/// One configuration problem, located in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub line: usize,
    pub column: usize,
    pub message: String,
    pub hint: Option<String>,
}

#[derive(Debug)]
pub struct ConfigError {
    pub file: PathBuf,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(
                f,
                "{}:{}:{}: {}",
                self.file.display(),
                p.line,
                p.column,
                p.message
            )?;
            if let Some(h) = &p.hint {
                write!(f, "\n  hint: {h}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

pub const DEFAULT_PORT: u16 = 45017;

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.to_owned(),
            problems: vec![Problem {
                line: 0,
                column: 0,
                message: format!("cannot read the file: {e}"),
                hint: None,
            }],
        })?;
        Config::parse(&text, path)
    }

    pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let err = |problems| ConfigError {
            file: file.to_owned(),
            problems,
        };
        let raw: RawConfig =
            serde_yaml_ng::from_str(text).map_err(|e| err(vec![yaml_problem(&e)]))?;
        validate(raw, text).map_err(err)
    }
}

/// Turn a serde error into a located problem, with a hint for misspelt keys and values.
fn yaml_problem(e: &serde_yaml_ng::Error) -> Problem {
    let (line, column) = e.location().map_or((1, 1), |l| (l.line(), l.column()));
    let full = e.to_string();
    // serde_yaml_ng appends " at line L column C"; the location is reported separately.
    let msg = full.split(" at line ").next().unwrap_or(&full).to_string();
    let hint = unknown_name_hint(&msg);
    // With a "did you mean", the full list of valid names is noise.
    let msg = match (&hint, msg.find(", expected one of")) {
        (Some(h), Some(i)) if h.starts_with("did you mean") => msg[..i].to_string(),
        _ => msg,
    };
    Problem {
        line,
        column,
        message: msg,
        hint,
    }
}

/// For "unknown field `x`, expected one of `a`, `b`" (and variants), suggest the closest name.
fn unknown_name_hint(msg: &str) -> Option<String> {
    // Nested errors carry a prefix such as "multipath_paths[0]: ".
    let (what, at) = match (msg.find("unknown field"), msg.find("unknown variant")) {
        (Some(i), _) => ("key", i),
        (None, Some(i)) => ("value", i),
        _ => return None,
    };
    let mut quoted = msg[at..].split('`').skip(1).step_by(2);
    let bad = quoted.next()?;
    let candidates: Vec<&str> = quoted.collect();
    match closest(bad, &candidates) {
        Some(best) => Some(format!("did you mean `{best}`?")),
        None if !candidates.is_empty() => Some(format!("valid {what}s: {}", candidates.join(", "))),
        None => None,
    }
}

/// The candidate within a small edit distance of `bad`, if any.
pub fn closest<'a>(bad: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (levenshtein(bad, c), *c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Line and column of the `nth` (0-based) occurrence of `key:` in the YAML text, for errors about
/// values that parsed but are not acceptable.
fn locate(text: &str, key: &str, nth: usize) -> (usize, usize) {
    text.lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let trimmed = l.trim_start().trim_start_matches("- ").trim_start();
            let col = l.len() - trimmed.len() + 1;
            trimmed
                .strip_prefix(key)
                .filter(|rest| rest.trim_start().starts_with(':'))
                .map(|_| (i + 1, col))
        })
        .nth(nth)
        .unwrap_or((1, 1))
}

struct Checker<'a> {
    text: &'a str,
    problems: Vec<Problem>,
}

impl Checker<'_> {
    fn at(&mut self, key: &str, nth: usize, message: String, hint: Option<String>) {
        let (line, column) = locate(self.text, key, nth);
        self.problems.push(Problem {
            line,
            column,
            message,
            hint,
        });
    }
    fn unsupported(&mut self, key: &str, nth: usize, what: &str) {
        self.at(
            key,
            nth,
            format!("`{key}`: {what} is not supported yet"),
            Some("remove this line; the feature is planned (see docs/CONFIG.md)".into()),
        );
    }
}

pub fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (a, p) = s.split_once('/')?;
    let addr: Ipv4Addr = a.trim().parse().ok()?;
    let prefix: u8 = p.trim().parse().ok()?;
    (prefix <= 32).then_some((addr, prefix))
}

fn parse_bind(s: &str) -> Option<Bind> {
    if let Some(ifname) = s.strip_prefix("if:") {
        let ok = !ifname.is_empty() && ifname.len() < 16 && !ifname.contains(['/', ' ']);
        return ok.then(|| Bind::Interface(ifname.to_string()));
    }
    let ip: IpAddr = s.parse().ok()?;
    Some(if ip.is_unspecified() {
        Bind::Any
    } else {
        Bind::Ip(ip)
    })
}

fn validate(raw: RawConfig, text: &str) -> Result<Config, Vec<Problem>> {
    let mut c = Checker {
        text,
        problems: Vec::new(),
    };
    let mut warnings = Vec::new();

    // Features that do not exist yet are refused, never silently ignored.
    if raw.stripe_enabled == Some(true) {
        c.unsupported(
            "stripe_enabled",
            0,
            "the stripe transport (UDP pipes + FEC)",
        );
    }
    for key in ["stripe_port", "stripe_data_shards", "stripe_parity_shards"] {
        let present = match key {
            "stripe_port" => raw.stripe_port.is_some(),
            "stripe_data_shards" => raw.stripe_data_shards.is_some(),
            _ => raw.stripe_parity_shards.is_some(),
        };
        if present {
            c.unsupported(key, 0, "the stripe transport (UDP pipes + FEC)");
        }
    }

    let tun_name = raw.tun_name.clone().unwrap_or_else(|| "mpquic0".into());
    if tun_name.is_empty() || tun_name.len() > 15 || tun_name.contains(['/', ' ']) {
        c.at(
            "tun_name",
            0,
            format!("`tun_name`: `{tun_name}` is not a valid interface name"),
            Some("use 1-15 characters without '/' or spaces, e.g. mp1".into()),
        );
    }
    if let Some(m) = raw.tun_mtu {
        if !(576..=9000).contains(&m) {
            c.at(
                "tun_mtu",
                0,
                format!("`tun_mtu`: {m} is out of range"),
                Some("use 576..9000, or leave it out to derive it from the path MTU".into()),
            );
        }
    }
    if let Some(n) = raw.worker_threads {
        if !(1..=64).contains(&n) {
            c.at(
                "worker_threads",
                0,
                format!("`worker_threads`: {n} is out of range"),
                Some("use 1..64; 1 is fastest on small machines".into()),
            );
        }
    }
    let log_level = raw.log_level.clone().unwrap_or_else(|| "info".into());
    const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];
    if !LEVELS.contains(&log_level.as_str()) {
        let hint = closest(&log_level, &LEVELS)
            .map(|b| format!("did you mean `{b}`?"))
            .unwrap_or_else(|| format!("valid values: {}", LEVELS.join(", ")));
        c.at(
            "log_level",
            0,
            format!("`log_level`: unknown level `{log_level}`"),
            Some(hint),
        );
    }
    let tun_cidr = match &raw.tun_cidr {
        Some(s) => match parse_cidr(s) {
            Some(v) => Some(v),
            None => {
                c.at(
                    "tun_cidr",
                    0,
                    format!("`tun_cidr`: `{s}` is not an IPv4 address with prefix"),
                    Some("e.g. 10.200.17.1/24".into()),
                );
                None
            }
        },
        None => None,
    };
    let policy = match raw.multipath_policy.as_deref() {
        None => Policy::Failover,
        Some(s) => Policy::parse(s).unwrap_or_else(|| {
            let hint = closest(s, &["failover", "balanced"])
                .map(|b| format!("did you mean `{b}`?"))
                .unwrap_or_else(|| "valid policies: failover, balanced".into());
            c.at(
                "multipath_policy",
                0,
                format!("`multipath_policy`: unknown policy `{s}`"),
                Some(hint),
            );
            Policy::Failover
        }),
    };

    let role = match raw.role {
        Role::Server => {
            let listen_ip = match raw.bind_ip.as_deref().map(parse_bind) {
                None | Some(Some(Bind::Any)) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                Some(Some(Bind::Ip(ip))) => ip,
                Some(_) => {
                    c.at(
                        "bind_ip",
                        0,
                        "`bind_ip`: the server listens on an IP address".into(),
                        Some("e.g. bind_ip: 0.0.0.0".into()),
                    );
                    IpAddr::V4(Ipv4Addr::UNSPECIFIED)
                }
            };
            let port = raw.remote_port.unwrap_or(DEFAULT_PORT);
            let (tun_addr, prefix) = match tun_cidr {
                Some(v) => v,
                None => {
                    if raw.tun_cidr.is_none() {
                        c.at(
                            "role",
                            0,
                            "a server needs `tun_cidr` (its tunnel address and the client pool)"
                                .into(),
                            Some("e.g. tun_cidr: 10.200.17.254/24".into()),
                        );
                    }
                    (Ipv4Addr::UNSPECIFIED, 24)
                }
            };
            if prefix > 30 && raw.tun_cidr.is_some() {
                c.at(
                    "tun_cidr",
                    0,
                    "`tun_cidr`: the server's prefix leaves no room for clients".into(),
                    Some("use a /30 or larger network, e.g. /24".into()),
                );
            }
            for key in ["tls_cert_file", "tls_key_file"] {
                let missing = if key == "tls_cert_file" {
                    raw.tls_cert_file.is_none()
                } else {
                    raw.tls_key_file.is_none()
                };
                if missing {
                    c.at(
                        "role",
                        0,
                        format!("a server needs `{key}`"),
                        Some("create them with: mpquic pki server --dir DIR --name NAME".into()),
                    );
                }
            }
            // Clients are verified against `tls_ca_file`; the seed's server files have none, so
            // the CA written by `mpquic pki` next to the server certificate is the default.
            let client_ca_file = raw.tls_ca_file.clone().or_else(|| {
                let dir = raw.tls_cert_file.as_ref()?.parent()?;
                Some(dir.join("ca.crt"))
            });
            let client_ca_file = client_ca_file.unwrap_or_default();
            if raw.tls_ca_file.is_none() && raw.tls_cert_file.is_some() {
                warnings.push(format!(
                    "tls_ca_file not set: clients are verified against {}",
                    client_ca_file.display()
                ));
            }
            if raw.tls_insecure_skip_verify {
                c.at(
                    "tls_insecure_skip_verify",
                    0,
                    "`tls_insecure_skip_verify` is a client option; a server always verifies clients".into(),
                    None,
                );
            }
            if !raw.multipath_paths.is_empty() {
                c.at(
                    "multipath_paths",
                    0,
                    "`multipath_paths` is a client option".into(),
                    Some("the server learns each client's paths when they connect".into()),
                );
            }
            let net = u32::from(tun_addr) & mask(prefix);
            let mut clients = Vec::new();
            for (i, cl) in raw.clients.iter().enumerate() {
                let a = u32::from(cl.address);
                let host_part = a & !mask(prefix);
                if a & mask(prefix) != net
                    || host_part == 0
                    || host_part == !mask(prefix)
                    || cl.address == tun_addr
                {
                    c.at(
                        "address",
                        i,
                        format!(
                            "client `{}`: {} is not a usable host address in {}/{}",
                            cl.name,
                            cl.address,
                            Ipv4Addr::from(net),
                            prefix
                        ),
                        None,
                    );
                }
                if clients
                    .iter()
                    .any(|(n, a): &(String, Ipv4Addr)| *n == cl.name || *a == cl.address)
                {
                    c.at(
                        "name",
                        i,
                        format!("client `{}`: duplicate name or address", cl.name),
                        None,
                    );
                }
                clients.push((cl.name.clone(), cl.address));
            }
            RoleConfig::Server(ServerConfig {
                listen: SocketAddr::new(listen_ip, port),
                tun_addr,
                prefix,
                client_ca_file,
                clients,
            })
        }
        Role::Client => {
            if !raw.clients.is_empty() {
                c.at("clients", 0, "`clients` is a server option".into(), None);
            }
            if raw.tls_cert_file.is_some() != raw.tls_key_file.is_some() {
                c.at(
                    "role",
                    0,
                    "`tls_cert_file` and `tls_key_file` go together".into(),
                    Some("create both with: mpquic pki client --dir DIR --name NAME".into()),
                );
            }
            if raw.tls_cert_file.is_none() {
                warnings.push(
                    "no client certificate (tls_cert_file/tls_key_file): an mpquic server will refuse this client"
                        .into(),
                );
            }
            if raw.tls_ca_file.is_none() && !raw.tls_insecure_skip_verify {
                c.at(
                    "role",
                    0,
                    "a client needs `tls_ca_file` to verify the server".into(),
                    Some("point it at the ca.crt written by `mpquic pki init`".into()),
                );
            }
            if raw.tls_insecure_skip_verify {
                warnings.push(
                    "tls_insecure_skip_verify: the server's certificate is NOT verified".into(),
                );
            }
            let paths = client_paths(&raw, &mut c);
            let server_name = raw
                .tls_server_name
                .clone()
                .or_else(|| paths.first().map(|p| p.remote_addr.clone()))
                .unwrap_or_default();
            RoleConfig::Client(ClientConfig {
                policy,
                paths,
                requested: tun_cidr,
                server_name,
                ca_file: raw.tls_ca_file.clone(),
                insecure_skip_verify: raw.tls_insecure_skip_verify,
            })
        }
    };

    if !c.problems.is_empty() {
        c.problems.sort_by_key(|p| (p.line, p.column));
        return Err(c.problems);
    }
    let control_socket = raw
        .control_socket
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("/run/mpquic/{tun_name}.sock")));
    Ok(Config {
        tun_name,
        tun_mtu: raw.tun_mtu,
        log_level,
        cert_file: raw.tls_cert_file,
        key_file: raw.tls_key_file,
        congestion: raw.congestion_algorithm.unwrap_or(Congestion::Cubic),
        mode: raw.transport_mode.unwrap_or(TransportMode::Datagram),
        control_socket,
        metrics_listen: raw.metrics_listen,
        worker_threads: raw.worker_threads.unwrap_or(1),
        role,
        warnings,
    })
}

pub fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

fn client_paths(raw: &RawConfig, c: &mut Checker) -> Vec<PathConfig> {
    let mut out = Vec::new();
    if raw.multipath_enabled == Some(false) && !raw.multipath_paths.is_empty() {
        c.at(
            "multipath_enabled",
            0,
            "`multipath_paths` is set but `multipath_enabled` is false".into(),
            Some("set multipath_enabled: true, or remove multipath_paths".into()),
        );
    }
    if raw.multipath_paths.is_empty() {
        if raw.multipath_enabled == Some(true) {
            c.at(
                "multipath_enabled",
                0,
                "`multipath_enabled` is true but `multipath_paths` is empty".into(),
                Some("list the WAN links under multipath_paths".into()),
            );
        }
        let Some(remote) = raw.remote_addr.clone() else {
            c.at(
                "role",
                0,
                "a client needs `remote_addr` (or `multipath_paths`)".into(),
                Some("the server's public address, e.g. remote_addr: 203.0.113.10".into()),
            );
            return out;
        };
        let bind = bind_or_report(raw.bind_ip.as_deref(), "bind_ip", 0, c);
        out.push(PathConfig {
            name: "default".into(),
            bind,
            remote_addr: remote,
            remote_port: raw.remote_port.unwrap_or(DEFAULT_PORT),
            priority: 1,
            weight: 1,
        });
        return out;
    }
    for (i, p) in raw.multipath_paths.iter().enumerate() {
        if out.iter().any(|o: &PathConfig| o.name == p.name) {
            c.at(
                "name",
                i,
                format!("path `{}`: duplicate name", p.name),
                None,
            );
        }
        if p.name.is_empty() || p.name.len() > 32 {
            c.at("name", i, "path name must be 1-32 characters".into(), None);
        }
        if let Some(n) = p.pipes {
            if n > 1 {
                c.unsupported(
                    "pipes",
                    count_before(raw, i, |p| p.pipes.is_some()),
                    "more than one pipe per path",
                );
            } else if n == 0 {
                c.at(
                    "pipes",
                    count_before(raw, i, |p| p.pipes.is_some()),
                    "`pipes` must be at least 1".into(),
                    None,
                );
            }
        }
        if let Some(t) = &p.transport {
            let nth = count_before(raw, i, |p| p.transport.is_some());
            match t.as_str() {
                "quic" => {}
                "stripe" => c.unsupported("transport", nth, "`transport: stripe`"),
                other => {
                    let hint = closest(other, &["quic", "stripe"])
                        .map(|b| format!("did you mean `{b}`?"))
                        .unwrap_or_else(|| "valid values: quic".into());
                    c.at(
                        "transport",
                        nth,
                        format!("`transport`: unknown transport `{other}`"),
                        Some(hint),
                    );
                }
            }
        }
        if p.weight == Some(0) {
            let nth = count_before(raw, i, |p| p.weight.is_some());
            c.at("weight", nth, "`weight` must be at least 1".into(), None);
        }
        let bind_nth =
            count_before(raw, i, |p| p.bind_ip.is_some()) + usize::from(raw.bind_ip.is_some());
        let bind = match &p.bind_ip {
            Some(b) => bind_or_report(Some(b), "bind_ip", bind_nth, c),
            None => bind_or_report(raw.bind_ip.as_deref(), "bind_ip", 0, c),
        };
        let Some(remote) = p.remote_addr.clone().or_else(|| raw.remote_addr.clone()) else {
            c.at(
                "name",
                i,
                format!("path `{}` has no `remote_addr`", p.name),
                None,
            );
            continue;
        };
        out.push(PathConfig {
            name: p.name.clone(),
            bind,
            remote_addr: remote,
            remote_port: p.remote_port.or(raw.remote_port).unwrap_or(DEFAULT_PORT),
            priority: p.priority.unwrap_or(1),
            weight: p.weight.unwrap_or(1),
        });
    }
    out
}

/// How many paths before index `i` have the key (to find the right occurrence in the text).
fn count_before(raw: &RawConfig, i: usize, has: impl Fn(&RawPath) -> bool) -> usize {
    raw.multipath_paths[..i].iter().filter(|p| has(p)).count()
}

fn bind_or_report(s: Option<&str>, key: &str, nth: usize, c: &mut Checker) -> Bind {
    match s {
        None => Bind::Any,
        Some(s) => parse_bind(s).unwrap_or_else(|| {
            c.at(
                key,
                nth,
                format!("`{key}`: `{s}` is neither an IP address nor if:INTERFACE"),
                Some("e.g. bind_ip: if:eth1 or bind_ip: 192.0.2.10".into()),
            );
            Bind::Any
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s, Path::new("test.yaml"))
    }

    const SEED_CLIENT: &str = "role: client
multipath_enabled: true
multipath_policy: balanced
tun_name: mp1
tun_cidr: 10.200.17.1/24
log_level: info
tls_ca_file: /etc/mpquic/tls/ca.crt
tls_cert_file: /etc/mpquic/tls/client1.crt
tls_key_file: /etc/mpquic/tls/client1.key
tls_server_name: mpquic-server
tls_insecure_skip_verify: false
congestion_algorithm: bbr
transport_mode: reliable
multipath_paths:
- name: wan4
  bind_ip: if:enp7s6
  remote_addr: 172.238.232.223
  remote_port: 45017
  priority: 1
  weight: 1
- name: wan5
  bind_ip: if:enp7s7
  remote_addr: 172.238.232.223
  remote_port: 45017
  priority: 1
  weight: 1
";

    #[test]
    fn seed_client_loads() {
        let c = parse(SEED_CLIENT).unwrap();
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        assert_eq!(cl.paths.len(), 2);
        assert_eq!(cl.paths[1].bind, Bind::Interface("enp7s7".into()));
        assert_eq!(cl.policy, Policy::Balanced);
        assert_eq!(c.mode, TransportMode::Reliable);
        assert_eq!(c.congestion, Congestion::Bbr);
    }

    #[test]
    fn stripe_and_pipes_are_not_supported_yet() {
        let text = SEED_CLIENT.replace(
            "  weight: 1\n- name: wan5",
            "  weight: 1\n  pipes: 4\n  transport: stripe\n- name: wan5",
        ) + "stripe_port: 46017\n";
        let e = parse(&text).unwrap_err();
        assert_eq!(e.problems.len(), 3, "{e}");
        for p in &e.problems {
            assert!(p.message.contains("not supported yet"), "{e}");
        }
        assert_eq!(e.problems[0].line, 21); // pipes
        assert_eq!(e.problems[2].line, 29); // stripe_port
    }

    #[test]
    fn misspelt_key_has_line_and_hint() {
        let e = parse(&SEED_CLIENT.replace("tun_name:", "tun_nme:")).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("test.yaml:4:"), "{s}");
        assert!(s.contains("did you mean `tun_name`?"), "{s}");
        let e = parse(&SEED_CLIENT.replace(
            "  priority: 1\n  weight: 1\n- name: wan5",
            "  priorty: 1\n  weight: 1\n- name: wan5",
        ))
        .unwrap_err();
        assert!(e.to_string().contains("did you mean `priority`?"), "{e}");
        let e = parse(&SEED_CLIENT.replace("reliable", "relaible")).unwrap_err();
        assert!(e.to_string().contains("did you mean `reliable`?"), "{e}");
    }

    #[test]
    fn server_defaults_ca_next_to_cert() {
        let c = parse(
            "role: server\nbind_ip: 0.0.0.0\nremote_port: 45017\nmulti_conn_enabled: true\ntun_name: mp1\ntun_cidr: 10.200.17.254/24\nlog_level: info\ntls_cert_file: /etc/mpquic/tls/server.crt\ntls_key_file: /etc/mpquic/tls/server.key\n",
        )
        .unwrap();
        let RoleConfig::Server(s) = &c.role else {
            panic!()
        };
        assert_eq!(s.client_ca_file, PathBuf::from("/etc/mpquic/tls/ca.crt"));
        assert_eq!(s.listen.port(), 45017);
        assert_eq!(s.tun_addr, Ipv4Addr::new(10, 200, 17, 254));
    }

    #[test]
    fn bad_values_are_located() {
        let e = parse(&SEED_CLIENT.replace("if:enp7s7", "nonsense")).unwrap_err();
        assert_eq!(e.problems[0].line, 22, "{e}");
        let e = parse(
            "role: client\nremote_addr: 1.2.3.4\ntls_ca_file: ca\nmultipath_policy: balancd\n",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("test.yaml:4:1") && e.to_string().contains("`balanced`"),
            "{e}"
        );
        let e = parse("role: client\n  bad indent: [\n").unwrap_err();
        assert!(e.problems[0].line >= 1);
    }

    /// Mutated files (bytes replaced, lines dropped or duplicated) give an error or a config,
    /// never a panic, and every error is located.
    #[test]
    fn mutations_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut rnd = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        let lines: Vec<&str> = SEED_CLIENT.lines().collect();
        for _ in 0..3000 {
            let mut l: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
            match rnd(3) {
                0 => {
                    let i = rnd(l.len());
                    l.remove(i);
                }
                1 => {
                    let i = rnd(l.len());
                    let d = l[i].clone();
                    l.insert(rnd(l.len()), d);
                }
                _ => {
                    let i = rnd(l.len());
                    if !l[i].is_empty() {
                        let mut b = l[i].clone().into_bytes();
                        let j = rnd(b.len());
                        const SPICE: &[u8] = b"x:- [{}0\"'#&*!|>%@`";
                        b[j] = SPICE[rnd(SPICE.len())];
                        l[i] = String::from_utf8_lossy(&b).into_owned();
                    }
                }
            }
            if let Err(e) = parse(&l.join("\n")) {
                assert!(!e.problems.is_empty());
                assert!(e.problems.iter().all(|p| p.line >= 1), "{e}");
            }
        }
    }

    #[test]
    fn closest_names() {
        assert_eq!(
            closest("tun_nme", &["tun_name", "tun_mtu"]),
            Some("tun_name")
        );
        assert_eq!(closest("zzzzzz", &["tun_name"]), None);
    }
}
