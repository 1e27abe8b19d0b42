//! The server (VPS) side: one UDP port, many clients, one TUN device. A client is the identity
//! in its certificate; its paths are grouped by that identity and its session id, so NAT
//! rebinding, new ports and reconnections just work. Inner packets from the TUN device are routed
//! to the client that owns the destination address.

use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mpquic_core::sessions::{self, Registry};
use mpquic_core::{DropReason, Drops, HealthMode, PathId, PathSpec, Policy};
use tracing::{info, warn};

use crate::config::{Config, ServerConfig};
use crate::hello::{self, Hello, HelloAck};
use crate::platform::Platform;
use crate::status::StatusReport;
use crate::transport::NewLink;
use crate::tun::Tun;
use crate::tunnel::{close, Tunnel};
use crate::{quic, runtime, tls};

const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
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
    let sessions = server.write().drain();
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

    /// Forget sessions that have been without paths for long (`sessions::SESSION_LINGER`).
    fn expire_sessions(&self) {
        let gone = self
            .write()
            .expire(Instant::now(), |s| s.tunnel.connected_paths() > 0);
        for (name, addr, _) in gone {
            info!(client = %name, address = %addr, "session expired");
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
                let session = self.read().by_addr(dst).cloned();
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
            Ok((session, addr, path)) => {
                let ack = HelloAck {
                    ok: true,
                    addr: Some(format!("{addr}/{}", self.scfg.prefix)),
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
                session.tunnel.install(path, link.into_transport(h.mode));
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
    /// Returns the session, its tunnel address and the path's id in it.
    fn join(
        &self,
        name: &str,
        h: &Hello,
    ) -> Result<(Arc<Session>, std::net::Ipv4Addr, PathId), String> {
        let policy =
            Policy::parse(&h.policy).ok_or_else(|| format!("unknown policy `{}`", h.policy))?;
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
