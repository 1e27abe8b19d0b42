//! A path's transport: how inner packets and control messages (probes) cross one path. The tunnel
//! (and the core's bonds behind it) only see `PathTransport`; QUIC is its first implementation
//! (`QuicTransport`: DATAGRAM frames, or in reliable mode one stream per path), so a stripe or a
//! MASQUE transport is one more implementation, not an edit of the tunnel.
//!
//! Receiving is pushed: a transport delivers what arrives to the `Sink` it was started with (the
//! tunnel's, for one path and one connection generation).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use mpquic_core::DropReason;
use tokio::sync::mpsc;

use crate::config::TransportMode;

/// Packets a reliable-mode path may queue before new ones are dropped (counted `queue_full`).
const STREAM_QUEUE: usize = 2048;
/// Bytes written to a stream in one call (batching amortises the per-write cost).
const STREAM_BATCH: usize = 64 * 1024;

/// The transport's own view of the path, for status and metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct TransportStats {
    pub rtt: Option<Duration>,
    pub cwnd: Option<u64>,
    pub sent_packets: u64,
    pub lost_packets: u64,
}

/// Where a transport delivers what it receives, and reports what it lost after accepting it.
pub trait Sink: Send + Sync + 'static {
    /// A datagram: an inner packet or a control message (`wire::decode` tells them apart).
    fn on_datagram(&self, d: &[u8]);
    /// An inner packet from an ordered byte stream (reliable mode); `None` for a malformed frame.
    fn on_stream_packet(&self, pkt: Option<&[u8]>);
    /// Packets accepted by `send_packet` that were lost with a failed stream (counted).
    fn on_send_lost(&self, packets: u64, bytes: u64);
    /// The transport has ended (connection closed); nothing more arrives.
    fn on_closed(&self);
}

pub trait PathTransport: Send + Sync + 'static {
    /// Send one inner packet; refused with the reason (the caller counts it).
    fn send_packet(&self, pkt: &[u8]) -> Result<(), DropReason>;
    /// Send a control message (probe, reply): never queued behind data, never evicting it.
    fn send_control(&self, msg: &[u8]) -> Result<(), DropReason>;
    fn remote(&self) -> SocketAddr;
    fn stats(&self) -> TransportStats;
    fn close(&self, code: u32, reason: &str);
    /// Start the receive side (and, for streams, the writer), delivering to `sink`.
    fn start(self: Arc<Self>, sink: Arc<dyn Sink>);
}

/// What a QUIC path's session setup (handshake, then the hello on the first stream) yields.
pub struct NewLink {
    pub conn: quinn::Connection,
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
    /// The client's per-path endpoint (its socket); `None` on the server's shared endpoint.
    pub endpoint: Option<quinn::Endpoint>,
}

impl NewLink {
    pub fn into_transport(self, mode: TransportMode) -> Arc<QuicTransport> {
        QuicTransport::new(self.conn, self.send, self.recv, self.endpoint, mode)
    }
}

/// A path over one QUIC connection.
pub struct QuicTransport {
    conn: quinn::Connection,
    /// Reliable mode: the queue into the stream writer task.
    stream_tx: Option<mpsc::Sender<Bytes>>,
    /// Taken by `start`: the hello stream (reliable mode carries the packets on it), and the
    /// stream writer's queue.
    start: std::sync::Mutex<Option<StartParts>>,
    /// Kept so the client's per-path socket lives as long as the connection.
    _endpoint: Option<quinn::Endpoint>,
}

struct StartParts {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    stream_rx: Option<mpsc::Receiver<Bytes>>,
}

impl QuicTransport {
    /// A connection whose hello exchange is done on (`send`, `recv`).
    pub fn new(
        conn: quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        endpoint: Option<quinn::Endpoint>,
        mode: TransportMode,
    ) -> Arc<QuicTransport> {
        let (stream_tx, stream_rx) = match mode {
            TransportMode::Reliable => {
                let (tx, rx) = mpsc::channel(STREAM_QUEUE);
                (Some(tx), Some(rx))
            }
            TransportMode::Datagram => (None, None),
        };
        Arc::new(QuicTransport {
            conn,
            stream_tx,
            start: std::sync::Mutex::new(Some(StartParts {
                send,
                recv,
                stream_rx,
            })),
            _endpoint: endpoint,
        })
    }
}

impl PathTransport for QuicTransport {
    fn send_packet(&self, pkt: &[u8]) -> Result<(), DropReason> {
        match &self.stream_tx {
            Some(tx) => tx
                .try_send(Bytes::copy_from_slice(pkt))
                .map_err(|e| match e {
                    mpsc::error::TrySendError::Full(_) => DropReason::QueueFull,
                    mpsc::error::TrySendError::Closed(_) => DropReason::SendFailed,
                }),
            None => send_datagram(&self.conn, pkt),
        }
    }

    fn send_control(&self, msg: &[u8]) -> Result<(), DropReason> {
        send_datagram(&self.conn, msg)
    }

    fn remote(&self) -> SocketAddr {
        self.conn.remote_address()
    }

    fn stats(&self) -> TransportStats {
        let st = self.conn.stats();
        TransportStats {
            rtt: Some(st.path.rtt),
            cwnd: Some(st.path.cwnd),
            sent_packets: st.path.sent_packets,
            lost_packets: st.path.lost_packets,
        }
    }

    fn close(&self, code: u32, reason: &str) {
        self.conn.close(code.into(), reason.as_bytes());
    }

    fn start(self: Arc<Self>, sink: Arc<dyn Sink>) {
        let Some(parts) = self.start.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return; // started already
        };
        // Datagrams: probes always, inner packets in datagram mode.
        let c = self.conn.clone();
        let s = sink.clone();
        tokio::spawn(async move {
            while let Ok(d) = c.read_datagram().await {
                s.on_datagram(&d);
            }
            s.on_closed();
        });
        let StartParts {
            send,
            recv,
            stream_rx,
        } = parts;
        match stream_rx {
            Some(rx) => {
                let s = sink.clone();
                tokio::spawn(async move { stream_reader(s, recv).await });
                tokio::spawn(async move { stream_writer(sink, send, rx).await });
            }
            None => {
                // Keep the control stream open for the connection's life.
                let conn = self.conn.clone();
                tokio::spawn(async move {
                    let _keep = (send, recv);
                    conn.closed().await;
                });
            }
        }
    }
}

/// Reliable mode, receive side: 2-byte big-endian length, then the packet.
async fn stream_reader(sink: Arc<dyn Sink>, mut recv: quinn::RecvStream) {
    let mut buf = vec![0u8; 65_536];
    loop {
        let mut len = [0u8; 2];
        if recv.read_exact(&mut len).await.is_err() {
            return;
        }
        let n = usize::from(u16::from_be_bytes(len));
        if recv.read_exact(&mut buf[..n]).await.is_err() {
            return;
        }
        sink.on_stream_packet((n > 0).then(|| &buf[..n]));
    }
}

/// Reliable mode, send side: frames queued packets and writes them in batches.
async fn stream_writer(
    sink: Arc<dyn Sink>,
    mut send: quinn::SendStream,
    mut rx: mpsc::Receiver<Bytes>,
) {
    let mut batch = BytesMut::with_capacity(STREAM_BATCH + 65_538);
    while let Some(first) = rx.recv().await {
        batch.clear();
        let frame = |p: &Bytes, b: &mut BytesMut| {
            b.extend_from_slice(&(p.len() as u16).to_be_bytes());
            b.extend_from_slice(p);
        };
        frame(&first, &mut batch);
        while batch.len() < STREAM_BATCH {
            match rx.try_recv() {
                Ok(p) => frame(&p, &mut batch),
                Err(_) => break,
            }
        }
        if send.write_all(&batch).await.is_err() {
            // Everything in this batch and everything still queued is lost with the stream;
            // closing the queue makes later packets fail (and count) in `send_packet`.
            rx.close();
            let (mut packets, mut bytes) = frames_in(&batch);
            while let Ok(p) = rx.try_recv() {
                packets += 1;
                bytes += p.len() as u64;
            }
            sink.on_send_lost(packets, bytes);
            return;
        }
    }
}

/// Send one datagram, refusing (and reporting) rather than letting the QUIC engine silently
/// drop older queued datagrams when its buffer is full. `send_datagram_wait` checks for space
/// and queues under one lock and never evicts; polled once, "would wait" means the buffer is
/// full. (`send_datagram` would make room by discarding queued datagrams uncounted, and a
/// separate space check before it races with the other threads that send.)
fn send_datagram(conn: &quinn::Connection, pkt: &[u8]) -> Result<(), DropReason> {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let fut = std::pin::pin!(conn.send_datagram_wait(Bytes::copy_from_slice(pkt)));
    match fut.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(())) => Ok(()),
        Poll::Ready(Err(quinn::SendDatagramError::TooLarge)) => Err(DropReason::Oversized),
        Poll::Ready(Err(_)) => Err(DropReason::SendFailed),
        Poll::Pending => Err(DropReason::QueueFull),
    }
}

/// Packets and payload bytes in a batch of length-prefixed frames (reliable mode).
fn frames_in(batch: &[u8]) -> (u64, u64) {
    let (mut packets, mut bytes, mut at) = (0, 0, 0);
    while at + 2 <= batch.len() {
        let n = usize::from(u16::from_be_bytes([batch[at], batch[at + 1]]));
        packets += 1;
        bytes += n as u64;
        at += 2 + n;
    }
    (packets, bytes)
}
