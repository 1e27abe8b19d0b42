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
//!
//! Here: `run` (the client started) and what the parts share. Beside it: `paths` (each path's
//! task: dial, supervise, reconnect), `reader` (the TUN readers), `apply` (a reload applied),
//! `standby` (one path at a time to a standard server).

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use mpquic_core::classify::Classifier;
use mpquic_core::fec::FecMode;
use mpquic_core::HealthMode;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::config::{parse_cidr, parse_cidr6, ClassConfig, ClientConfig, Config};
use crate::control::reload;
use crate::hello::HelloAck;
use crate::io::platform::Platform;
use crate::io::tun::Tun;
use crate::runtime;
use crate::status::StatusReport;
use crate::transport::quic::QuicDialer;
use crate::transport::{Carrier, Dialer};
use crate::tunnel::{close, Carriage, LaneSpec, Tunnel};

mod apply;
mod paths;
mod reader;
mod standby;

use paths::{LivePath, PathSlot};

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
    // Held until run returns: the socket file goes with the instance.
    let (_control, reloads) = crate::control::start(
        &platform,
        &client.cfg,
        Arc::new(move || status_client.status(started)),
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
    /// The turns the paths take, while they take them (`protocol: masque` to a server that
    /// does not bond, or before the first answer said).
    fn turns(&self) -> Option<&standby::Turns> {
        self.turns.as_ref().filter(|t| t.taking())
    }
}

/// The FEC mode of the tunnel's paths: the classes that use FEC share one (the config checks
/// that they agree); off when none does.
pub(super) fn tunnel_fec(classes: &[ClassConfig]) -> FecMode {
    (classes.iter().map(|k| k.fec))
        .find(|f| *f != FecMode::Off)
        .unwrap_or(FecMode::Off)
}
