//! Datagram wire format (docs/PROTOCOL.md). A QUIC DATAGRAM payload is either a bare inner IP
//! packet, recognised by its version nibble (4 or 6), or a control message whose first byte is a
//! type below 0x10, which no IP packet can start with. Data therefore carries zero framing bytes.

use std::time::Duration;

use crate::path::delivery::Counts;
use crate::path::health::{PathState, PeerView};
use crate::path::reconfig::LinkKind;
use crate::role::Role;

pub const PROBE: u8 = 0x01;
pub const PROBE_REPLY: u8 = 0x02;
/// An inner packet protected by FEC: type, group (u16), index in the group (u8), the packet.
pub const FEC_DATA: u8 = 0x03;
/// A repair packet of an FEC group: type, group (u16), repair index (u8), the group's data
/// count k (u8) and repair count m (u8), then the Reed-Solomon shard (docs/PROTOCOL.md).
pub const FEC_REPAIR: u8 = 0x04;
/// A path-MTU probe (`pmtu.rs`): type, sequence number (u32), then padding to the size being
/// tested. Its reply has the same layout and the same length, so it tests the way back too.
pub const MTU_PROBE: u8 = 0x05;
pub const MTU_PROBE_REPLY: u8 = 0x06;
/// An inner packet of a per-packet bonded flow (`reseq.rs`): type, flow slot (u16), sequence
/// number in the slot (u32), the packet. Inside an FEC data packet or a reliable-mode stream
/// frame too: it is the bond's header, in front of the packet whatever carries it.
pub const BOND_DATA: u8 = 0x07;
pub const BOND_HEADER: usize = 7;
/// An inner packet of a traffic class other than the tunnel's first (`router::Lane`): type,
/// lane (u8, 1 to `MAX_LANES` - 1), then the packet as that lane's bond sent it (bare or
/// `BOND_DATA`). Inside an FEC data packet or a stream frame too, like the bond's header; the
/// first lane's packets carry no such header (a tunnel without classes never sends one).
pub const CLASSED: u8 = 0x08;
pub const CLASSED_HEADER: usize = 2;
/// The most lanes (traffic classes) a tunnel has.
pub const MAX_LANES: usize = 8;
pub const FEC_DATA_HEADER: usize = 4;
pub const FEC_REPAIR_HEADER: usize = 6;
/// Type and sequence number: a probe reply, or a probe without the sender's view.
pub const PROBE_LEN: usize = 5;
/// A probe reply with the answering side's counts for the path (`path/delivery.rs`): inner
/// packets it sent, then inner packets that arrived (u32 each, wrapping). Sent to a client
/// whose hello asked for them (`counts`).
pub const PROBE_REPLY_COUNTED_LEN: usize = PROBE_LEN + 8;
/// A probe with the prober's view: state (1), srtt, rttvar, min RTT (4 each, microseconds,
/// all ones = not measured), loss in 1/1000 (2), the interval to the next probe in ms (2), the
/// path's role (1, `Role::to_wire`), its link (1, `LinkKind::to_wire`). A longer probe (a
/// later build's, with fields appended) is read as far as these go.
pub const PROBE_VIEW_LEN: usize = PROBE_LEN + 19;
/// The same without the link, without the role, and without the interval too (earlier
/// builds' probes; still accepted).
const PROBE_VIEW_LEN_V2: usize = PROBE_LEN + 18;
const PROBE_VIEW_LEN_V1: usize = PROBE_LEN + 17;
const PROBE_VIEW_LEN_V0: usize = PROBE_LEN + 15;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Datagram<'a> {
    Packet(&'a [u8]),
    Probe {
        seq: u32,
        view: Option<PeerView>,
    },
    /// A reply to our probe `seq`, with the peer's counts when it sends them.
    ProbeReply {
        seq: u32,
        counts: Option<Counts>,
    },
    FecData {
        group: u16,
        index: u8,
        packet: &'a [u8],
    },
    FecRepair(Repair<'a>),
    /// A path-MTU probe of `len` bytes (all of it, padding included).
    MtuProbe {
        seq: u32,
        len: usize,
    },
    MtuProbeReply(u32),
    /// An inner packet with its flow slot and sequence number (`BOND_DATA`).
    Bonded {
        slot: u16,
        seq: u32,
        packet: &'a [u8],
    },
    /// An inner packet of lane `lane` (`CLASSED`): `inner` decodes as `Packet` or `Bonded`.
    Classed {
        lane: u8,
        inner: &'a [u8],
    },
}

/// A repair packet of an FEC group (`FEC_REPAIR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repair<'a> {
    pub group: u16,
    /// Which of the group's `m` repairs this is.
    pub index: u8,
    /// The group's data and repair counts.
    pub k: u8,
    pub m: u8,
    pub shard: &'a [u8],
}

/// Classify a received datagram. `None` for anything malformed (counted by the caller).
pub fn decode(buf: &[u8]) -> Option<Datagram<'_>> {
    let first = *buf.first()?;
    match first >> 4 {
        4 | 6 => return Some(Datagram::Packet(buf)),
        0 => {}
        _ => return None,
    }
    match first {
        FEC_DATA => return decode_fec_data(buf),
        FEC_REPAIR => return decode_fec_repair(buf),
        BOND_DATA => return decode_bonded(buf),
        CLASSED => return decode_classed(buf),
        _ => {}
    }
    if buf.len() < PROBE_LEN {
        return None;
    }
    let seq = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    match first {
        MTU_PROBE => {
            return Some(Datagram::MtuProbe {
                seq,
                len: buf.len(),
            })
        }
        MTU_PROBE_REPLY => return Some(Datagram::MtuProbeReply(seq)),
        _ => {}
    }
    match (first, buf.len()) {
        (PROBE, PROBE_LEN) => Some(Datagram::Probe { seq, view: None }),
        (PROBE, PROBE_VIEW_LEN_V2 | PROBE_VIEW_LEN_V1 | PROBE_VIEW_LEN_V0) => {
            Some(Datagram::Probe {
                seq,
                view: Some(decode_view(&buf[PROBE_LEN..])?),
            })
        }
        (PROBE, n) if n >= PROBE_VIEW_LEN => Some(Datagram::Probe {
            seq,
            view: Some(decode_view(&buf[PROBE_LEN..])?),
        }),
        (PROBE_REPLY, PROBE_LEN) => Some(Datagram::ProbeReply { seq, counts: None }),
        (PROBE_REPLY, PROBE_REPLY_COUNTED_LEN) => Some(Datagram::ProbeReply {
            seq,
            counts: Some(Counts {
                sent: u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]),
                arrived: u32::from_be_bytes([buf[9], buf[10], buf[11], buf[12]]),
            }),
        }),
        _ => None,
    }
}

fn decode_fec_data(buf: &[u8]) -> Option<Datagram<'_>> {
    let packet = buf.get(FEC_DATA_HEADER..).filter(|p| !p.is_empty())?;
    let index = buf[3];
    if usize::from(index) >= crate::fec::MAX_DATA {
        return None;
    }
    Some(Datagram::FecData {
        group: u16::from_be_bytes([buf[1], buf[2]]),
        index,
        packet,
    })
}

fn decode_fec_repair(buf: &[u8]) -> Option<Datagram<'_>> {
    // A shard holds at least a packet's 2-byte length.
    let shard = buf.get(FEC_REPAIR_HEADER..).filter(|s| s.len() > 2)?;
    let (index, k, m) = (buf[3], buf[4], buf[5]);
    let valid = k >= 1
        && m >= 1
        && index < m
        && usize::from(k) <= crate::fec::MAX_DATA
        && usize::from(m) <= crate::fec::MAX_REPAIR;
    valid.then_some(Datagram::FecRepair(Repair {
        group: u16::from_be_bytes([buf[1], buf[2]]),
        index,
        k,
        m,
        shard,
    }))
}

fn decode_bonded(buf: &[u8]) -> Option<Datagram<'_>> {
    let packet = buf.get(BOND_HEADER..).filter(|p| !p.is_empty())?;
    Some(Datagram::Bonded {
        slot: u16::from_be_bytes([buf[1], buf[2]]),
        seq: u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]),
        packet,
    })
}

fn decode_classed(buf: &[u8]) -> Option<Datagram<'_>> {
    let lane = *buf.get(1)?;
    if lane == 0 || usize::from(lane) >= MAX_LANES {
        return None;
    }
    let inner = &buf[CLASSED_HEADER..];
    // One lane header at most (decoding a chain of them would recurse once per header).
    if inner.first() == Some(&CLASSED) {
        return None;
    }
    match decode(inner)? {
        Datagram::Packet(_) | Datagram::Bonded { .. } => Some(Datagram::Classed { lane, inner }),
        _ => None,
    }
}

/// The inner IP packet a stream frame or data datagram carries, past its lane and bond headers
/// (`None`: not an inner packet).
pub fn inner_packet(buf: &[u8]) -> Option<&[u8]> {
    match decode(buf)? {
        Datagram::Packet(p) | Datagram::Bonded { packet: p, .. } => Some(p),
        // `decode_classed` allows one lane header only, so this recurses once at most.
        Datagram::Classed { inner, .. } => inner_packet(inner),
        _ => None,
    }
}

/// Where `inner_packet` begins in `buf`, to rewrite it in place (an ECN mark): it is always
/// the rest of `buf`.
pub fn inner_packet_at(buf: &[u8]) -> Option<usize> {
    inner_packet(buf).map(|p| buf.len() - p.len())
}

/// The header in front of an inner packet of `lane` (`CLASSED`); the first lane (0) has none.
pub fn encode_classed(lane: u8) -> Option<[u8; CLASSED_HEADER]> {
    (lane > 0 && usize::from(lane) < MAX_LANES).then_some([CLASSED, lane])
}

/// The bond's header in front of an inner packet (`BOND_DATA`).
pub fn encode_bonded(slot: u16, seq: u32) -> [u8; BOND_HEADER] {
    let (a, b) = (slot.to_be_bytes(), seq.to_be_bytes());
    [BOND_DATA, a[0], a[1], b[0], b[1], b[2], b[3]]
}

/// The header in front of an FEC-protected inner packet.
pub fn encode_fec_data(group: u16, index: u8) -> [u8; FEC_DATA_HEADER] {
    let g = group.to_be_bytes();
    [FEC_DATA, g[0], g[1], index]
}

/// The header in front of a repair shard.
pub fn encode_fec_repair(group: u16, index: u8, k: u8, m: u8) -> [u8; FEC_REPAIR_HEADER] {
    let g = group.to_be_bytes();
    [FEC_REPAIR, g[0], g[1], index, k, m]
}

const NOT_MEASURED: u32 = u32::MAX;

fn micros(d: Option<Duration>) -> [u8; 4] {
    let v = d.map_or(NOT_MEASURED, |d| {
        u32::try_from(d.as_micros()).unwrap_or(NOT_MEASURED - 1)
    });
    v.to_be_bytes()
}

fn decode_view(b: &[u8]) -> Option<PeerView> {
    let state = match b[0] {
        0 => PathState::Probing,
        1 => PathState::Up,
        2 => PathState::Down,
        _ => return None,
    };
    let dur = |i: usize| {
        let v = u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        (v != NOT_MEASURED).then(|| Duration::from_micros(u64::from(v)))
    };
    let loss_permille = u16::from_be_bytes([b[13], b[14]]);
    if loss_permille > 1000 {
        return None;
    }
    let probe_interval = b
        .get(15..17)
        .map(|i| Duration::from_millis(u64::from(u16::from_be_bytes([i[0], i[1]]))));
    let role = match b.get(17) {
        Some(&r) => Some(Role::from_wire(r)?),
        None => None,
    };
    let link = b.get(18).map(|&l| LinkKind::from_wire(l));
    Some(PeerView {
        state,
        srtt: dur(1),
        rttvar: dur(5).unwrap_or_default(),
        min_rtt: dur(9),
        loss_permille,
        probe_interval,
        role,
        link,
    })
}

/// A probe reply, or a probe without a view.
pub fn encode_probe(kind: u8, seq: u32) -> [u8; PROBE_LEN] {
    let s = seq.to_be_bytes();
    [kind, s[0], s[1], s[2], s[3]]
}

/// A probe reply; with `counts`, the counted form (`PROBE_REPLY_COUNTED_LEN`).
pub fn encode_probe_reply(seq: u32, counts: Option<Counts>) -> Vec<u8> {
    let mut out = encode_probe(PROBE_REPLY, seq).to_vec();
    if let Some(c) = counts {
        out.extend_from_slice(&c.sent.to_be_bytes());
        out.extend_from_slice(&c.arrived.to_be_bytes());
    }
    out
}

/// A path-MTU probe (`MTU_PROBE`) or its reply (`MTU_PROBE_REPLY`), `len` bytes long (at least
/// `PROBE_LEN`): the header, then zeros.
pub fn encode_mtu_probe(kind: u8, seq: u32, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len.max(PROBE_LEN)];
    out[..PROBE_LEN].copy_from_slice(&encode_probe(kind, seq));
    out
}

/// A probe carrying the prober's view of the path.
pub fn encode_probe_view(seq: u32, v: &PeerView) -> [u8; PROBE_VIEW_LEN] {
    let mut out = [0u8; PROBE_VIEW_LEN];
    out[..PROBE_LEN].copy_from_slice(&encode_probe(PROBE, seq));
    out[5] = match v.state {
        PathState::Probing => 0,
        PathState::Up => 1,
        PathState::Down => 2,
    };
    out[6..10].copy_from_slice(&micros(v.srtt));
    out[10..14].copy_from_slice(&micros(Some(v.rttvar)));
    out[14..18].copy_from_slice(&micros(v.min_rtt));
    out[18..20].copy_from_slice(&v.loss_permille.min(1000).to_be_bytes());
    let interval_ms = v
        .probe_interval
        .map_or(0, |i| i.as_millis().min(0xffff) as u16);
    out[20..22].copy_from_slice(&interval_ms.to_be_bytes());
    out[22] = v.role.unwrap_or_default().to_wire();
    out[23] = v.link.unwrap_or_default().to_wire();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::path::health::{PathState, PeerView};
    use std::time::Duration;

    #[test]
    fn inner_packet_is_found_past_lane_and_bond_headers() {
        let ip = [0x45u8, 0, 0, 20];
        assert_eq!(inner_packet(&ip), Some(&ip[..]));
        let bonded = [&encode_bonded(3, 7)[..], &ip].concat();
        assert_eq!(inner_packet(&bonded), Some(&ip[..]));
        let classed = [&encode_classed(2).unwrap()[..], &bonded].concat();
        assert_eq!(inner_packet(&classed), Some(&ip[..]));
        assert_eq!(
            inner_packet_at(&classed),
            Some(CLASSED_HEADER + BOND_HEADER)
        );
        assert_eq!(inner_packet_at(&ip), Some(0));
        assert_eq!(inner_packet(&encode_probe(PROBE, 1)), None);
        assert_eq!(inner_packet_at(&encode_probe(PROBE, 1)), None);
        assert_eq!(inner_packet(&[]), None);
    }

    #[test]
    fn vectors() {
        assert_eq!(encode_probe(PROBE, 0x01020304), [0x01, 1, 2, 3, 4]);
        assert_eq!(
            decode(&[0x01, 0, 0, 0, 9]),
            Some(Datagram::Probe { seq: 9, view: None })
        );
        let view = PeerView {
            state: PathState::Down,
            srtt: Some(Duration::from_micros(20_500)),
            rttvar: Duration::from_micros(1_000),
            min_rtt: None,
            loss_permille: 125,
            probe_interval: Some(Duration::from_millis(500)),
            role: Some(Role::Backup),
            link: Some(LinkKind::Starlink),
        };
        let p = encode_probe_view(7, &view);
        assert_eq!(
            p,
            [
                1, 0, 0, 0, 7, 2, 0, 0, 0x50, 0x14, 0, 0, 0x03, 0xe8, 0xff, 0xff, 0xff, 0xff, 0,
                125, 0x01, 0xf4, 1, 1
            ]
        );
        // Earlier builds' probes (no link; no role; no interval either) are still understood,
        // and a later build's, longer, as far as this one reads.
        assert_eq!(
            decode(&p[..23]),
            Some(Datagram::Probe {
                seq: 7,
                view: Some(PeerView { link: None, ..view })
            })
        );
        assert_eq!(
            decode(&[&p[..], &[9, 9]].concat()),
            Some(Datagram::Probe {
                seq: 7,
                view: Some(view)
            })
        );
        assert_eq!(
            decode(&p[..22]),
            Some(Datagram::Probe {
                seq: 7,
                view: Some(PeerView {
                    role: None,
                    link: None,
                    ..view
                })
            })
        );
        assert_eq!(
            decode(&p[..20]),
            Some(Datagram::Probe {
                seq: 7,
                view: Some(PeerView {
                    probe_interval: None,
                    role: None,
                    link: None,
                    ..view
                })
            })
        );
        assert_eq!(
            decode(&p),
            Some(Datagram::Probe {
                seq: 7,
                view: Some(view)
            })
        );
        let mut bad = p;
        bad[5] = 3;
        assert_eq!(decode(&bad), None, "unknown state");
        let mut bad = p;
        bad[18..20].copy_from_slice(&1001u16.to_be_bytes());
        assert_eq!(decode(&bad), None, "loss above 100%");
        let mut bad = p;
        bad[22] = 9;
        assert_eq!(decode(&bad), None, "unknown role");
        assert_eq!(decode(&p[..19]), None);
        assert_eq!(decode(&p[..21]), None);
        assert_eq!(
            decode(&[0x02, 0, 0, 1, 0]),
            Some(Datagram::ProbeReply {
                seq: 256,
                counts: None
            })
        );
        let counted = encode_probe_reply(
            7,
            Some(Counts {
                sent: 0x01020304,
                arrived: 0xfffffffe,
            }),
        );
        assert_eq!(
            counted,
            [0x02, 0, 0, 0, 7, 1, 2, 3, 4, 0xff, 0xff, 0xff, 0xfe]
        );
        assert_eq!(
            decode(&counted),
            Some(Datagram::ProbeReply {
                seq: 7,
                counts: Some(Counts {
                    sent: 0x01020304,
                    arrived: 0xfffffffe
                })
            })
        );
        assert_eq!(encode_probe_reply(7, None), encode_probe(PROBE_REPLY, 7));
        assert_eq!(decode(&[0x45, 0]), Some(Datagram::Packet(&[0x45, 0])));
        assert_eq!(decode(&[0x60]), Some(Datagram::Packet(&[0x60])));
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[0x01, 0, 0]), None);
        assert_eq!(decode(&[0x07, 0, 0, 0, 0]), None);
        assert_eq!(decode(&[0x20, 0, 0, 0, 0]), None);
    }

    #[test]
    fn mtu_probe_vectors() {
        let p = encode_mtu_probe(MTU_PROBE, 0x0a0b0c0d, 8);
        assert_eq!(p, [0x05, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0, 0]);
        assert_eq!(
            decode(&p),
            Some(Datagram::MtuProbe {
                seq: 0x0a0b0c0d,
                len: 8
            })
        );
        let r = encode_mtu_probe(MTU_PROBE_REPLY, 2, 1300);
        assert_eq!(r.len(), 1300);
        assert_eq!(decode(&r), Some(Datagram::MtuProbeReply(2)));
        // Never shorter than its header; a truncated one is malformed.
        assert_eq!(encode_mtu_probe(MTU_PROBE, 1, 0).len(), PROBE_LEN);
        assert_eq!(decode(&[0x05, 0, 0, 1]), None);
    }
}

#[cfg(test)]
mod fec_tests {
    use super::*;

    #[test]
    fn fec_vectors() {
        assert_eq!(encode_fec_data(0x0102, 3), [0x03, 0x01, 0x02, 0x03]);
        assert_eq!(
            decode(&[0x03, 0x01, 0x02, 0x03, 0x45, 0x00]),
            Some(Datagram::FecData {
                group: 0x0102,
                index: 3,
                packet: &[0x45, 0x00]
            })
        );
        assert_eq!(
            encode_fec_repair(0xfffe, 1, 10, 2),
            [0x04, 0xff, 0xfe, 1, 10, 2]
        );
        assert_eq!(
            decode(&[0x04, 0xff, 0xfe, 1, 10, 2, 0, 1, 0xaa]),
            Some(Datagram::FecRepair(Repair {
                group: 0xfffe,
                index: 1,
                k: 10,
                m: 2,
                shard: &[0, 1, 0xaa]
            }))
        );
        // No packet, no shard, a repair index beyond m, k or m zero or above the bounds.
        assert_eq!(decode(&[0x03, 0, 0, 0]), None);
        assert_eq!(decode(&[0x03, 0, 0, 200, 0x45]), None);
        assert_eq!(decode(&[0x04, 0, 0, 2, 10, 2, 0, 1, 0]), None);
        assert_eq!(decode(&[0x04, 0, 0, 0, 0, 2, 0, 1, 0]), None);
        assert_eq!(decode(&[0x04, 0, 0, 0, 10, 0, 0, 1, 0]), None);
        assert_eq!(decode(&[0x04, 0, 0, 0, 200, 2, 0, 1, 0]), None);
        assert_eq!(decode(&[0x04, 0, 0, 0, 10, 2, 0, 1]), None);
    }
}

#[cfg(test)]
mod bond_tests {
    use super::*;

    #[test]
    fn bond_vectors() {
        assert_eq!(
            encode_bonded(0x0102, 0x0a0b0c0d),
            [0x07, 0x01, 0x02, 0x0a, 0x0b, 0x0c, 0x0d]
        );
        assert_eq!(
            decode(&[0x07, 0x01, 0x02, 0x0a, 0x0b, 0x0c, 0x0d, 0x45, 0x00]),
            Some(Datagram::Bonded {
                slot: 0x0102,
                seq: 0x0a0b0c0d,
                packet: &[0x45, 0x00]
            })
        );
        // No packet behind the header.
        assert_eq!(decode(&[0x07, 0, 1, 0, 0, 0, 1]), None);
    }

    #[test]
    fn classed_vectors() {
        assert_eq!(encode_classed(0), None);
        assert_eq!(encode_classed(2), Some([0x08, 0x02]));
        assert_eq!(encode_classed(8), None);
        let bare = [0x08, 0x02, 0x45, 0x00];
        assert_eq!(
            decode(&bare),
            Some(Datagram::Classed {
                lane: 2,
                inner: &[0x45, 0x00]
            })
        );
        let bonded = [0x08, 0x07, 0x07, 0, 1, 0, 0, 0, 9, 0x60];
        assert_eq!(
            decode(&bonded),
            Some(Datagram::Classed {
                lane: 7,
                inner: &bonded[2..]
            })
        );
        // Lane 0 has no header; lanes from MAX_LANES on do not exist; only inner packets
        // (bare or numbered) may be in a lane, never a probe, FEC or another lane's header.
        assert_eq!(decode(&[0x08, 0x00, 0x45]), None);
        assert_eq!(decode(&[0x08, 0x08, 0x45]), None);
        assert_eq!(decode(&[0x08, 0x01]), None);
        assert_eq!(decode(&[0x08, 0x01, 0x01, 0, 0, 0, 1]), None);
        assert_eq!(decode(&[0x08, 0x01, 0x08, 0x02, 0x45]), None);
        assert_eq!(decode(&[0x08, 0x01, 0x03, 0, 0, 0, 0x45]), None);
    }
}

#[cfg(test)]
mod props {
    use proptest::prelude::*;

    proptest! {
        /// Anything from the network: decoding never panics, and a PROBE round-trips.
        #[test]
        fn decode_total(bytes in proptest::collection::vec(any::<u8>(), 0..64), seq in any::<u32>()) {
            let _ = super::decode(&bytes);
            let p = super::encode_probe(super::PROBE, seq);
            prop_assert_eq!(super::decode(&p), Some(super::Datagram::Probe { seq, view: None }));
        }
    }
}
