//! Lane connections set up ahead: the client keeps `READY` lane connections with their MPTCP
//! and TLS handshakes done, so a LAN connection's request goes out at once instead of after
//! two round trips of handshakes (the LAN host's own handshake was answered locally: with a
//! connection ready, the lane sets up faster than a direct connection would). Each is used for
//! one LAN connection (the request names its destination) and replaced at once; one that
//! waited `MAX_AGE` is replaced before the server gives up on it (`serve::IDLE_REQUEST`); one
//! the server closed meanwhile (a restart, a revocation) is seen closed when taken and skipped.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tracing::debug;

/// Connections kept ready: a burst of that many LAN connections (a browser opening a page)
/// all start at once; more set up their own.
pub const READY: usize = 2;
/// Replaced after this long unused (the server waits `serve::IDLE_REQUEST` for a request).
pub const MAX_AGE: Duration = Duration::from_secs(45);

pub type LaneStream = tokio_rustls::client::TlsStream<TcpStream>;

/// The ready connections, oldest first.
#[derive(Default)]
pub struct Ahead {
    ready: Mutex<VecDeque<(Instant, LaneStream)>>,
    /// Wakes the filler when one was taken.
    taken: Notify,
}

impl Ahead {
    /// A ready connection the server has not closed, if there is one.
    pub async fn take(&self) -> Option<LaneStream> {
        loop {
            let (made, mut tls) = self.lock().pop_front()?;
            self.taken.notify_one();
            if made.elapsed() >= MAX_AGE {
                continue;
            }
            // Polled once: a closed connection reads its end at once; a live one has nothing
            // to read (the server speaks only after the request), bar session tickets, which
            // the read takes in. Dropping the pending read loses nothing.
            let mut probe = [0u8; 1];
            match tokio::time::timeout(Duration::ZERO, tls.read(&mut probe)).await {
                Err(_) => return Some(tls),
                Ok(r) => debug!(read = ?r, "lane connection set up ahead was closed; skipped"),
            }
        }
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Drop the ready ones (a reload: new connections use the new TLS settings).
    pub fn clear(&self) {
        self.lock().clear();
        self.taken.notify_one();
    }

    /// Drop the ones that waited `MAX_AGE`; how many are left.
    pub fn expire(&self) -> usize {
        let mut ready = self.lock();
        ready.retain(|(made, _)| made.elapsed() < MAX_AGE);
        ready.len()
    }

    pub fn push(&self, tls: LaneStream) {
        self.lock().push_back((Instant::now(), tls));
    }

    /// Until one is taken or the oldest expires.
    pub async fn wait(&self) {
        let oldest = self.lock().front().map(|(made, _)| *made + MAX_AGE);
        let expiry = tokio::time::Instant::from_std(oldest.unwrap_or_else(Instant::now));
        tokio::select! {
            _ = self.taken.notified() => {}
            _ = tokio::time::sleep_until(expiry) => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(Instant, LaneStream)>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner())
    }
}
