//! The client's end of the MPTCP lane for one LAN connection: a lane connection (one set up
//! ahead, or a new one: `dial.rs`; its subflows on the paths: `endpoints.rs`), the request
//! (core `tcp_lane`), then both ways. What the LAN host sends goes on at once, before the
//! server's answer; what comes back waits for the answer. A destination the server could not reach is reset
//! to the LAN host (it had its handshake from us already: TPROXY answers the SYN locally).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use std::collections::BTreeMap;

use mpquic_core::tcp_lane;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::counted::Counted;
use super::dial::{self, Lane};

#[derive(Debug, Default)]
pub struct Counters {
    /// LAN connections whose destination the server reached.
    pub connected: AtomicU64,
    pub opened: AtomicU64,
    pub active: AtomicU64,
    /// LAN connections reset because the lane could not be set up, or the server could not
    /// reach the destination (by `Outcome`: refused, unreachable, timed out, not allowed).
    pub setup_failed: AtomicU64,
    /// LAN connections that went out on a lane connection set up ahead.
    pub ahead: AtomicU64,
    pub failed: [AtomicU64; 4],
    pub bytes_up: AtomicU64,
    pub bytes_down: AtomicU64,
}

impl Counters {
    /// For status, with the subflows by path.
    pub fn status(
        &self,
        subflows: BTreeMap<String, u64>,
        ready: usize,
    ) -> crate::status::LaneStatus {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut failed = super::failures(&self.failed);
        failed.insert("setup_failed".into(), n(&self.setup_failed));
        crate::status::LaneStatus {
            connections: n(&self.opened),
            active: n(&self.active),
            connected: n(&self.connected),
            failed,
            bytes_up: n(&self.bytes_up),
            bytes_down: n(&self.bytes_down),
            subflows,
            ahead: n(&self.ahead),
            ready: ready as u64,
        }
    }
}

/// Carry `lan`, whose destination was `dst`, over the lane until either end closes.
pub async fn carry(lan: TcpStream, dst: SocketAddr, lane: Arc<Lane>, counters: Arc<Counters>) {
    counters.opened.fetch_add(1, Ordering::Relaxed);
    counters.active.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = relay(lan, dst, &lane, counters.clone()).await {
        tracing::debug!(dst = %dst, error = %format!("{e:#}"), "lane connection ended");
    }
    counters.active.fetch_sub(1, Ordering::Relaxed);
}

async fn relay(
    lan: TcpStream,
    dst: SocketAddr,
    lane: &Lane,
    counters: Arc<Counters>,
) -> Result<()> {
    let _ = lan.set_nodelay(true);
    let tls = match lane.ahead.take().await {
        Some(tls) => {
            counters.ahead.fetch_add(1, Ordering::Relaxed);
            tls
        }
        None => match dial::setup(lane).await {
            Ok(t) => t,
            Err(e) => {
                counters.setup_failed.fetch_add(1, Ordering::Relaxed);
                reset(lan);
                return Err(e);
            }
        },
    };
    let (from_server, mut to_server) = tokio::io::split(tls);
    let (from_lan, mut to_lan) = lan.into_split();
    let mut from_server = Counted::new(from_server, counters.clone(), |c| &c.bytes_down);
    let mut from_lan = Counted::new(from_lan, counters.clone(), |c| &c.bytes_up);
    let sent = to_server.write_all(&tcp_lane::encode_request(dst)).await;
    // The LAN host's bytes go on now; its connection is reset if the answer says no.
    let up = tokio::spawn(async move {
        let n = tokio::io::copy(&mut from_lan, &mut to_server).await;
        let _ = to_server.shutdown().await;
        n
    });
    // With TLS 1.3 the server refuses a client certificate (unknown, revoked) only after our
    // handshake is done: then the request or the answer fails, and that too is a failed setup
    // (reset, not an orderly end the LAN host would take for the destination's).
    let mut answer = [0u8; tcp_lane::ANSWER_LEN];
    let outcome = match sent {
        Err(e) => Err(anyhow!(e).context("the lane's request")),
        Ok(()) => match from_server.read_exact(&mut answer).await {
            Ok(_) => {
                tcp_lane::decode_answer(&answer).ok_or_else(|| anyhow!("malformed lane answer"))
            }
            Err(e) => Err(anyhow!(e).context("the lane's answer")),
        },
    };
    let failed = match &outcome {
        Ok(o) => o.failure_index().map(|i| &counters.failed[i]),
        Err(_) => Some(&counters.setup_failed),
    };
    if let Some(count) = failed {
        count.fetch_add(1, Ordering::Relaxed);
        reset_halves(to_lan, up).await;
        let outcome = outcome?;
        bail!("the server could not reach {dst}: {}", outcome.as_str());
    }
    counters.connected.fetch_add(1, Ordering::Relaxed);
    match tokio::io::copy(&mut from_server, &mut to_lan).await {
        Ok(_) => {
            let _ = to_lan.shutdown().await;
            let _ = up.await;
            Ok(())
        }
        // The lane broke (no TLS close_notify: the server went, or closed it on revocation):
        // a reset, so the LAN host cannot take a cut transfer for a whole one.
        Err(e) => {
            reset_halves(to_lan, up).await;
            Err(anyhow!(e).context("the lane broke"))
        }
    }
}

/// Reset the LAN host's connection, split in two: the reset goes when the last half goes
/// (the read half, with the aborted task `up`); the write half goes without its FIN
/// (`forget`), or the host would read an orderly end first.
async fn reset_halves(
    to_lan: tokio::net::tcp::OwnedWriteHalf,
    up: tokio::task::JoinHandle<std::io::Result<u64>>,
) {
    let _ = socket2::SockRef::from(to_lan.as_ref()).set_linger(Some(Duration::ZERO));
    to_lan.forget();
    up.abort();
    let _ = up.await;
}

/// Close with a reset (SO_LINGER 0): the LAN host learns at once that the connection failed,
/// as it would from the destination.
fn reset(lan: TcpStream) {
    let _ = socket2::SockRef::from(&lan).set_linger(Some(Duration::ZERO));
    drop(lan);
}
