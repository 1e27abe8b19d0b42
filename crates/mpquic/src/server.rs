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

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use mpquic_core::classify::Prefix;
use mpquic_core::fec::FecMode;
use mpquic_core::sessions::{self, Presence, Registry};
use mpquic_core::{DropReason, Drops, HealthMode, PacketInfo, PathId, PathSpec, Policy};
use tracing::{info, warn};

use crate::config::{Config, Ipv6Plan, RoleConfig, ServerConfig};
use crate::control::reload;
use crate::hello::{ClassOf, Hello, HelloAck};
use crate::io::platform::Platform;
use crate::io::tun::Tun;
use crate::runtime;
use crate::status::StatusReport;
use crate::tls::certificate::Facts;
use crate::tls::revocation;
use crate::transport::masque::MasqueListener;
use crate::transport::quic::QuicListener;
use crate::transport::{Carrier, Listener, Offer};
use crate::tunnel::{close, Carriage, LaneSpec, Shares, Sources, Tunnel};

/// Traffic classes one session may have (each a lane of its tunnel).
const MAX_CLASSES: usize = crate::config::MAX_CLASSES;
/// How often sessions are checked for expiry (path health runs on each session's own timers).
const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// What the shell keeps per session; the rules (which session a path joins, replacement,
/// expiry, addresses, the path bound) are the core's `sessions::Registry`. A session has one
/// tunnel, made by its first connection, with a lane per traffic class of the client instance
/// (one without classes).
struct Session {
    /// The client's identity (its certificate's name): which `clients:` entries apply.
    identity: String,
    /// The certificates its connections presented (one, unless the client rotated its
    /// certificate while the session ran): a reload that revokes one closes the session.
    certificates: Mutex<Vec<Facts>>,
    /// The TUN queue the session's tunnel writes to (`Server::queues`).
    tun: Arc<Tun>,
    /// The site LAN prefixes routed to this session (announced, allowed by `clients:`).
    lans: Vec<Prefix>,
    tunnel: RwLock<Option<SessionTunnel>>,
}

/// A session's tunnel and its classes.
struct SessionTunnel {
    tunnel: Arc<Tunnel>,
    /// The classes as the session's first hello listed them (every later one must agree).
    classes: Vec<ClassOf>,
    /// The lane of flows the client has not sent on (its default class; 0 without classes).
    default: usize,
    /// Per lane: packets sent in it because their flow arrived in it / (default class) because
    /// their flow was not seen.
    classified: Vec<AtomicU64>,
    unmatched: Vec<AtomicU64>,
    /// The task serving the tunnel's timers; it ends with the session.
    timers: tokio::task::AbortHandle,
    /// How the session's first connection came (status).
    carrier: Carrier,
}

impl Drop for SessionTunnel {
    fn drop(&mut self) {
        self.timers.abort();
    }
}

impl Session {
    fn tunnel(&self) -> Option<Arc<Tunnel>> {
        let t = self.tunnel.read().unwrap_or_else(|e| e.into_inner());
        t.as_ref().map(|t| t.tunnel.clone())
    }

    fn presence(&self) -> Presence {
        match self.tunnel() {
            Some(t) if t.connected_paths() > 0 => Presence::Connected,
            Some(t) if t.peer_leaving() => Presence::Left,
            _ => Presence::Away,
        }
    }

    fn close_all(&self, code: u32, reason: &str) {
        if let Some(t) = self.tunnel() {
            t.close_all(code, reason);
        }
    }

    fn remember(&self, cert: Facts) {
        let mut certs = self.certificates.lock().unwrap_or_else(|e| e.into_inner());
        if !certs.iter().any(|c| c.serial == cert.serial) {
            // Bounded: a client rotates rarely; the newest few are what a revocation names.
            if certs.len() == 4 {
                certs.remove(0);
            }
            certs.push(cert);
        }
    }

    /// A client known by a token only (no certificate) whose token is not among `tokens`.
    fn token_gone(&self, tokens: &[&str]) -> bool {
        let certs = self.certificates.lock().unwrap_or_else(|e| e.into_inner());
        certs.is_empty() && !tokens.contains(&self.identity.as_str())
    }

    fn revoked_by(&self, list: &[String]) -> bool {
        let certs = self.certificates.lock().unwrap_or_else(|e| e.into_inner());
        certs.iter().any(|c| revocation::is_revoked(list, c))
    }

    /// The tunnel and lane an inner packet for this client goes through: with classes, the
    /// class its flow arrived in, else the default class (both counted). `false`: the session
    /// has no tunnel yet (its first connection is still being set up).
    fn pick(&self, info: &PacketInfo, now: Instant, to: impl FnOnce(&Arc<Tunnel>, usize)) -> bool {
        let t = self.tunnel.read().unwrap_or_else(|e| e.into_inner());
        let Some(st) = t.as_ref() else {
            return false;
        };
        let lane = match st.classes.is_empty() {
            true => 0,
            false => match st.tunnel.lane_of(info.flow_hash(), now) {
                Some(lane) => {
                    st.classified[lane].fetch_add(1, Ordering::Relaxed);
                    lane
                }
                None => {
                    st.unmatched[st.default].fetch_add(1, Ordering::Relaxed);
                    st.default
                }
            },
        };
        to(&st.tunnel, lane);
        true
    }
}

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
    let (trigger, reloads) = reload::channel();
    platform.on_hangup(trigger.clone())?;
    // Held until run returns: the socket file goes with the instance.
    let _control = crate::control::serve(
        &server.cfg.control_socket,
        server.cfg.metrics_listen,
        server.cfg.dashboard.as_ref(),
        Arc::new(move || s.status(started)),
        trigger,
    )
    .await?;

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
fn route(tun: &Tun, lan: &Prefix, add: bool) -> std::io::Result<()> {
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

    /// Apply a reloaded configuration (`reload::read` has checked that only `clients:`
    /// differs): new LAN routes into the device first (a failure changes nothing), then the new
    /// rules, then the old routes out, and the sessions whose rules changed closed.
    fn apply(
        &self,
        new: Config,
        listener: &QuicListener,
        masque: Option<&MasqueListener>,
    ) -> Result<String, String> {
        let RoleConfig::Server(snew) = &new.role else {
            return Err("the file is no longer a server's".into());
        };
        // TLS built before anything changes (its files read again: a rotated certificate, key
        // or CA), so an unreadable one refuses the reload whole.
        let tls = crate::transport::quic::server_quic(&new, snew, crate::tls::Served::Native)
            .map_err(|e| format!("{e:#}"))?;
        let masque_tls = match (masque, &snew.masque) {
            (Some(_), Some(_)) => {
                Some(crate::transport::masque::settings(&new, snew).map_err(|e| format!("{e:#}"))?)
            }
            _ => None,
        };
        let lane_tls = match &self.lane {
            Some(_) => Some(crate::lane::serve::tls(&new, snew).map_err(|e| format!("{e:#}"))?),
            None => None,
        };
        let new = snew.clone();
        let old = self.scfg();
        let lans = |c: &ServerConfig| -> Vec<Prefix> {
            let mut v: Vec<Prefix> = c.routes.iter().map(|(_, p)| *p).collect();
            v.dedup();
            v
        };
        let (before, after) = (lans(&old), lans(&new));
        let added: Vec<Prefix> = after
            .iter()
            .filter(|p| !before.contains(p))
            .copied()
            .collect();
        let gone: Vec<Prefix> = before
            .iter()
            .filter(|p| !after.contains(p))
            .copied()
            .collect();
        for (i, p) in added.iter().enumerate() {
            if let Err(e) = route(&self.queues[0], p, true) {
                for q in &added[..i] {
                    let _ = route(&self.queues[0], q, false);
                }
                return Err(e.to_string());
            }
        }
        *self.scfg.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new.clone());
        listener.install(tls);
        if let (Some(l), Some(settings), Some(m)) = (masque, masque_tls, &new.masque) {
            l.install(settings, m);
        }
        let lane_closed = match (&self.lane, lane_tls) {
            (Some(l), Some(tls)) => l.install(tls, &new.revoked),
            _ => 0,
        };
        *self.certificates.write().unwrap_or_else(|e| e.into_inner()) =
            crate::tls::loaded(self.cfg.cert_file.as_deref(), Some(&new.client_ca_file));
        for p in &gone {
            if let Err(e) = route(&self.queues[0], p, false) {
                warn!(error = %e, "a LAN route no client may announce any more is still there");
            }
        }
        // A session's rules: the `clients:` entries naming it (by session name or identity).
        let rules = |c: &'_ ServerConfig, name: &str, identity: &str| {
            let mine = |n: &String| n == name || n == identity;
            let fixed: Vec<_> = c.clients.iter().filter(|(n, _)| mine(n)).cloned().collect();
            let routes: Vec<_> = c.routes.iter().filter(|(n, _)| mine(n)).cloned().collect();
            (fixed, routes)
        };
        let mut registry = self.write();
        // Revoked: closed now; their next handshake is refused. A CONNECT-IP client's token
        // taken out of `masque_tokens` is revoked likewise (its next request is refused).
        let tokens: Vec<&str> = (new.masque.iter())
            .flat_map(|m| m.tokens.iter().map(|(n, _)| n.as_str()))
            .collect();
        let revoked: Vec<String> = (registry.sessions().into_iter())
            .filter(|(_, _, s)| s.revoked_by(&new.revoked) || s.token_gone(&tokens))
            .map(|(name, _, _)| name.to_string())
            .collect();
        let revoked_sessions: Vec<Arc<Session>> =
            revoked.iter().filter_map(|n| registry.remove(n)).collect();
        let affected: Vec<String> = (registry.sessions().into_iter())
            .filter(|(name, _, s)| rules(&old, name, &s.identity) != rules(&new, name, &s.identity))
            .map(|(name, _, _)| name.to_string())
            .collect();
        let closed: Vec<Arc<Session>> =
            affected.iter().filter_map(|n| registry.remove(n)).collect();
        drop(registry);
        for s in &revoked_sessions {
            warn!(client = %s.identity, "certificate revoked or token taken out; session closed");
            s.close_all(close::REVOKED, "credentials revoked");
        }
        for s in &closed {
            s.close_all(
                close::RULES_CHANGED,
                "the server's rules for this client changed",
            );
        }
        let show = |v: &[Prefix]| {
            v.iter()
                .map(Prefix::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if !added.is_empty() {
            parts.push(format!("LAN routes added {}", show(&added)));
        }
        if !gone.is_empty() {
            parts.push(format!("LAN routes removed {}", show(&gone)));
        }
        if !affected.is_empty() {
            parts.push(format!(
                "sessions rejoining under the new rules: {}",
                affected.join(", ")
            ));
        }
        if !revoked.is_empty() {
            parts.push(format!(
                "sessions closed, certificate revoked or token taken out: {}",
                revoked.join(", ")
            ));
        }
        if old.clients != new.clients || old.routes != new.routes {
            parts.push("clients: updated".into());
        }
        if old.revoked != new.revoked {
            parts.push(format!("revoked: {} entries", new.revoked.len()));
        }
        if lane_closed > 0 {
            warn!(
                connections = lane_closed,
                "certificate revoked; MPTCP lane connections closed"
            );
            parts.push(format!(
                "MPTCP lane connections closed, certificate revoked: {lane_closed}"
            ));
        }
        parts.push("TLS certificate, key and CA read again".into());
        Ok(parts.join("; "))
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

    /// Inner packets from TUN queue `q`, a batch per wake-up, to the sessions that own their
    /// destinations (each session's share of the batch routed in one call; with classes, each
    /// class's share). A flow's packets all come from one queue, so readers of different
    /// queues never reorder a flow.
    async fn tun_reader(&self, q: usize) {
        let mut shares = Shares::default();
        self.queues[q]
            .read_loop(
                self.mtu,
                mpquic_core::packet::mtu::tcp_mss(self.mtu),
                |batch, infos, drops| {
                    self.queue_packets[q].fetch_add(infos.len() as u64, Ordering::Relaxed);
                    for _ in 0..drops.oversized {
                        self.drop_packet(DropReason::Oversized);
                    }
                    for _ in 0..drops.unsplit {
                        self.drop_packet(DropReason::Malformed);
                    }
                    let now = Instant::now();
                    {
                        let registry = self.read();
                        for (i, info) in infos.iter().enumerate() {
                            let Some(info) = info else {
                                self.drop_packet(DropReason::Malformed);
                                continue;
                            };
                            // A client's IPv6 address names its IPv4 one (`Ipv6Plan`);
                            // any other IPv6 address may be in a site LAN.
                            let dst = match info.dst {
                                IpAddr::V6(a) => match self.ipv6.and_then(|p| p.v4_of(a)) {
                                    Some(v4) => IpAddr::V4(v4),
                                    None => info.dst,
                                },
                                v4 => v4,
                            };
                            let Some(s) = registry.by_addr(dst) else {
                                self.drop_packet(DropReason::NoRoute);
                                continue;
                            };
                            if !s.pick(info, now, |t, lane| shares.add(t, lane, i)) {
                                self.drop_packet(DropReason::NoPath);
                            }
                        }
                    }
                    shares.send(batch, infos);
                },
            )
            .await
    }

    /// A path offered by an authenticated client: join its session (or refuse), answer, and
    /// put the path's transport into the session's tunnel.
    async fn handle(&self, offer: Offer) {
        let Offer {
            identity: name,
            certificate,
            remote,
            hello: h,
            carrier,
            reply,
        } = offer;
        match self.join(&name, certificate, &h, carrier) {
            Ok((tunnel, addr, path)) => {
                let scfg = self.scfg();
                let ack = HelloAck {
                    ok: true,
                    addr: Some(format!("{addr}/{}", scfg.prefix)),
                    server_addr: Some(scfg.tun_addr.to_string()),
                    mtu: Some(self.mtu),
                    addr6: self.address6(addr),
                    ..Default::default()
                };
                match reply.accept(ack).await {
                    Ok(transport) => {
                        transport.set_rate_cap(h.rate_limit);
                        tunnel.install(path, transport);
                    }
                    Err(e) => {
                        warn!(client = %name, %remote, error = %format!("{e:#}"), "path not set up")
                    }
                }
            }
            Err(msg) => {
                warn!(client = %name, %remote, reason = %msg, "client refused");
                self.refuse("refused");
                reply
                    .refuse(HelloAck {
                        ok: false,
                        error: Some(msg),
                        ..Default::default()
                    })
                    .await;
            }
        }
    }

    /// Attach a path to the client's session (and with classes to its class's tunnel), creating
    /// or replacing the session as needed. Returns the tunnel, its address and the path's id in
    /// it.
    fn join(
        &self,
        identity: &str,
        certificate: Option<Facts>,
        h: &Hello,
        carrier: Carrier,
    ) -> Result<(Arc<Tunnel>, std::net::Ipv4Addr, PathId), String> {
        let (policy, fec) = terms(h)?;
        let name = sessions::session_name(identity, h.instance.as_deref());
        let lans = self.allowed_lans(&name, identity, &h.routes)?;
        let plan = self.scfg().address_plan();
        let mut registry = self.write();
        if let Some((a, _)) = h.previous.as_deref().and_then(crate::config::parse_cidr) {
            registry.remember(&name, a);
        }
        let joined = registry.join(
            &plan,
            &name,
            identity,
            h.session,
            h.addr.as_deref(),
            Instant::now(),
            |_| {
                let made = self.made.fetch_add(1, Ordering::Relaxed) as usize;
                Arc::new(Session {
                    identity: identity.to_string(),
                    certificates: Mutex::default(),
                    tun: self.queues[made % self.queues.len()].clone(),
                    lans: lans.clone(),
                    tunnel: RwLock::new(None),
                })
            },
        )?;
        if joined.created && !lans.is_empty() {
            registry.set_routes(&name, &lans)?;
            info!(client = %name, lans = %h.routes.join(","), "site LAN routed to the client");
        }
        drop(registry);
        if let Some(c) = certificate {
            joined.value.remember(c);
        }
        if let Some(old) = &joined.replaced {
            info!(client = %name, "client restarted; replacing its old session");
            old.close_all(close::REPLACED, "replaced by a new session");
        }
        if joined.created {
            info!(client = %name, address = %joined.addr, policy = policy.as_str(), mode = h.mode.as_str(), "client session started");
        }
        let tunnel =
            self.session_tunnel(&joined.value, &name, joined.addr, h, (policy, fec), carrier)?;
        let role = match h.role.as_deref() {
            None => mpquic_core::Role::Primary,
            Some(r) => mpquic_core::Role::parse(r).ok_or_else(|| format!("unknown role `{r}`"))?,
        };
        let spec = PathSpec {
            name: h.path.clone(),
            priority: h.priority,
            weight: h.weight.max(1),
            role,
            rate_limit: h.rate_limit,
        };
        let path = tunnel
            .path(spec, sessions::MAX_PATHS_PER_SESSION)
            .ok_or_else(|| {
                format!(
                    "too many paths in this session (at most {})",
                    sessions::MAX_PATHS_PER_SESSION
                )
            })?;
        Ok((tunnel, joined.addr, path))
    }

    /// The site LAN prefixes a client announced, if its `clients:` entry (by session name or
    /// identity) allows each of them (each inside an allowed prefix); else the refusal.
    fn allowed_lans(
        &self,
        name: &str,
        identity: &str,
        announced: &[String],
    ) -> Result<Vec<Prefix>, String> {
        let scfg = self.scfg();
        let allowed: Vec<&Prefix> = (scfg.routes.iter())
            .filter(|(n, _)| n == name || n == identity)
            .map(|(_, p)| p)
            .collect();
        announced
            .iter()
            .map(|s| {
                let p = Prefix::parse(s)
                    .filter(|p| *p == p.network() && s.contains('/'))
                    .ok_or_else(|| format!("LAN prefix `{s}` is not a network prefix"))?;
                match allowed.iter().any(|a| a.covers(&p)) {
                    true => Ok(p),
                    false => Err(format!(
                        "LAN prefix {s} is not allowed for this client (server `clients:` routes)"
                    )),
                }
            })
            .collect()
    }

    /// The session's tunnel, made by its first connection with a lane per class the hello
    /// lists (one without classes); a later connection must list the same classes.
    fn session_tunnel(
        &self,
        session: &Session,
        name: &str,
        addr: std::net::Ipv4Addr,
        h: &Hello,
        (policy, fec): (Policy, FecMode),
        carrier: Carrier,
    ) -> Result<Arc<Tunnel>, String> {
        let mut slot = session.tunnel.write().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = slot.as_ref() {
            if st.classes != h.classes {
                return Err("this session's connections disagree on traffic classes".into());
            }
            // The client reloaded with another policy (no classes): its paths reconnect with it.
            if h.classes.is_empty() {
                st.tunnel.set_policy(policy)?;
            }
            return Ok(st.tunnel.clone());
        }
        let lanes = lanes_of(h, policy, fec)?;
        for c in &h.classes {
            info!(client = %name, class = %c.name, rank = c.rank, policy = %c.policy, mode = c.mode.as_str(), fec = c.fec, "traffic class started");
        }
        let n = lanes.len();
        let tunnel = Tunnel::new(
            name.to_string(),
            session.tun.clone(),
            Some(Sources {
                addr,
                addr6: self.ipv6.map(|p| p.v6_of(addr)),
                lans: session.lans.clone(),
            }),
            // A standard CONNECT-IP client neither probes nor answers probes: its one path is
            // up while its connection is.
            match carrier.plain() {
                true => HealthMode::Transport,
                false => HealthMode::Follow,
            },
            self.cfg.congestion,
            Carriage {
                fec,
                lanes,
                marks: !h.classes.is_empty(),
            },
        );
        let t = tunnel.clone();
        let timers = tokio::spawn(async move { t.run_timers().await }).abort_handle();
        *slot = Some(SessionTunnel {
            tunnel: tunnel.clone(),
            classes: h.classes.clone(),
            default: h.classes.iter().position(|c| c.default).unwrap_or(0),
            classified: (0..n).map(|_| AtomicU64::new(0)).collect(),
            unmatched: (0..n).map(|_| AtomicU64::new(0)).collect(),
            timers,
            carrier,
        });
        Ok(tunnel)
    }
}

/// The policy and FEC mode a hello asks for (an unknown one refuses it).
pub(crate) fn terms(h: &Hello) -> Result<(Policy, FecMode), String> {
    let policy =
        Policy::parse(&h.policy).ok_or_else(|| format!("unknown policy `{}`", h.policy))?;
    let fec = match h.fec.as_deref() {
        Some(f) => FecMode::parse(f)?,
        None => FecMode::Off,
    };
    Ok((policy, fec))
}

/// The lanes of a session's tunnel from its first hello: one per class it lists, in rank
/// order, each with its policy, carriage and FEC; one lane of the hello's own settings without
/// classes. A list that is not one (ranks out of order, a name twice, not exactly one default,
/// too many, carriages that the connection's mode does not carry) is refused.
pub(crate) fn lanes_of(h: &Hello, policy: Policy, fec: FecMode) -> Result<Vec<LaneSpec>, String> {
    if h.classes.is_empty() {
        return Ok(vec![LaneSpec {
            name: None,
            policy,
            mode: h.mode,
            fec: fec != FecMode::Off,
            tun: None,
        }]);
    }
    if h.classes.len() > MAX_CLASSES {
        return Err(format!("too many traffic classes (at most {MAX_CLASSES})"));
    }
    for (i, c) in h.classes.iter().enumerate() {
        if usize::from(c.rank) != i {
            return Err(format!("class `{}`: rank {} out of order", c.name, c.rank));
        }
        if h.classes[..i].iter().any(|o| o.name == c.name) {
            return Err(format!("class `{}` listed twice", c.name));
        }
    }
    if h.classes.iter().filter(|c| c.default).count() != 1 {
        return Err("traffic classes: exactly one must be the default".into());
    }
    if Carriage::connection_mode(h.classes.iter().map(|c| c.mode)) != h.mode {
        return Err(format!(
            "traffic classes: their modes are not carried by a connection in mode {}",
            h.mode.as_str()
        ));
    }
    h.classes
        .iter()
        .map(|c| {
            Ok(LaneSpec {
                name: Some(c.name.clone()),
                policy: Policy::parse(&c.policy)
                    .ok_or_else(|| format!("class `{}`: unknown policy `{}`", c.name, c.policy))?,
                mode: c.mode,
                fec: c.fec,
                tun: None,
            })
        })
        .collect()
}
