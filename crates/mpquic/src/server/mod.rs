//! The server (VPS) side: one UDP port, many clients, one TUN device with a queue per runtime
//! thread (each queue read by its own task, each session writing to one queue, sessions spread
//! over the queues). A client is the identity
//! in its certificate; its paths are grouped by that identity and its session id, so NAT
//! rebinding, new ports and reconnections just work. Inner packets from the TUN device are routed
//! to the client that owns the destination address. Connections reach it as offers from a
//! `transport::Listener` (QUIC: `transport::quic::QuicListener`), which has done the handshake,
//! identity and hello; the server decides (the core's session registry) and answers.
//!
//! A reload (`control/reload.rs`) swaps the `clients:` rules: routes for new LAN prefixes go into the
//! device, those no client may announce any more come out, and the sessions whose rules changed
//! are closed, so their clients rejoin under the new ones; the other sessions are not touched.
//!
//! Here: `run` (the server started), status, housekeeping. Beside it: `session` (offers judged
//! and joined to sessions), `reader` (the TUN readers), `apply` (a reload applied).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use mpquic_core::classify::Prefix;
use mpquic_core::sessions::{Presence, Registry};
use mpquic_core::{DropReason, Drops};
use tracing::info;

use crate::config::{Config, Ipv6Plan, ServerConfig};
use crate::control::reload;
use crate::io::platform::Platform;
use crate::io::tun::Tun;
use crate::runtime;
use crate::status::StatusReport;
use crate::transport::masque::MasqueListener;
use crate::transport::quic::QuicListener;
use crate::transport::Listener;
use crate::tunnel::close;

mod apply;
mod reader;
mod session;

use session::Session;
pub(crate) use session::{lanes_of, terms};

/// Traffic classes one session may have (each a lane of its tunnel).
const MAX_CLASSES: usize = crate::config::MAX_CLASSES;
/// How often sessions are checked for expiry (path health runs on each session's own timers).
const HOUSEKEEPING: Duration = Duration::from_secs(1);

struct Server {
    cfg: Config,
    /// The MPTCP lane (its counters, TLS and open connections), when `tcp_lane_listen` is set.
    lane: Option<Arc<crate::lane::serve::Shared>>,
    /// The server's certificate and the clients' CA as loaded (at start, at each reload).
    certificates: RwLock<Vec<crate::status::CertificateStatus>>,
    /// The running server configuration; a reload replaces it (only `clients:` may differ).
    scfg: RwLock<Arc<ServerConfig>>,
    /// The last reload's outcome (status).
    reloads: reload::Record,
    /// A dual-stack tunnel: how a client's IPv6 address follows from its IPv4 one (fixed for
    /// the process: `tun_cidr` does not reload).
    ipv6: Option<Ipv6Plan>,
    /// The TUN device's queues; the first also carries the device's settings.
    queues: Vec<Arc<Tun>>,
    /// Packets read from each queue (status: are the queues, and so the threads, all used).
    queue_packets: Vec<AtomicU64>,
    /// Sessions made so far: the next session writes to queue `made % queues`.
    made: AtomicU64,
    mtu: u32,
    registry: RwLock<Registry<Arc<Session>>>,
    drops: Mutex<Drops>,
    /// Connections refused, by reason (status and metrics); the listener counts its own.
    refused: Arc<Mutex<BTreeMap<String, u64>>>,
}

pub async fn run(cfg: Config, scfg: ServerConfig, platform: Platform) -> Result<()> {
    let refused: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let count = refused.clone();
    let counter: crate::transport::quic::Refused =
        Arc::new(move |reason| count_refused(&count, reason));
    // `stripe_enabled`: the stripe socket that stripe paths' sessions join.
    let stripe: Option<Arc<dyn crate::transport::quic::RideServer>> = match scfg.stripe {
        Some(addr) => Some(Arc::new(
            crate::transport::stripe::server::StripeServer::start(
                &platform,
                addr,
                cfg.congestion,
                counter.clone(),
            )?,
        )),
        None => None,
    };
    let listener = QuicListener::start(&cfg, &scfg, &platform, counter.clone(), stripe)?;
    let masque = match &scfg.masque {
        Some(m) => {
            let l = MasqueListener::start(&cfg, &scfg, m, &platform, counter)?;
            info!(listen = %m.listen, tokens = m.tokens.len(), "CONNECT-IP (MASQUE) listening");
            Some(Arc::new(l))
        }
        None => None,
    };

    let _lane = match scfg.tcp_lane {
        Some(listen) => Some(crate::lane::serve::start(&cfg, &scfg, listen)?),
        None => None,
    };
    let mtu = runtime::tun_mtu(&cfg, crate::io::socket::DEFAULT_LINK_MTU);
    // One queue per runtime thread: that many readers can run at once.
    let queues: Vec<Arc<Tun>> =
        runtime::open_tun_queues(&platform, &cfg, &cfg.tun_name, mtu, cfg.worker_threads)?
            .into_iter()
            .map(Arc::new)
            .collect();
    // IPv6 first: setting the IPv4 address brings the device up.
    if let Some((a6, plan)) = scfg.ipv6 {
        queues[0].device().set_ipv6(a6, plan.prefix6())?;
    }
    queues[0].device().set_ipv4(scfg.tun_addr, scfg.prefix)?;
    // Every site LAN a client may announce is routed into the device from the start; packets
    // for one whose client is not connected are counted (`no_route`).
    for (client, lan) in &scfg.routes {
        route(&queues[0], lan, true)?;
        info!(%client, %lan, "site LAN routed into the TUN device");
    }
    let address6 = scfg.ipv6.map(|(a, p)| format!("{a}/{}", p.prefix6()));
    info!(listen = %scfg.listen, tun = %cfg.tun_name, address = %format!("{}/{}", scfg.tun_addr, scfg.prefix), address6, mtu, queues = queues.len(), "server listening");

    let server = Arc::new(Server {
        lane: _lane.as_ref().map(|l| l.shared.clone()),
        certificates: RwLock::new(crate::tls::loaded(
            cfg.cert_file.as_deref(),
            Some(&scfg.client_ca_file),
        )),
        ipv6: scfg.ipv6.map(|(_, plan)| plan),
        cfg,
        scfg: RwLock::new(Arc::new(scfg)),
        reloads: reload::Record::default(),
        queue_packets: queues.iter().map(|_| AtomicU64::new(0)).collect(),
        queues,
        made: AtomicU64::new(0),
        mtu,
        registry: RwLock::new(Registry::default()),
        drops: Mutex::new(Drops::default()),
        refused,
    });
    let started = Instant::now();
    let s = server.clone();
    // Held until run returns: the socket file goes with the instance.
    let (_control, reloads) =
        crate::control::start(&platform, &server.cfg, Arc::new(move || s.status(started))).await?;

    let s = server.clone();
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(HOUSEKEEPING);
        loop {
            iv.tick().await;
            s.expire_sessions();
        }
    });
    for q in 0..server.queues.len() {
        let s = server.clone();
        tokio::spawn(async move { s.tun_reader(q).await });
    }
    let listener = Arc::new(listener);
    take_offers(&server, listener.clone());
    if let Some(m) = &masque {
        take_offers(&server, m.clone());
    }

    let apply = |new| server.apply(new, &listener, masque.as_deref());
    let stopped = platform.stopped();
    reload::serve_until(reloads, &server.cfg, &server.reloads, apply, stopped).await;
    info!("server shutting down");
    let sessions = server.write().drain();
    for sess in sessions {
        sess.close_all(close::SHUTDOWN, "server shutting down");
    }
    listener
        .close(close::SHUTDOWN, "server shutting down")
        .await;
    if let Some(m) = &masque {
        m.close(close::SHUTDOWN, "server shutting down").await;
    }
    info!("server stopped");
    Ok(())
}

/// Each offer of `listener` handled in its own task, for as long as it offers.
fn take_offers(server: &Arc<Server>, listener: Arc<impl Listener>) {
    let s = server.clone();
    tokio::spawn(async move {
        while let Some(offer) = listener.next().await {
            let s = s.clone();
            tokio::spawn(async move { s.handle(offer).await });
        }
    });
}

/// Route site LAN `lan` into the TUN device (`add`), or take the route out.
pub(super) fn route(tun: &Tun, lan: &Prefix, add: bool) -> std::io::Result<()> {
    match add {
        true => tun.device().add_route(lan),
        false => tun.device().del_route(lan),
    }
}

/// One more connection refused for `reason` (status and metrics).
fn count_refused(counts: &Mutex<BTreeMap<String, u64>>, reason: &str) {
    *counts
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(reason.to_string())
        .or_default() += 1;
}

impl Server {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Registry<Arc<Session>>> {
        self.registry.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Registry<Arc<Session>>> {
        self.registry.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The IPv6 tunnel address ("x::y/len") of the client at `v4`, in a dual-stack tunnel.
    fn address6(&self, v4: std::net::Ipv4Addr) -> Option<String> {
        self.ipv6
            .map(|p| format!("{}/{}", p.v6_of(v4), p.prefix6()))
    }

    fn scfg(&self) -> Arc<ServerConfig> {
        self.scfg.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn status(&self, started: Instant) -> StatusReport {
        let sessions: Vec<(std::net::Ipv4Addr, Arc<Session>)> = self
            .read()
            .sessions()
            .into_iter()
            .map(|(_, addr, s)| (addr, s.clone()))
            .collect();
        let prefix = self.scfg().prefix;
        StatusReport {
            last_reload: self.reloads.last(),
            process: crate::runtime::process_status(),
            lane: self.lane.as_ref().map(|l| l.counters.status()),
            tls: crate::tls::status(self.cfg.tls_post_quantum, {
                let mut certs = self
                    .certificates
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                for (_, s) in &sessions {
                    let mine = s.certificates.lock().unwrap_or_else(|e| e.into_inner());
                    certs.extend(mine.last().map(|c| c.status("client")));
                }
                certs
            }),
            role: "server".into(),
            congestion: self.cfg.congestion.as_str().into(),
            tun_name: self.cfg.tun_name.clone(),
            tun_mtu: self.mtu,
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: started.elapsed().as_secs_f64(),
            tunnels: sessions
                .iter()
                .filter_map(|(addr, s)| {
                    let t = s.tunnel.read().unwrap_or_else(|e| e.into_inner());
                    let t = t.as_ref()?;
                    let mut st = t.tunnel.status(Some(format!("{addr}/{prefix}")));
                    st.address6 = self.address6(*addr);
                    st.protocol = t.carrier.as_str().into();
                    let counts = t.classified.iter().zip(&t.unmatched);
                    for (c, (m, u)) in st.classes.iter_mut().zip(counts) {
                        c.classified_packets = m.load(Ordering::Relaxed);
                        c.unmatched_packets = u.load(Ordering::Relaxed);
                    }
                    Some(st)
                })
                .collect(),
            drops: {
                let mut d: BTreeMap<String, u64> = (self.drops.lock())
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .map(|(r, n)| (r.as_str().to_string(), n))
                    .collect();
                // What the kernel dropped at the listening port before the server read it
                // (its socket buffer full: a flood, or a burst the server was too slow for).
                d.insert(
                    "udp_receive_buffer_full".into(),
                    crate::runtime::udp_drops(self.scfg().listen.port()),
                );
                d
            },
            refused: self
                .refused
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            tun_queue_packets: match self.queue_packets.len() {
                1 => Vec::new(),
                _ => self
                    .queue_packets
                    .iter()
                    .map(|n| n.load(Ordering::Relaxed))
                    .collect(),
            },
        }
    }

    fn refuse(&self, reason: &str) {
        count_refused(&self.refused, reason);
    }

    fn drop_packet(&self, r: DropReason) {
        self.drops.lock().unwrap_or_else(|e| e.into_inner()).add(r);
    }

    /// End the sessions whose client left, and forget those that have been without paths for
    /// long (`sessions::SESSION_LINGER`).
    fn expire_sessions(&self) {
        let gone = self.write().expire(Instant::now(), |s| s.presence());
        if !gone.is_empty() {
            // Their tunnels' buffers are freed with them: back to the system soon.
            crate::runtime::released();
        }
        for (name, addr, s) in gone {
            match s.presence() {
                Presence::Left => {
                    info!(client = %name, address = %addr, "session ended: the client stopped")
                }
                _ => info!(client = %name, address = %addr, "session expired"),
            }
        }
    }
}
