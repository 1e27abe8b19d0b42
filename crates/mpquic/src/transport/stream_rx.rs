//! Reliable mode, receive side: frames off a path's stream (docs/PROTOCOL.md section 3), handed
//! on at the steady delay `mpquic_core::playout` sets (none on a clean path).
//!
//! Two tasks, because reading a frame is not cancel-safe (a frame half read when a timer won
//! would be lost, and the stream with it): one reads frames as they arrive and stamps them,
//! the other holds them until their release. While nothing is held, a frame goes straight
//! through.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use mpquic_core::playout::Playout;
use tokio::sync::mpsc;

use super::Sink;

/// A frame's header: the packet's length (u16, big-endian), then its send time (u32,
/// big-endian, microseconds of the sender's clock, wrapping).
pub const HEADER: usize = 6;
/// Frames read and not yet handed to the playout (it takes them as fast as they come).
const READ_AHEAD: usize = 1024;
/// Packets held at most (about 6 MB of 1400-byte packets: 250 ms at 190 Mbit/s, 45 ms at 1
/// Gbit/s); beyond this the oldest leaves early, so memory stays bounded at any rate and a held
/// packet is never dropped.
const MAX_HELD: usize = 4096;
/// Read buffer: frames are split off it, so one allocation serves many packets.
const READ_BUFFER: usize = 256 * 1024;

/// A frame's header: `len` bytes of packet, sent at `sent_us`.
pub fn header(len: u16, sent_us: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..2].copy_from_slice(&len.to_be_bytes());
    h[2..].copy_from_slice(&sent_us.to_be_bytes());
    h
}

/// The packet length and send time a header gives.
fn parse(h: &[u8; HEADER]) -> (usize, u32) {
    (
        usize::from(u16::from_be_bytes([h[0], h[1]])),
        u32::from_be_bytes([h[2], h[3], h[4], h[5]]),
    )
}

/// The sender's clock for frame headers: microseconds since the process's first frame,
/// wrapping (the receiver only uses differences).
pub fn clock_us() -> u32 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u32
}

/// Read `recv` until it ends, handing packets to `sink`; `delay_us` shows the playout delay
/// (status), `conn` gives the path's RTT.
pub async fn run(
    sink: Arc<dyn Sink>,
    recv: quinn::RecvStream,
    conn: quinn::Connection,
    delay_us: Arc<AtomicU64>,
) {
    let (tx, mut rx) = mpsc::channel(READ_AHEAD);
    tokio::spawn(read_frames(recv, tx));
    let mut playout = Playout::default();
    let mut held: VecDeque<(Instant, Bytes)> = VecDeque::new();
    loop {
        let release = held.front().map(|(t, _)| *t);
        let timer = async {
            match release {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        let frame = tokio::select! {
            f = rx.recv() => f,
            () = timer => {
                let now = Instant::now();
                while held.front().is_some_and(|(t, _)| *t <= now) {
                    deliver(&*sink, &held.pop_front().expect("front checked").1);
                }
                sink.on_batch_end();
                continue;
            }
        };
        let Some((sent_us, packet)) = frame else {
            // The stream ended: what is held is still delivered, at once.
            for (_, p) in held.drain(..) {
                deliver(&*sink, &p);
            }
            sink.on_batch_end();
            return;
        };
        let now = Instant::now();
        let at = playout.on_packet(now, sent_us, conn.rtt());
        delay_us.store(playout.delay().as_micros() as u64, Ordering::Relaxed);
        if at <= now && held.is_empty() {
            deliver(&*sink, &packet);
        } else {
            if held.len() == MAX_HELD {
                deliver(&*sink, &held.pop_front().expect("full").1);
            }
            held.push_back((at, packet));
        }
        // More frames read already join this write to the TUN device.
        if rx.is_empty() {
            sink.on_batch_end();
        }
    }
}

fn deliver(sink: &dyn Sink, packet: &[u8]) {
    // A zero length is malformed: the sink counts it.
    sink.on_stream_packet((!packet.is_empty()).then_some(packet));
}

async fn read_frames(mut recv: quinn::RecvStream, tx: mpsc::Sender<(u32, Bytes)>) {
    let mut buf = BytesMut::with_capacity(READ_BUFFER);
    loop {
        let mut header = [0u8; HEADER];
        if recv.read_exact(&mut header).await.is_err() {
            return;
        }
        let (n, sent_us) = parse(&header);
        if buf.capacity() < n {
            buf = BytesMut::with_capacity(READ_BUFFER);
        }
        buf.resize(n, 0);
        if recv.read_exact(&mut buf[..]).await.is_err() {
            return;
        }
        if tx.send((sent_us, buf.split().freeze())).await.is_err() {
            return;
        }
    }
}

/// The playout delay a path's receiver holds packets to, for status.
pub fn delay(delay_us: &AtomicU64) -> Duration {
    Duration::from_micros(delay_us.load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/PROTOCOL.md section 3's test vector.
    #[test]
    fn vector() {
        let frame = [0x00, 0x03, 0x00, 0x01, 0xe2, 0x40, 0x45, 0x00, 0x00];
        let h: [u8; HEADER] = frame[..HEADER].try_into().unwrap();
        assert_eq!(parse(&h), (3, 123_456));
        assert_eq!(header(3, 123_456), h);
        assert_eq!(&frame[HEADER..], [0x45, 0x00, 0x00]);
    }
}
