//! Reliable mode, receive side: frames off a path's stream (docs/PROTOCOL.md section 3), handed
//! on at the steady delay `mpquic_core::reorder::playout` sets (none on a clean path); packets
//! that are not TCP are handed on at once, and after the loss only bulk TCP flows are held
//! (`tcp_flow`, `Playout::on_flow`).
//!
//! The stream is read in any order (`mpquic_core::reorder::reassembly` puts the frames back in order),
//! so each frame's head-of-line wait is known: the playout acts on those waits only, not on
//! queueing at a bottleneck.
//!
//! Two tasks, because a read is not worth cancelling for a timer: one reads chunks as they
//! arrive and cuts them into frames, the other holds frames until their release. While nothing
//! is held, a frame goes straight through.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use mpquic_core::packet::{PacketInfo, PROTO_TCP};
use mpquic_core::reorder::playout::Playout;
pub use mpquic_core::reorder::reassembly::{header, HEADER};
use mpquic_core::reorder::reassembly::{Frame, Reassembly};
use mpquic_core::sendq::WaitingFlows;
use mpquic_core::wire;
use tokio::sync::mpsc;
use tracing::warn;

use super::{close, Sink};

/// Frames read and not yet handed to the playout (it takes them as fast as they come).
const READ_AHEAD: usize = 1024;
/// Packets held at most (about 6 MB of 1400-byte packets: 250 ms at 190 Mbit/s, 45 ms at 1
/// Gbit/s); beyond this the oldest leaves early, so memory stays bounded at any rate and a held
/// packet is never dropped.
const MAX_HELD: usize = 4096;
/// The most one read takes (QUIC hands over one STREAM frame's data at most anyway).
const READ_CHUNK: usize = 64 * 1024;

/// The sender's clock for frame headers: microseconds since the process's first frame,
/// wrapping (the receiver only uses differences).
pub fn clock_us() -> u32 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u32
}

/// A connection's playout, shared by all its streams (each class's bulk and sparse stream):
/// one delay for every packet of the path. A flow whose packets take two streams (a TCP flow's
/// handshake or the packets after a pause on the sparse stream, its data on the bulk one) then
/// sees one steady RTT: with a playout per stream, a lossy path's sparse packets skipped the
/// hold its bulk stream's packets waited, inner BBR took their RTT for the path's minimum and
/// kept too little in flight (10% loss, 60 Mbit/s 30 ms: 6 Mbit/s against 19-28).
#[derive(Default)]
pub struct SharedPlayout {
    playout: Mutex<Playout>,
    /// The delay it holds packets to, for status (`delay`).
    delay_us: AtomicU64,
    /// The peer's streams being read (`run`), for status (`streams`).
    streams: AtomicU64,
}

/// Read `recv` until it ends, handing packets to `sink` through the connection's `playout`;
/// `conn` is closed if the peer breaks the stream's rules.
pub async fn run(
    sink: Arc<dyn Sink>,
    recv: quinn::RecvStream,
    conn: quinn::Connection,
    shared: Arc<SharedPlayout>,
) {
    let (tx, mut rx) = mpsc::channel(READ_AHEAD);
    // Counted while read: each stream is two tasks (this one and its reader) the connection
    // holds until the stream or the connection ends.
    struct Reading(Arc<SharedPlayout>);
    impl Drop for Reading {
        fn drop(&mut self) {
            self.0.streams.fetch_sub(1, Ordering::Relaxed);
        }
    }
    shared.streams.fetch_add(1, Ordering::Relaxed);
    let _reading = Reading(shared.clone());
    tokio::spawn(read_frames(recv, conn, tx));
    let mut held = Held::default();
    loop {
        let release = held.next_release();
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
                while held.next_release().is_some_and(|t| t <= now) {
                    deliver(&*sink, &held.pop_front().expect("front checked"));
                }
                sink.on_batch_end();
                continue;
            }
        };
        let Some(Frame {
            sent_us,
            packet,
            waited,
        }) = frame
        else {
            // The stream ended: what is held is still delivered, at once.
            while let Some(p) = held.pop_front() {
                deliver(&*sink, &p);
            }
            sink.on_batch_end();
            return;
        };
        let now = Instant::now();
        let tcp = tcp_flow(&packet);
        let at = {
            let mut playout = shared.playout.lock().unwrap_or_else(|e| e.into_inner());
            let bulk = matches!(tcp, Some(Some(flow)) if playout.on_flow(now, flow, packet.len()));
            let at = playout.on_packet(now, sent_us, waited, bulk);
            shared
                .delay_us
                .store(playout.delay().as_micros() as u64, Ordering::Relaxed);
            at
        };
        match tcp {
            Some(flow) if at > now || held.has(flow) => {
                if held.len() == MAX_HELD {
                    deliver(&*sink, &held.pop_front().expect("full"));
                }
                held.push_back(at, flow, packet);
            }
            _ => deliver(&*sink, &packet),
        }
        // More frames read already join this write to the TUN device.
        if rx.is_empty() {
            sink.on_batch_end();
        }
    }
}

/// Packets held for their release, in order, and how many of each flow are held (by hash
/// bucket, `WaitingFlows`: a collision makes a packet wait, never overtake): a packet that is
/// not held itself still waits behind its own flow's held packets, never behind other flows'.
/// A packet without a flow key waits behind any, and any behind it.
#[derive(Default)]
struct Held {
    packets: VecDeque<(Instant, Option<u64>, Bytes)>,
    flows: WaitingFlows,
    unkeyed: usize,
}

impl Held {
    /// Whether a packet of `flow` must wait behind held ones.
    fn has(&self, flow: Option<u64>) -> bool {
        match flow {
            None => !self.packets.is_empty(),
            Some(_) => self.unkeyed > 0 || !self.flows.is_idle(flow),
        }
    }

    fn len(&self) -> usize {
        self.packets.len()
    }

    /// When the oldest held packet leaves.
    fn next_release(&self) -> Option<Instant> {
        self.packets.front().map(|(t, _, _)| *t)
    }

    fn push_back(&mut self, at: Instant, flow: Option<u64>, packet: Bytes) {
        self.flows.add(flow);
        self.unkeyed += usize::from(flow.is_none());
        self.packets.push_back((at, flow, packet));
    }

    fn pop_front(&mut self) -> Option<Bytes> {
        let (_, flow, packet) = self.packets.pop_front()?;
        self.flows.sub(flow);
        self.unkeyed -= usize::from(flow.is_none());
        Some(packet)
    }
}

/// Whether the playout is for `packet` (`Some`, with its flow's hash when it parses): it
/// steadies inner TCP's RTT. Anything else (a call, a
/// video, a ping, DNS, an inner QUIC connection) leaves as soon as the stream has it: such a
/// flow has its own jitter buffer or none, and the hold, set by the bulk's head-of-line waits
/// (up to `playout::MAX_DELAY`), only made it late. A Starlink reconfiguration's loss burst
/// moved a call onto the stream (`writer::DATAGRAM_LOSS`) and 68-88% of its packets in the
/// next two seconds came later than 150 ms, pings at 270-420 ms. A packet that does not parse
/// is held as TCP is (the sink counts it).
fn tcp_flow(frame: &[u8]) -> Option<Option<u64>> {
    match wire::inner_packet(frame).and_then(PacketInfo::parse) {
        Some(i) if i.proto == PROTO_TCP => Some(Some(i.flow_hash())),
        Some(_) => None,
        None => Some(None),
    }
}

fn deliver(sink: &dyn Sink, packet: &[u8]) {
    // A zero length is malformed: the sink counts it.
    sink.on_stream_packet((!packet.is_empty()).then_some(packet));
}

async fn read_frames(
    mut recv: quinn::RecvStream,
    conn: quinn::Connection,
    tx: mpsc::Sender<Frame>,
) {
    // The stream carried the hello before the frames: one ordered read says where they start
    // (reads in any order may follow ordered ones, not the other way round).
    let (mut frames, mut chunk) = match recv.read_chunk(READ_CHUNK, true).await {
        Ok(Some(c)) => (Reassembly::starting_at(c.offset), c),
        Ok(None) | Err(_) => return,
    };
    loop {
        if frames
            .insert(chunk.offset, chunk.bytes, Instant::now())
            .is_err()
        {
            // Only a peer that ignores QUIC's flow control gets here; the path is dialled
            // again like any other that failed.
            warn!("a path's stream ran far beyond its flow control window; closing the connection");
            conn.close(
                close::PROTOCOL.into(),
                b"stream beyond its flow control window",
            );
            return;
        }
        while let Some(f) = frames.pop() {
            if tx.send(f).await.is_err() {
                return;
            }
        }
        chunk = match recv.read_chunk(READ_CHUNK, false).await {
            Ok(Some(c)) => c,
            Ok(None) | Err(_) => return,
        };
    }
}

/// The playout delay a path's receiver holds packets to, for status.
pub fn delay(shared: &SharedPlayout) -> Duration {
    Duration::from_micros(shared.delay_us.load(Ordering::Relaxed))
}

/// The peer's streams a path's receiver reads now, for status: a lane's stream opens when its
/// first packet goes (`LaneStreams`), so a connection holds from one to two per class.
pub fn streams(shared: &SharedPlayout) -> u64 {
    shared.streams.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 28-byte IPv4 packet of protocol `proto`.
    fn ipv4(proto: u8) -> Vec<u8> {
        let mut p = vec![
            0x45, 0, 0, 28, 0, 0, 0x40, 0, 64, proto, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        p.extend_from_slice(&[0x13, 0x88, 0x14, 0x51, 0, 8, 0, 0]);
        p
    }

    #[test]
    fn only_tcp_waits_for_the_playout() {
        assert!(tcp_flow(&ipv4(6)).is_some());
        assert!(tcp_flow(&ipv4(17)).is_none(), "udp");
        assert!(tcp_flow(&ipv4(1)).is_none(), "icmp");
        // Past a lane's and the bond's headers, as frames carry them.
        let mut framed = wire::encode_classed(2).unwrap().to_vec();
        framed.extend_from_slice(&wire::encode_bonded(1, 9));
        framed.extend_from_slice(&ipv4(17));
        assert!(tcp_flow(&framed).is_none());
        framed.truncate(framed.len() - 28);
        framed.extend_from_slice(&ipv4(6));
        assert!(tcp_flow(&framed).is_some());
        // What does not parse is held as TCP is.
        assert!(tcp_flow(&[0x45, 0, 0]).is_some());
        assert!(tcp_flow(&[]).is_some());
    }

    #[test]
    fn a_packet_waits_behind_its_own_flows_held_packets_only() {
        let mut held = Held::default();
        let t = Instant::now();
        assert!(!held.has(Some(1)) && !held.has(None));
        held.push_back(t, Some(1), Bytes::from_static(b"a"));
        assert!(held.has(Some(1)), "its own flow's packet is held");
        assert!(!held.has(Some(2)), "another flow passes");
        assert!(
            held.has(None),
            "a packet without a flow key waits behind anything"
        );
        held.push_back(t, None, Bytes::from_static(b"b"));
        assert!(held.has(Some(2)), "...and anything waits behind it");
        assert_eq!(held.pop_front().as_deref(), Some(&b"a"[..]));
        assert!(!held.has(Some(1)) || held.has(None));
        assert_eq!(held.pop_front().as_deref(), Some(&b"b"[..]));
        assert!(!held.has(Some(1)) && !held.has(None) && held.len() == 0);
    }
}
