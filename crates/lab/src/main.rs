//! mpquic-lab: link emulator and lab topologies (see crates/lab/src/topo.rs and docs/LAB.md).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand};
use mpquic_lab::bridge::{self, Direction, DirectionIo, Input, NatSide, PathNat, RawSocket};
use mpquic_lab::emu::{Dir, LinkSpec};
use mpquic_lab::topo;

#[derive(Parser)]
#[command(
    name = "mpquic-lab",
    version,
    about = "Link emulator and lab topologies for mpquic"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create a lab: namespaces lan, client, emulator, server, internet; one emulated WAN per --path.
    Up {
        name: String,
        /// Link behaviour, e.g. rate=100mbit,delay=20ms,jitter=2ms,loss=1% (both directions).
        #[arg(long = "path", required = true)]
        paths: Vec<String>,
        /// Sites (LAN host + client router) sharing the server; each gets one WAN per --path.
        #[arg(long, default_value_t = 1)]
        clients: usize,
        /// The lab belongs to this process: `down --stale` removes it once the process is gone
        /// (a test run that crashed).
        #[arg(long)]
        owner_pid: Option<u32>,
        /// Seed of the emulator's randomness (same seed, same losses).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Describe a lab (names, addresses, link specs).
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Change a path's link live: mpquic-lab set NAME PATH key=value... [--dir up|down|both].
    Set {
        name: String,
        /// The path's number on its client (1..).
        path: usize,
        #[arg(required = true)]
        changes: Vec<String>,
        /// up: client to server; down: server to client.
        #[arg(long, default_value = "both")]
        dir: String,
        #[arg(long, default_value_t = 1)]
        client: usize,
    },
    /// Take a client's WAN interface down or up (the client sees the interface go, unlike
    /// `set ... state=down`); `up` also restores its route to the server.
    Link {
        name: String,
        path: usize,
        #[arg(value_parser = ["up", "down"])]
        state: String,
        #[arg(long, default_value_t = 1)]
        client: usize,
    },
    /// A carrier-grade NAT in front of a path's client end: `on` (the client's ports mapped to
    /// random external ones; `--timeout 30s`: idle mappings expire), `rebind` (every mapping
    /// forgotten at once, as when a CGNAT renews them: the next packet gets a new port, packets
    /// to the old one are dropped), `off`.
    Nat {
        name: String,
        path: usize,
        #[arg(value_parser = ["on", "off", "rebind"])]
        action: String,
        #[arg(long)]
        timeout: Option<String>,
        #[arg(long, default_value_t = 1)]
        client: usize,
    },
    /// Write a fresh PKI and mpquic configurations for every client of a lab into DIR; prints
    /// their paths, namespaces and sockets as JSON.
    Configs {
        name: String,
        #[arg(long)]
        dir: std::path::PathBuf,
        #[arg(long, default_value = "failover")]
        policy: String,
        /// transport_mode (default: none written, mpquic's default).
        #[arg(long)]
        mode: Option<String>,
        /// congestion_algorithm (default: none written, mpquic's default).
        #[arg(long)]
        congestion: Option<String>,
        /// Per path, e.g. 1,1.
        #[arg(long, value_delimiter = ',')]
        priorities: Option<Vec<u32>>,
        #[arg(long, value_delimiter = ',')]
        weights: Option<Vec<u32>>,
        /// Pipes per path, e.g. 4,4.
        #[arg(long, value_delimiter = ',')]
        pipes: Option<Vec<u32>>,
        /// Transport per path, e.g. stripe,quic (a stripe path enables stripe on the server).
        #[arg(long, value_delimiter = ',')]
        transport: Option<Vec<String>>,
        /// Top-level YAML added to every configuration, e.g. "worker_threads: 2".
        #[arg(long, default_value = "")]
        extra_yaml: String,
    },
    /// Route a client's LAN to the internet host through its tunnel interface (idempotent).
    Route {
        name: String,
        #[arg(long, default_value_t = 1)]
        client: usize,
        #[arg(long, default_value = "mpq0")]
        dev: String,
        #[arg(long, default_value = mpquic_lab::mpquic_conf::TUNNEL_NET)]
        tunnel_net: String,
        /// No masquerade: the LAN is routed by the tunnel (`lan_prefixes`), not hidden behind it.
        #[arg(long)]
        routed: bool,
    },
    /// Counters of each path and direction (JSON).
    Stats { name: String },
    /// Run a scenario (bench/scenarios/*.yaml) against its systems; writes results.json, report.md, PNG plots.
    Run {
        scenario: std::path::PathBuf,
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Redraw the plots and report.md of a finished run (DIR holds its results.json).
    Plot { dir: std::path::PathBuf },
    /// One side of a voice-like call (run inside a lab namespace; scenarios' `kind: voice`):
    /// `call HOST PORT` sends first, `answer PORT` talks back to where the call comes from.
    /// Prints what it sent and received (JSON).
    Voice {
        /// `call` or `answer`.
        role: String,
        /// call: the answerer's address and port (HOST:PORT); answer: the port to listen on.
        at: String,
        #[arg(long, default_value_t = 50.0)]
        pps: f64,
        #[arg(long, default_value_t = 200)]
        len: usize,
        #[arg(long)]
        seconds: f64,
    },
    /// One side of web-like transfers (run inside a lab namespace; scenarios' `kind: web`):
    /// `serve PORT` sends each connection the object it asks for, `fetch HOST:PORT` fetches
    /// objects of `--size` bytes, `--parallel` at a time, each on a new connection. Prints the
    /// fetches' start and completion times (JSON).
    Web {
        /// `serve` or `fetch`.
        role: String,
        /// serve: the port to listen on; fetch: the server's address and port (HOST:PORT).
        at: String,
        #[arg(long, default_value_t = 100_000)]
        size: u64,
        #[arg(long, default_value_t = 1)]
        parallel: usize,
        #[arg(long)]
        seconds: f64,
    },
    /// Watch the TCP flows this namespace receives on PORT (either end) by their ACKs until
    /// standard input closes, then print their stalls (JSON; run inside a lab namespace beside
    /// a transfer: scenarios' TCP `iperf3` items).
    Stalls { port: u16 },
    /// Unauthenticated traffic at a server's UDP port from spoofed sources (run it inside a lab
    /// namespace with `ip netns exec`); prints what it sent (JSON).
    Flood {
        /// The server's address and port, e.g. 10.99.0.1:45017.
        #[arg(long)]
        to: std::net::SocketAddrV4,
        /// `initial` (genuine QUIC Initials, each a new connection) or `garbage`.
        #[arg(long, default_value = "initial")]
        kind: String,
        #[arg(long, default_value_t = 20_000)]
        pps: u64,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Source addresses, counted up from --first-source.
        #[arg(long, default_value_t = 1000)]
        sources: u32,
        #[arg(long, default_value = "198.18.0.1")]
        first_source: std::net::Ipv4Addr,
    },
    /// Remove a lab, or with --stale every leftover of crashed runs.
    Down {
        name: Option<String>,
        #[arg(long)]
        stale: bool,
    },
    /// (internal) the emulator process, run inside the lab's emulator namespace.
    #[command(hide = true)]
    Emu {
        name: String,
        #[arg(long)]
        seed: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Up {
            name,
            paths,
            clients,
            owner_pid,
            seed,
        } => up(&name, &paths, clients, seed, owner_pid),
        Cmd::Show { name, json } => show(&name, json),
        Cmd::Set {
            name,
            path,
            changes,
            dir,
            client,
        } => topo::load(&name)
            .and_then(|st| st.emulator_path(client, path))
            .and_then(|k| topo::control(&name, &format!("set {k} {dir} {}", changes.join(","))))
            .map(|r| println!("{r}")),
        Cmd::Nat {
            name,
            path,
            action,
            timeout,
            client,
        } => topo::load(&name)
            .and_then(|st| st.emulator_path(client, path))
            .and_then(|k| {
                let timeout = timeout.map(|t| format!(" {t}")).unwrap_or_default();
                topo::control(&name, &format!("nat {k} {action}{timeout}"))
            })
            .map(|r| println!("{r}")),
        Cmd::Link {
            name,
            path,
            state,
            client,
        } => topo::load(&name).and_then(|st| topo::set_link(&st, client, path, state == "up")),
        Cmd::Configs {
            name,
            dir,
            policy,
            mode,
            congestion,
            priorities,
            weights,
            pipes,
            transport,
            extra_yaml,
        } => configs(
            &name,
            &dir,
            mpquic_lab::scenario::MpquicOpts {
                policy,
                mode,
                congestion,
                priorities,
                weights,
                pipes,
                transport,
                extra_yaml: if extra_yaml.is_empty() || extra_yaml.ends_with('\n') {
                    extra_yaml
                } else {
                    extra_yaml + "\n"
                },
                requires: Vec::new(),
                fec: None,
                classes: None,
                path_yaml: None,
                lane: None,
                paths: None,
            },
        ),
        Cmd::Route {
            name,
            client,
            dev,
            tunnel_net,
            routed,
        } => topo::load(&name).and_then(|st| {
            mpquic_lab::sut::route_lan_through(&st, client, &dev, &tunnel_net, !routed)
        }),
        Cmd::Stats { name } => topo::control(&name, "stats").map(|r| println!("{r}")),
        Cmd::Down { name, stale } => down(name, stale),
        Cmd::Run { scenario, out } => mpquic_lab::runner::run(&scenario, &out),
        Cmd::Plot { dir } => mpquic_lab::report::redraw(&dir),
        Cmd::Voice {
            role,
            at,
            pps,
            len,
            seconds,
        } => mpquic_lab::voice::run(&role, &at, pps, len, seconds).map(|v| println!("{v}")),
        Cmd::Web {
            role,
            at,
            size,
            parallel,
            seconds,
        } => mpquic_lab::web::run(&role, &at, size, parallel, seconds).map(|v| println!("{v}")),
        Cmd::Stalls { port } => mpquic_lab::stalls::run(port).map(|v| println!("{v}")),
        Cmd::Emu { name, seed } => emu(&name, seed),
        Cmd::Flood {
            to,
            kind,
            pps,
            seconds,
            sources,
            first_source,
        } => mpquic_lab::flood::run(to, &kind, pps, seconds, sources, first_source).map(|s| {
            println!("{}", serde_json::to_string(&s).unwrap_or_default());
        }),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpquic-lab: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn configs(
    name: &str,
    dir: &std::path::Path,
    opts: mpquic_lab::scenario::MpquicOpts,
) -> Result<()> {
    let st = topo::load(name)?;
    let written = mpquic_lab::mpquic_conf::write(&st, &opts, dir)?;
    println!("{}", serde_json::to_string_pretty(&written)?);
    Ok(())
}

fn up(
    name: &str,
    paths: &[String],
    clients: usize,
    seed: u64,
    owner_pid: Option<u32>,
) -> Result<()> {
    let st = topo::up(name, paths, clients, seed, owner_pid)?;
    println!("{}", serde_json::to_string_pretty(&st)?);
    Ok(())
}

fn show(name: &str, json: bool) -> Result<()> {
    let st = topo::load(name)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
        return Ok(());
    }
    println!("lab {}  (emulator pid {:?})", st.name, st.emulator_pid);
    println!(
        "  lan {} ({})  client {}  emulator {}  server {} (service {})  internet {} ({})",
        st.namespaces.lan,
        st.hosts.lan_addr,
        st.namespaces.client,
        st.namespaces.emulator,
        st.namespaces.server,
        st.hosts.server_service_addr,
        st.namespaces.internet,
        st.hosts.internet_addr
    );
    for (i, c) in st.clients.iter().enumerate().skip(1) {
        println!(
            "  client {}: lan {} ({})  client {}",
            i + 1,
            c.lan,
            c.lan_addr,
            c.client
        );
    }
    for p in &st.paths {
        println!(
            "  path {} (client {} path {}): client {} {} <-> server {} {}  [{}]",
            p.index,
            p.client,
            p.client_path,
            p.client_if,
            p.client_addr,
            p.server_if,
            p.server_addr,
            p.spec_text
        );
    }
    Ok(())
}

fn down(name: Option<String>, stale: bool) -> Result<()> {
    let names = match (name, stale) {
        (Some(n), false) => vec![n],
        (None, true) => topo::stale(),
        _ => bail!("give a lab name, or --stale"),
    };
    for n in names {
        let removed = topo::teardown(&n);
        println!("removed lab {n} ({} namespaces)", removed.len());
    }
    Ok(())
}

/// The emulator process: bridges every path through its two direction models.
fn emu(name: &str, seed: u64) -> Result<()> {
    let st = topo::load(name)?;
    let stop = Arc::new(AtomicBool::new(false));
    // Indexed by path number - 1; `None` for direct paths.
    let mut dirs: Vec<Option<EmuPath>> = Vec::new();
    for p in &st.paths {
        if !p.emulated {
            dirs.push(None);
            continue;
        }
        let (up, down) = LinkSpec::parse_both(&p.spec_text).map_err(|e| anyhow!(e))?;
        let (up, down) = (Direction::new(up), Direction::new(down));
        let nat = PathNat::new(seed.wrapping_mul(1000).wrapping_add(p.index as u64));
        let c = format!("c{}", p.index);
        let s = format!("s{}", p.index);
        for (from, to, d, k, side) in [
            (&c, &s, up.clone(), 0u64, NatSide::Outbound(nat.clone())),
            (&s, &c, down.clone(), 1u64, NatSide::Inbound(nat.clone())),
        ] {
            let io = DirectionIo {
                input: Input::open(from).with_context(|| format!("raw socket on {from}"))?,
                output: RawSocket::output(to).with_context(|| format!("raw socket on {to}"))?,
                dir: d,
                seed: seed.wrapping_mul(1000).wrapping_add(p.index as u64 * 2 + k),
                nat: side,
            };
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!(
                    "path{}-{}",
                    p.index,
                    if k == 0 { "up" } else { "down" }
                ))
                .spawn(move || bridge::run(io, stop))?;
        }
        dirs.push(Some(EmuPath { up, down, nat }));
    }
    let _ = std::fs::remove_file(&st.control_socket);
    let listener = UnixListener::bind(&st.control_socket)?;
    eprintln!(
        "emulator for lab {name}: {} paths",
        dirs.iter().flatten().count()
    );
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let mut line = String::new();
        let mut reader = BufReader::new(&conn);
        if reader.read_line(&mut line).is_err() {
            continue;
        }
        let reply = match handle(&dirs, line.trim()) {
            Ok(r) => r,
            Err(e) => format!("error: {e}"),
        };
        let _ = writeln!(&conn, "{reply}");
    }
    Ok(())
}

/// An emulated path: its two directions and its NAT.
struct EmuPath {
    up: Arc<Direction>,
    down: Arc<Direction>,
    nat: Arc<PathNat>,
}

fn handle(dirs: &[Option<EmuPath>], line: &str) -> Result<String, String> {
    let lock = |m: &std::sync::Mutex<LinkSpec>| {
        m.lock()
            .map(|g| g.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    };
    let mut words = line.splitn(4, ' ');
    match words.next() {
        Some("stats") => {
            let paths: Vec<serde_json::Value> = dirs
                .iter()
                .enumerate()
                .filter_map(|(i, x)| x.as_ref().map(|x| (i, x)))
                .map(|(i, p)| {
                    let one = |x: &Direction| {
                        serde_json::json!({
                            "spec": lock(&x.spec),
                            "stats": *x.stats.lock().unwrap_or_else(|e| e.into_inner()),
                            "passthrough": *x.passthrough.lock().unwrap_or_else(|e| e.into_inner()),
                            "send_errors": *x.send_errors.lock().unwrap_or_else(|e| e.into_inner()),
                            "socket_drops": *x.socket_drops.lock().unwrap_or_else(|e| e.into_inner()),
                            "oversize_drops": *x.oversize_drops.lock().unwrap_or_else(|e| e.into_inner()),
                        })
                    };
                    let nat = p.nat.is_on().then(|| p.nat.stats());
                    serde_json::json!({"index": i + 1, "up": one(&p.up), "down": one(&p.down), "nat": nat})
                })
                .collect();
            Ok(serde_json::json!({ "paths": paths }).to_string())
        }
        Some("set") => {
            let path: usize = words
                .next()
                .and_then(|p| p.parse().ok())
                .ok_or("set PATH DIR SPEC: bad path number")?;
            let p = emulated(dirs, path)?;
            let (u, d) = (&p.up, &p.down);
            let which: Vec<(&Arc<Direction>, Dir)> = match words.next() {
                Some("up") => vec![(u, Dir::Up)],
                Some("down") => vec![(d, Dir::Down)],
                Some("both") => vec![(u, Dir::Up), (d, Dir::Down)],
                other => return Err(format!("direction {other:?}: use up, down or both")),
            };
            let changes = words.next().unwrap_or("");
            // Both directions' changes are checked before either takes effect.
            let mut specs = Vec::new();
            for (dir, name) in &which {
                let mut spec = lock(&dir.spec);
                spec.apply_dir(changes, Some(*name))?;
                specs.push(spec);
            }
            for ((dir, _), spec) in which.iter().zip(specs) {
                dir.set_pending(spec);
            }
            let directions: Vec<&Arc<Direction>> = which.iter().map(|(d, _)| *d).collect();
            applied(&directions)
        }
        Some("epoch") => {
            // epoch UNIX_SECONDS: time zero of every path's recordings and slots.
            let secs: f64 = words
                .next()
                .and_then(|t| t.parse().ok())
                .filter(|t: &f64| t.is_finite() && *t >= 0.0)
                .ok_or("epoch UNIX_SECONDS: bad time")?;
            let wall = std::time::UNIX_EPOCH + Duration::from_secs_f64(secs);
            let all: Vec<&Arc<Direction>> =
                dirs.iter().flatten().flat_map(|p| [&p.up, &p.down]).collect();
            for d in &all {
                d.set_epoch(wall);
            }
            applied(&all)
        }
        Some("nat") => {
            let path: usize = words
                .next()
                .and_then(|p| p.parse().ok())
                .ok_or("nat PATH on|off|rebind [TIMEOUT]: bad path number")?;
            let nat = &emulated(dirs, path)?.nat;
            match (words.next(), words.next()) {
                (Some("on"), timeout) => {
                    let timeout = timeout
                        .map(|t| {
                            mpquic_lab::emu::spec::parse_duration(t)
                                .map_err(|e| format!("nat timeout {t:?}: {e}"))
                        })
                        .transpose()?;
                    nat.set(true, timeout);
                }
                (Some("off"), None) => nat.set(false, None),
                (Some("rebind"), None) => nat.rebind()?,
                other => return Err(format!("nat {other:?}: use on [TIMEOUT], off or rebind")),
            }
            Ok("ok".into())
        }
        _ => Err(
            "commands: stats | set PATH up|down|both key=value,... | nat PATH on|off|rebind | epoch UNIX_SECONDS".into(),
        ),
    }
}

/// Answer only once the direction threads run with the change (they are woken up for it).
fn applied(directions: &[&Arc<Direction>]) -> Result<String, String> {
    let t0 = Instant::now();
    while directions.iter().any(|d| d.changing()) {
        if t0.elapsed() > Duration::from_secs(1) {
            return Err("the emulator did not apply the change within 1 s".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok("ok".into())
}

fn emulated(dirs: &[Option<EmuPath>], path: usize) -> Result<&EmuPath, String> {
    dirs.get(path.wrapping_sub(1))
        .ok_or_else(|| format!("no path {path} (paths 1..{})", dirs.len()))?
        .as_ref()
        .ok_or_else(|| format!("path {path} is direct (not emulated)"))
}
