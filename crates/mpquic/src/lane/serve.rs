//! The server's end of the MPTCP lane (`tcp_lane_listen`): it takes lane connections (kernel
//! MPTCP, plain TCP from a peer without it), authenticates the client by its certificate (TLS
//! 1.3, the same CA as the tunnel), reads its request (core `tcp_lane`), opens the TCP
//! connection to the destination, answers, and relays both ways until either end closes.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use mpquic_core::tcp_lane::{self, Outcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use super::counted::Counted;
use super::socket;

/// Lane connections served at once; more wait for a slot (the kernel's backlog holds them).
const MAX_CONNECTIONS: usize = 4096;
/// A client that has not finished its handshake and request by then is dropped.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
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
            subflows: Default::default(),
        }
    }
}

/// The server's lane, running until dropped.
pub struct Serving {
    pub counters: Arc<Counters>,
    task: tokio::task::AbortHandle,
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Listen on `listen` with the server's certificate, its clients' CA and `revoked:` list (as
/// they are at start).
pub fn start(
    cfg: &crate::config::Config,
    scfg: &crate::config::ServerConfig,
    listen: SocketAddr,
) -> Result<Serving> {
    let (cert, key) = cfg
        .cert_file
        .as_deref()
        .zip(cfg.key_file.as_deref())
        .context("the lane needs tls_cert_file and tls_key_file")?;
    let tls = crate::tls::server_crypto(
        cert,
        key,
        &scfg.client_ca_file,
        cfg.tls_post_quantum,
        &scfg.revoked,
        crate::tls::Served::Lane,
    )?;
    let listener =
        socket::mptcp_listener(listen).with_context(|| format!("tcp_lane_listen {listen}"))?;
    // A subflow per client path (a client has at most 8 paths on the lane).
    if let Err(e) = super::endpoints::set_limits(8) {
        warn!(error = %format!("{e:#}"), "MPTCP lane: the kernel's limits are as they were (a client gets fewer subflows)");
    }
    info!(listen = %listen, "MPTCP lane listening");
    let counters = Arc::new(Counters::default());
    let c = counters.clone();
    let task = tokio::spawn(async move {
        if let Err(e) = run(listener, Arc::new(tls), Destinations::Internet, c).await {
            warn!(error = %format!("{e:#}"), "MPTCP lane stopped");
        }
    })
    .abort_handle();
    Ok(Serving { counters, task })
}

pub(super) async fn run(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    destinations: Destinations,
    counters: Arc<Counters>,
) -> Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
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
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        let (acceptor, counters) = (acceptor.clone(), counters.clone());
        tokio::spawn(async move {
            counters.active.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = one(stream, acceptor, destinations, counters.clone()).await {
                debug!(from = %from, error = %format!("{e:#}"), "MPTCP lane connection ended");
            }
            counters.active.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
}

async fn one(
    stream: TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    destinations: Destinations,
    counters: Arc<Counters>,
) -> Result<()> {
    let _ = stream.set_nodelay(true);
    let request = async {
        let mut tls = acceptor.accept(stream).await.context("TLS handshake")?;
        let mut buf = Vec::with_capacity(tcp_lane::MAX_REQUEST + 1500);
        loop {
            if let Some((dst, used)) =
                tcp_lane::decode_request(&buf).map_err(|e| anyhow::anyhow!(e))?
            {
                let early = buf.split_off(used);
                return Ok::<_, anyhow::Error>((tls, dst, early));
            }
            if tls.read_buf(&mut buf).await? == 0 {
                anyhow::bail!("closed before its request");
            }
        }
    };
    let (mut tls, dst, early) = match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            counters.bad.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        Err(_) => {
            counters.bad.fetch_add(1, Ordering::Relaxed);
            anyhow::bail!("no request within {REQUEST_TIMEOUT:?}");
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
    tokio::io::copy_bidirectional(&mut tls, &mut dest).await?;
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
