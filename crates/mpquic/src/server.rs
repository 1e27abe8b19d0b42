//! The server (VPS) side: one UDP port, many clients, one TUN device. A client is the identity
//! in its certificate; its paths are grouped by that identity and its session id, so NAT
//! rebinding, new ports and reconnections just work. Inner packets from the TUN device are routed
//! to the client that owns the destination address. Connections reach it as offers from a
//! `transport::Listener` (QUIC: `transport::quic::QuicListener`), which has done the handshake,
//! identity and hello; the server decides (the core's session registry) and answers.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use mpquic_core::fec::FecMode;
use mpquic_core::sessions::{self, Registry};
use mpquic_core::{DropReason, Drops, HealthMode, PathId, PathSpec, Policy};
use tracing::{info, warn};

use crate::config::{Config, ServerConfig};
use crate::hello::{Hello, HelloAck};
use crate::platform::Platform;
use crate::status::StatusReport;
use crate::transport::quic::QuicListener;
use crate::transport::{Listener, Offer};
use crate::tun::Tun;
use crate::tunnel::{close, Routed, Tunnel};
use crate::{quic, runtime};

/// How often sessions are checked for expiry (path health runs on each session's own timers).
const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// What the shell keeps per session; the rules (which session a path joins, replacement,
/// expiry, addresses, the path bound) are the core's `sessions::Registry`.
struct Session {
    tunnel: Arc<Tunnel>,
    /// The task serving the tunnel's timers; it ends with the session.
    timers: tokio::task::AbortHandle,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.timers.abort();
    }
}

struct Server {
    cfg: Config,
    scfg: ServerConfig,
    tun: Arc<Tun>,
    mtu: u32,
    registry: RwLock<Registry<Arc<Session>>>,
    drops: Mutex<Drops>,
    /// Connections refused, by reason (status and metrics); the listener counts its own.
    refused: Arc<Mutex<BTreeMap<String, u64>>>,
}

pub async fn run(cfg: Config, scfg: ServerConfig, platform: Platform) -> Result<()> {
    let refused: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let count = refused.clone();
    let listener = QuicListener::start(
        &cfg,
        &scfg,
        &platform,
        Arc::new(move |reason| count_refused(&count, reason)),
    )?;

    let mtu = runtime::tun_mtu(&cfg, quic::DEFAULT_LINK_MTU);
    let tun = Arc::new(runtime::open_tun(&platform, &cfg, mtu)?);
    tun.set_ipv4(scfg.tun_addr, scfg.prefix)?;
    info!(listen = %scfg.listen, tun = %cfg.tun_name, address = %format!("{}/{}", scfg.tun_addr, scfg.prefix), mtu, "server listening");

    let server = Arc::new(Server {
        cfg,
        scfg,
        tun,
        mtu,
        registry: RwLock::new(Registry::default()),
        drops: Mutex::new(Drops::default()),
        refused,
    });
    let started = Instant::now();
    let s = server.clone();
    crate::control::serve(
        &server.cfg.control_socket,
        server.cfg.metrics_listen,
        Arc::new(move || s.status(started)),
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
    let s = server.clone();
    tokio::spawn(async move { s.tun_reader().await });
    let listener: Arc<dyn Listener> = Arc::new(listener);
    let l = listener.clone();
    let s = server.clone();
    tokio::spawn(async move {
        while let Some(offer) = l.next().await {
            let s = s.clone();
            tokio::spawn(async move { s.handle(offer).await });
        }
    });

    platform.stopped().await;
    info!("server shutting down");
    let sessions = server.write().drain();
    for sess in sessions {
        sess.tunnel
            .close_all(close::SHUTDOWN, "server shutting down");
    }
    listener
        .close(close::SHUTDOWN, "server shutting down")
        .await;
    info!("server stopped");
    Ok(())
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

    fn status(&self, started: Instant) -> StatusReport {
        let sessions: Vec<(std::net::Ipv4Addr, Arc<Session>)> = self
            .read()
            .sessions()
            .into_iter()
            .map(|(_, addr, s)| (addr, s.clone()))
            .collect();
        StatusReport {
            role: "server".into(),
            congestion: self.cfg.congestion.as_str().into(),
            tun_name: self.cfg.tun_name.clone(),
            tun_mtu: self.mtu,
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: started.elapsed().as_secs_f64(),
            tunnels: sessions
                .iter()
                .map(|(addr, s)| {
                    s.tunnel
                        .status(Some(format!("{addr}/{}", self.scfg.prefix)))
                })
                .collect(),
            drops: self
                .drops
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(r, n)| (r.as_str().to_string(), n))
                .collect(),
            refused: self
                .refused
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }

    fn refuse(&self, reason: &str) {
        count_refused(&self.refused, reason);
    }

    fn drop_packet(&self, r: DropReason) {
        self.drops.lock().unwrap_or_else(|e| e.into_inner()).add(r);
    }

    /// Forget sessions that have been without paths for long (`sessions::SESSION_LINGER`).
    fn expire_sessions(&self) {
        let gone = self
            .write()
            .expire(Instant::now(), |s| s.tunnel.connected_paths() > 0);
        for (name, addr, _) in gone {
            info!(client = %name, address = %addr, "session expired");
        }
    }

    /// Inner packets from the TUN device, a batch per wake-up, to the sessions that own their
    /// destinations (each session's share of the batch routed in one call).
    async fn tun_reader(&self) {
        // The batch's packets grouped by session, and each session's routing; reused from batch
        // to batch.
        let mut by_session: Vec<(Arc<Session>, Vec<usize>, Routed)> = Vec::new();
        self.tun
            .read_loop(
                self.mtu,
                mpquic_core::mtu::tcp_mss(self.mtu),
                |batch, infos, drops| {
                    for _ in 0..drops.oversized {
                        self.drop_packet(DropReason::Oversized);
                    }
                    for _ in 0..drops.unsplit {
                        self.drop_packet(DropReason::Malformed);
                    }
                    for (_, picks, _) in &mut by_session {
                        picks.clear();
                    }
                    {
                        let registry = self.read();
                        for (i, info) in infos.iter().enumerate() {
                            let Some(info) = info else {
                                self.drop_packet(DropReason::Malformed);
                                continue;
                            };
                            let IpAddr::V4(dst) = info.dst else {
                                self.drop_packet(DropReason::NoRoute);
                                continue;
                            };
                            let Some(s) = registry.by_addr(dst) else {
                                self.drop_packet(DropReason::NoRoute);
                                continue;
                            };
                            match by_session.iter_mut().find(|(x, ..)| Arc::ptr_eq(x, s)) {
                                Some((_, picks, _)) => picks.push(i),
                                None => by_session.push((s.clone(), vec![i], Routed::default())),
                            }
                        }
                    }
                    // Every session writes its headers into the batch before any sends (sending
                    // shares the batch, and it takes no header after that).
                    for (s, picks, routed) in &mut by_session {
                        if !picks.is_empty() {
                            s.tunnel.route_batch(batch, picks, infos, routed);
                        }
                    }
                    for (s, picks, routed) in &mut by_session {
                        if !picks.is_empty() {
                            s.tunnel.send_routed(batch, routed);
                        }
                    }
                    // Forget sessions that took nothing this time (ended ones go with them).
                    by_session.retain(|(_, picks, _)| !picks.is_empty());
                },
            )
            .await
    }

    /// A path offered by an authenticated client: join its session (or refuse), answer, and
    /// put the path's transport into the session's tunnel.
    async fn handle(&self, offer: Offer) {
        let Offer {
            identity: name,
            remote,
            hello: h,
            reply,
        } = offer;
        match self.join(&name, &h) {
            Ok((session, addr, path)) => {
                let ack = HelloAck {
                    ok: true,
                    addr: Some(format!("{addr}/{}", self.scfg.prefix)),
                    server_addr: Some(self.scfg.tun_addr.to_string()),
                    mtu: Some(self.mtu),
                    ..Default::default()
                };
                match reply.accept(ack).await {
                    Ok(transport) => {
                        session.tunnel.install(path, transport);
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

    /// Attach a path to the client's session, creating or replacing the session as needed.
    /// Returns the session, its tunnel address and the path's id in it.
    fn join(
        &self,
        name: &str,
        h: &Hello,
    ) -> Result<(Arc<Session>, std::net::Ipv4Addr, PathId), String> {
        let policy =
            Policy::parse(&h.policy).ok_or_else(|| format!("unknown policy `{}`", h.policy))?;
        let fec = match h.fec.as_deref() {
            Some(f) => FecMode::parse(f)?,
            None => FecMode::Off,
        };
        let plan = self.scfg.address_plan();
        let joined = self.write().join(
            &plan,
            name,
            h.session,
            h.addr.as_deref(),
            Instant::now(),
            |addr| {
                let tunnel = Tunnel::new(
                    name.to_string(),
                    self.tun.clone(),
                    h.mode,
                    policy,
                    Some(addr),
                    HealthMode::Follow,
                    fec,
                );
                let t = tunnel.clone();
                let timers = tokio::spawn(async move { t.run_timers().await }).abort_handle();
                Arc::new(Session { tunnel, timers })
            },
        )?;
        if let Some(old) = &joined.replaced {
            info!(client = %name, "client restarted; replacing its old session");
            old.tunnel
                .close_all(close::REPLACED, "replaced by a new session");
        }
        if joined.created {
            info!(client = %name, address = %joined.addr, policy = policy.as_str(), mode = h.mode.as_str(), "client session started");
        }
        let spec = PathSpec {
            name: h.path.clone(),
            priority: h.priority,
            weight: h.weight.max(1),
        };
        let path = joined
            .value
            .tunnel
            .path(spec, sessions::MAX_PATHS_PER_SESSION)
            .ok_or_else(|| {
                format!(
                    "too many paths in this session (at most {})",
                    sessions::MAX_PATHS_PER_SESSION
                )
            })?;
        Ok((joined.value, joined.addr, path))
    }
}
