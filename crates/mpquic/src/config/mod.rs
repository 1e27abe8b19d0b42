//! Instance configuration: YAML accepting the seed platform's keys (docs/CONFIG.md).
//!
//! Loading has two stages: serde parses the YAML into `RawConfig` (unknown keys are errors with a
//! "did you mean" hint), then `validate.rs` turns it into a `Config` the rest of the program can
//! trust, section by section, reporting every problem with the file, line and column of its key
//! (`positions.rs`: from the YAML parser's marks).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use mpquic_core::addressing::AddressPlan;
pub use mpquic_core::addressing::{mask, parse_cidr, parse_cidr6, Ipv6Plan};
use mpquic_core::classify::Prefix;
use mpquic_core::path::reconfig::LinkKind;
use mpquic_core::Policy;
use serde::Deserialize;

mod checker;
mod classes;
mod lane;
mod masque;
mod metering;
pub use classes::MAX_CLASSES;
pub use masque::{MasqueClient, MasqueServer};
mod positions;
mod validate;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Client,
    Server,
}

/// The shared vocabulary of modes and controllers is the core's.
pub use mpquic_core::cc::Congestion;
pub use mpquic_core::recovery::TransportMode;

/// serde for the core's names (`Congestion`, `TransportMode`): checked by the core's parser,
/// refused with serde's own "unknown variant" error, so the file's line and the closest-name
/// hint come with it.
mod names {
    use std::fmt;

    use serde::de::{Deserializer, Error, Visitor};

    use super::{Congestion, TransportMode};

    /// Refused inside the visitor, as a derived enum would, so the error carries its place.
    struct Named<T> {
        parse: fn(&str) -> Option<T>,
        names: &'static [&'static str],
    }

    impl<T> Visitor<'_> for Named<T> {
        type Value = Option<T>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "one of {}", self.names.join(", "))
        }

        fn visit_str<E: Error>(self, s: &str) -> Result<Option<T>, E> {
            (self.parse)(s)
                .map(Some)
                .ok_or_else(|| E::unknown_variant(s, self.names))
        }
    }

    fn named<'de, D: Deserializer<'de>, T>(
        d: D,
        parse: fn(&str) -> Option<T>,
        names: &'static [&'static str],
    ) -> Result<Option<T>, D::Error> {
        d.deserialize_str(Named { parse, names })
    }

    pub fn congestion<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Congestion>, D::Error> {
        named(d, Congestion::parse, Congestion::NAMES)
    }

    pub fn mode<'de, D: Deserializer<'de>>(d: D) -> Result<Option<TransportMode>, D::Error> {
        named(d, TransportMode::parse, TransportMode::NAMES)
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
    /// Mbit/s, each direction.
    rate_limit: Option<f64>,
    role: Option<String>,
    data_budget: Option<metering::RawBudget>,
    link: Option<String>,
}

/// One value or a list of them (`dscp: 46` or `dscp: [46, 34]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(v) => vec![v.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// A number or a word (`protocol: udp` or `protocol: 17`; `port: 5060` or `port: 16384-32767`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum NumOrText {
    Num(u64),
    Text(String),
}

impl fmt::Display for NumOrText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NumOrText::Num(n) => write!(f, "{n}"),
            NumOrText::Text(t) => f.write_str(t),
        }
    }
}

/// One rule of a class's `match` list: every key it has must hold.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    dscp: Option<OneOrMany<NumOrText>>,
    protocol: Option<OneOrMany<NumOrText>>,
    src: Option<OneOrMany<String>>,
    dst: Option<OneOrMany<String>>,
    src_port: Option<OneOrMany<NumOrText>>,
    dst_port: Option<OneOrMany<NumOrText>>,
    port: Option<OneOrMany<NumOrText>>,
}

/// A traffic class (`classes:`, client): its rules and its own bond over the shared paths.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    name: String,
    #[serde(rename = "match", default)]
    rules: Vec<RawRule>,
    multipath_policy: Option<String>,
    #[serde(default, deserialize_with = "names::mode")]
    transport_mode: Option<TransportMode>,
    #[serde(default, deserialize_with = "names::congestion")]
    congestion_algorithm: Option<Congestion>,
    fec: Option<String>,
    tun_name: Option<String>,
    tcp_lane: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClient {
    name: String,
    address: Option<Ipv4Addr>,
    /// Site LAN prefixes this client may announce (`lan_prefixes`), routed to it.
    #[serde(default)]
    routes: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    role: Role,
    tun_name: Option<String>,
    tun_cidr: Option<String>,
    tun_mtu: Option<u32>,
    log_level: Option<String>,
    log_format: Option<String>,
    #[serde(default)]
    lan_prefixes: Vec<String>,
    tls_ca_file: Option<PathBuf>,
    tls_cert_file: Option<PathBuf>,
    tls_key_file: Option<PathBuf>,
    tls_server_name: Option<String>,
    #[serde(default)]
    tls_insecure_skip_verify: bool,
    tls_post_quantum: Option<bool>,
    #[serde(default, deserialize_with = "names::congestion")]
    congestion_algorithm: Option<Congestion>,
    #[serde(default, deserialize_with = "names::mode")]
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
    /// Client: `off`, `auto` or `K/M` (FEC on every path, both directions).
    fec: Option<String>,
    control_socket: Option<PathBuf>,
    metrics_listen: Option<SocketAddr>,
    dashboard_listen: Option<SocketAddr>,
    dashboard_token: Option<String>,
    worker_threads: Option<usize>,
    tun_offload: Option<bool>,
    #[serde(default)]
    clients: Vec<RawClient>,
    /// Server: client certificates refused, by name (CN) or `serial:HEX` (reloadable).
    #[serde(default)]
    revoked: Vec<String>,
    /// Client: traffic classes, in priority order (`classes.rs`).
    #[serde(default)]
    classes: Vec<RawClass>,
    /// Server: CONNECT-IP for standard MASQUE clients (`masque.rs`).
    masque_listen: Option<SocketAddr>,
    masque_template: Option<String>,
    #[serde(default)]
    masque_tokens: Vec<masque::RawToken>,
    /// Client: `native` (default) or `masque` (CONNECT-IP to a standard server).
    protocol: Option<String>,
    masque_token: Option<String>,
    state_dir: Option<String>,
    /// The MPTCP lane: a client's (implicit class's) `tcp_lane`, its server port; a server's
    /// listening address.
    tcp_lane: Option<String>,
    tcp_lane_port: Option<u16>,
    tcp_lane_listen: Option<String>,
    masque_path: Option<String>,
}

/// Where a path's UDP socket is bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bind {
    Any,
    Ip(IpAddr),
    /// SO_BINDTODEVICE to this interface, source address taken from it.
    Interface(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct PathConfig {
    pub name: String,
    pub bind: Bind,
    pub remote_addr: String,
    pub remote_port: u16,
    pub priority: u32,
    pub weight: u32,
    /// UDP 5-tuples (distinct source ports) the path runs over, sharing one congestion
    /// controller: past carriers' per-session caps. QUIC connections (`transport/quic/pipes.rs`),
    /// or with `transport: stripe` the stripe sockets beside the path's one QUIC connection.
    pub pipes: u8,
    pub transport: PathKind,
    /// `rate_limit`: the path carries no more than this, each direction (bits/s, IP packets
    /// counted whole; both ends pace under it, the server learning it from the hello).
    pub rate_limit: Option<u64>,
    /// `role`: primary (default), backup or overflow (`mpquic_core::Role`).
    pub role: mpquic_core::Role,
    /// `data_budget`: bytes per day or month, both directions; used up, the path is a backup.
    pub data_budget: Option<mpquic_core::path::budget::Budget>,
    /// `link: starlink`: the path runs over a Starlink dish, whose reconfigurations the tunnel
    /// anticipates (`mpquic_core::path::reconfig`).
    pub link: LinkKind,
    /// `link` unset or `auto`: the link is recognised as Starlink by its probes
    /// (`mpquic_core::path::reconfig::detect`); `link: other` or `starlink` says what it is.
    pub detect_link: bool,
}

impl PathConfig {
    /// A path with a `data_budget` is paid by the byte: no bulk flow is moved onto it
    /// (`mpquic_core::bond::spill`), and its hello tells the server so.
    pub fn metered(&self) -> bool {
        self.data_budget.is_some()
    }
}

/// How a path carries the tunnel's datagrams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// In the path's QUIC connection(s) (`transport/quic.rs`).
    Quic,
    /// In sealed raw UDP packets beside the path's QUIC connection, which does the handshake,
    /// the hello and the keys (`transport/stripe`, seed 000 section 14).
    Stripe,
}

#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub policy: Policy,
    pub paths: Vec<PathConfig>,
    /// The tunnel address this client asks for (the server decides).
    pub requested: Option<(Ipv4Addr, u8)>,
    /// `lan_prefixes`: the site LAN prefixes the client announces (routed LANs: the server
    /// routes them to this client, if its `clients:` entry allows them; no masquerade needed).
    pub lan_prefixes: Vec<Prefix>,
    pub server_name: String,
    pub ca_file: Option<PathBuf>,
    pub insecure_skip_verify: bool,
    /// FEC on every path, in both directions (the server applies the client's choice).
    pub fec: mpquic_core::fec::FecMode,
    /// The server's stripe port for `transport: stripe` paths; `None`: the one the server
    /// announces in its hello answer.
    pub stripe_port: Option<u16>,
    /// Traffic classes in priority order (highest first); without `classes:`, one class
    /// (`explicit: false`) from the top-level keys.
    pub classes: Vec<ClassConfig>,
    /// Which class each packet read from the TUN device belongs to.
    pub classifier: mpquic_core::classify::Classifier,
    /// `protocol: masque`: CONNECT-IP instead of the native protocol.
    pub masque: Option<MasqueClient>,
    /// `state_dir`: where the metered paths' counts are kept (`TUN_NAME.budget`).
    pub state_dir: PathBuf,
    /// The server's MPTCP lane port (`tcp_lane_port`; default: its `remote_port` + 1), used
    /// when a class has `tcp_lane: mptcp`.
    pub tcp_lane_port: u16,
}

/// A traffic class: its own bond (policy), and on every path its own connection (congestion
/// controller, transport mode, FEC).
#[derive(Debug, Clone)]
pub struct ClassConfig {
    pub name: String,
    /// Declared under `classes:` (its hellos name it); `false`: the only class, implicit.
    pub explicit: bool,
    pub policy: Policy,
    pub mode: TransportMode,
    pub fec: mpquic_core::fec::FecMode,
    /// The class's own TUN device (sites that classify by VLAN: route a VLAN into it): what it
    /// reads goes in this class, what the class receives is written to it. `None`: the
    /// instance's device.
    pub tun_name: Option<String>,
    /// `tcp_lane: mptcp`: the class's TCP connections go over the MPTCP lane, not the tunnel.
    pub tcp_lane: bool,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub tun_addr: Ipv4Addr,
    pub prefix: u8,
    /// The IPv6 part of a dual-stack `tun_cidr`: the server's IPv6 address, and how each
    /// client's follows from its IPv4 one.
    pub ipv6: Option<(Ipv6Addr, Ipv6Plan)>,
    pub client_ca_file: PathBuf,
    /// Fixed tunnel addresses by client name (certificate CN).
    pub clients: Vec<(String, Ipv4Addr)>,
    /// Site LAN prefixes each client may announce (routed LANs), by client name; the server
    /// routes them into its TUN device at start.
    pub routes: Vec<(String, Prefix)>,
    /// `stripe_enabled`: where the stripe transport's socket listens.
    pub stripe: Option<SocketAddr>,
    /// `revoked`: client certificates refused at the handshake, each a name (the CN) or
    /// `serial:HEX` (lower case, no colons or leading zeros: `tls::is_revoked` compares).
    pub revoked: Vec<String>,
    /// `masque_listen`: CONNECT-IP served to standard clients.
    pub masque: Option<MasqueServer>,
    /// `tcp_lane_listen`: where the MPTCP lane takes its clients' TCP connections (off unless
    /// set).
    pub tcp_lane: Option<SocketAddr>,
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
    /// `log_format: json`: one JSON object per log line (fields as keys), for log shippers.
    pub log_json: bool,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Offer and accept the hybrid post-quantum key exchange first (`tls/key_exchange.rs`).
    pub tls_post_quantum: bool,
    pub congestion: Congestion,
    pub control_socket: PathBuf,
    pub metrics_listen: Option<SocketAddr>,
    /// The live web dashboard (off unless configured; docs/OPERATIONS.md).
    pub dashboard: Option<Dashboard>,
    /// Threads of the async runtime. 1 (the default) measured fastest on a 2-core machine.
    pub worker_threads: usize,
    /// The TUN device's segmentation and checksum offloads (super-packets in, coalesced writes
    /// out); on by default.
    pub tun_offload: bool,
    pub role: RoleConfig,
    /// Non-fatal remarks for the operator (printed by check-config, logged at startup).
    pub warnings: Vec<String>,
    /// The file it was read from (a reload reads it again).
    pub file: PathBuf,
}

/// `dashboard_listen` and `dashboard_token`.
#[derive(Debug, Clone)]
pub struct Dashboard {
    pub listen: SocketAddr,
    /// Required (as `?token=` or `Authorization: Bearer`) when set; mandatory off loopback.
    pub token: Option<String>,
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
        let mut cfg = validate::validate(raw, text).map_err(err)?;
        cfg.file = file.to_owned();
        Ok(cfg)
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

impl ServerConfig {
    /// The tunnel network and reserved addresses, for the core's address assignment.
    pub fn address_plan(&self) -> AddressPlan {
        AddressPlan {
            tun_addr: self.tun_addr,
            prefix: self.prefix,
            fixed: self.clients.clone(),
        }
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

    /// The seed's three classes in one client: rules in several forms, per-class settings with
    /// the top-level keys as defaults, and the classifier that results.
    #[test]
    fn classes_load_and_classify() {
        let text = SEED_CLIENT.to_string()
            + "classes:
- name: critical
  multipath_policy: redundant
  transport_mode: datagram
  match:
  - dscp: [ef, 34]
  - protocol: icmp
  - protocol: udp
    port: 5060-5061
- name: default
- name: bulk
  multipath_policy: wlb
  match:
  - dst: [192.0.2.0/24, 2001:db8::/32]
    dst_port: 873
";
        let c = parse(&text).unwrap_or_else(|e| panic!("{e}"));
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        let names: Vec<&str> = cl.classes.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["critical", "default", "bulk"]);
        let (crit, dflt, bulk) = (&cl.classes[0], &cl.classes[1], &cl.classes[2]);
        assert!(crit.explicit && dflt.explicit);
        assert_eq!(
            (crit.policy, crit.mode),
            (Policy::Redundant, TransportMode::Datagram)
        );
        // Unset keys come from the top level (balanced, reliable, bbr).
        assert_eq!(
            (dflt.policy, dflt.mode),
            (Policy::Balanced, TransportMode::Reliable)
        );
        assert_eq!(bulk.policy, Policy::Wlb);
        assert_eq!(cl.classifier.default_class(), 1);
        // ICMP echo to anywhere: critical.
        let mut ping = vec![0u8; 28];
        ping[0] = 0x45;
        ping[2..4].copy_from_slice(&28u16.to_be_bytes());
        ping[9] = 1;
        ping[12..16].copy_from_slice(&[10, 0, 0, 1]);
        ping[16..20].copy_from_slice(&[192, 0, 2, 1]);
        let info = mpquic_core::PacketInfo::parse(&ping);
        assert_eq!(cl.classifier.classify(info.as_ref()), (0, true));
        // Without classes: one implicit class of the top-level keys.
        let plain = parse(SEED_CLIENT).unwrap();
        let RoleConfig::Client(p) = &plain.role else {
            panic!()
        };
        assert_eq!(p.classes.len(), 1);
        assert!(!p.classes[0].explicit);
    }

    #[test]
    fn class_mistakes_are_located_with_hints() {
        let with = |classes: &str| {
            parse(&(SEED_CLIENT.to_string() + "classes:\n" + classes))
                .unwrap_err()
                .to_string()
        };
        // Every class has rules: nothing takes the rest.
        let e = with("- name: a\n  match:\n  - protocol: udp\n");
        assert!(
            e.contains("no default class") && e.contains("hint: add a class without `match`"),
            "{e}"
        );
        // Two catch-all classes.
        let e = with("- name: a\n- name: b\n");
        assert!(
            e.contains("test.yaml:29:") && e.contains("only one class takes"),
            "{e}"
        );
        let e = with("- name: a\n  match:\n  - dscp: af5\n- name: b\n");
        assert!(
            e.contains("`dscp`: `af5` is not a DSCP value") && e.contains("hint: use 0-63"),
            "{e}"
        );
        let e = with("- name: a\n  match:\n  - protocol: ospfx\n- name: b\n");
        assert!(
            e.contains("`protocol`: `ospfx` is not an IP protocol"),
            "{e}"
        );
        let e = with("- name: a\n  match:\n  - port: 90-80\n- name: b\n");
        assert!(e.contains("`port`: `90-80` is not a port or range"), "{e}");
        let e = with("- name: a\n  match:\n  - dst: 10.0.0.0/40\n- name: b\n");
        assert!(
            e.contains("`dst`: `10.0.0.0/40` is not an address or prefix"),
            "{e}"
        );
        let e = with("- name: a\n  match:\n  - {}\n- name: b\n");
        assert!(e.contains("an empty rule would match every packet"), "{e}");
        let e = with("- name: a\n  match:\n  - dscpp: 46\n- name: b\n");
        assert!(e.contains("did you mean `dscp`"), "{e}");
        let e = with("- name: a\n  fec: auto\n  transport_mode: reliable\n  match:\n  - port: 1\n- name: b\n");
        assert!(e.contains("`fec` needs `transport_mode: datagram`"), "{e}");
        // A class's own device: a valid name, not the instance's (mp1) or another class's.
        let e = with("- name: a\n  tun_name: mp1\n  match:\n  - port: 1\n- name: b\n");
        assert!(
            e.contains("`tun_name`: `mp1` is not a valid interface name of its own"),
            "{e}"
        );
        let e =
            with("- name: a\n  tun_name: x0\n  match:\n  - port: 1\n- name: b\n  tun_name: x0\n");
        assert!(
            e.contains("`x0` is not a valid interface name of its own"),
            "{e}"
        );
        assert!(parse(
            &(SEED_CLIENT.to_string()
                + "classes:\n- name: a\n  tun_name: x0\n  match:\n  - port: 1\n- name: b\n")
        )
        .is_ok());
        let e = with("- name: a b\n");
        assert!(e.contains("class name `a b` is not valid"), "{e}");
        let e = with("- name: a\n  match:\n  - port: 1\n- name: a\n");
        assert!(e.contains("class `a`: duplicate name"), "{e}");
        // A server has no classes.
        let server = "role: server\ntun_cidr: 10.0.0.254/24\ntls_cert_file: a\ntls_key_file: b\ntls_ca_file: c\nclasses:\n- name: a\n";
        let e = parse(server).unwrap_err().to_string();
        assert!(e.contains("`classes` is a client option"), "{e}");
    }

    /// The transport mode of a client without classes (its one class's).
    fn mode_of(c: &Config) -> TransportMode {
        match &c.role {
            RoleConfig::Client(cl) => cl.classes[0].mode,
            RoleConfig::Server(_) => panic!("a client config"),
        }
    }

    #[test]
    fn seed_client_loads() {
        let c = parse(SEED_CLIENT).unwrap();
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        assert_eq!(cl.paths.len(), 2);
        assert_eq!(cl.paths[1].bind, Bind::Interface("enp7s7".into()));
        assert_eq!(cl.policy, Policy::Balanced);
        assert_eq!(mode_of(&c), TransportMode::Reliable);
        // The seed's `bbr` is our model-based BBR (the loss-tolerant one); its earlier name
        // still works.
        assert_eq!(c.congestion, Congestion::Bbr);
        let ours = parse(&SEED_CLIENT.replace(
            "congestion_algorithm: bbr",
            "congestion_algorithm: bbr-model",
        ))
        .unwrap();
        assert_eq!(ours.congestion, Congestion::Bbr);
        // No key at all: the defaults (bbr; each path choosing datagrams or its stream).
        let bare = parse(
            &SEED_CLIENT
                .replace("congestion_algorithm: bbr\n", "")
                .replace("transport_mode: reliable\n", ""),
        )
        .unwrap();
        assert_eq!(bare.congestion, Congestion::Bbr);
        assert_eq!(mode_of(&bare), TransportMode::Auto);
        // Status prints the name the config spells.
        for c in [
            Congestion::Bbr,
            Congestion::Bbr3,
            Congestion::Cubic,
            Congestion::Newreno,
            Congestion::QuinnBbr,
        ] {
            let text = format!("congestion_algorithm: {}", c.as_str());
            let parsed = parse(&SEED_CLIENT.replace("congestion_algorithm: bbr", &text)).unwrap();
            assert_eq!(parsed.congestion, c);
        }
    }

    /// The classes share each path's connection: one congestion controller, one FEC mode.
    #[test]
    fn classes_share_the_controller_and_the_fec_mode() {
        let classes = |crit: &str, bulk: &str| {
            format!(
                "{SEED_CLIENT}classes:\n- name: critical\n{crit}  match:\n  - protocol: icmp\n- name: default\n- name: bulk\n{bulk}  match:\n  - port: 873\n"
            )
        };
        let same = classes("  congestion_algorithm: bbr\n", "");
        assert!(parse(&same).is_ok(), "the top-level controller, said again");
        let bad = classes("", "  congestion_algorithm: cubic\n");
        let e = parse(&bad).unwrap_err();
        let at = bad.lines().position(|l| l.contains("cubic")).unwrap() + 1;
        assert_eq!(e.problems[0].line, at, "{e}");
        assert!(
            e.to_string().contains("share each path's connection"),
            "{e}"
        );
        assert!(e.to_string().contains("top level"), "{e}");
        let fec = |m: &str| format!("  transport_mode: datagram\n  fec: {m}\n");
        assert!(parse(&classes(&fec("auto"), &fec("auto"))).is_ok());
        assert!(
            parse(&classes(&fec("auto"), "")).is_ok(),
            "one class with FEC"
        );
        let e = parse(&classes(&fec("auto"), &fec("10/2"))).unwrap_err();
        assert!(
            e.to_string().contains("share each path's FEC groups"),
            "{e}"
        );
    }

    #[test]
    fn fec_modes_and_their_errors() {
        use mpquic_core::fec::FecMode;
        let bare = SEED_CLIENT.replace("transport_mode: reliable\n", "");
        let client = |text: &str| match parse(text).unwrap().role {
            RoleConfig::Client(c) => c,
            _ => panic!(),
        };
        // Off by default; auto alone also picks datagram mode (FEC is for datagrams).
        assert_eq!(client(&bare).fec, FecMode::Off);
        let auto = parse(&(bare.clone() + "fec: auto\n")).unwrap();
        assert_eq!(mode_of(&auto), TransportMode::Datagram);
        assert_eq!(client(&(bare.clone() + "fec: auto\n")).fec, FecMode::Auto);
        assert_eq!(
            client(&(bare.clone() + "fec: 10/2\n")).fec,
            FecMode::Fixed { k: 10, m: 2 }
        );
        assert_eq!(client(&(bare.clone() + "fec: 10/0\n")).fec, FecMode::Off);
        // Errors point at the line.
        let lines = bare.lines().count() + 1;
        for (bad, says) in [
            ("fec: sometimes", "off, auto or K/M"),
            ("fec: 100/2", "data shards"),
            ("fec: 10/40", "repair shards"),
        ] {
            let e = parse(&format!("{bare}{bad}\n")).unwrap_err();
            assert_eq!(e.problems[0].line, lines, "{e}");
            assert!(e.to_string().contains(says), "{e}");
        }
        let e = parse(&(SEED_CLIENT.to_string() + "fec: auto\n")).unwrap_err();
        assert!(
            e.to_string().contains("needs `transport_mode: datagram`"),
            "{e}"
        );
    }

    #[test]
    fn stripe_paths_fec_and_pipes() {
        use mpquic_core::fec::FecMode;
        let text = SEED_CLIENT.replace(
            "  weight: 1\n- name: wan5",
            "  weight: 1\n  pipes: 4\n  transport: stripe\n- name: wan5",
        ) + "stripe_port: 46017\n";
        let c = parse(&text).unwrap();
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        assert_eq!(cl.paths[0].transport, PathKind::Stripe);
        assert_eq!(cl.paths[1].transport, PathKind::Quic);
        assert_eq!(cl.stripe_port, Some(46017));
        // The seed's shards default to 10/2; stripe runs the tunnel in datagram mode, and says
        // so when the file asks for reliable.
        assert_eq!(cl.fec, FecMode::Fixed { k: 10, m: 2 });
        assert_eq!(mode_of(&c), TransportMode::Datagram);
        assert!(
            c.warnings.iter().any(|w| w.contains("datagram mode")),
            "{:?}",
            c.warnings
        );
        // Shards set: the FEC; bad shards: located errors.
        let c =
            parse(&(text.clone() + "stripe_data_shards: 20\nstripe_parity_shards: 4\n")).unwrap();
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        assert_eq!(cl.fec, FecMode::Fixed { k: 20, m: 4 });
        let e = parse(&(text.clone() + "stripe_parity_shards: 40\n")).unwrap_err();
        assert_eq!(e.problems[0].line, 30, "{e}");
        assert!(e.to_string().contains("repair shards"), "{e}");
        // A loss-based controller cannot pace stripe; stripe keys without a stripe path are
        // mistakes.
        let e = parse(&text.replace("congestion_algorithm: bbr", "congestion_algorithm: cubic"))
            .unwrap_err();
        assert!(e.to_string().contains("bbr or bbr3"), "{e}");
        let e = parse(&(SEED_CLIENT.to_string() + "stripe_port: 46017\n")).unwrap_err();
        assert!(
            e.to_string().contains("no path has `transport: stripe`"),
            "{e}"
        );
        let e = parse(&text.replace("transport: stripe", "transport: stripey")).unwrap_err();
        assert!(e.to_string().contains("did you mean `stripe`?"), "{e}");
        let four = SEED_CLIENT.replace(
            "  weight: 1\n- name: wan5",
            "  weight: 1\n  pipes: 4\n- name: wan5",
        );
        let c = parse(&four).unwrap();
        let RoleConfig::Client(cc) = &c.role else {
            panic!()
        };
        assert_eq!(cc.paths.iter().map(|p| p.pipes).collect::<Vec<_>>(), [4, 1]);
        let e = parse(&SEED_CLIENT.replace(
            "  weight: 1\n- name: wan5",
            "  weight: 1\n  pipes: 17\n- name: wan5",
        ))
        .unwrap_err();
        assert_eq!(e.problems[0].line, 21, "{e}");
        assert!(e.to_string().contains("1 to 16 pipes"), "{e}");
    }

    #[test]
    fn seed_stripe_examples_load() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/seed/");
        let c = Config::load(&PathBuf::from(format!("{dir}client-stripe.yaml"))).unwrap();
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        assert!(cl
            .paths
            .iter()
            .all(|p| p.transport == PathKind::Stripe && p.pipes == 4));
        let s = Config::load(&PathBuf::from(format!("{dir}server-stripe.yaml"))).unwrap();
        let RoleConfig::Server(sv) = &s.role else {
            panic!()
        };
        assert_eq!(sv.stripe, Some("0.0.0.0:46017".parse().unwrap()));
        // The server's parity line is reported as having no effect, not silently dropped.
        assert!(s
            .warnings
            .iter()
            .any(|w| w.contains("stripe_parity_shards")));
        // Without stripe_enabled, a stripe_port is a mistake.
        let e = Config::parse(
            "role: server\ntun_cidr: 10.0.0.1/24\ntls_cert_file: a\ntls_key_file: b\nstripe_port: 46017\n",
            std::path::Path::new("s.yaml"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("stripe_enabled"), "{e}");
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
    fn a_dual_stack_tun_cidr_is_the_servers_alone() {
        let server = "role: server\ntun_cidr: 10.200.17.254/24, fd00:17::fe/64\ntls_cert_file: /s.crt\ntls_key_file: /s.key\n";
        let c = parse(server).unwrap();
        let RoleConfig::Server(s) = &c.role else {
            panic!()
        };
        let (a6, plan) = s.ipv6.unwrap();
        assert_eq!(a6, "fd00:17::fe".parse::<Ipv6Addr>().unwrap());
        assert_eq!(plan.prefix6(), 64);
        for (bad, says) in [
            ("fd00:17::1/64", "would be a client's"),
            ("fd00:17::fe/124", "fewer host numbers"),
            ("fd00:17::zz/64", "not an IPv6 address"),
            (
                "fd00:17::fe/64, 10.1.1.1/24",
                "at most one IPv4 and one IPv6",
            ),
        ] {
            let text = server.replace("fd00:17::fe/64", bad);
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("test.yaml:2:"), "{bad}: {e}");
        }
        let client = SEED_CLIENT.replace(
            "tun_cidr: 10.200.17.1/24",
            "tun_cidr: 10.200.17.1/24, fd00:17::1/64",
        );
        let e = parse(&client).unwrap_err().to_string();
        assert!(e.contains("comes from the server"), "{e}");
    }

    #[test]
    fn masque_keys_take_a_listen_address_a_template_and_tokens_and_say_where_one_is_wrong() {
        const SERVER: &str = "role: server\nremote_port: 45017\ntun_name: mp1\ntun_cidr: 10.200.17.254/24\ntls_cert_file: /s.crt\ntls_key_file: /s.key\n";
        let hash = mpquic_core::connect_ip::TokenHash::new("mpq_x", &[3; 16]).to_string();
        let c = parse(&format!(
            "{SERVER}masque_listen: 0.0.0.0:443\nmasque_template: /vpn\nmasque_tokens:\n- name: phone1\n  hash: {hash}\n"
        ))
        .unwrap();
        let RoleConfig::Server(s) = &c.role else {
            panic!()
        };
        let m = s.masque.as_ref().unwrap();
        assert_eq!(m.listen.port(), 443);
        assert_eq!(m.tokens.len(), 1);
        assert!(m.tokens[0].1.verify("mpq_x"));
        assert!(m.template.matches("/vpn").is_ok());
        // Without CONNECT-IP: off.
        let RoleConfig::Server(s) = parse(SERVER).unwrap().role else {
            panic!()
        };
        assert!(s.masque.is_none());
        for (yaml, line, says) in [
            (format!("{SERVER}masque_tokens:\n- name: a\n  hash: {hash}\n"), 7, "`masque_listen` is not"),
            (format!("{SERVER}masque_listen: 0.0.0.0:45017\n"), 7, "is the QUIC port"),
            (format!("{SERVER}masque_listen: 0.0.0.0:443\nmasque_tokens:\n- name: a\n  hash: sha256:zz\n"), 10, "sha256:SALT:DIGEST"),
            (format!("{SERVER}masque_listen: 0.0.0.0:443\nmasque_tokens:\n- name: a\n  hash: {hash}\n- name: a\n  hash: {hash}\n"), 11, "duplicate name"),
            (format!("{SERVER}masque_listen: 0.0.0.0:443\nmasque_template: vpn{{x}}\n"), 8, "masque_template"),
        ] {
            let e = parse(&yaml).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(&format!(".yaml:{line}:")), "{yaml}\n{e}");
        }
        let client =
            "role: client\nremote_addr: 1.2.3.4\ntls_ca_file: ca\nmasque_listen: 0.0.0.0:443\n";
        assert!(parse(client)
            .unwrap_err()
            .to_string()
            .contains("`masque_listen` is a server option"));
    }

    #[test]
    fn a_masque_client_takes_a_token_and_a_path_on_one_path_without_fec_or_classes() {
        const CLIENT: &str =
            "role: client\nremote_addr: 1.2.3.4\nremote_port: 443\ntls_ca_file: ca\n";
        let c = parse(&format!("{CLIENT}protocol: masque\nmasque_token: mpq_ab\n")).unwrap();
        let RoleConfig::Client(cc) = &c.role else {
            panic!()
        };
        let m = cc.masque.as_ref().unwrap();
        assert_eq!(m.token.as_deref(), Some("mpq_ab"));
        assert_eq!(m.path, masque::DEFAULT_PATH);
        // A token stands in for the certificate: no warning about a missing one.
        assert!(
            c.warnings
                .iter()
                .all(|w| !w.contains("no client certificate")),
            "{:?}",
            c.warnings
        );
        let RoleConfig::Client(cc) = parse(CLIENT).unwrap().role else {
            panic!()
        };
        assert!(cc.masque.is_none());
        // Several paths take turns (one connected at a time).
        let two = "multipath_enabled: true\nmultipath_paths:\n- {name: a, remote_addr: 1.2.3.4}\n- {name: b, remote_addr: 1.2.3.4}\n";
        let RoleConfig::Client(cc) = parse(&format!("{CLIENT}protocol: masque\n{two}"))
            .unwrap()
            .role
        else {
            panic!()
        };
        assert_eq!(cc.paths.len(), 2);
        // Datagram mode (HTTP Datagrams), whatever was asked, with a word when it was not; a
        // per-packet policy is taken (an mpquic server bonds).
        let c = parse(&format!(
            "{CLIENT}protocol: masque\ntransport_mode: reliable\nmultipath_policy: wlb\n{two}"
        ))
        .unwrap();
        assert_eq!(mode_of(&c), TransportMode::Datagram);
        assert!(
            (c.warnings.iter()).any(|w| w.contains("does not apply over CONNECT-IP")),
            "{:?}",
            c.warnings
        );
        let c = parse(&format!("{CLIENT}protocol: masque\n")).unwrap();
        assert_eq!(mode_of(&c), TransportMode::Datagram);
        for (extra, says) in [
            ("protocol: masqe\n".to_string(), "did you mean `masque`"),
            (
                "masque_token: mpq_ab\n".to_string(),
                "`protocol` is not masque",
            ),
            (
                "protocol: masque\nmasque_path: vpn\n".to_string(),
                "not a request path",
            ),
            (
                "protocol: masque\nfec: auto\n".to_string(),
                "FEC is not carried",
            ),
        ] {
            let e = parse(&format!("{CLIENT}{extra}")).unwrap_err().to_string();
            assert!(e.contains(says), "{extra}\n{e}");
        }
        let server = "role: server\ntun_cidr: 10.200.17.254/24\ntls_cert_file: /s.crt\ntls_key_file: /s.key\nprotocol: masque\n";
        assert!(parse(server)
            .unwrap_err()
            .to_string()
            .contains("`protocol` is a client option"));
    }

    #[test]
    fn path_limits_take_rates_roles_and_budgets_and_say_where_they_are_wrong() {
        const CLIENT: &str = "role: client\nremote_addr: 1.2.3.4\ntls_ca_file: ca\nmultipath_enabled: true\nmultipath_paths:\n";
        let c = parse(&format!(
            "{CLIENT}- {{name: lte, rate_limit: 5, role: backup, data_budget: {{limit: 30GB, reset_day: 15}}}}\n- {{name: dsl, data_budget: {{limit: 500MB, period: day, warn_at: 90}}}}\n- {{name: sat, role: overflow}}\n"
        ))
        .unwrap();
        let RoleConfig::Client(cc) = &c.role else {
            panic!()
        };
        let caps: Vec<_> = cc.paths.iter().map(|p| p.rate_limit).collect();
        assert_eq!(caps, [Some(5_000_000), None, None]);
        let roles: Vec<_> = cc.paths.iter().map(|p| p.role.as_str()).collect();
        assert_eq!(roles, ["backup", "primary", "overflow"]);
        use mpquic_core::path::budget::{Budget, Period};
        assert_eq!(
            cc.paths[0].data_budget,
            Some(Budget {
                limit: 30_000_000_000,
                period: Period::Month { reset_day: 15 },
                warn_at: 0.8
            })
        );
        assert_eq!(
            cc.paths[1].data_budget,
            Some(Budget {
                limit: 500_000_000,
                period: Period::Day,
                warn_at: 0.9
            })
        );
        assert_eq!(cc.state_dir, Path::new("/var/lib/mpquic"));
        for (path, says) in [
            ("{name: lte, rate_limit: 0}", "from 0.1 to 100000"),
            (
                "{name: lte, rate_limit: 5, pipes: 2}",
                "not applied to pipes or stripe",
            ),
            (
                "{name: lte, role: standby}",
                "valid values: primary, backup, overflow",
            ),
            (
                "{name: lte, data_budget: {limit: 30 gigs}}",
                "at least 1 MB",
            ),
            (
                "{name: lte, data_budget: {limit: 1GB, reset_day: 32}}",
                "1 to 31",
            ),
            (
                "{name: lte, data_budget: {limit: 1GB, period: week}}",
                "unknown period",
            ),
            (
                "{name: lte, data_budget: {limit: 1GB, period: day, reset_day: 3}}",
                "monthly",
            ),
            (
                "{name: lte, data_budget: {limit: 1GB, warn_at: 0}}",
                "1 to 100",
            ),
            (
                "{name: lte, transport: stripe, data_budget: {limit: 1GB}}",
                "not applied to stripe",
            ),
        ] {
            let e = parse(&format!("{CLIENT}- {path}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(says) && e.contains("test.yaml:6:"),
                "{path}: {e}"
            );
        }
        let e = parse(&format!("state_dir: var/mpquic\n{CLIENT}- {{name: a}}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("absolute"), "{e}");
    }

    #[test]
    fn a_path_says_what_link_it_runs_over() {
        const CLIENT: &str = "role: client\nremote_addr: 1.2.3.4\ntls_ca_file: ca\nmultipath_enabled: true\nmultipath_paths:\n";
        let c = parse(&format!(
            "{CLIENT}- {{name: dish, link: starlink}}\n- {{name: lte}}\n- {{name: dsl, link: other}}\n- {{name: b, link: auto}}\n"
        ))
        .unwrap();
        let RoleConfig::Client(cc) = &c.role else {
            panic!()
        };
        // Unset or `auto`: recognised by its probes; `other` or `starlink`: as said.
        let links: Vec<_> = cc.paths.iter().map(|p| (p.link, p.detect_link)).collect();
        assert_eq!(
            links,
            [
                (LinkKind::Starlink, false),
                (LinkKind::Other, true),
                (LinkKind::Other, false),
                (LinkKind::Other, true)
            ]
        );
        let e = parse(&format!("{CLIENT}- {{name: dish, link: starlnk}}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("test.yaml:6:") && e.contains("did you mean `starlink`?"),
            "{e}"
        );
    }

    #[test]
    fn a_misspelt_mode_or_controller_is_named_with_its_line_and_the_closest_name() {
        const CLIENT: &str =
            "role: client\nremote_addr: 1.2.3.4\nremote_port: 5000\ntls_ca_file: ca\n";
        for (line, says) in [
            ("transport_mode: datagam", "did you mean `datagram`"),
            ("congestion_algorithm: bbr2", "did you mean `bbr`"),
        ] {
            let e = parse(&format!("{CLIENT}{line}\n")).unwrap_err().to_string();
            assert!(e.contains("test.yaml:5:") && e.contains(says), "{e}");
        }
    }

    #[test]
    fn the_mptcp_lane_is_a_class_key_with_a_server_port() {
        const CLIENT: &str =
            "role: client\nremote_addr: 1.2.3.4\nremote_port: 5000\ntls_ca_file: ca\n";
        let c = parse(&format!("{CLIENT}tcp_lane: mptcp\n")).unwrap();
        let RoleConfig::Client(cc) = &c.role else {
            panic!()
        };
        assert!(cc.classes[0].tcp_lane);
        assert_eq!(cc.tcp_lane_port, 5001);
        assert!(c.warnings.iter().all(|w| !w.contains("MPTCP lane")));
        // A capped or budgeted path: the lane's subflows on it are neither; said.
        let c = parse(
            "role: client\ntls_ca_file: ca\ntcp_lane: mptcp\nmultipath_paths:\n- {name: lte, remote_addr: 1.2.3.4, remote_port: 5000, rate_limit: 5}\n",
        )
        .unwrap();
        assert!(
            (c.warnings.iter()).any(|w| w.contains(
                "path lte: rate_limit and data_budget hold for the tunnel, not for the MPTCP lane"
            )),
            "{:?}",
            c.warnings
        );
        let c = parse(&format!(
            "{CLIENT}tcp_lane_port: 443\nclasses:\n- {{name: web, tcp_lane: mptcp, match: [{{port: 443}}]}}\n- {{name: default}}\n"
        ))
        .unwrap();
        let RoleConfig::Client(cc) = &c.role else {
            panic!()
        };
        let lanes: Vec<bool> = cc.classes.iter().map(|k| k.tcp_lane).collect();
        assert_eq!((lanes, cc.tcp_lane_port), (vec![true, false], 443));
        for (text, says) in [
            (
                format!("{CLIENT}tcp_lane: quic\n"),
                "valid values: mptcp, off",
            ),
            (
                format!("{CLIENT}tcp_lane: mptcp\nclasses:\n- {{name: default}}\n"),
                "a class's key",
            ),
            (
                format!("{CLIENT}tcp_lane_listen: 0.0.0.0:1\n"),
                "a server option",
            ),
            (
                format!("{CLIENT}protocol: masque\ntcp_lane: mptcp\n"),
                "not with `protocol: masque`",
            ),
        ] {
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
        const SERVER: &str = "role: server\nremote_port: 45017\ntun_name: mp1\ntun_cidr: 10.200.17.254/24\ntls_cert_file: /s.crt\ntls_key_file: /s.key\n";
        let s = parse(&format!("{SERVER}tcp_lane_listen: 0.0.0.0:45018\n")).unwrap();
        let RoleConfig::Server(sc) = &s.role else {
            panic!()
        };
        assert_eq!(sc.tcp_lane, Some("0.0.0.0:45018".parse().unwrap()));
        let e = parse(&format!("{SERVER}tcp_lane_listen: 45018\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("an address and a TCP port") && e.contains("test.yaml:7:"),
            "{e}"
        );
        let e = parse(&format!("{SERVER}tcp_lane: mptcp\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("client option"), "{e}");
    }

    #[test]
    fn revoked_takes_names_and_serials_and_says_where_one_is_wrong() {
        const SERVER: &str = "role: server\nremote_port: 45017\ntun_name: mp1\ntun_cidr: 10.200.17.254/24\ntls_cert_file: /s.crt\ntls_key_file: /s.key\n";
        let c = parse(&format!("{SERVER}revoked:\n- site3\n- 'serial:00:1B:06'\n")).unwrap();
        let RoleConfig::Server(s) = &c.role else {
            panic!()
        };
        assert_eq!(
            s.revoked,
            vec!["site3".to_string(), "serial:1b06".to_string()]
        );
        let e = parse(&format!("{SERVER}revoked:\n- site3\n- serial:xyz\n")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("`serial:xyz` is not a certificate serial"),
            "{text}"
        );
        assert!(text.contains(":9:"), "the line of the bad entry: {text}");
        let client = "role: client\nremote_addr: 1.2.3.4\ntls_ca_file: ca\nrevoked: [site3]\n";
        assert!(parse(client)
            .unwrap_err()
            .to_string()
            .contains("`revoked` is a server option"));
    }

    #[test]
    fn routed_lans_are_checked_for_form_and_overlaps() {
        const SERVER: &str = "role: server\nremote_port: 45017\ntun_name: mp1\ntun_cidr: 10.200.17.254/24\ntls_cert_file: /s.crt\ntls_key_file: /s.key\n";
        let c = parse(&format!("{SERVER}clients:\n- name: site1\n  routes: [192.168.50.0/24, 172.16.0.0/16]\n- name: site2\n  address: 10.200.17.9\n")).unwrap();
        let RoleConfig::Server(s) = &c.role else {
            panic!()
        };
        assert_eq!(s.routes.len(), 2);
        assert_eq!(
            s.clients,
            vec![("site2".to_string(), Ipv4Addr::new(10, 200, 17, 9))]
        );
        let e = parse(&format!("{SERVER}clients:\n- name: site1\n  routes: [192.168.50.0/24]\n- name: site2\n  routes: [192.168.0.0/16]\n")).unwrap_err().to_string();
        assert!(
            e.contains("overlaps 192.168.50.0/24, a LAN prefix of client `site1`"),
            "{e}"
        );
        let e = parse(&format!(
            "{SERVER}clients:\n- name: site1\n  routes: [10.200.17.0/25]\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("the tunnel subnet"), "{e}");
        let e = parse(&format!(
            "{SERVER}clients:\n- name: site1\n  routes: [192.168.50.1/24]\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("host bits set") && e.contains("did you mean 192.168.50.0/24"),
            "{e}"
        );
        let e = parse(&format!("{SERVER}lan_prefixes: [192.168.50.0/24]\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`lan_prefixes` is a client option"), "{e}");
        // The client: its announcement is checked against its own tunnel subnet.
        let c = parse(&format!("{SEED_CLIENT}lan_prefixes: [192.168.50.0/24]\n")).unwrap();
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        assert_eq!(cl.lan_prefixes.len(), 1);
        let e = parse(&format!("{SEED_CLIENT}lan_prefixes: [10.200.0.0/16]\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlaps the tunnel subnet"), "{e}");
        let e = parse(&format!("{SEED_CLIENT}lan_prefixes: [0.0.0.0/0]\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("default route"), "{e}");
        let e = parse(&format!("{SEED_CLIENT}lan_prefixes: [192.168.50]\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a prefix"), "{e}");
    }

    #[test]
    fn ipv6_site_lans_need_a_dual_stack_tunnel() {
        const V4: &str = "role: server\nremote_port: 45017\ntun_name: mp1\ntun_cidr: 10.200.17.254/24\ntls_cert_file: /s.crt\ntls_key_file: /s.key\n";
        let dual = V4.replace("10.200.17.254/24", "10.200.17.254/24, fd00:17::fe/64");
        let routes = |r: &str| format!("clients:\n- name: site1\n  routes: [{r}]\n");
        let e = parse(&format!("{V4}{}", routes("fd00:50::/64")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("IPv4 only") && e.contains("give `tun_cidr` an IPv6 part"),
            "{e}"
        );
        let c = parse(&format!(
            "{dual}{}",
            routes("192.168.50.0/24, fd00:50::/64")
        ))
        .unwrap();
        let RoleConfig::Server(s) = &c.role else {
            panic!()
        };
        assert_eq!(s.routes.len(), 2);
        let e = parse(&format!("{dual}{}", routes("fd00:17::/80")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("overlaps fd00:17::/64, the tunnel subnet"),
            "{e}"
        );
        let e = parse(&format!("{dual}{}", routes("fd00:50::1/64")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean fd00:50::/64"), "{e}");
        // The client announces IPv6 prefixes as it does IPv4 ones.
        let c = parse(&format!(
            "{SEED_CLIENT}lan_prefixes: [192.168.50.0/24, fd00:50::/64]\n"
        ))
        .unwrap();
        let RoleConfig::Client(cl) = &c.role else {
            panic!()
        };
        assert_eq!(cl.lan_prefixes.len(), 2);
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
    fn dashboard_off_loopback_needs_a_token() {
        let with = |extra: &str| {
            parse(&SEED_CLIENT.replace("log_level: info", &format!("log_level: info\n{extra}")))
        };
        assert!(with("").unwrap().dashboard.is_none());
        let d = with("dashboard_listen: 127.0.0.1:9480").unwrap().dashboard;
        assert!(d.is_some_and(|d| d.token.is_none()));
        let e = with("dashboard_listen: 0.0.0.0:9480")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("test.yaml:7") && e.contains("no `dashboard_token`"),
            "{e}"
        );
        let c = with("dashboard_listen: 0.0.0.0:9480\ndashboard_token: 0123456789abcdef");
        assert!(c.is_ok());
        let e = with("dashboard_listen: 0.0.0.0:9480\ndashboard_token: short")
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 16 characters"), "{e}");
        let e = with("dashboard_token: has spaces in it ok?")
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 16 characters"), "{e}");
    }

    #[test]
    fn log_format_text_or_json() {
        assert!(!parse(SEED_CLIENT).unwrap().log_json);
        let c = parse(&SEED_CLIENT.replace("log_level: info", "log_level: info\nlog_format: json"));
        assert!(c.unwrap().log_json);
        let e = parse(&SEED_CLIENT.replace("log_level: info", "log_level: info\nlog_format: jsn"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("test.yaml:7") && e.contains("did you mean `json`"),
            "{e}"
        );
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

    #[test]
    fn more_paths_than_a_server_session_takes_are_refused() {
        let mut text =
            String::from("role: client\ntls_ca_file: ca\nremote_addr: 1.2.3.4\nmultipath_paths:\n");
        for i in 0..65 {
            text.push_str(&format!("- name: p{i}\n"));
        }
        let e = parse(&text).unwrap_err();
        assert!(
            e.to_string()
                .contains("65 paths: a server takes at most 64"),
            "{e}"
        );
        assert_eq!(e.problems[0].line, 4 + 65, "{e}");
    }

    /// Nested keys are located by their place in the structure: the same key name earlier in
    /// the file (a comment, another section, a later top-level key) does not mislead it.
    #[test]
    fn nested_problems_point_at_their_own_key() {
        let text = "# weight: 0 and bind_ip: in a comment\nrole: client\ntls_ca_file: ca\n\
                    multipath_paths:\n- name: a\n  remote_addr: 1.2.3.4\n  weight: 3\n\
                    - name: b\n  remote_addr: 1.2.3.4\n  bind_ip: nonsense\n  weight: 0\n\
                    bind_ip: 0.0.0.0\n";
        let e = parse(text).unwrap_err();
        let at: Vec<(usize, usize, &str)> = e
            .problems
            .iter()
            .map(|p| (p.line, p.column, p.message.as_str()))
            .collect();
        assert_eq!(at.len(), 2, "{e}");
        assert_eq!((at[0].0, at[0].1), (10, 3), "{e}");
        assert!(at[0].2.contains("nonsense"), "{e}");
        assert_eq!((at[1].0, at[1].1), (11, 3), "{e}");
        assert!(at[1].2.contains("`weight` must be at least 1"), "{e}");
        // A key that is missing is reported at its item.
        let e = parse("role: client\ntls_ca_file: ca\nmultipath_paths:\n- name: a\n  weight: 2\n")
            .unwrap_err();
        assert_eq!((e.problems[0].line, e.problems[0].column), (4, 3), "{e}");
        assert!(e.to_string().contains("has no `remote_addr`"), "{e}");
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
