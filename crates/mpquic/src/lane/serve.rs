//! The server's end of the MPTCP lane (`tcp_lane_listen`): it takes lane connections (kernel
//! MPTCP, plain TCP from a peer without it), authenticates the client by its certificate (TLS
//! 1.3, the same CA as the tunnel), reads its request (core `tcp_lane`), opens the TCP
//! connection to the destination, answers, and relays both ways until either end closes.
//! A reload reads the certificate, key and CA again and applies `revoked:` to open lane
//! connections too (`Shared::install`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};
use mpquic_core::tcp_lane::{self, Outcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use super::counted::Counted;
use super::socket;
use crate::tls::certificate::{self, Facts};
use crate::tls::revocation;

/// Lane connections served at once; more wait for a slot (the kernel's backlog holds them).
const MAX_CONNECTIONS: usize = 4096;
/// A client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// An authenticated client's request within this: a client sets connections up ahead
/// (`ahead::MAX_AGE`, less than this) and sends the request when a LAN connection comes.
pub const IDLE_REQUEST: Duration = Duration::from_secs(60);
/// The destination's answer to our SYN (the LAN host's own stack would wait longer; a lane
/// that holds a connection open for two minutes holds the LAN host with it).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the server opens connections for its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destinations {
    /// Hosts on the internet, not the server's own (`tcp_lane::allowed`).
    Internet,
    /// Anything, loopback included (in-process tests, whose only network is loopback).
    Any,
}

/// What the lane did, for status and metrics.
#[derive(Debug, Default)]
pub struct Counters {
    pub accepted: AtomicU64,
    pub active: AtomicU64,
    /// Connections the destination took (relayed).
    pub connected: AtomicU64,
    /// Requests answered with another outcome, by `Outcome::failure_index`.
    pub failed: [AtomicU64; 4],
    /// Lane connections dropped before a request: handshake failed, unauthenticated, timed out,
    /// malformed request.
    pub bad: AtomicU64,
    pub bytes_to_destination: AtomicU64,
    pub bytes_from_destination: AtomicU64,
}

impl Counters {
    pub fn status(&self) -> crate::status::LaneStatus {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut failed = super::failures(&self.failed);
        failed.insert("bad_request".into(), n(&self.bad));
        crate::status::LaneStatus {
            connections: n(&self.accepted),
            active: n(&self.active),
            connected: n(&self.connected),
            failed,
            bytes_up: n(&self.bytes_to_destination),
            bytes_down: n(&self.bytes_from_destination),
            ..Default::default()
        }
    }
}

/// The lane's state a reload changes, beside its counters.
pub struct Shared {
    pub counters: Arc<Counters>,
    /// New connections' TLS (the certificate, key and CA as last read).
    tls: RwLock<Arc<rustls::ServerConfig>>,
    /// `revoked:` as last read: checked once more after each handshake, so a handshake that
    /// began under the old TLS settings cannot slip through a reload.
    revoked: RwLock<Vec<String>>,
    /// Connections open, with the client certificate each was made with (once known).
    open: Mutex<HashMap<u64, Open>>,
    next: AtomicU64,
}

struct Open {
    cert: Option<Facts>,
    task: tokio::task::AbortHandle,
}

impl Shared {
    pub fn new(tls: Arc<rustls::ServerConfig>, revoked: &[String]) -> Arc<Shared> {
        Arc::new(Shared {
            counters: Arc::default(),
            tls: RwLock::new(tls),
            revoked: RwLock::new(revoked.to_vec()),
            open: Mutex::default(),
            next: AtomicU64::new(0),
        })
    }

    /// New TLS settings and `revoked:` list: the connections of a revoked certificate are
    /// closed now (their next one is refused at the handshake). How many were closed.
    pub fn install(&self, tls: Arc<rustls::ServerConfig>, revoked: &[String]) -> usize {
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = tls;
        *self.revoked.write().unwrap_or_else(|e| e.into_inner()) = revoked.to_vec();
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mut closed = 0;
        for o in open.values() {
            if o.cert
                .as_ref()
                .is_some_and(|c| revocation::is_revoked(revoked, c))
            {
                o.task.abort();
                closed += 1;
            }
        }
        closed
    }

    fn revoked(&self, cert: &Facts) -> bool {
        let list = self.revoked.read().unwrap_or_else(|e| e.into_inner());
        revocation::is_revoked(&list, cert)
    }

    fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.tls.read().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// What connection `id` was made with (its entry goes with its `Registered`).
    fn authenticated(&self, id: u64, cert: Facts) {
        if let Some(o) = (self.open.lock().unwrap_or_else(|e| e.into_inner())).get_mut(&id) {
            o.cert = Some(cert);
        }
    }
}

/// A connection's entry in `Shared::open` and its count in `active`, both taken out when
/// its task ends or is aborted.
struct Registered(Arc<Shared>, u64);

impl Registered {
    fn new(shared: &Arc<Shared>) -> Registered {
        shared.counters.active.fetch_add(1, Ordering::Relaxed);
        Registered(shared.clone(), shared.next.fetch_add(1, Ordering::Relaxed))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.counters.active.fetch_sub(1, Ordering::Relaxed);
        (self.0.open.lock().unwrap_or_else(|e| e.into_inner())).remove(&self.1);
    }
}

/// The server's lane, running until dropped.
pub struct Serving {
    pub shared: Arc<Shared>,
    task: tokio::task::AbortHandle,
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.task.abort();
        // The relays are tasks of their own: they go with the lane.
        for o in (self.shared.open.lock().unwrap_or_else(|e| e.into_inner())).values() {
            o.task.abort();
        }
    }
}

/// The lane's TLS: the server's certificate, its clients' CA and `revoked:` (files read now).
pub fn tls(
    cfg: &crate::config::Config,
    scfg: &crate::config::ServerConfig,
) -> Result<Arc<rustls::ServerConfig>> {
    let (cert, key) = cfg
        .cert_file
        .as_deref()
        .zip(cfg.key_file.as_deref())
        .context("the lane needs tls_cert_file and tls_key_file")?;
    Ok(Arc::new(crate::tls::server_crypto(
        cert,
        key,
        &scfg.client_ca_file,
        cfg.tls_post_quantum,
        &scfg.revoked,
        crate::tls::Served::Lane,
    )?))
}

/// Listen on `listen` with the lane's TLS (`tls`).
pub fn start(
    cfg: &crate::config::Config,
    scfg: &crate::config::ServerConfig,
    listen: SocketAddr,
) -> Result<Serving> {
    let shared = Shared::new(tls(cfg, scfg)?, &scfg.revoked);
    let listener =
        socket::mptcp_listener(listen).with_context(|| format!("tcp_lane_listen {listen}"))?;
    // A subflow per client path (a client has at most 8 paths on the lane).
    if let Err(e) = super::endpoints::set_limits(8) {
        warn!(error = %format!("{e:#}"), "MPTCP lane: the kernel's limits are as they were (a client gets fewer subflows)");
    }
    info!(listen = %listen, "MPTCP lane listening");
    let s = shared.clone();
    let task = tokio::spawn(async move {
        if let Err(e) = run(listener, s, Destinations::Internet).await {
            warn!(error = %format!("{e:#}"), "MPTCP lane stopped");
        }
    })
    .abort_handle();
    Ok(Serving { shared, task })
}

pub(super) async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    destinations: Destinations,
) -> Result<()> {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = slots.clone().acquire_owned().await?;
        let (stream, from) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and the like: wait a moment rather than spin.
                warn!(error = %e, "MPTCP lane: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        shared.counters.accepted.fetch_add(1, Ordering::Relaxed);
        let registered = Registered::new(&shared);
        let id = registered.1;
        // Held across the spawn: the task's entry is in before the task could take it out.
        let mut open = shared.open.lock().unwrap_or_else(|e| e.into_inner());
        let task = tokio::spawn(async move {
            if let Err(e) = one(stream, &registered, destinations).await {
                debug!(from = %from, error = %format!("{e:#}"), "MPTCP lane connection ended");
            }
            drop((registered, slot));
        });
        let task = task.abort_handle();
        open.insert(id, Open { cert: None, task });
    }
}

async fn one(stream: TcpStream, me: &Registered, destinations: Destinations) -> Result<()> {
    let Registered(shared, id) = me;
    let counters = shared.counters.clone();
    let _ = stream.set_nodelay(true);
    let handshake = async {
        let tls = (shared.acceptor().accept(stream).await).context("TLS handshake")?;
        let cert = (tls.get_ref().1.peer_certificates())
            .and_then(|c| c.first())
            .and_then(certificate::facts)
            .context("no client certificate")?;
        if shared.revoked(&cert) {
            anyhow::bail!("certificate revoked");
        }
        shared.authenticated(*id, cert);
        Ok(tls)
    };
    // Authenticated, a client may wait for a LAN connection before its request (`IDLE_REQUEST`;
    // a connection it set up ahead and closed unused is no bad request).
    let request = async {
        let mut tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
            Ok(r) => r?,
            Err(_) => anyhow::bail!("no handshake within {HANDSHAKE_TIMEOUT:?}"),
        };
        let deadline = tokio::time::Instant::now() + IDLE_REQUEST;
        let mut buf = Vec::with_capacity(tcp_lane::MAX_REQUEST + 1500);
        loop {
            if let Some((dst, used)) =
                tcp_lane::decode_request(&buf).map_err(|e| anyhow::anyhow!(e))?
            {
                let early = buf.split_off(used);
                return Ok::<_, anyhow::Error>(Some((tls, dst, early)));
            }
            let read = tokio::time::timeout_at(deadline, tls.read_buf(&mut buf)).await;
            match read {
                Ok(Ok(0)) if buf.is_empty() => return Ok(None),
                Ok(Ok(0)) => anyhow::bail!("closed before its request"),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => anyhow::bail!("no request within {IDLE_REQUEST:?}"),
            }
        }
    };
    let (mut tls, dst, early) = match request.await {
        Ok(Some(r)) => r,
        Ok(None) => return Ok(()),
        Err(e) => {
            counters.bad.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    let (outcome, dest) = match destinations == Destinations::Any || tcp_lane::allowed(dst) {
        false => (Outcome::NotAllowed, None),
        true => match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(dst)).await {
            Ok(Ok(s)) => (Outcome::Connected, Some(s)),
            Ok(Err(e)) => (outcome_of(&e), None),
            Err(_) => (Outcome::TimedOut, None),
        },
    };
    tls.write_all(&tcp_lane::encode_answer(outcome)).await?;
    let Some(mut dest) = dest else {
        if let Some(i) = outcome.failure_index() {
            counters.failed[i].fetch_add(1, Ordering::Relaxed);
        }
        tls.shutdown().await?;
        return Ok(());
    };
    counters.connected.fetch_add(1, Ordering::Relaxed);
    let _ = dest.set_nodelay(true);
    dest.write_all(&early).await?;
    counters
        .bytes_to_destination
        .fetch_add(early.len() as u64, Ordering::Relaxed);
    let mut tls = Counted::new(tls, counters.clone(), |c| &c.bytes_to_destination);
    let mut dest = Counted::new(dest, counters, |c| &c.bytes_from_destination);
    // Until both ends have closed in order, closing the destination's socket resets it: a lane
    // that broke (the client went without a TLS close_notify) or was closed on revocation (the
    // task aborted) is no orderly end the destination could take a cut upload for.
    let linger = |d: &Counted<TcpStream, Counters>, l| {
        let _ = socket2::SockRef::from(d.get_ref()).set_linger(l);
    };
    linger(&dest, Some(Duration::ZERO));
    tokio::io::copy_bidirectional(&mut tls, &mut dest)
        .await
        .context("the lane broke")?;
    linger(&dest, None);
    Ok(())
}

/// What the LAN host is to be told of a connection the server could not open.
fn outcome_of(e: &std::io::Error) -> Outcome {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused | ConnectionReset => Outcome::Refused,
        TimedOut => Outcome::TimedOut,
        HostUnreachable | NetworkUnreachable | AddrNotAvailable => Outcome::Unreachable,
        _ => Outcome::Unreachable,
    }
}
