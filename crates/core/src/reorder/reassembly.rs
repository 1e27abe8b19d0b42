//! A path's stream of frames (docs/PROTOCOL.md section 3: length, send time, inner packet) put
//! back together from the chunks QUIC hands over in any order, with each frame's head-of-line
//! wait: how long it had been complete before every byte ahead of it had arrived too.
//!
//! Why read the stream in any order: the receiver's playout (`playout.rs`) holds packets to a
//! steady delay where the stream makes them wait for retransmissions, and only there. Judged
//! from send times, a wait behind a lost packet looks the same as waiting in a bottleneck queue
//! shared with other traffic, so a quiet path beside someone else's upload got its pings held
//! to the queue's swings. The stream itself knows which is which: a frame whose bytes all
//! arrived while a gap ahead of it was still open waited for a retransmission, and so did the
//! frame that fills the gap (it is late by as long as the data right after the gap has
//! waited); a frame that arrived late but in order did not.
//!
//! Memory: bytes beyond a gap are kept until it fills. QUIC's stream flow control bounds them
//! (the receive window; unordered reads return each byte once), and `MAX_AHEAD` bounds them
//! here too, so a peer that breaks flow control is refused, not followed.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

/// A frame's header: the packet's length (u16, big-endian), then its send time (u32,
/// big-endian, microseconds of the sender's clock, wrapping).
pub const HEADER: usize = 6;
/// Bytes kept beyond a gap at most (twice the receive window the binary gives QUIC).
pub const MAX_AHEAD: usize = 32 << 20;
/// In-order bytes are gathered in buffers of this size, so one allocation serves many frames.
const BUFFER: usize = 256 * 1024;

/// A frame's header: `len` bytes of packet, sent at `sent_us`.
pub fn header(len: u16, sent_us: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..2].copy_from_slice(&len.to_be_bytes());
    h[2..].copy_from_slice(&sent_us.to_be_bytes());
    h
}

/// The packet length and send time a header gives.
pub fn parse_header(h: &[u8; HEADER]) -> (usize, u32) {
    (
        usize::from(u16::from_be_bytes([h[0], h[1]])),
        u32::from_be_bytes([h[2], h[3], h[4], h[5]]),
    )
}

/// One frame off the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The sender's clock when the frame entered the stream.
    pub sent_us: u32,
    /// The inner packet (empty: a malformed frame, for the caller to count).
    pub packet: Bytes,
    /// How long the frame waited for bytes ahead of it (zero when it arrived in order).
    pub waited: Duration,
}

/// The peer sent more beyond a gap than flow control allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooFarAhead;

#[derive(Debug, Default)]
pub struct Reassembly {
    /// Stream offset of the first byte not yet in order.
    next: u64,
    /// Chunks beyond a gap, by offset, with when they arrived.
    ahead: BTreeMap<u64, (Bytes, Instant)>,
    ahead_bytes: usize,
    /// In-order bytes that are not a whole frame yet.
    partial: BytesMut,
    /// The latest arrival among `partial`'s bytes.
    partial_arrived: Option<Instant>,
    ready: VecDeque<Frame>,
}

impl Reassembly {
    /// Frames from stream offset `next` on (what precedes it was read otherwise, e.g. the
    /// hello on a path's first stream).
    pub fn starting_at(next: u64) -> Self {
        Reassembly {
            next,
            ..Self::default()
        }
    }

    /// The chunk at stream `offset` arrived at `now`.
    pub fn insert(&mut self, offset: u64, chunk: Bytes, now: Instant) -> Result<(), TooFarAhead> {
        if offset > self.next {
            let end = offset + chunk.len() as u64;
            // Keep the longer of two chunks at one offset; other overlaps are trimmed in order.
            let old = self.ahead.get(&offset).map_or(0, |(c, _)| c.len());
            if chunk.len() > old {
                self.ahead_bytes = self.ahead_bytes + chunk.len() - old;
                self.ahead.insert(offset, (chunk, now));
            }
            if self.ahead_bytes > MAX_AHEAD || end - self.next > 2 * MAX_AHEAD as u64 {
                return Err(TooFarAhead);
            }
            return Ok(());
        }
        // A chunk that fills a gap is late by as long as the data right after the gap has
        // waited: it counts as arrived when that did.
        let arrived = self.ahead.first_key_value().map_or(now, |(_, (_, a))| *a);
        self.append(offset, chunk, arrived, now);
        while let Some(entry) = self.ahead.first_entry() {
            if *entry.key() > self.next {
                break;
            }
            let (at, (chunk, arrived)) = entry.remove_entry();
            self.ahead_bytes -= chunk.len();
            self.append(at, chunk, arrived, now);
        }
        Ok(())
    }

    /// The next whole frame, oldest first.
    pub fn pop(&mut self) -> Option<Frame> {
        self.ready.pop_front()
    }

    /// Bytes held beyond a gap.
    pub fn ahead_bytes(&self) -> usize {
        self.ahead_bytes
    }

    /// In-order bytes from `offset` on (what precedes `next` was had already) that arrived at
    /// `arrived`, taken in at `now`.
    fn append(&mut self, offset: u64, mut chunk: Bytes, arrived: Instant, now: Instant) {
        let seen = (self.next - offset) as usize;
        if seen >= chunk.len() {
            return;
        }
        let _ = chunk.split_to(seen);
        self.next += chunk.len() as u64;
        if self.partial.capacity() - self.partial.len() < chunk.len() {
            self.partial.reserve(BUFFER.max(chunk.len()));
        }
        self.partial.extend_from_slice(&chunk);
        self.partial_arrived = Some(self.partial_arrived.map_or(arrived, |a| a.max(arrived)));
        while self.partial.len() >= HEADER {
            let h: [u8; HEADER] = self.partial[..HEADER].try_into().expect("length checked");
            let (n, sent_us) = parse_header(&h);
            if self.partial.len() < HEADER + n {
                break;
            }
            let frame = self.partial.split_to(HEADER + n).freeze();
            let complete = self.partial_arrived.expect("set above");
            self.ready.push_back(Frame {
                sent_us,
                packet: frame.slice(HEADER..),
                waited: now.saturating_duration_since(complete),
            });
            // What is left came with this chunk (the frame ended inside it).
            self.partial_arrived = (!self.partial.is_empty()).then_some(arrived);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn frames(sizes: &[usize]) -> (Vec<u8>, Vec<Vec<u8>>) {
        let mut wire = Vec::new();
        let mut packets = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            let p: Vec<u8> = (0..*n).map(|j| (i * 7 + j) as u8).collect();
            wire.extend_from_slice(&header(*n as u16, i as u32));
            wire.extend_from_slice(&p);
            packets.push(p);
        }
        (wire, packets)
    }

    fn drain(r: &mut Reassembly) -> Vec<Frame> {
        std::iter::from_fn(|| r.pop()).collect()
    }

    /// docs/PROTOCOL.md section 3's test vector.
    #[test]
    fn vector() {
        let frame = [0x00, 0x03, 0x00, 0x01, 0xe2, 0x40, 0x45, 0x00, 0x00];
        let h: [u8; HEADER] = frame[..HEADER].try_into().unwrap();
        assert_eq!(parse_header(&h), (3, 123_456));
        assert_eq!(header(3, 123_456), h);
        let mut r = Reassembly::default();
        r.insert(0, Bytes::copy_from_slice(&frame), Instant::now())
            .unwrap();
        let f = r.pop().unwrap();
        assert_eq!((f.sent_us, &f.packet[..]), (123_456, &[0x45, 0, 0][..]));
    }

    #[test]
    fn in_order_chunks_of_any_size_wait_for_nothing() {
        let (wire, packets) = frames(&[1, 1400, 0, 37, 1200, 3]);
        for step in [1, 5, 6, 7, 100, 1500, wire.len()] {
            let mut r = Reassembly::default();
            let t0 = Instant::now();
            for (i, c) in wire.chunks(step).enumerate() {
                let off = (i * step) as u64;
                r.insert(off, Bytes::copy_from_slice(c), t0 + MS * i as u32)
                    .unwrap();
            }
            let got = drain(&mut r);
            let bodies: Vec<Vec<u8>> = got.iter().map(|f| f.packet.to_vec()).collect();
            assert_eq!(bodies, packets, "chunks of {step}");
            assert!(got.iter().all(|f| f.waited.is_zero()), "chunks of {step}");
            assert_eq!(r.ahead_bytes(), 0);
        }
    }

    #[test]
    fn a_gap_holds_what_is_behind_it_and_the_wait_is_measured() {
        // Three frames in three chunks; the first chunk is lost and comes 40 ms late.
        let (wire, packets) = frames(&[100, 100, 100]);
        let t0 = Instant::now();
        let mut r = Reassembly::default();
        r.insert(106, Bytes::copy_from_slice(&wire[106..212]), t0)
            .unwrap();
        r.insert(212, Bytes::copy_from_slice(&wire[212..]), t0 + 5 * MS)
            .unwrap();
        assert!(r.pop().is_none());
        assert_eq!(r.ahead_bytes(), 212);
        r.insert(0, Bytes::copy_from_slice(&wire[..106]), t0 + 40 * MS)
            .unwrap();
        let got = drain(&mut r);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].packet.to_vec(), packets[0]);
        // The first frame came in the retransmission: late by as long as the second had been
        // there.
        assert_eq!(
            got.iter().map(|f| f.waited).collect::<Vec<_>>(),
            [40 * MS, 40 * MS, 35 * MS]
        );
        assert_eq!(r.ahead_bytes(), 0);
    }

    #[test]
    fn each_gap_filler_is_late_by_what_waited_right_behind_it() {
        // Four frames; the first and the third are lost. The data behind the first gap came
        // at 0, behind the second at 50 ms; the fillers at 40 and 60 ms.
        let (wire, _) = frames(&[100, 100, 100, 100]);
        let t0 = Instant::now();
        let mut r = Reassembly::default();
        let put = |r: &mut Reassembly, a: usize, b: usize, at: Duration| {
            r.insert(a as u64, Bytes::copy_from_slice(&wire[a..b]), t0 + at)
                .unwrap()
        };
        put(&mut r, 106, 212, Duration::ZERO);
        put(&mut r, 318, 424, 50 * MS);
        put(&mut r, 0, 106, 40 * MS);
        put(&mut r, 212, 318, 60 * MS);
        let waits: Vec<_> = drain(&mut r).iter().map(|f| f.waited).collect();
        assert_eq!(waits, [40 * MS, 40 * MS, 10 * MS, 10 * MS]);
    }

    #[test]
    fn a_frame_split_across_a_gap_waits_from_its_last_byte() {
        let (wire, _) = frames(&[1000]);
        let t0 = Instant::now();
        let mut r = Reassembly::default();
        r.insert(0, Bytes::copy_from_slice(&wire[..300]), t0)
            .unwrap();
        r.insert(700, Bytes::copy_from_slice(&wire[700..]), t0 + 2 * MS)
            .unwrap();
        r.insert(300, Bytes::copy_from_slice(&wire[300..700]), t0 + 30 * MS)
            .unwrap();
        // Its last bytes came 2 ms in, the missing middle at 30 ms: it was late by 28 ms.
        let f = r.pop().unwrap();
        assert_eq!(f.waited, 28 * MS);
        assert_eq!(f.packet.len(), 1000);
    }

    #[test]
    fn any_order_and_duplicates_give_the_same_frames() {
        let sizes: Vec<usize> = (0..200).map(|i| (i * 97) % 1400).collect();
        let (wire, packets) = frames(&sizes);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20 {
            let mut chunks = Vec::new();
            let mut at = 0;
            while at < wire.len() {
                let n = (1 + rand() % 2000) as usize;
                let end = (at + n).min(wire.len());
                chunks.push((at, end));
                at = end;
            }
            // A shuffle within windows of 8 chunks (the reordering a loss makes), and a few
            // chunks sent twice.
            for w in chunks.chunks_mut(8) {
                for i in (1..w.len()).rev() {
                    w.swap(i, (rand() % (i as u64 + 1)) as usize);
                }
            }
            let dups: Vec<_> = chunks.iter().step_by(13).copied().collect();
            chunks.extend(dups);
            let t0 = Instant::now();
            let mut r = Reassembly::default();
            for (i, (a, b)) in chunks.iter().enumerate() {
                r.insert(
                    *a as u64,
                    Bytes::copy_from_slice(&wire[*a..*b]),
                    t0 + MS * i as u32,
                )
                .unwrap();
            }
            let bodies: Vec<Vec<u8>> = drain(&mut r).iter().map(|f| f.packet.to_vec()).collect();
            assert_eq!(bodies, packets);
            assert_eq!(r.ahead_bytes(), 0);
        }
    }

    #[test]
    fn a_peer_far_beyond_flow_control_is_refused() {
        let mut r = Reassembly::default();
        let t = Instant::now();
        assert_eq!(
            r.insert(3 * MAX_AHEAD as u64, Bytes::from_static(b"x"), t),
            Err(TooFarAhead)
        );
        let mut r = Reassembly::default();
        let big = Bytes::from(vec![0u8; 1 << 20]);
        let mut res = Ok(());
        for i in 0..40u64 {
            res = res.and(r.insert(1 + i * (1 << 20), big.clone(), t));
        }
        assert_eq!(res, Err(TooFarAhead));
    }
}
