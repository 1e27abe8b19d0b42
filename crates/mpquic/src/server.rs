//! The server (VPS) side: one UDP port, many clients, one TUN device. A client is the identity
//! in its certificate; its paths are grouped by that identity and its session id, so NAT
//! rebinding, new ports and reconnections just work. Inner packets from the TUN device are routed
//! to the client that owns the destination address.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mpquic_core::{DropReason, Drops, PathId, PathSpec, Policy};
use tracing::{info, warn};

use crate::config::{Config, ServerConfig};
use crate::hello::{self, Hello, HelloAck};
use crate::platform::Platform;
use crate::status::StatusReport;
use crate::tun::Tun;
use crate::tunnel::{close, NewLink, Tunnel};
use crate::{addressing, quic, runtime, tls};

const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// A session with no connected path for this long is forgotten (its address becomes free).
const SESSION_LINGER: Duration = Duration::from_secs(120);
/// How often sessions are checked for expiry (path health runs on each session's own timers).
const HOUSEKEEPING: Duration = Duration::from_secs(1);

struct Session {
    name: String,
    id: u64,
    addr: Ipv4Addr,
    tunnel: Arc<Tunnel>,
    /// Last time the session had a connected path.
    last_connected: Mutex<Instant>,
    /// The task serving the tunnel's timers; it ends with the session.
    timers: tokio::task::AbortHandle,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.timers.abort();
    }
}

#[derive(Default)]
struct Registry {
    by_name: HashMap<String, Arc<Session>>,
    by_addr: HashMap<Ipv4Addr, Arc<Session>>,
    /// Last address each client had, so a reconnecting client gets it back.
    remembered: HashMap<String, Ipv4Addr>,
}

struct Server {
    cfg: Config,
    scfg: ServerConfig,
    tun: Arc<Tun>,
    mtu: u32,
    registry: RwLock<Registry>,
    drops: Mutex<Drops>,
    /// Connections refused, by reason (status and metrics).
    refused: Mutex<std::collections::BTreeMap<String, u64>>,
}

pub async fn run(cfg: Config, scfg: ServerConfig, platform: Platform) -> Result<()> {
    let cert = cfg.cert_file.clone().context("tls_cert_file is required")?;
    let key = cfg.key_file.clone().context("tls_key_file is required")?;
    let crypto = tls::server_crypto(&cert, &key, &scfg.client_ca_file)?;
    let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(
        quinn::crypto::rustls::QuicServerConfig::try_from(Arc::new(crypto))
            .context("TLS config unusable for QUIC")?,
    ));
    server_config.transport_config(quic::transport(cfg.congestion, quic::DEFAULT_LINK_MTU));
    let socket = platform.server_socket(scfg.listen)?;
    let endpoint = quinn::Endpoint::new_with_abstract_socket(
        quinn::EndpointConfig::default(),
        Some(server_config),
        socket,
        Arc::new(quinn::TokioRuntime),
    )?;

    let mtu = runtime::tun_mtu(&cfg, quic::DEFAULT_LINK_MTU);
    let tun = Arc::new(platform.tun(&cfg.tun_name)?);
    tun.set_mtu(mtu)?;
    tun.disable_ipv6();
    tun.set_ipv4(scfg.tun_addr, scfg.prefix)?;
    info!(listen = %scfg.listen, tun = %cfg.tun_name, address = %format!("{}/{}", scfg.tun_addr, scfg.prefix), mtu, "server listening");

    let server = Arc::new(Server {
        cfg,
        scfg,
        tun,
        mtu,
        registry: RwLock::new(Registry::default()),
        drops: Mutex::new(Drops::default()),
        refused: Mutex::default(),
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
    let ep = endpoint.clone();
    let s = server.clone();
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            let s = s.clone();
            tokio::spawn(async move { s.handle(incoming).await });
        }
    });

    platform.stopped().await;
    info!("server shutting down");
    let sessions: Vec<Arc<Session>> = server.read().by_name.values().cloned().collect();
    for sess in sessions {
        sess.tunnel
            .close_all(close::SHUTDOWN, "server shutting down");
    }
    endpoint.close(close::SHUTDOWN.into(), b"server shutting down");
    let _ = tokio::time::timeout(Duration::from_millis(300), endpoint.wait_idle()).await;
    info!("server stopped");
    Ok(())
}

impl Server {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner())
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.registry.write().unwrap_or_else(|e| e.into_inner())
    }

    fn status(&self, started: Instant) -> StatusReport {
        let mut sessions: Vec<Arc<Session>> = self.read().by_name.values().cloned().collect();
        sessions.sort_by(|a, b| a.name.cmp(&b.name));
        StatusReport {
            role: "server".into(),
            tun_name: self.cfg.tun_name.clone(),
            tun_mtu: self.mtu,
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: started.elapsed().as_secs_f64(),
            tunnels: sessions
                .iter()
                .map(|s| {
                    s.tunnel
                        .status(Some(format!("{}/{}", s.addr, self.scfg.prefix)))
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
        *self
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason.to_string())
            .or_default() += 1;
    }

    fn drop_packet(&self, r: DropReason) {
        self.drops.lock().unwrap_or_else(|e| e.into_inner()).add(r);
    }

    /// Forget sessions that have been without paths for long.
    fn expire_sessions(&self) {
        let sessions: Vec<Arc<Session>> = self.read().by_name.values().cloned().collect();
        let now = Instant::now();
        let mut stale = Vec::new();
        for s in sessions {
            let mut last = s.last_connected.lock().unwrap_or_else(|e| e.into_inner());
            if s.tunnel.connected_paths() > 0 {
                *last = now;
            } else if now.duration_since(*last) > SESSION_LINGER {
                stale.push(s.clone());
            }
        }
        if !stale.is_empty() {
            let mut reg = self.write();
            for s in stale {
                if reg
                    .by_name
                    .get(&s.name)
                    .is_some_and(|cur| Arc::ptr_eq(cur, &s))
                {
                    info!(client = %s.name, address = %s.addr, "session expired");
                    reg.by_name.remove(&s.name);
                    reg.by_addr.remove(&s.addr);
                }
            }
        }
    }

    async fn tun_reader(&self) {
        self.tun
            .read_loop(mpquic_core::mtu::tcp_mss(self.mtu), |pkt, info| {
                let Some(info) = info else {
                    return self.drop_packet(DropReason::Malformed);
                };
                let IpAddr::V4(dst) = info.dst else {
                    return self.drop_packet(DropReason::NoRoute);
                };
                let session = self.read().by_addr.get(&dst).cloned();
                match session {
                    Some(s) => s.tunnel.send_packet(pkt, Some(&info)),
                    None => self.drop_packet(DropReason::NoRoute),
                }
            })
            .await
    }

    /// One incoming connection: handshake, identity, hello, then it becomes a path.
    async fn handle(&self, incoming: quinn::Incoming) {
        let remote = incoming.remote_address();
        let conn = match incoming.await {
            Ok(c) => c,
            Err(e) => {
                warn!(%remote, error = %e, "handshake failed; client refused");
                self.refuse("handshake_failed");
                return;
            }
        };
        let Some(name) = tls::peer_common_name(&conn) else {
            warn!(%remote, "client certificate has no common name; refused");
            self.refuse("no_common_name");
            conn.close(close::REFUSED.into(), b"certificate has no common name");
            return;
        };
        let hello = tokio::time::timeout(HELLO_TIMEOUT, async {
            let (send, mut recv) = conn.accept_bi().await?;
            let h: Hello = hello::read(&mut recv).await?;
            anyhow::Ok((send, recv, h))
        })
        .await;
        let (mut send, recv, h) = match hello {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                warn!(client = %name, %remote, error = %e, "bad hello; connection closed");
                self.refuse("bad_hello");
                conn.close(close::PROTOCOL.into(), b"bad hello");
                return;
            }
            Err(_) => {
                warn!(client = %name, %remote, "no hello within {HELLO_TIMEOUT:?}; connection closed");
                self.refuse("hello_timeout");
                conn.close(close::PROTOCOL.into(), b"no hello");
                return;
            }
        };
        match self.join(&name, &h) {
            Ok((session, path)) => {
                let ack = HelloAck {
                    ok: true,
                    addr: Some(format!("{}/{}", session.addr, self.scfg.prefix)),
                    server_addr: Some(self.scfg.tun_addr.to_string()),
                    mtu: Some(self.mtu),
                    ..Default::default()
                };
                if let Err(e) = hello::write(&mut send, &ack).await {
                    warn!(client = %name, error = %e, "cannot answer hello");
                    return;
                }
                let link = NewLink {
                    conn,
                    send,
                    recv,
                    endpoint: None,
                };
                session.tunnel.install(path, link);
            }
            Err(msg) => {
                warn!(client = %name, %remote, reason = %msg, "client refused");
                self.refuse("refused");
                let ack = HelloAck {
                    ok: false,
                    error: Some(msg.clone()),
                    ..Default::default()
                };
                let _ = hello::write(&mut send, &ack).await;
                let _ = send.finish();
                // Let the refusal reach the client before the close frame.
                let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
                conn.close(close::REFUSED.into(), msg.as_bytes());
            }
        }
    }

    /// Attach a path to the client's session, creating or replacing the session as needed.
    fn join(&self, name: &str, h: &Hello) -> Result<(Arc<Session>, PathId), String> {
        let policy =
            Policy::parse(&h.policy).ok_or_else(|| format!("unknown policy `{}`", h.policy))?;
        let mut reg = self.write();
        let existing = reg.by_name.get(name).cloned();
        let session = match existing {
            Some(s) if s.id == h.session => s,
            other => {
                // A new session id from a known identity: the client restarted. Drop the old
                // session at once so nothing stale lingers, then assign afresh.
                if let Some(old) = other {
                    info!(client = %name, "client restarted; replacing its old session");
                    reg.by_name.remove(name);
                    reg.by_addr.remove(&old.addr);
                    old.tunnel
                        .close_all(close::REPLACED, "replaced by a new session");
                }
                let owner = |a: Ipv4Addr| reg.by_addr.get(&a).map(|s| s.name.clone());
                let addr = addressing::assign(
                    &self.scfg,
                    owner,
                    &reg.remembered,
                    name,
                    h.addr.as_deref(),
                )?;
                let tunnel = Tunnel::new(
                    name.to_string(),
                    self.tun.clone(),
                    h.mode,
                    policy,
                    Some(addr),
                );
                let t = tunnel.clone();
                let timers = tokio::spawn(async move { t.run_timers().await }).abort_handle();
                let s = Arc::new(Session {
                    name: name.to_string(),
                    id: h.session,
                    addr,
                    tunnel,
                    last_connected: Mutex::new(Instant::now()),
                    timers,
                });
                reg.by_name.insert(name.to_string(), s.clone());
                reg.by_addr.insert(addr, s.clone());
                reg.remembered.insert(name.to_string(), addr);
                info!(client = %name, address = %addr, policy = policy.as_str(), mode = h.mode.as_str(), "client session started");
                s
            }
        };
        let path = session
            .tunnel
            .path(PathSpec {
                name: h.path.clone(),
                priority: h.priority,
                weight: h.weight.max(1),
            })
            .ok_or("too many paths in this session")?;
        Ok((session, path))
    }
}
