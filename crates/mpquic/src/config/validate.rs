//! `RawConfig` -> `Config`, one function per section: features not built yet, the general keys,
//! the server's, the client's and its paths. Every problem is located by the key's path in the
//! YAML structure (`positions.rs`), so all of them are reported at once, each at its own line.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use mpquic_core::classify::Prefix;
use mpquic_core::fec::FecMode;
use mpquic_core::path::reconfig::LinkKind;
use mpquic_core::sessions::MAX_PATHS_PER_SESSION;
use mpquic_core::Policy;

use super::checker::Checker;

/// Pipes per path: each is a QUIC connection and a socket.
const MAX_PIPES: u32 = 16;
use super::{
    mask, parse_cidr, parse_cidr6, Bind, ClassConfig, ClientConfig, Config, Congestion, Ipv6Plan,
    PathConfig, PathKind, Problem, RawConfig, Role, RoleConfig, ServerConfig, TransportMode,
    DEFAULT_PORT,
};

/// `bind_ip` at `path`: an address, `if:INTERFACE`, or none.
fn bind(c: &mut Checker, s: Option<&str>, path: &str) -> Bind {
    let Some(s) = s else { return Bind::Any };
    parse_bind(s).unwrap_or_else(|| {
        c.at(
            path,
            format!("`bind_ip`: `{s}` is neither an IP address nor if:INTERFACE"),
            Some("e.g. bind_ip: if:eth1 or bind_ip: 192.0.2.10".into()),
        );
        Bind::Any
    })
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

/// The keys both roles share, validated.
struct General {
    tun_name: String,
    log_level: String,
    log_json: bool,
    tun_cidr: Option<(Ipv4Addr, u8)>,
    /// The IPv6 part of a dual-stack `tun_cidr`.
    tun_cidr6: Option<(Ipv6Addr, u8)>,
    policy: Policy,
}

pub(super) fn validate(raw: RawConfig, text: &str) -> Result<Config, Vec<Problem>> {
    let mut c = Checker::new(text);
    let g = general(&raw, &mut c);
    let mut role = match raw.role {
        Role::Server => RoleConfig::Server(server(&raw, &g, &mut c)),
        Role::Client => RoleConfig::Client(client(&raw, &g, &mut c)),
    };
    let mode = mode(&raw, &role, &mut c);
    // Defaults chosen by measurement for lossy links (docs/BENCHMARKS.md, "Loss").
    let congestion = raw.congestion_algorithm.unwrap_or(Congestion::Bbr);
    if let RoleConfig::Client(cl) = &mut role {
        let top = ClassConfig {
            name: "default".into(),
            explicit: false,
            policy: cl.policy,
            mode,
            fec: cl.fec,
            tun_name: None,
            tcp_lane: super::lane::lane(raw.tcp_lane.as_deref(), "tcp_lane", &mut c),
        };
        let stripe = cl.paths.iter().any(|p| p.transport == PathKind::Stripe);
        (cl.classes, cl.classifier) =
            super::classes::classes(&raw, &mut c, top, congestion, stripe, &g.tun_name);
        super::lane::client_checks(&raw, cl, &mut c);
    } else if !raw.classes.is_empty() {
        c.at(
            "classes",
            "`classes` is a client option".into(),
            Some("the server keeps each flow's class from the packets the client sends".into()),
        );
    }
    let dashboard = dashboard(&raw, &mut c);
    if !c.problems.is_empty() {
        c.problems.sort_by_key(|p| (p.line, p.column));
        return Err(c.problems);
    }
    let control_socket = raw
        .control_socket
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("/run/mpquic/{}.sock", g.tun_name)));
    Ok(Config {
        tun_name: g.tun_name,
        tun_mtu: raw.tun_mtu,
        log_level: g.log_level,
        log_json: g.log_json,
        cert_file: raw.tls_cert_file,
        key_file: raw.tls_key_file,
        tls_post_quantum: raw.tls_post_quantum.unwrap_or(true),
        congestion,
        control_socket,
        metrics_listen: raw.metrics_listen,
        dashboard,
        worker_threads: raw.worker_threads.unwrap_or(1),
        tun_offload: raw.tun_offload.unwrap_or(true),
        role,
        warnings: c.warnings,
        // Set by `Config::parse`, which knows it.
        file: PathBuf::new(),
    })
}

fn general(raw: &RawConfig, c: &mut Checker) -> General {
    let tun_name = raw.tun_name.clone().unwrap_or_else(|| "mpquic0".into());
    if tun_name.is_empty() || tun_name.len() > 15 || tun_name.contains(['/', ' ']) {
        c.at(
            "tun_name",
            format!("`tun_name`: `{tun_name}` is not a valid interface name"),
            Some("use 1-15 characters without '/' or spaces, e.g. mp1".into()),
        );
    }
    if let Some(m) = raw.tun_mtu.filter(|m| !(576..=9000).contains(m)) {
        c.at(
            "tun_mtu",
            format!("`tun_mtu`: {m} is out of range"),
            Some("use 576..9000, or leave it out to derive it from the path MTU".into()),
        );
    }
    if let Some(n) = raw.worker_threads.filter(|n| !(1..=64).contains(n)) {
        c.at(
            "worker_threads",
            format!("`worker_threads`: {n} is out of range"),
            Some("use 1..64; 1 is fastest on small machines".into()),
        );
    }
    let log_level = raw.log_level.clone().unwrap_or_else(|| "info".into());
    const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];
    if !LEVELS.contains(&log_level.as_str()) {
        c.unknown_value("log_level", "level", &log_level, &LEVELS);
    }
    let log_json = match raw.log_format.as_deref() {
        None | Some("text") => false,
        Some("json") => true,
        Some(s) => {
            c.unknown_value("log_format", "format", s, &["text", "json"]);
            false
        }
    };
    // `a.b.c.d/len`, or dual-stack `a.b.c.d/len, x:y::z/len` (the IPv6 part: server only).
    let mut parts = raw.tun_cidr.as_deref().map(|s| s.split(',').map(str::trim));
    let tun_cidr = parts.as_mut().and_then(|p| p.next()).and_then(|s| {
        let v = parse_cidr(s);
        if v.is_none() {
            c.at(
                "tun_cidr",
                format!("`tun_cidr`: `{s}` is not an IPv4 address with prefix"),
                Some("e.g. 10.200.17.1/24 (dual-stack: 10.200.17.254/24, fd00:17::fe/64)".into()),
            );
        }
        v
    });
    let tun_cidr6 = parts.as_mut().and_then(|p| p.next()).and_then(|s| {
        let v = parse_cidr6(s);
        if v.is_none() {
            c.at(
                "tun_cidr",
                format!("`tun_cidr`: `{s}` is not an IPv6 address with prefix"),
                Some(
                    "dual-stack: IPv4 first, then IPv6, e.g. 10.200.17.254/24, fd00:17::fe/64"
                        .into(),
                ),
            );
        }
        v
    });
    if let Some(extra) = parts.as_mut().and_then(|p| p.next()) {
        c.at(
            "tun_cidr",
            format!("`tun_cidr`: `{extra}`: at most one IPv4 and one IPv6 address"),
            None,
        );
    }
    let policy = match raw.multipath_policy.as_deref() {
        None => Policy::Failover,
        Some(s) => Policy::parse(s).unwrap_or_else(|| {
            let names: Vec<&str> = Policy::ALL.iter().map(|p| p.as_str()).collect();
            c.unknown_value("multipath_policy", "policy", s, &names);
            Policy::Failover
        }),
    };
    General {
        tun_name,
        log_level,
        log_json,
        tun_cidr,
        tun_cidr6,
        policy,
    }
}

fn server(raw: &RawConfig, g: &General, c: &mut Checker) -> ServerConfig {
    if raw.state_dir.is_some() {
        c.at(
            "state_dir",
            "`state_dir` is a client option (where its paths' data budgets are kept)".into(),
            None,
        );
    }
    let listen_ip = match raw.bind_ip.as_deref().map(parse_bind) {
        None | Some(Some(Bind::Any)) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Some(Some(Bind::Ip(ip))) => ip,
        Some(_) => {
            c.at(
                "bind_ip",
                "`bind_ip`: the server listens on an IP address".into(),
                Some("e.g. bind_ip: 0.0.0.0".into()),
            );
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        }
    };
    let port = raw.remote_port.unwrap_or(DEFAULT_PORT);
    let (tun_addr, prefix) = g.tun_cidr.unwrap_or_else(|| {
        if raw.tun_cidr.is_none() {
            c.at(
                "role",
                "a server needs `tun_cidr` (its tunnel address and the client pool)".into(),
                Some("e.g. tun_cidr: 10.200.17.254/24".into()),
            );
        }
        (Ipv4Addr::UNSPECIFIED, 24)
    });
    let ipv6 = g.tun_cidr6.and_then(|v6| {
        Ipv6Plan::new((tun_addr, prefix), v6)
            .map_err(|e| c.at("tun_cidr", format!("`tun_cidr`: {e}"), None))
            .ok()
            .map(|plan| (v6.0, plan))
    });
    if prefix > 30 && raw.tun_cidr.is_some() {
        c.at(
            "tun_cidr",
            "`tun_cidr`: the server's prefix leaves no room for clients".into(),
            Some("use a /30 or larger network, e.g. /24".into()),
        );
    }
    for (key, missing) in [
        ("tls_cert_file", raw.tls_cert_file.is_none()),
        ("tls_key_file", raw.tls_key_file.is_none()),
    ] {
        if missing {
            c.at(
                "role",
                format!("a server needs `{key}`"),
                Some("create them with: mpquic pki server --dir DIR --name NAME".into()),
            );
        }
    }
    // Clients are verified against `tls_ca_file`; the seed's server files have none, so the CA
    // written by `mpquic pki` next to the server certificate is the default.
    let client_ca_file = raw.tls_ca_file.clone().or_else(|| {
        let dir = raw.tls_cert_file.as_ref()?.parent()?;
        Some(dir.join("ca.crt"))
    });
    let client_ca_file = client_ca_file.unwrap_or_default();
    if raw.tls_ca_file.is_none() && raw.tls_cert_file.is_some() {
        c.warnings.push(format!(
            "tls_ca_file not set: clients are verified against {}",
            client_ca_file.display()
        ));
    }
    if raw.tls_insecure_skip_verify {
        c.at(
            "tls_insecure_skip_verify",
            "`tls_insecure_skip_verify` is a client option; a server always verifies clients"
                .into(),
            None,
        );
    }
    if raw.fec.is_some() {
        c.at(
            "fec",
            "`fec` is a client option".into(),
            Some("each client chooses FEC for its own tunnel (both directions)".into()),
        );
    }
    if !raw.multipath_paths.is_empty() {
        c.at(
            "multipath_paths",
            "`multipath_paths` is a client option".into(),
            Some("the server learns each client's paths when they connect".into()),
        );
    }
    let net = u32::from(tun_addr) & mask(prefix);
    let mut clients: Vec<(String, Ipv4Addr)> = Vec::new();
    let mut routes: Vec<(String, Prefix)> = Vec::new();
    let tunnel_nets: Vec<Prefix> = std::iter::once(network(tun_addr, prefix))
        .chain(ipv6.map(|(a, plan)| {
            Prefix {
                addr: a.into(),
                len: plan.prefix6(),
            }
            .network()
        }))
        .collect();
    for (i, cl) in raw.clients.iter().enumerate() {
        for (j, r) in cl.routes.iter().enumerate() {
            let at = format!("clients[{i}].routes[{j}]");
            let Some(p) = lan_prefix(c, &at, r) else {
                continue;
            };
            if p.addr.is_ipv6() && ipv6.is_none() {
                // The device carries no IPv6 in an IPv4-only tunnel (`Tun::disable_ipv6`).
                c.at(
                    &at,
                    format!("`{r}` is an IPv6 LAN, and the tunnel is IPv4 only"),
                    Some("give `tun_cidr` an IPv6 part, e.g. tun_cidr: 10.200.17.254/24, fd00:17::fe/64".into()),
                );
                continue;
            }
            let clash = (tunnel_nets
                .iter()
                .map(|q| (q, "the tunnel subnet".to_string())))
            .chain(
                routes
                    .iter()
                    .map(|(n, q)| (q, format!("a LAN prefix of client `{n}`"))),
            );
            for (q, what) in clash {
                if p.overlaps(q) {
                    c.at(
                        &at,
                        format!("`{r}` overlaps {q}, {what}"),
                        Some("each prefix routes to one client; they must not overlap".into()),
                    );
                    break;
                }
            }
            routes.push((cl.name.clone(), p));
        }
        if clients.iter().any(|(n, _)| *n == cl.name) {
            c.at(
                &format!("clients[{i}].name"),
                format!("client `{}`: duplicate name", cl.name),
                None,
            );
        }
        let Some(address) = cl.address else {
            continue;
        };
        let a = u32::from(address);
        let host_part = a & !mask(prefix);
        if a & mask(prefix) != net
            || host_part == 0
            || host_part == !mask(prefix)
            || address == tun_addr
        {
            c.at(
                &format!("clients[{i}].address"),
                format!(
                    "client `{}`: {} is not a usable host address in {}/{}",
                    cl.name,
                    address,
                    Ipv4Addr::from(net),
                    prefix
                ),
                None,
            );
        }
        if clients.iter().any(|(_, a)| *a == address) {
            c.at(
                &format!("clients[{i}].address"),
                format!("client `{}`: duplicate address {address}", cl.name),
                None,
            );
        }
        clients.push((cl.name.clone(), address));
    }
    if !raw.lan_prefixes.is_empty() {
        c.at(
            "lan_prefixes",
            "`lan_prefixes` is a client option".into(),
            Some("on the server, list each client's allowed prefixes as `routes:` in its `clients:` entry".into()),
        );
    }
    let listen = SocketAddr::new(listen_ip, port);
    let stripe = server_stripe(raw, c, listen);
    ServerConfig {
        listen,
        tun_addr,
        prefix,
        ipv6,
        client_ca_file,
        clients,
        routes,
        stripe,
        revoked: revoked(raw, c),
        masque: {
            super::masque::not_on_server(raw, c);
            super::masque::server(raw, c, listen, stripe)
        },
        tcp_lane: super::lane::server(raw, c),
    }
}

/// `revoked`: names as they are, serials normalized (`serial:0A:1b` -> `serial:a1b`).
fn revoked(raw: &RawConfig, c: &mut Checker) -> Vec<String> {
    let mut out = Vec::new();
    for (i, r) in raw.revoked.iter().enumerate() {
        let r = r.trim();
        match r.strip_prefix("serial:") {
            Some(hex) => {
                let digits: String = hex.chars().filter(|ch| *ch != ':').collect();
                if digits.is_empty() || !digits.chars().all(|ch| ch.is_ascii_hexdigit()) {
                    c.at(
                        &format!("revoked[{i}]"),
                        format!("`{r}` is not a certificate serial"),
                        Some("write it as `serial:` and the hex digits `openssl x509 -noout -serial` or `mpquic status` shows".into()),
                    );
                    continue;
                }
                out.push(format!("serial:{}", crate::tls::normal_serial(&digits)));
            }
            None if r.is_empty() => c.at(
                &format!("revoked[{i}]"),
                "an empty entry".into(),
                Some("a client's name (its certificate's CN) or `serial:HEX`".into()),
            ),
            None => out.push(r.to_string()),
        }
    }
    out
}

/// `stripe_enabled`, `stripe_port` (default: the QUIC port + 1000, as in the seed: 45017 and
/// 46017). The FEC of a stripe session is the client's choice, as on any path.
fn server_stripe(raw: &RawConfig, c: &mut Checker, listen: SocketAddr) -> Option<SocketAddr> {
    for (key, set) in [
        ("stripe_data_shards", raw.stripe_data_shards.is_some()),
        ("stripe_parity_shards", raw.stripe_parity_shards.is_some()),
    ] {
        if set {
            c.warnings.push(format!(
                "`{key}` on a server has no effect: each client's FEC (its stripe_data_shards/stripe_parity_shards or fec) applies to both directions of its tunnel"
            ));
        }
    }
    if raw.stripe_enabled != Some(true) {
        if raw.stripe_port.is_some() {
            c.at(
                "stripe_port",
                "`stripe_port` is set but `stripe_enabled` is not true".into(),
                Some("add stripe_enabled: true to accept stripe paths".into()),
            );
        }
        return None;
    }
    let port = raw
        .stripe_port
        .unwrap_or_else(|| listen.port().saturating_add(1000));
    if port == listen.port() {
        c.at(
            "stripe_port",
            format!("`stripe_port`: {port} is the QUIC port"),
            Some(
                "the stripe transport needs a UDP port of its own, e.g. the QUIC port + 1000"
                    .into(),
            ),
        );
    }
    Some(SocketAddr::new(listen.ip(), port))
}

fn client(raw: &RawConfig, g: &General, c: &mut Checker) -> ClientConfig {
    if !raw.clients.is_empty() {
        c.at("clients", "`clients` is a server option".into(), None);
    }
    if !raw.revoked.is_empty() {
        c.at("revoked", "`revoked` is a server option".into(), None);
    }
    let masque = super::masque::client(raw, c);
    if g.tun_cidr6.is_some() {
        c.at(
            "tun_cidr",
            "`tun_cidr`: a client's IPv6 tunnel address comes from the server".into(),
            Some(
                "give the IPv4 part only; the server's dual-stack tun_cidr gives each client both"
                    .into(),
            ),
        );
    }
    if raw.tls_cert_file.is_some() != raw.tls_key_file.is_some() {
        let present = if raw.tls_cert_file.is_some() {
            "tls_cert_file"
        } else {
            "tls_key_file"
        };
        c.at(
            present,
            "`tls_cert_file` and `tls_key_file` go together".into(),
            Some("create both with: mpquic pki client --dir DIR --name NAME".into()),
        );
    }
    if raw.tls_cert_file.is_none() && raw.masque_token.is_none() {
        c.warnings.push(
            "no client certificate (tls_cert_file/tls_key_file): an mpquic server will refuse this client"
                .into(),
        );
    }
    if raw.tls_ca_file.is_none() && !raw.tls_insecure_skip_verify {
        c.at(
            "role",
            "a client needs `tls_ca_file` to verify the server".into(),
            Some("point it at the ca.crt written by `mpquic pki init`".into()),
        );
    }
    if raw.tls_insecure_skip_verify {
        c.warnings
            .push("tls_insecure_skip_verify: the server's certificate is NOT verified".into());
    }
    if raw.stripe_enabled.is_some() {
        c.at(
            "stripe_enabled",
            "`stripe_enabled` is a server option".into(),
            Some("a client uses stripe on the paths marked `transport: stripe`".into()),
        );
    }
    let paths = client_paths(raw, c);
    let stripe = paths.iter().any(|p| p.transport == PathKind::Stripe);
    let fec = match stripe {
        true => stripe_fec(raw, c),
        false => client_fec(raw, c),
    };
    if !stripe {
        for (key, set) in [
            ("stripe_port", raw.stripe_port.is_some()),
            ("stripe_data_shards", raw.stripe_data_shards.is_some()),
            ("stripe_parity_shards", raw.stripe_parity_shards.is_some()),
        ] {
            if set {
                c.at(
                    key,
                    format!("`{key}` is set but no path has `transport: stripe`"),
                    Some("add `transport: stripe` to the paths that use it (FEC on quic paths: fec: K/M)".into()),
                );
            }
        }
    }
    if stripe && matches!(raw.congestion_algorithm, Some(cc) if !cc.is_ours()) {
        c.at(
            "congestion_algorithm",
            "`transport: stripe` paces with bbr or bbr3".into(),
            Some("use congestion_algorithm: bbr (the default) or bbr3".into()),
        );
    }
    let server_name = raw
        .tls_server_name
        .clone()
        .or_else(|| paths.first().map(|p| p.remote_addr.clone()))
        .unwrap_or_default();
    let mut lan_prefixes: Vec<Prefix> = Vec::new();
    for (j, r) in raw.lan_prefixes.iter().enumerate() {
        let at = format!("lan_prefixes[{j}]");
        let Some(p) = lan_prefix(c, &at, r) else {
            continue;
        };
        let tunnel = g.tun_cidr.map(|(a, l)| network(a, l));
        if let Some(q) = tunnel.filter(|q| p.overlaps(q)) {
            c.at(&at, format!("`{r}` overlaps the tunnel subnet {q}"), None);
        } else if let Some(q) = lan_prefixes.iter().find(|q| p.overlaps(q)) {
            c.at(&at, format!("`{r}` overlaps {q}"), None);
        }
        lan_prefixes.push(p);
    }
    if masque.is_some() {
        // A standard server carries IP packets only (one path at a time: `client/standby.rs`).
        let pathwise = (paths.iter().enumerate())
            .find(|(_, p)| p.transport == PathKind::Stripe || p.pipes > 1);
        if let Some((i, p)) = pathwise {
            c.at(
                &format!("multipath_paths[{i}]"),
                format!(
                    "path `{}`: stripe and pipes are not carried over CONNECT-IP",
                    p.name
                ),
                Some("remove `transport: stripe` / `pipes`, or use the native protocol".into()),
            );
        }
        if fec != FecMode::Off {
            c.at(
                "fec",
                "FEC is not carried over CONNECT-IP".into(),
                Some("remove `fec`, or use the native protocol".into()),
            );
        }
        if !raw.classes.is_empty() {
            c.at(
                "classes",
                "traffic classes are not carried over CONNECT-IP".into(),
                Some("remove `classes`, or use the native protocol".into()),
            );
        }
    }
    let tcp_lane_port = super::lane::client_port(
        raw,
        paths.first().map_or(DEFAULT_PORT, |p| p.remote_port),
        c,
    );
    ClientConfig {
        masque,
        policy: g.policy,
        paths,
        requested: g.tun_cidr,
        lan_prefixes,
        server_name,
        ca_file: raw.tls_ca_file.clone(),
        insecure_skip_verify: raw.tls_insecure_skip_verify,
        fec,
        stripe_port: raw.stripe_port,
        // Filled in by `validate` once the transport mode is known (`classes.rs`).
        classes: Vec::new(),
        classifier: mpquic_core::classify::Classifier::new(vec![Vec::new()], 0),
        state_dir: super::metering::state_dir(raw, c),
        tcp_lane_port,
    }
}

/// FEC on a client with stripe paths: `stripe_data_shards`/`stripe_parity_shards` (seed 000
/// section 14; default 10/2), or `fec` instead of them.
fn stripe_fec(raw: &RawConfig, c: &mut Checker) -> FecMode {
    let shards = raw.stripe_data_shards.is_some() || raw.stripe_parity_shards.is_some();
    if raw.fec.is_some() {
        if shards {
            c.at(
                "fec",
                "`fec` and `stripe_data_shards`/`stripe_parity_shards` both set".into(),
                Some("keep one: they set the same FEC".into()),
            );
        }
        return client_fec(raw, c);
    }
    let k = raw.stripe_data_shards.unwrap_or(10);
    let m = raw.stripe_parity_shards.unwrap_or(2);
    FecMode::fixed(k as usize, m as usize).unwrap_or_else(|e| {
        let key = match e.contains("data") {
            true => "stripe_data_shards",
            false => "stripe_parity_shards",
        };
        c.at(key, format!("`{key}`: {e}"), None);
        FecMode::Off
    })
}

/// `transport_mode`, or its default. A client with stripe paths runs in datagram mode: stripe
/// packets are datagrams, and loss is repaired by FEC. So does a CONNECT-IP client: its
/// packets are HTTP Datagrams (a path's stream would be a request stream of its own, which
/// no server serves).
fn mode(raw: &RawConfig, role: &RoleConfig, c: &mut Checker) -> TransportMode {
    let why = match role {
        RoleConfig::Client(cl) if cl.masque.is_some() => "over CONNECT-IP (protocol: masque)",
        RoleConfig::Client(cl) if cl.paths.iter().any(|p| p.transport == PathKind::Stripe) => {
            "with stripe paths"
        }
        _ => return raw.transport_mode.unwrap_or(default_mode(raw)),
    };
    if let Some(m) = raw.transport_mode.filter(|m| m.has_stream()) {
        c.warnings.push(format!(
            "transport_mode: {} does not apply {why}: the tunnel runs in datagram mode",
            m.as_str()
        ));
    }
    TransportMode::Datagram
}

/// `auto`, unless the client asks for FEC (which is for datagram mode).
fn default_mode(raw: &RawConfig) -> TransportMode {
    let fec_on = raw
        .fec
        .as_deref()
        .is_some_and(|f| FecMode::parse(f).is_ok_and(|m| m != FecMode::Off));
    if fec_on {
        TransportMode::Datagram
    } else {
        TransportMode::Auto
    }
}

/// `fec`: off (the default), auto, or K/M; datagram mode only (reliable mode retransmits).
fn client_fec(raw: &RawConfig, c: &mut Checker) -> FecMode {
    let Some(text) = raw.fec.as_deref() else {
        return FecMode::Off;
    };
    let mode = match FecMode::parse(text) {
        Ok(m) => m,
        Err(e) => {
            c.at(
                "fec",
                format!("`fec`: {e}"),
                Some("auto adapts the repair packets to each path's measured loss".into()),
            );
            return FecMode::Off;
        }
    };
    let stripe = raw
        .multipath_paths
        .iter()
        .any(|p| p.transport.as_deref() == Some("stripe"));
    let fixed_stream = raw
        .transport_mode
        .is_some_and(|m| m != TransportMode::Datagram);
    if mode != FecMode::Off && fixed_stream && !stripe {
        c.at(
            "fec",
            "`fec` needs `transport_mode: datagram`".into(),
            Some("auto and reliable modes retransmit what is lost on their streams; use fec: off, or transport_mode: datagram".into()),
        );
    }
    mode
}

/// The client's paths: `multipath_paths`, or one path from the top-level keys.
fn client_paths(raw: &RawConfig, c: &mut Checker) -> Vec<PathConfig> {
    let mut out: Vec<PathConfig> = Vec::new();
    if raw.multipath_enabled == Some(false) && !raw.multipath_paths.is_empty() {
        c.at(
            "multipath_enabled",
            "`multipath_paths` is set but `multipath_enabled` is false".into(),
            Some("set multipath_enabled: true, or remove multipath_paths".into()),
        );
    }
    if raw.multipath_paths.is_empty() {
        if raw.multipath_enabled == Some(true) {
            c.at(
                "multipath_enabled",
                "`multipath_enabled` is true but `multipath_paths` is empty".into(),
                Some("list the WAN links under multipath_paths".into()),
            );
        }
        let Some(remote) = raw.remote_addr.clone() else {
            c.at(
                "role",
                "a client needs `remote_addr` (or `multipath_paths`)".into(),
                Some("the server's public address, e.g. remote_addr: 203.0.113.10".into()),
            );
            return out;
        };
        let bind = bind(c, raw.bind_ip.as_deref(), "bind_ip");
        out.push(PathConfig {
            name: "default".into(),
            bind,
            remote_addr: remote,
            remote_port: raw.remote_port.unwrap_or(DEFAULT_PORT),
            priority: 1,
            weight: 1,
            pipes: 1,
            transport: PathKind::Quic,
            rate_limit: None,
            role: mpquic_core::Role::Primary,
            data_budget: None,
            link: LinkKind::Other,
            detect_link: true,
        });
        return out;
    }
    if raw.multipath_paths.len() > MAX_PATHS_PER_SESSION {
        c.at(
            &format!("multipath_paths[{MAX_PATHS_PER_SESSION}]"),
            format!(
                "{} paths: a server takes at most {MAX_PATHS_PER_SESSION} per client",
                raw.multipath_paths.len()
            ),
            None,
        );
    }
    for (i, p) in raw.multipath_paths.iter().enumerate() {
        let at = |key: &str| format!("multipath_paths[{i}].{key}");
        if out.iter().any(|o| o.name == p.name) {
            c.at(
                &at("name"),
                format!("path `{}`: duplicate name", p.name),
                None,
            );
        }
        if p.name.is_empty() || p.name.len() > 32 {
            c.at(
                &at("name"),
                "path name must be 1-32 characters".into(),
                None,
            );
        }
        let pipes = match p.pipes {
            None => 1,
            Some(n @ 1..=MAX_PIPES) => n as u8,
            Some(n) => {
                c.at(
                    &at("pipes"),
                    format!("`pipes: {n}`: a path has 1 to {MAX_PIPES} pipes"),
                    None,
                );
                1
            }
        };
        let transport = match p.transport.as_deref() {
            None | Some("quic") => PathKind::Quic,
            Some("stripe") => PathKind::Stripe,
            Some(other) => {
                c.unknown_value(&at("transport"), "transport", other, &["quic", "stripe"]);
                PathKind::Quic
            }
        };
        if p.weight == Some(0) {
            c.at(&at("weight"), "`weight` must be at least 1".into(), None);
        }
        let limits = super::metering::path_limits(p, &at, pipes, transport, c);
        // Unset or `auto`: nothing configured, the link recognised by its probes.
        let (link, detect_link) = match p.link.as_deref() {
            None | Some("auto") => (LinkKind::Other, true),
            Some(l) => match LinkKind::parse(l) {
                Some(kind) => (kind, false),
                None => {
                    let names: Vec<&str> = ["auto"]
                        .into_iter()
                        .chain(LinkKind::NAMES.iter().copied())
                        .collect();
                    c.unknown_value(&at("link"), "link", l, &names);
                    (LinkKind::Other, true)
                }
            },
        };
        let bind = match &p.bind_ip {
            Some(b) => bind(c, Some(b), &at("bind_ip")),
            None => bind(c, raw.bind_ip.as_deref(), "bind_ip"),
        };
        let Some(remote) = p.remote_addr.clone().or_else(|| raw.remote_addr.clone()) else {
            c.at(
                &format!("multipath_paths[{i}]"),
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
            pipes,
            transport,
            rate_limit: limits.rate_limit,
            role: limits.role,
            data_budget: limits.data_budget,
            link,
            detect_link,
        });
    }
    if !out.is_empty() && out.iter().all(|p| p.role.is_backup()) {
        c.warnings.push(
            "every path has `role: backup` or `overflow`: with no primary they carry as primaries would"
                .into(),
        );
    }
    out
}

/// The dashboard's address and token: a dashboard reachable from other hosts must ask for a
/// token (it shows the site's paths, addresses and traffic).
fn dashboard(raw: &RawConfig, c: &mut Checker) -> Option<super::Dashboard> {
    let token = raw.dashboard_token.clone();
    if let Some(t) = &token {
        // Characters that stand in a URL as they are (the page is opened with `?token=`).
        let url_safe = |ch: char| ch.is_ascii_alphanumeric() || "-._~".contains(ch);
        if t.len() < 16 || !t.chars().all(url_safe) {
            c.at(
                "dashboard_token",
                "`dashboard_token` must be at least 16 characters of A-Z, a-z, 0-9, `-._~`".into(),
                Some("e.g. the output of `openssl rand -hex 16`".into()),
            );
        }
    }
    let listen = raw.dashboard_listen?;
    if !listen.ip().is_loopback() && token.is_none() {
        c.at(
            "dashboard_listen",
            format!("`dashboard_listen`: {listen} is reachable from other hosts and no `dashboard_token` is set"),
            Some("set `dashboard_token`, or listen on 127.0.0.1 and reach it through an SSH tunnel".into()),
        );
    }
    Some(super::Dashboard { listen, token })
}

/// A site LAN prefix (`lan_prefixes`, a client's `routes`): IPv4 or IPv6, the network address
/// itself (no host bits), not a default route.
fn lan_prefix(c: &mut Checker, at: &str, s: &str) -> Option<Prefix> {
    let Some(p) = Prefix::parse(s).filter(|_| s.contains('/')) else {
        c.at(
            at,
            format!("`{s}` is not a prefix"),
            Some("e.g. 192.168.50.0/24 or fd00:50::/64".into()),
        );
        return None;
    };
    if p.len == 0 {
        c.at(
            at,
            format!("`{s}` is a default route, not a site LAN"),
            None,
        );
        return None;
    }
    let network = p.network();
    if network != p {
        c.at(
            at,
            format!("`{s}` has host bits set"),
            Some(format!("did you mean {network}?")),
        );
        return None;
    }
    Some(p)
}

/// The network `addr/len` belongs to (the tunnel subnet of a `tun_cidr`).
fn network(addr: Ipv4Addr, len: u8) -> Prefix {
    Prefix {
        addr: addr.into(),
        len,
    }
    .network()
}
