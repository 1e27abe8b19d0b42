//! Inner packets in batches: what one wake-up of a TUN reader takes in, routed under one lock and
//! handed to each path's transport together. The packets sit in one buffer that is reused from
//! batch to batch, each with `HEADROOM` free bytes before it, so a transport can put its own
//! header in front of a packet where it lies instead of copying it. A transport that needs an
//! owned, reference-counted view (QUIC's datagram and stream queues take `Bytes`) gets a slice of
//! the frozen buffer: no copy and no allocation per packet; the buffer's memory is reused once
//! the transport has let go of the last packet of a batch.

use std::ops::Range;

use bytes::{Bytes, BytesMut};

/// Free bytes before every packet, for the headers stacked in front of it (the bond's 7-byte
/// numbering, FEC's 4, reliable mode's 6-byte frame header; later a stripe header, a nonce).
pub const HEADROOM: usize = 32;
/// Packets one batch holds: one TUN wake-up reads at most this many before they are sent (the
/// first waits for the last, so a batch is kept short).
pub const BATCH_PACKETS: usize = 16;
/// Below this many packets, `bytes` copies rather than shares: a shared view keeps the whole
/// buffer alive while the transport queues it, so a batch of one or two packets would pin tens
/// of KiB per queued packet (QUIC's datagram queue holds hundreds). From this size on, the
/// buffer held per queued packet stays below 1/SHARE_MIN of a full batch, and the copy it saves
/// is what costs at high rates (where batches are large).
const SHARE_MIN: usize = 8;

pub struct PacketBatch {
    buf: BytesMut,
    /// Where each packet lies in `buf` (after its headroom), and how many bytes of its
    /// headroom a transport has written its header into (`with_header_mut`).
    packets: Vec<(Range<usize>, usize)>,
    /// Set once a transport took `Bytes` views: the same memory as `buf` had, now shared.
    frozen: Option<Bytes>,
    /// Start of the slot handed out by `slot` and not yet committed.
    pending: Option<usize>,
    /// What the tunnel learnt of each packet's inner header when it routed it (`set_facts`),
    /// indexed like `packets`: the transports queue and carry by it without parsing again.
    facts: Vec<Facts>,
}

/// What a transport needs to know of an inner packet, from its header as parsed once
/// (`PacketInfo`): its flow (sparse flows go first, a flow's packets stay in order) and whether
/// it is a pure TCP ACK (reliable mode sends those as datagrams). Unparsed: no flow, not an ACK.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    pub flow: Option<u64>,
    pub pure_ack: bool,
    /// A TCP segment: its flow needs every packet, in order (the stream's recovery serves it).
    pub tcp: bool,
}

impl Facts {
    /// The facts of `pkt`, whose parsed header is `info`.
    pub fn of(pkt: &[u8], info: Option<&mpquic_core::PacketInfo>) -> Facts {
        match info {
            Some(i) => Facts {
                flow: Some(i.flow_hash()),
                pure_ack: i.is_pure_tcp_ack(pkt),
                tcp: i.proto == mpquic_core::packet::PROTO_TCP,
            },
            None => Facts::default(),
        }
    }
}

impl Default for PacketBatch {
    fn default() -> Self {
        PacketBatch::new()
    }
}

impl PacketBatch {
    pub fn new() -> PacketBatch {
        PacketBatch {
            buf: BytesMut::new(),
            packets: Vec::with_capacity(BATCH_PACKETS),
            frozen: None,
            pending: None,
            facts: Vec::with_capacity(BATCH_PACKETS),
        }
    }

    pub fn len(&self) -> usize {
        self.packets.len()
    }
    pub fn is_empty(&self) -> bool {
        self.packets.is_empty()
    }
    pub fn is_full(&self) -> bool {
        self.packets.len() >= BATCH_PACKETS
    }

    /// Empty the batch for reuse. Memory still referenced by a transport stays with it; the rest
    /// (and all of it, once the transport is done) is reused.
    pub fn clear(&mut self) {
        self.packets.clear();
        self.facts.clear();
        self.frozen = None;
        self.pending = None;
        self.buf.clear();
    }

    /// Room for one more packet of at most `cap` bytes, after its headroom: fill it (a TUN read)
    /// and `commit` the length, or leave it (the next `slot` or `clear` takes it back).
    pub fn slot(&mut self, cap: usize) -> &mut [u8] {
        debug_assert!(
            self.frozen.is_none(),
            "slot() after a transport took packets"
        );
        let start = self.pending.unwrap_or(self.buf.len());
        self.buf.truncate(start);
        self.buf.resize(start + HEADROOM + cap, 0);
        self.pending = Some(start);
        &mut self.buf[start + HEADROOM..]
    }

    /// A copy of `pkt` as the next packet (a TUN read that went through a scratch buffer).
    pub fn push(&mut self, pkt: &[u8]) {
        debug_assert!(
            self.frozen.is_none(),
            "push() after a transport took packets"
        );
        let start = self.pending.take().unwrap_or(self.buf.len());
        self.buf.truncate(start);
        self.buf.extend_from_slice(&[0; HEADROOM]);
        let at = self.buf.len();
        self.buf.extend_from_slice(pkt);
        self.packets.push((at..at + pkt.len(), 0));
        self.facts.push(Facts::default());
    }

    /// The slot from `slot` holds a packet of `len` bytes.
    pub fn commit(&mut self, len: usize) {
        let Some(start) = self.pending.take() else {
            return;
        };
        let at = start + HEADROOM;
        let len = len.min(self.buf.len() - at);
        self.buf.truncate(at + len);
        self.packets.push((at..at + len, 0));
        self.facts.push(Facts::default());
    }

    /// What is known of packet `i`'s inner header (`Facts::of`), set once it is parsed.
    pub fn set_facts(&mut self, i: usize, facts: Facts) {
        self.facts[i] = facts;
    }

    pub fn facts(&self, i: usize) -> Facts {
        self.facts[i]
    }

    /// Packet `i` (without any header).
    pub fn packet(&self, i: usize) -> &[u8] {
        let r = self.packets[i].0.clone();
        match &self.frozen {
            Some(b) => &b[r],
            None => &self.buf[r],
        }
    }

    /// Packet `i`, writable (MSS clamping), while no transport has taken packets yet.
    pub fn packet_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        if self.frozen.is_some() {
            return None;
        }
        let r = self.packets[i].0.clone();
        Some(&mut self.buf[r])
    }

    /// Packet `i` with `header` bytes of its headroom in front, writable: the transport writes
    /// its header into the first `header` bytes, and from then on `framed` includes them.
    /// `None` when `header` exceeds `HEADROOM` or a transport has already taken packets of
    /// this batch (they are shared, so immutable): transports write headers first
    /// (`PathTransport::prepare`), then take packets.
    pub fn with_header_mut(&mut self, i: usize, header: usize) -> Option<&mut [u8]> {
        if header > HEADROOM || self.frozen.is_some() {
            return None;
        }
        let (r, h) = &mut self.packets[i];
        *h = header;
        Some(&mut self.buf[r.start - header..r.end])
    }

    /// Put `header` in front of whatever header packet `i` has already (the bond's numbering
    /// first, then FEC's, then the transport's framing): false when the headroom is used up or
    /// the batch is shared already.
    pub fn push_header(&mut self, i: usize, header: &[u8]) -> bool {
        let total = self.packets[i].1 + header.len();
        match self.with_header_mut(i, total) {
            Some(w) => {
                w[..header.len()].copy_from_slice(header);
                true
            }
            None => false,
        }
    }

    /// Packet `i` with its headers, without the first `skip` bytes of them (a transport's
    /// own framing that a packet leaving another way does not carry).
    pub fn headed(&self, i: usize, skip: usize) -> &[u8] {
        let (r, h) = self.packets[i].clone();
        let r = r.start - h + skip.min(h)..r.end;
        match &self.frozen {
            Some(b) => &b[r],
            None => &self.buf[r],
        }
    }

    /// Whether headers can still be written (`with_header_mut`): no transport has taken packets
    /// of this batch yet.
    pub fn headers_writable(&self) -> bool {
        self.frozen.is_none()
    }

    /// The header length written in front of packet `i` (0: none).
    pub fn header_len(&self, i: usize) -> usize {
        self.packets[i].1
    }

    /// Packet `i` with the header written in front of it, as an owned, reference-counted view
    /// of the batch's memory (no copy), or a copy for a small batch (`SHARE_MIN`).
    pub fn framed(&mut self, i: usize) -> Bytes {
        self.framed_from(i, 0)
    }

    /// `framed`, without the first `skip` bytes of the headers (as `headed`).
    pub fn framed_from(&mut self, i: usize, skip: usize) -> Bytes {
        let (r, h) = self.packets[i].clone();
        let r = r.start - h + skip.min(h)..r.end;
        if self.packets.len() < SHARE_MIN && self.frozen.is_none() {
            return Bytes::copy_from_slice(&self.buf[r]);
        }
        let buf = &mut self.buf;
        self.frozen
            .get_or_insert_with(|| buf.split().freeze())
            .slice(r)
    }
}

/// The core writes the bond's and FEC's headers into the batch's headroom.
impl mpquic_core::tunnel::Outgoing for PacketBatch {
    fn packet(&self, i: usize) -> &[u8] {
        PacketBatch::packet(self, i)
    }
    fn headed(&self, i: usize) -> &[u8] {
        PacketBatch::headed(self, i, 0)
    }
    fn push_header(&mut self, i: usize, header: &[u8]) -> bool {
        PacketBatch::push_header(self, i, header)
    }
    fn headers_writable(&self) -> bool {
        PacketBatch::headers_writable(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(b: &mut PacketBatch, data: &[u8]) {
        let s = b.slot(1500);
        s[..data.len()].copy_from_slice(data);
        b.commit(data.len());
    }

    /// An IPv4 TCP segment from 10.0.0.1:1000 to 10.0.0.2:80 with `flags` and `data` bytes.
    fn tcp(flags: u8, data: usize) -> Vec<u8> {
        let total = (40 + data) as u16;
        let mut p = vec![
            0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        p[2..4].copy_from_slice(&total.to_be_bytes());
        let mut t = vec![0u8; 20];
        t[0..2].copy_from_slice(&1000u16.to_be_bytes());
        t[2..4].copy_from_slice(&80u16.to_be_bytes());
        t[12] = 5 << 4;
        t[13] = flags;
        p.extend_from_slice(&t);
        p.extend(std::iter::repeat_n(7, data));
        p
    }

    /// The facts a transport reads are those of the parsed header: a pure ACK and a data
    /// segment of one flow share its flow key, only the ACK is one; unparsed bytes have none.
    #[test]
    fn facts_come_from_the_parsed_header() {
        let mut b = PacketBatch::new();
        let (ack, data) = (tcp(0x10, 0), tcp(0x18, 100));
        for p in [&ack, &data, &vec![0xff; 30]] {
            fill(&mut b, p);
        }
        assert_eq!(
            b.facts(0),
            Facts::default(),
            "nothing known before it is set"
        );
        for i in 0..b.len() {
            let info = mpquic_core::PacketInfo::parse(b.packet(i));
            let facts = Facts::of(b.packet(i), info.as_ref());
            b.set_facts(i, facts);
        }
        let flow = mpquic_core::PacketInfo::parse(&ack).map(|i| i.flow_hash());
        assert!(flow.is_some());
        assert_eq!(
            b.facts(0),
            Facts {
                flow,
                pure_ack: true,
                tcp: true
            }
        );
        assert_eq!(
            b.facts(1),
            Facts {
                flow,
                pure_ack: false,
                tcp: true
            }
        );
        assert_eq!(b.facts(2), Facts::default());
        b.clear();
        fill(&mut b, &ack);
        assert_eq!(b.facts(0), Facts::default(), "a reused batch forgets");
    }

    #[test]
    fn packets_keep_their_headroom_and_bytes_share_the_buffer() {
        let mut b = PacketBatch::new();
        fill(&mut b, b"first");
        fill(&mut b, b"second packet");
        let _abandoned = b.slot(1500); // a read that failed: not a packet
        fill(&mut b, b"third");
        for _ in 3..SHARE_MIN {
            fill(&mut b, b"more");
        }
        assert_eq!(b.len(), SHARE_MIN);
        assert_eq!(b.packet(1), b"second packet");
        // A header goes in front of the packet where it lies.
        let w = b.with_header_mut(0, 4).unwrap();
        w[..4].copy_from_slice(b"HDR:");
        assert_eq!(&w[..], b"HDR:first");
        assert_eq!(b.header_len(0), 4);
        assert_eq!(b.packet(0), b"first");
        assert!(b.with_header_mut(0, HEADROOM + 1).is_none());
        b.packet_mut(2).unwrap()[0] = b'T';
        // Owned views: the same memory, no copy.
        let one = b.framed(1);
        let two = b.framed(2);
        assert_eq!(&one[..], b"second packet");
        assert_eq!(&two[..], b"Third");
        assert_eq!(
            one.as_ptr() as usize + one.len() + HEADROOM,
            two.as_ptr() as usize
        );
        assert!(b.packet_mut(0).is_none(), "shared now");
        assert!(
            b.with_header_mut(1, 2).is_none(),
            "headers first, then sharing"
        );
        assert_eq!(&b.framed(0)[..], b"HDR:first");
        assert_eq!(b.packet(0), b"first");
        b.clear();
        assert!(b.is_empty());
        fill(&mut b, b"next batch");
        assert_eq!(b.packet(0), b"next batch");
        assert_eq!(
            &one[..],
            b"second packet",
            "a transport's view outlives the batch"
        );
    }

    #[test]
    fn pushed_packets_get_headroom_like_read_ones() {
        let mut b = PacketBatch::new();
        fill(&mut b, b"read");
        let _abandoned = b.slot(1500);
        b.push(b"pushed");
        fill(&mut b, b"read again");
        assert_eq!(b.len(), 3);
        assert_eq!(b.packet(1), b"pushed");
        assert!(b.push_header(1, b"H"));
        assert_eq!(b.headed(1, 0), b"Hpushed");
        assert_eq!(b.packet(2), b"read again");
    }

    #[test]
    fn a_small_batch_is_copied_not_pinned() {
        let mut b = PacketBatch::new();
        fill(&mut b, b"lonely");
        let one = b.framed(0);
        assert_eq!(&one[..], b"lonely");
        assert!(
            b.packet_mut(0).is_some(),
            "not frozen: nothing shares the buffer"
        );
        assert_ne!(one.as_ptr(), b.packet(0).as_ptr());
    }

    #[test]
    fn a_batch_never_overwrites_what_a_transport_holds_and_reuses_what_it_let_go() {
        let mut b = PacketBatch::new();
        let full = |b: &mut PacketBatch, x: u8| {
            b.clear();
            for _ in 0..BATCH_PACKETS {
                fill(b, &[x; 1400]);
            }
        };
        full(&mut b, 7);
        assert!(b.is_full());
        let held = b.framed(0);
        full(&mut b, 8);
        assert!(
            held.iter().all(|&x| x == 7),
            "still queued in a transport: intact"
        );
        let second = b.framed(0).as_ptr();
        assert_ne!(second, held.as_ptr());
        // Nothing holds the second batch's packets: its memory is used again, not reallocated.
        full(&mut b, 9);
        assert_eq!(b.framed(0).as_ptr(), second);
        assert!(held.iter().all(|&x| x == 7));
    }
}
