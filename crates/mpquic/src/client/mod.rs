//! The client (site) side: one transport per WAN path (a QUIC connection, each on its own socket
//! bound to its interface: `transport::quic::QuicDialer`), all feeding one `Tunnel`. A path whose
//! connection dies, or that stays unusable (black-holed, server restarted), is reconnected in the
//! background while the others carry on.
//!
//! With traffic classes (`classes:`), each class is a lane of that tunnel (its bond and
//! resequencer, its rank in every path's send queue, its carriage), and the TUN reader puts each
//! packet in its class (`classify::Classifier`); the classes share the paths (one connection,
//! prober and congestion controller each), the TUN device and the tunnel address.
//!
//! Over CONNECT-IP (`protocol: masque`) the first answer says what the server is (`learn`): an
//! mpquic server took the hello the request carried, and the paths bond as on the native
//! protocol; a standard server does not bond, and the client carries on one path at a time,
//! moving to the next when it dies (`standby.rs`). Until that answer the paths take turns.
//!
//! The paths can change while it runs (`control/reload.rs`): each path's task watches its
//! configuration, so a changed path reconnects (the new connection made before the old one
//! closes), a removed one is retired, a new one starts; the others are not touched.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use mpquic_core::classify::Classifier;
use mpquic_core::fec::FecMode;
use mpquic_core::path::reconnect;
use mpquic_core::path::standby::Standing;
use mpquic_core::{sessions, DropReason, HealthMode, PathId, PathSpec};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::config::{
    parse_cidr, parse_cidr6, ClassConfig, ClientConfig, Config, PathConfig, RoleConfig,
};
use crate::control::reload::{self, PathChanges};
use crate::hello::{ClassOf, Hello, HelloAck};
use crate::io::platform::Platform;
use crate::io::tun::Tun;
use crate::runtime;
use crate::status::StatusReport;
use crate::transport::quic::QuicDialer;
use crate::transport::{Carrier, Dialed, Dialer, Known, PathTransport, Unfinished};
use crate::tunnel::{close, Carriage, LaneSpec, Routed, Shares, Tunnel};

mod standby;

/// Bound on socket setup + handshake + hello for one attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The bound for an attempt on a path whose RTT is known (a redial): the handshake's
/// retransmissions start about three RTTs apart and double (`quic::transport`), so later ones
/// come a second or more apart; an attempt given up after ~40 RTTs (1 s at most 25 ms, never
/// more than `CONNECT_TIMEOUT`) and made again keeps the wait after a path's return under half
/// a second rather than up to one and a half.
fn connect_timeout(rtt: Option<Duration>) -> Duration {
    rtt.map_or(CONNECT_TIMEOUT, |r| {
        (r * 40).clamp(Duration::from_secs(1), CONNECT_TIMEOUT)
    })
}

struct Client {
    cfg: Config,
    /// Everything but the paths, which are in `paths` (and can change).
    ccfg: ClientConfig,
    platform: Platform,
    session: u64,
    tun: Arc<Tun>,
    /// The tunnel over every path: a lane per traffic class.
    tunnel: Arc<Tunnel>,
    /// The traffic classes in priority order (one, implicit, without `classes:`): class `k` is
    /// lane `k` of `tunnel`.
    classes: Vec<Class>,
    /// Dials every path's connection.
    dialer: Box<dyn Dialer>,
    /// Per path, by `PathId::index()`.
    slots: Mutex<Vec<PathSlot>>,
    /// The address the server gave us (set on the TUN device).
    addr: Mutex<Option<Assigned>>,
    /// A refusal from the server that retrying cannot fix (e.g. address not allowed).
    fatal: mpsc::Sender<String>,
    mtu: u32,
    /// The smallest link MTU of the paths at start (the TUN MTU was derived from it).
    link_mtu: u32,
    /// The UDP payload of the client's links.
    link_payload: u16,
    /// The configured paths, in config order.
    paths: Mutex<Vec<LivePath>>,
    /// The last reload's outcome (status).
    reloads: reload::Record,
    /// This client's certificate and the CA it verifies the server with, as loaded at start.
    certificates: std::sync::RwLock<Vec<crate::status::CertificateStatus>>,
    /// The classes' rules (`ccfg.classifier` at start): a reload swaps them, the TUN reader
    /// takes the current ones for each batch.
    classifier: std::sync::RwLock<Arc<Classifier>>,
    /// `protocol: masque`: the paths take turns, one connected at a time (`standby.rs`), until
    /// the server turns out to be an mpquic one (`turns()`).
    turns: Option<standby::Turns>,
    /// How the session is carried: native from the start; over CONNECT-IP what the first
    /// answer said (`learn`).
    carrier: std::sync::OnceLock<Carrier>,
    /// Where the metered paths' counts are kept (`data_budget`), and what it said at start
    /// for the paths not yet added.
    budget_file: crate::budgets::StateFile,
    /// The MPTCP lane (status reads it, a reload changes it), once it runs.
    lane: std::sync::OnceLock<Arc<crate::lane::client::Live>>,
    saved_usage: Mutex<std::collections::HashMap<String, mpquic_core::path::budget::Usage>>,
}

/// The tunnel addresses the server gave: IPv4, and IPv6 when its tunnel is dual-stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Assigned {
    v4: (Ipv4Addr, u8),
    v6: Option<(Ipv6Addr, u8)>,
}

impl Assigned {
    /// The addresses in the server's answer to a hello; an answer without a usable one is an
    /// error.
    pub(crate) fn from_answer(ack: &HelloAck) -> Result<Assigned> {
        let v4 = (ack.addr.as_deref())
            .and_then(parse_cidr)
            .ok_or_else(|| anyhow!("server sent no usable address"))?;
        let v6 = match ack.addr6.as_deref() {
            Some(s) => Some(
                parse_cidr6(s)
                    .ok_or_else(|| anyhow!("server sent an unusable IPv6 address `{s}`"))?,
            ),
            None => None,
        };
        Ok(Assigned { v4, v6 })
    }
}

/// A configured path: its configuration, watched by its task, which ends with it.
struct LivePath {
    cfg: watch::Sender<Arc<PathConfig>>,
    task: tokio::task::AbortHandle,
}

impl Drop for LivePath {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the client keeps per path between its connections.
#[derive(Debug, Clone, Copy, Default)]
struct PathSlot {
    /// The UDP payload its connections use when its route carries less than its link (`None`:
    /// the link's), as the tunnel's MTU watch found. Over CONNECT-IP: the largest its last
    /// connection reached, where the next one starts (`quic::client_transport`).
    payload: Option<u16>,
    /// Connection attempts failed in a row.
    connect_failures: u32,
    /// Its last connection's own RTT estimate, for a path without probes (CONNECT-IP), which
    /// the tunnel has no RTT for.
    quic_rtt: Option<Duration>,
}

/// A path's connection in the tunnel: the transport, its end, and the tunnel's generation for it.
struct Installed {
    transport: Arc<dyn PathTransport>,
    closed: crate::transport::BoxFuture<'static, crate::transport::Closed>,
    generation: u64,
}

impl Installed {
    fn new(tunnel: &Arc<Tunnel>, id: PathId, transport: Arc<dyn PathTransport>) -> Installed {
        Installed {
            closed: transport.closed(),
            generation: tunnel.install(id, transport.clone()),
            transport,
        }
    }
}

/// One traffic class (a lane of the client's tunnel).
struct Class {
    cfg: ClassConfig,
    /// The class's own TUN device (`tun_name` of the class), read by its own reader.
    own_tun: Option<Arc<Tun>>,
    /// Packets the classifier put in this class by a rule / because no rule matched.
    classified: AtomicU64,
    unmatched: AtomicU64,
}

pub async fn run(cfg: Config, mut ccfg: ClientConfig, platform: Platform) -> Result<()> {
    let link_mtu = ccfg
        .paths
        .iter()
        .map(|p| platform.link_mtu(&p.bind))
        .min()
        .unwrap_or(crate::io::socket::DEFAULT_LINK_MTU);
    // A per-packet policy numbers every packet (`wire::BOND_HEADER` more bytes in front), and
    // the classes after the first carry their lane (`wire::CLASSED_HEADER`).
    let bond_header = if ccfg.classes.iter().any(|k| k.policy.per_packet()) {
        mpquic_core::wire::BOND_HEADER as u32
    } else {
        0
    };
    let lane_header = match ccfg.classes.len() {
        1 => 0,
        _ => mpquic_core::wire::CLASSED_HEADER as u32,
    };
    let mtu = runtime::tun_mtu(&cfg, link_mtu.saturating_sub(bond_header + lane_header));
    let tun = Arc::new(runtime::open_tun(&platform, &cfg, &cfg.tun_name, mtu)?);
    let classes = ccfg
        .classes
        .iter()
        .map(|k| {
            let own = match &k.tun_name {
                Some(name) => Some(Arc::new(runtime::open_tun(&platform, &cfg, name, mtu)?)),
                None => None,
            };
            Ok(Class {
                cfg: k.clone(),
                own_tun: own,
                classified: AtomicU64::new(0),
                unmatched: AtomicU64::new(0),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let tunnel = Tunnel::new(
        cfg.tun_name.clone(),
        tun.clone(),
        None,
        // The client probes every path; the server follows its view (core health.rs). A
        // standard CONNECT-IP server answers no probes: a path is up while its connection is.
        match ccfg.masque {
            None => HealthMode::Probe,
            Some(_) => HealthMode::Transport,
        },
        cfg.congestion,
        Carriage {
            fec: tunnel_fec(&ccfg.classes),
            lanes: classes
                .iter()
                .map(|k| LaneSpec {
                    name: k.cfg.explicit.then(|| k.cfg.name.clone()),
                    policy: k.cfg.policy,
                    mode: k.cfg.mode,
                    fec: k.cfg.fec != FecMode::Off,
                    tun: k.own_tun.clone(),
                })
                .collect(),
            marks: false,
        },
    );
    let dialer = Box::new(
        QuicDialer::new(&cfg, &ccfg, link_mtu, platform.clone())?.with_stripe(
            crate::transport::stripe::client::ride(platform.clone(), cfg.congestion),
        ),
    );
    // From here on the paths are `Client::paths` (a reload changes them, not `ccfg`).
    let initial_paths = std::mem::take(&mut ccfg.paths);
    // The first refusal ends the process; later ones (other paths) are dropped.
    let (fatal_tx, mut fatal_rx) = mpsc::channel(1);
    let budget_file = crate::budgets::StateFile::new(&ccfg.state_dir, &cfg.tun_name);
    let saved_usage = match initial_paths.iter().any(|p| p.data_budget.is_some()) {
        true => {
            info!(file = %budget_file.path().display(), "data budgets: the metered paths' counts are kept in this file");
            budget_file.load()
        }
        false => Default::default(),
    };
    let client = Arc::new(Client {
        session: runtime::random_u64(),
        tun: tun.clone(),
        tunnel,
        classes,
        dialer,
        slots: Mutex::new(Vec::new()),
        addr: Mutex::new(None),
        fatal: fatal_tx,
        mtu,
        link_mtu,
        link_payload: mpquic_core::packet::mtu::udp_payload(link_mtu),
        paths: Mutex::new(Vec::new()),
        reloads: reload::Record::default(),
        certificates: std::sync::RwLock::new(crate::tls::loaded(
            cfg.cert_file.as_deref(),
            ccfg.ca_file.as_deref(),
        )),
        platform: platform.clone(),
        classifier: std::sync::RwLock::new(Arc::new(ccfg.classifier.clone())),
        turns: ccfg.masque.is_some().then(standby::Turns::new),
        carrier: match ccfg.masque {
            None => Carrier::Native.into(),
            Some(_) => std::sync::OnceLock::new(),
        },
        budget_file,
        lane: std::sync::OnceLock::new(),
        saved_usage: Mutex::new(saved_usage),
        cfg,
        ccfg,
    });
    info!(tun = %client.cfg.tun_name, mtu, paths = initial_paths.len(), policy = client.ccfg.policy.as_str(), "client starting");
    for (rank, k) in client.classes.iter().filter(|k| k.cfg.explicit).enumerate() {
        info!(class = %k.cfg.name, rank, policy = k.cfg.policy.as_str(), mode = k.cfg.mode.as_str(), fec = %k.cfg.fec, "traffic class");
    }

    let started = Instant::now();
    let status_client = client.clone();
    let (trigger, reloads) = reload::channel();
    platform.on_hangup(trigger.clone())?;
    // Held until run returns: the socket file goes with the instance.
    let _control = crate::control::serve(
        &client.cfg.control_socket,
        client.cfg.metrics_listen,
        client.cfg.dashboard.as_ref(),
        Arc::new(move || status_client.status(started)),
        trigger,
    )
    .await?;

    // Held until run returns: the lane's kernel setup goes with it.
    let _lane = crate::lane::client::start(&client.cfg, &client.ccfg, &initial_paths)
        .await
        .context("the MPTCP lane (tcp_lane)")?;
    if let Some(l) = &_lane {
        let _ = client.lane.set(l.live.clone());
    }
    // Every path in place before any task runs: with turns, the first dials first.
    let ids = (initial_paths.iter())
        .map(|p| client.add_path(p))
        .collect::<Result<Vec<_>>>()?;
    for (p, id) in initial_paths.into_iter().zip(ids) {
        let live = client.spawn_path(id, p);
        client.lock_paths().push(live);
    }
    let t = client.tunnel.clone();
    tokio::spawn(async move { t.run_timers().await });
    let t = client.tunnel.clone();
    tokio::spawn(client.budget_file.clone().keep(t));
    let c = client.clone();
    tokio::spawn(async move { c.tun_reader().await });
    for k in 0..client.classes.len() {
        if client.classes[k].own_tun.is_some() {
            let c = client.clone();
            tokio::spawn(async move { c.class_tun_reader(k).await });
        }
    }

    let until = async {
        tokio::select! {
            _ = platform.stopped() => Ok(()),
            msg = fatal_rx.recv() => Err(anyhow!(msg.unwrap_or_default())),
        }
    };
    let apply = |new| client.apply(new);
    let result = reload::serve_until(reloads, &client.cfg, &client.reloads, apply, until).await;
    // Stop reconnecting first, or the closed paths would be dialled again at once.
    client.lock_paths().clear();
    client
        .tunnel
        .close_all(close::LEAVING, "client shutting down");
    let usage = client.tunnel.budget_usage();
    if !usage.is_empty() {
        if let Err(e) = client.budget_file.save(&usage) {
            warn!(error = %format!("{e:#}"), "data budget file not written at shutdown");
        }
    }
    // Give the close frames a moment to leave; the TUN device goes with the process.
    tokio::time::sleep(Duration::from_millis(50)).await;
    info!("client stopped");
    result
}

impl Client {
    fn status(&self, started: Instant) -> StatusReport {
        let addr = *self.addr.lock().unwrap_or_else(|e| e.into_inner());
        let address6 = addr.and_then(|a| a.v6).map(|(a, p)| format!("{a}/{p}"));
        StatusReport {
            role: "client".into(),
            congestion: self.tunnel.congestion(),
            tun_name: self.cfg.tun_name.clone(),
            tun_mtu: self.mtu,
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: started.elapsed().as_secs_f64(),
            tunnels: {
                let mut st = (self.tunnel).status(addr.map(|a| format!("{}/{}", a.v4.0, a.v4.1)));
                st.address6 = address6;
                st.protocol = self.carrier.get().map_or("", |c| c.as_str()).into();
                // Over CONNECT-IP to a standard server a path without a connection may be
                // waiting for its turn.
                if let Some(turns) = self.turns() {
                    for p in st.paths.iter_mut().filter(|p| p.state == "disconnected") {
                        let id = self.tunnel.path_id(&p.name);
                        if id.is_some_and(|id| turns.standing_by(id)) {
                            p.state = "standby".into();
                        }
                    }
                }
                // With classes, `st.classes` lists them all, in lane order.
                for (c, k) in st.classes.iter_mut().zip(&self.classes) {
                    c.classified_packets = k.classified.load(Ordering::Relaxed);
                    c.unmatched_packets = k.unmatched.load(Ordering::Relaxed);
                }
                vec![st]
            },
            drops: Default::default(),
            refused: Default::default(),
            tun_queue_packets: Vec::new(),
            last_reload: self.reloads.last(),
            process: crate::runtime::process_status(),
            lane: self.lane.get().map(|l| l.status()),
            tls: crate::tls::status(
                self.cfg.tls_post_quantum,
                (self.certificates.read().unwrap_or_else(|e| e.into_inner())).clone(),
            ),
        }
    }

    fn lock_paths(&self) -> MutexGuard<'_, Vec<LivePath>> {
        self.paths.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Path `p` in the tunnel, with its task.
    fn start_path(self: &Arc<Self>, p: PathConfig) -> Result<LivePath> {
        let id = self.add_path(&p)?;
        Ok(self.spawn_path(id, p))
    }

    /// The task of path `id` (in the tunnel already).
    fn spawn_path(self: &Arc<Self>, id: PathId, p: PathConfig) -> LivePath {
        let (tx, rx) = watch::channel(Arc::new(p));
        let c = self.clone();
        let task = tokio::spawn(async move { c.path_task(id, rx).await }).abort_handle();
        LivePath { cfg: tx, task }
    }

    /// Apply a reloaded configuration (`reload::read` has checked that only what applies live
    /// changed): the paths that differ are removed, reconnected or added; the others are left
    /// alone.
    fn apply(self: &Arc<Self>, new: Config) -> Result<String, String> {
        let RoleConfig::Client(nc) = &new.role else {
            return Err("the file is no longer a client's".into());
        };
        // TLS first (its files read again: a rotated certificate, key or CA), so an unreadable
        // one refuses the reload whole.
        let lane = match self.lane.get() {
            Some(l) => Some((l, l.prepare(&new, nc).map_err(|e| format!("{e:#}"))?)),
            None => None,
        };
        (self.dialer)
            .reload_tls(&new, nc)
            .map_err(|e| format!("{e:#}"))?;
        *self.certificates.write().unwrap_or_else(|e| e.into_inner()) =
            crate::tls::loaded(new.cert_file.as_deref(), nc.ca_file.as_deref());
        let RoleConfig::Client(nc) = new.role else {
            return Err("the file is no longer a client's".into());
        };
        let mut paths = self.lock_paths();
        let old: Vec<PathConfig> = paths.iter().map(|l| (**l.cfg.borrow()).clone()).collect();
        let changes = PathChanges::between(&old, &nc.paths);
        // Without `classes:` the top-level policy is the one lane's (with them, a class's
        // policy is fixed at start: `reload::read`).
        let implicit = self.classes.iter().any(|k| !k.cfg.explicit);
        let policy = Some(self.tunnel.policy()).filter(|now| implicit && *now != nc.policy);
        if policy.is_some() {
            self.tunnel.set_policy(nc.policy)?;
        }
        let rules = *self.classifier() != nc.classifier;
        for p in changes.added.iter().chain(&changes.changed) {
            let mtu = self.platform.link_mtu(&p.bind);
            if mtu < self.link_mtu {
                warn!(path = %p.name, link_mtu = mtu, tun_mtu = self.mtu, "the path's link MTU is below the one the TUN MTU was derived from at start; its packets are sized by the MTU watch (a restart sizes the TUN device for it)");
            }
        }
        // New paths first: a failure leaves the running set as it was.
        let mut lane_message = None;
        let mut added = Vec::new();
        for p in &changes.added {
            added.push(
                self.start_path(p.clone())
                    .map_err(|e| format!("path {}: {e:#}", p.name))?,
            );
        }
        // The classes' rules: packets are classified by them from the next batch read on (the
        // classes themselves, and which is the default, are fixed at start: `reload::read`).
        if let Some((l, prepared)) = lane {
            // The tunnel's part is in place already: the lane's failure is told, not undone.
            match l.apply(prepared, &nc.classifier) {
                Ok(m) => lane_message = Some(m),
                Err(e) => {
                    warn!(error = %format!("{e:#}"), "MPTCP lane: the reload is applied in part");
                    lane_message = Some(format!("MPTCP lane not changed in full: {e:#}"));
                }
            }
        }
        if rules {
            *self.classifier.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(nc.classifier);
        }
        for name in &changes.removed {
            paths.retain(|l| l.cfg.borrow().name != *name);
            if let Some(id) = self.tunnel.path_id(name) {
                self.tunnel.retire(id, None);
            }
        }
        for p in &changes.changed {
            if let Some(l) = paths.iter().find(|l| l.cfg.borrow().name == p.name) {
                // Its tasks reconnect it (`supervise`).
                l.cfg.send_replace(Arc::new(p.clone()));
            }
        }
        if policy.is_some() {
            // The server learns the policy from the hellos: every path reconnects (each new
            // connection made before its old one closes).
            for l in paths.iter() {
                l.cfg.send_modify(|_| {});
            }
        }
        paths.extend(added);
        // Config order, as status lists them.
        let order = |l: &LivePath| nc.paths.iter().position(|p| p.name == l.cfg.borrow().name);
        paths.sort_by_key(order);
        let mut what = Vec::new();
        if let Some(before) = policy {
            what.push(format!(
                "multipath_policy {} -> {}",
                before.as_str(),
                nc.policy.as_str()
            ));
        }
        if rules {
            what.push("classes: match rules changed".to_string());
        }
        if what.is_empty() || !changes.is_empty() {
            what.push(changes.summary());
        }
        what.push("TLS certificate, key and CA read again".into());
        what.extend(lane_message);
        Ok(what.join("; "))
    }

    /// The classes' rules in force.
    fn classifier(&self) -> Arc<Classifier> {
        self.classifier
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    async fn tun_reader(&self) {
        let default = self.ccfg.classifier.default_class();
        let mut shares = Shares::default();
        // Per class: packets put in it by a rule, and without one (added to the counters once
        // per batch).
        let mut counts = vec![(0u64, 0u64); self.classes.len()];
        self.tun
            .read_loop(
                self.mtu,
                mpquic_core::packet::mtu::tcp_mss(self.mtu),
                |batch, infos, drops| {
                    let t = &self.tunnel;
                    t.drop_unsent(default, DropReason::Oversized, drops.oversized);
                    t.drop_unsent(default, DropReason::Malformed, drops.unsplit);
                    let classifier = self.classifier();
                    for (i, info) in infos.iter().enumerate() {
                        let (k, matched) = classifier.classify(info.as_ref());
                        shares.add(t, k, i);
                        match matched {
                            true => counts[k].0 += 1,
                            false => counts[k].1 += 1,
                        }
                    }
                    shares.send(batch, infos);
                    for (k, (m, u)) in self.classes.iter().zip(&mut counts) {
                        k.classified.fetch_add(std::mem::take(m), Ordering::Relaxed);
                        k.unmatched.fetch_add(std::mem::take(u), Ordering::Relaxed);
                    }
                },
            )
            .await
    }

    /// A class's own TUN device: everything read from it goes in the class (counted as put
    /// there by a rule: the device is the rule).
    async fn class_tun_reader(&self, k: usize) {
        let class = &self.classes[k];
        let Some(tun) = &class.own_tun else { return };
        let mut routed = Routed::default();
        let mut all: Vec<usize> = Vec::new();
        tun.read_loop(
            self.mtu,
            mpquic_core::packet::mtu::tcp_mss(self.mtu),
            |batch, infos, drops| {
                let t = &self.tunnel;
                t.drop_unsent(k, DropReason::Oversized, drops.oversized);
                t.drop_unsent(k, DropReason::Malformed, drops.unsplit);
                all.clear();
                all.extend(0..batch.len());
                t.send_batch(k, batch, &all, infos, &mut routed);
                class
                    .classified
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            },
        )
        .await
    }

    /// Keep path `id` connected for as long as it is configured (`cfg`: its configuration,
    /// which a reload may change).
    async fn path_task(self: Arc<Self>, id: PathId, mut cfg: watch::Receiver<Arc<PathConfig>>) {
        let mut backoff = reconnect::Backoff::default();
        // Out of the turns when the task ends (the path removed: the task is aborted).
        let _turn = self.turns.as_ref().map(|t| t.member(id));
        // The path's sender goes when it is removed (its tasks are aborted then, too).
        while cfg.has_changed().is_ok() {
            let p = cfg.borrow_and_update().clone();
            if let Some(turns) = self.turns() {
                // A reload may have changed its priority.
                turns.rerank(id, p.priority);
                // One path at a time: it dials once no better one is connected or trying.
                tokio::select! {
                    _ = turns.turn(id) => {}
                    _ = cfg.changed() => continue,
                }
            }
            match self.connect(id, &p).await {
                Ok(transport) => {
                    backoff.succeeded();
                    self.stand(id, &p, Standing::Connected);
                    let after = self.supervise(id, &mut cfg, transport).await;
                    self.stand(id, &cfg.borrow(), after);
                }
                Err(e) => {
                    self.stand(id, &p, Standing::Failed);
                    let wait = backoff.failed();
                    warn!(path = %p.name, error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64, "path connect failed");
                    // A changed configuration is tried at once.
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = cfg.changed() => {}
                    }
                }
            }
        }
    }

    /// Path `id` (configured as `p`) now stands so, when the paths take turns.
    fn stand(&self, id: PathId, p: &PathConfig, standing: Standing) {
        if let Some(turns) = self.turns() {
            turns.set(id, p.priority, standing);
        }
    }

    /// Watch an installed transport; replace it when it has been unusable for too long, or
    /// when the path's configuration changed. When the paths take turns, also hand over to a
    /// better path that connected, and close the connection once it stops acknowledging
    /// (`standby.rs`). Returns where the path stands when its connection is gone.
    async fn supervise(
        &self,
        id: PathId,
        cfg: &mut watch::Receiver<Arc<PathConfig>>,
        transport: Arc<dyn PathTransport>,
    ) -> Standing {
        let tunnel = &self.tunnel;
        let mut p = cfg.borrow().clone();
        let mut now = Installed::new(tunnel, id, transport);
        let mut liveness = standby::Liveness::default();
        let outranked = async {
            match self.turns() {
                Some(turns) => turns.outranked(id).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(outranked);
        let mut sample = tokio::time::interval(standby::SAMPLE_EVERY);
        sample.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // An interval, not a sleep made anew in each turn of the loop: the samples' ticks
        // would keep putting that off.
        let every = Duration::from_millis(250);
        let mut check = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ended = &mut now.closed => {
                    tunnel.remove(id, now.generation);
                    info!(path = %p.name, reason = %ended, "path connection closed");
                    let Some(turns) = self.turns() else {
                        return Standing::Failed;
                    };
                    // The server gave the session to this client's newer connection on another
                    // path (an mpquic server keeps a client's newest): wait for it to connect
                    // before dialing again, or the two would take the session from each other
                    // in turn.
                    if ended.peer_code == Some(close::REPLACED) {
                        // It stands by meanwhile, so that, being the better path, it does not
                        // outrank the newer connection and close it.
                        self.stand(id, &p, Standing::Ready);
                        tokio::select! {
                            _ = turns.another_connected(id) => {}
                            _ = tokio::time::sleep(CONNECT_TIMEOUT) => {}
                        }
                        return Standing::Ready;
                    }
                    return match turns.is_outranked(id) {
                        true => Standing::Ready,
                        false => Standing::Failed,
                    };
                }
                _ = &mut outranked => {
                    now.transport.close(close::REPLACED, "a better path took over");
                    tunnel.remove(id, now.generation);
                    info!(path = %p.name, "a better path connected and carries; this one stands by");
                    return Standing::Ready;
                }
                _ = sample.tick(), if self.turns().is_some_and(|t| t.has_others(id)) => {
                    let verdict = liveness.dead_for(now.transport.as_ref(), Instant::now());
                    self.with_slot(id, |s| {
                        s.quic_rtt = liveness.rtt();
                        s.payload = liveness.payload().or(s.payload);
                    });
                    if let Some(silent) = verdict {
                        now.transport.close(close::PATH_DOWN, "no ACK");
                        tunnel.remove(id, now.generation);
                        warn!(path = %p.name, silent_ms = silent.as_millis() as u64, "path stopped acknowledging; its connection is closed and the next path takes over");
                        return Standing::Failed;
                    }
                }
                changed = cfg.changed() => {
                    if changed.is_err() {
                        return Standing::Failed;
                    }
                    p = cfg.borrow_and_update().clone();
                    if let Some(turns) = self.turns() {
                        turns.rerank(id, p.priority);
                    }
                    // Priority and weight count here at once; the server learns them from
                    // the new connection's hello, made before the old one is closed.
                    tunnel.path(spec_of(&p), sessions::MAX_PATHS_PER_SESSION);
                    // A changed budget counts on from what the period has used.
                    tunnel.set_budget(id, p.data_budget, None);
                    match self.dial(id, &p).await {
                        Ok(new) => {
                            info!(path = %p.name, "path reconfigured; new connection in place");
                            now = Installed::new(tunnel, id, new);
                        }
                        Err(e) => warn!(path = %p.name, error = %format!("{e:#}"), "path reconfigured, but its new connection failed; the old one carries on (the new settings apply at its next reconnect)"),
                    }
                }
                _ = check.tick() => {
                    if let Some(r) = tunnel.take_resize(id) {
                        // The route's MTU changed, or a larger size is tried: a new connection
                        // at that size (the QUIC engine's packet size is fixed per connection);
                        // the old one drains and closes, or carries on if this one fails.
                        let before = self.set_payload(id, Some(r.payload));
                        match self.dial(id, &p).await {
                            Ok(new) => {
                                info!(path = %p.name, payload = r.payload, "path reconnected at a new packet size");
                                now = Installed::new(tunnel, id, new);
                            }
                            Err(e) => {
                                self.set_payload(id, before);
                                let error = format!("{e:#}");
                                if !tunnel.resize_failed(id, r.payload) {
                                    info!(path = %p.name, payload = r.payload, %error, "reconnect at a new packet size failed while the path was down; tried again once it is up");
                                } else if before == Some(mpquic_core::path::pmtu::FLOOR) {
                                    // Connected at the floor only, and larger packets fail
                                    // while those pass: the route's MTU fell.
                                    warn!(path = %p.name, payload = r.payload, %error, "path MTU fell: larger packets do not pass while the smallest do; finding the size that passes");
                                } else {
                                    let level = if r.recheck { "larger packets do not pass yet" } else { "failed" };
                                    info!(path = %p.name, payload = r.payload, %error, "reconnect at a new packet size: {level}");
                                }
                            }
                        }
                        continue;
                    }
                    if reconnect::should_replace(tunnel.unusable_for(id)) {
                        match self.connect(id, &p).await {
                            Ok(new) => {
                                info!(path = %p.name, "path unusable; replaced its connection");
                                now = Installed::new(tunnel, id, new);
                            }
                            Err(e) => info!(path = %p.name, error = %format!("{e:#}"), "path still unusable; reconnect failed"),
                        }
                    }
                }
            }
        }
    }

    /// Connect path `idx` (a new connection, or a replacement for one that is unusable). A
    /// route whose MTU fell drops the server's full-size handshake packets, so after a failure
    /// every other attempt is made with QUIC's minimum packet size; once connected,
    /// the MTU watch finds the size that passes (`pmtu.rs`; native protocol only).
    async fn connect(&self, id: PathId, p: &PathConfig) -> Result<Arc<dyn PathTransport>> {
        let tunnel = &self.tunnel;
        let failures = self.slot(id).connect_failures;
        let floor = mpquic_core::path::pmtu::FLOOR;
        let current = self.slot(id).payload;
        // Only where the tunnel watches the size (not over CONNECT-IP: its server answers no
        // size probes), or nothing would find the larger size again.
        let fall_back = failures % 2 == 1 && current != Some(floor) && tunnel.watches_mtu();
        if fall_back {
            self.set_payload(id, Some(floor));
        }
        match self.dial(id, p).await {
            Ok(t) => {
                self.with_slot(id, |s| s.connect_failures = 0);
                if fall_back {
                    let tried = current.unwrap_or(self.link_payload);
                    tunnel.fell_back(id);
                    info!(path = %p.name, tried, payload = floor,
                          "path connected with the smallest packets after an unanswered attempt (an outage or an MTU fall); its size tried again as soon as it is up");
                }
                Ok(t)
            }
            Err(e) => {
                self.with_slot(id, |s| s.connect_failures += 1);
                if fall_back {
                    self.set_payload(id, current);
                }
                Err(e)
            }
        }
    }

    /// The path's RTT as last known: its probes', or its connection's.
    fn rtt(&self, id: PathId) -> Option<Duration> {
        self.tunnel.rtt(id).or(self.slot(id).quic_rtt)
    }

    async fn dial(&self, id: PathId, p: &PathConfig) -> Result<Arc<dyn PathTransport>> {
        let limit = connect_timeout(self.rtt(id));
        tokio::time::timeout(limit, self.connect_inner(id, p))
            .await
            .map_err(|_| anyhow!("no answer from the server within {limit:?}"))?
    }

    async fn connect_inner(&self, id: PathId, p: &PathConfig) -> Result<Arc<dyn PathTransport>> {
        let previous = self
            .addr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|a| a.v4);
        let h = Hello {
            session: self.session,
            path: p.name.clone(),
            priority: p.priority,
            weight: p.weight,
            // The first lane's, which a reload may have changed.
            policy: self.tunnel.policy().as_str().into(),
            mode: self.tunnel.mode(),
            addr: self.ccfg.requested.map(|(a, l)| format!("{a}/{l}")),
            previous: previous.map(|(a, l)| format!("{a}/{l}")),
            fec: Some(tunnel_fec(&self.ccfg.classes))
                .filter(|f| *f != FecMode::Off)
                .map(|f| f.to_string()),
            // The dialer numbers the pipes of a path that has several, and says which are
            // stripe paths.
            pipe: None,
            stripe: None,
            instance: Some(self.cfg.tun_name.clone()),
            classes: (self.classes.iter().enumerate())
                .filter(|(_, k)| k.cfg.explicit)
                .map(|(rank, k)| ClassOf {
                    name: k.cfg.name.clone(),
                    rank: rank as u8,
                    default: rank == self.ccfg.classifier.default_class(),
                    policy: k.cfg.policy.as_str().into(),
                    mode: k.cfg.mode,
                    fec: k.cfg.fec != FecMode::Off,
                })
                .collect(),
            routes: self
                .ccfg
                .lan_prefixes
                .iter()
                .map(|p| p.to_string())
                .collect(),
            rate_limit: p.rate_limit,
            // Backup while its budget is used up, whatever its configured role.
            role: Some(self.tunnel.role(id))
                .filter(|r| *r != mpquic_core::Role::Primary)
                .map(|r| r.as_str().into()),
        };
        let known = Known {
            payload: self.slot(id).payload,
            rtt: self.rtt(id),
        };
        let Dialed {
            transport,
            ack,
            carrier,
        } = self.dialer.dial(p, &h, known).await?;
        // Closed if the answer is unusable (or this attempt is given up by its timeout).
        let transport = Unfinished::new(transport);
        if !ack.ok {
            let msg = ack
                .error
                .unwrap_or_else(|| "refused without a reason".into());
            transport.get().close(close::SHUTDOWN, "refused");
            let _ = self
                .fatal
                .try_send(format!("server refused this client: {msg}"));
            bail!("server refused: {msg}");
        }
        self.learn(carrier)?;
        self.set_address(Assigned::from_answer(&ack)?)?;
        transport.get().set_rate_cap(p.rate_limit);
        Ok(transport.keep())
    }

    /// How the server carries the session, from an answer: the first over CONNECT-IP sets the
    /// tunnel up for it (before its path is installed, so that path is already probed or not);
    /// a later one that differs (the server replaced by another kind) is refused, since the
    /// tunnel's framing and policy cannot change under a running session.
    fn learn(&self, carrier: Carrier) -> Result<()> {
        let known = *self.carrier.get_or_init(|| {
            if !carrier.plain() {
                self.tunnel.peer_speaks_mpquic();
                if let Some(turns) = &self.turns {
                    turns.end();
                }
                info!("the CONNECT-IP server is an mpquic server: the paths bond as on the native protocol");
            } else if self.tunnel.peer_speaks_ip_only() {
                warn!(policy = self.ccfg.policy.as_str(), "the CONNECT-IP server does not bond (a standard server): the paths take turns, and the policy gives way to failover");
            } else {
                info!("the CONNECT-IP server is a standard one: the paths take turns");
            }
            carrier
        });
        if known != carrier {
            bail!(
                "the server now speaks {} where it spoke {}: restart the client to follow it",
                carrier.as_str(),
                known.as_str()
            );
        }
        Ok(())
    }

    fn set_address(&self, new: Assigned) -> Result<()> {
        let mut cur = self.addr.lock().unwrap_or_else(|e| e.into_inner());
        if *cur != Some(new) {
            // The classes' own devices carry the same address (policy routing picks the device).
            let own = self.classes.iter().filter_map(|k| k.own_tun.as_ref());
            for tun in std::iter::once(&self.tun).chain(own) {
                // IPv6 first: setting the IPv4 address brings the device up.
                if let Some((a, l)) = new.v6 {
                    tun.device()
                        .set_ipv6(a, l)
                        .context("cannot set the IPv6 tunnel address")?;
                }
                tun.device()
                    .set_ipv4(new.v4.0, new.v4.1)
                    .context("cannot set the tunnel address")?;
            }
            let (a, l) = new.v4;
            let address6 = new.v6.map(|(a, l)| format!("{a}/{l}"));
            info!(address = %format!("{a}/{l}"), address6, tun = %self.cfg.tun_name, "tunnel address assigned");
            *cur = Some(new);
        }
        Ok(())
    }
}

impl Client {
    /// Path `p` in the tunnel (its id; the same one if it was there before).
    fn add_path(&self, p: &PathConfig) -> Result<PathId> {
        // The config allows no more than a server session takes.
        let id = (self.tunnel)
            .path(spec_of(p), sessions::MAX_PATHS_PER_SESSION)
            .ok_or_else(|| anyhow!("too many paths"))?;
        let saved = (self.saved_usage.lock().unwrap_or_else(|e| e.into_inner())).remove(&p.name);
        self.tunnel.set_budget(id, p.data_budget, saved);
        self.with_slot(id, |_| ());
        self.stand(id, p, Standing::Ready);
        Ok(id)
    }

    /// The turns the paths take, while they take them (`protocol: masque` to a server that
    /// does not bond, or before the first answer said).
    fn turns(&self) -> Option<&standby::Turns> {
        self.turns.as_ref().filter(|t| t.taking())
    }

    fn slot(&self, id: PathId) -> PathSlot {
        self.with_slot(id, |s| *s)
    }

    fn with_slot<R>(&self, id: PathId, f: impl FnOnce(&mut PathSlot) -> R) -> R {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if slots.len() <= id.index() {
            slots.resize_with(id.index() + 1, Default::default);
        }
        f(&mut slots[id.index()])
    }

    /// Set path `id`'s packet size for its next connections; returns the previous one.
    fn set_payload(&self, id: PathId, payload: Option<u16>) -> Option<u16> {
        self.with_slot(id, |s| std::mem::replace(&mut s.payload, payload))
    }
}

/// The FEC mode of the tunnel's paths: the classes that use FEC share one (the config checks
/// that they agree); off when none does.
fn tunnel_fec(classes: &[ClassConfig]) -> FecMode {
    (classes.iter().map(|k| k.fec))
        .find(|f| *f != FecMode::Off)
        .unwrap_or(FecMode::Off)
}

fn spec_of(p: &PathConfig) -> PathSpec {
    PathSpec {
        name: p.name.clone(),
        priority: p.priority,
        weight: p.weight,
        role: p.role,
        rate_limit: p.rate_limit,
    }
}
