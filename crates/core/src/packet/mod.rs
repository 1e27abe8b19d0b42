//! Read-only views of inner IP packets and the in-place rewrites the data path does (TCP MSS
//! clamping here, ECN marks in `ecn`). Everything here takes untrusted bytes: every accessor is
//! bounds-checked and returns `None` instead of panicking.
//!
//! Beside the parser: `coalesce` (GRO for the TUN writes), `ecn` (congestion marks for the
//! sender's queue), `icmp` ("packet too big" for inner senders), `mtu` (the tunnel's size
//! arithmetic).

pub mod coalesce;
pub mod ecn;
pub mod icmp;
pub mod mtu;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// What the data path needs to know about an inner packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketInfo {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// IP protocol number (after IPv6 extension headers we understand).
    pub proto: u8,
    /// Source and destination port for TCP/UDP/SCTP when the packet carries them
    /// (not for non-first IPv4 fragments).
    pub ports: Option<(u16, u16)>,
    /// Differentiated services code point (IPv4 TOS / IPv6 traffic class, upper 6 bits).
    pub dscp: u8,
    /// Offset of the transport header, when known.
    transport_offset: Option<usize>,
}

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
const PROTO_SCTP: u8 = 132;

impl PacketInfo {
    /// Parse the IP header of `pkt`. `None` if the bytes are not a well-formed IPv4/IPv6 header.
    pub fn parse(pkt: &[u8]) -> Option<PacketInfo> {
        match pkt.first()? >> 4 {
            4 => parse_v4(pkt),
            6 => parse_v6(pkt),
            _ => None,
        }
    }

    /// A 64-bit flow key: identical for all packets of one 5-tuple flow and direction.
    pub fn flow_hash(&self) -> u64 {
        tuple_hash(self.src, self.dst, self.proto, self.ports)
    }

    /// The `flow_hash` of this flow's other direction (the answers to this packet), so a
    /// return packet finds what was learned from the flow's first direction.
    pub fn reply_hash(&self) -> u64 {
        tuple_hash(
            self.dst,
            self.src,
            self.proto,
            self.ports.map(|(s, d)| (d, s)),
        )
    }

    /// Whether `pkt` (the packet this was parsed from) is a TCP segment that only acknowledges:
    /// ACK set, no SYN, FIN or RST, no payload. Reliable mode sends these as datagrams rather than
    /// on the path's stream: ACKs are cumulative, so a lost one costs nothing and one arriving
    /// before an earlier segment is harmless, whereas on the stream one retransmission holds
    /// every later ACK back and stalls the peer's sender (10% loss both ways, inner BBR
    /// 26 Mbit/s through reliable mode).
    pub fn is_pure_tcp_ack(&self, pkt: &[u8]) -> bool {
        let (Some(t), PROTO_TCP) = (self.transport_offset, self.proto) else {
            return false;
        };
        let Some(hdr) = pkt.get(t..t + 20) else {
            return false;
        };
        let flags = hdr[13];
        let only_ack = flags & 0x10 != 0 && flags & 0x07 == 0;
        let end = match self.src {
            IpAddr::V4(_) => usize::from(u16::from_be_bytes([pkt[2], pkt[3]])),
            IpAddr::V6(_) => 40 + usize::from(u16::from_be_bytes([pkt[4], pkt[5]])),
        };
        only_ack && t + usize::from(hdr[12] >> 4) * 4 == end
    }
}

fn tuple_hash(src: IpAddr, dst: IpAddr, proto: u8, ports: Option<(u16, u16)>) -> u64 {
    let mut h = Fnv::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            h.write(&s.octets());
            h.write(&d.octets());
        }
        (s, d) => {
            h.write(&to_v6(s).octets());
            h.write(&to_v6(d).octets());
        }
    }
    h.write(&[proto]);
    if let Some((sp, dp)) = ports {
        h.write(&sp.to_be_bytes());
        h.write(&dp.to_be_bytes());
    }
    h.finish()
}

fn to_v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

fn ports_at(pkt: &[u8], off: usize, proto: u8) -> Option<(u16, u16)> {
    if !matches!(proto, PROTO_TCP | PROTO_UDP | PROTO_SCTP) {
        return None;
    }
    let p = pkt.get(off..off + 4)?;
    Some((
        u16::from_be_bytes([p[0], p[1]]),
        u16::from_be_bytes([p[2], p[3]]),
    ))
}

fn parse_v4(pkt: &[u8]) -> Option<PacketInfo> {
    let ihl = usize::from(pkt.first()? & 0x0f) * 4;
    if ihl < 20 || pkt.len() < ihl {
        return None;
    }
    let total = usize::from(u16::from_be_bytes([pkt[2], pkt[3]]));
    if total < ihl || total > pkt.len() {
        return None;
    }
    let frag = u16::from_be_bytes([pkt[6], pkt[7]]);
    let more_fragments = frag & 0x2000 != 0;
    let offset = frag & 0x1fff;
    let proto = pkt[9];
    let src = Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]);
    let dst = Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]);
    // Fragments are keyed by addresses only so that all fragments of a datagram follow one path.
    let unfragmented = !more_fragments && offset == 0;
    let (ports, transport_offset) = if unfragmented {
        (ports_at(&pkt[..total], ihl, proto), Some(ihl))
    } else {
        (None, None)
    };
    Some(PacketInfo {
        src: IpAddr::V4(src),
        dst: IpAddr::V4(dst),
        proto,
        ports,
        dscp: pkt[1] >> 2,
        transport_offset,
    })
}

fn parse_v6(pkt: &[u8]) -> Option<PacketInfo> {
    if pkt.len() < 40 {
        return None;
    }
    let payload_len = usize::from(u16::from_be_bytes([pkt[4], pkt[5]]));
    let end = 40 + payload_len;
    if end > pkt.len() {
        return None;
    }
    let pkt = &pkt[..end];
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&pkt[8..24]);
    dst.copy_from_slice(&pkt[24..40]);
    // Walk the common extension headers (hop-by-hop, routing, destination options); a fragment
    // header ends the walk without ports, like an IPv4 fragment.
    let mut next = pkt[6];
    let mut off = 40;
    let mut fragmented = false;
    for _ in 0..8 {
        match next {
            0 | 43 | 60 => {
                let h = pkt.get(off..off + 2)?;
                next = h[0];
                off += (usize::from(h[1]) + 1) * 8;
            }
            44 => {
                fragmented = true;
                next = *pkt.get(off)?;
                break;
            }
            _ => break,
        }
    }
    let (ports, transport_offset) = if fragmented || off > pkt.len() {
        (None, None)
    } else {
        (ports_at(pkt, off, next), Some(off))
    };
    Some(PacketInfo {
        src: IpAddr::V6(Ipv6Addr::from(src)),
        dst: IpAddr::V6(Ipv6Addr::from(dst)),
        proto: next,
        ports,
        // Traffic class: the low nibble of byte 0 and the high nibble of byte 1.
        dscp: ((pkt[0] & 0x0f) << 2) | (pkt[1] >> 6),
        transport_offset,
    })
}

/// Lower the MSS option of a TCP SYN to `max_mss` (IPv4 and IPv6; `max_mss` is the IPv4 figure,
/// `mtu::tcp_mss`: an IPv6 SYN gets 20 bytes less, its header being that much longer). Returns
/// true if the packet was changed. The TCP checksum is updated incrementally (RFC 1624), so no pseudo-header is needed.
/// This is what keeps TCP through the tunnel from producing segments that would not fit.
pub fn clamp_mss(pkt: &mut [u8], max_mss: u16) -> bool {
    PacketInfo::parse(pkt).is_some_and(|info| info.clamp_mss(pkt, max_mss))
}

impl PacketInfo {
    /// `clamp_mss` for a packet whose header this `PacketInfo` was parsed from (the data path
    /// parses each packet once and uses the result for both clamping and routing).
    pub fn clamp_mss(&self, pkt: &mut [u8], max_mss: u16) -> bool {
        clamp_parsed(self, pkt, max_mss)
    }
}

fn clamp_parsed(info: &PacketInfo, pkt: &mut [u8], max_mss: u16) -> bool {
    if info.proto != PROTO_TCP {
        return false;
    }
    let max_mss = match info.src {
        IpAddr::V6(_) => max_mss.saturating_sub(20),
        IpAddr::V4(_) => max_mss,
    };
    let Some(t) = info.transport_offset else {
        return false;
    };
    let Some(hdr) = pkt.get(t..t + 20) else {
        return false;
    };
    let flags = hdr[13];
    if flags & 0x02 == 0 {
        return false; // not a SYN
    }
    let data_off = usize::from(hdr[12] >> 4) * 4;
    if data_off < 20 || t + data_off > pkt.len() {
        return false;
    }
    let mut i = t + 20;
    let end = t + data_off;
    while i < end {
        match pkt[i] {
            0 => return false, // end of options
            1 => i += 1,       // NOP
            kind => {
                let Some(&len) = pkt.get(i + 1) else {
                    return false;
                };
                let len = usize::from(len);
                if len < 2 || i + len > end {
                    return false;
                }
                if kind == 2 && len == 4 {
                    let old = u16::from_be_bytes([pkt[i + 2], pkt[i + 3]]);
                    if old <= max_mss {
                        return false;
                    }
                    pkt[i + 2..i + 4].copy_from_slice(&max_mss.to_be_bytes());
                    let csum_at = t + 16;
                    let csum = u16::from_be_bytes([pkt[csum_at], pkt[csum_at + 1]]);
                    let new = checksum_adjust(csum, old, max_mss);
                    pkt[csum_at..csum_at + 2].copy_from_slice(&new.to_be_bytes());
                    return true;
                }
                i += len;
            }
        }
    }
    false
}

/// The Internet checksum (RFC 1071) of `data`, starting from `sum` (a pseudo-header's sum, or
/// 0). Over bytes that include a valid checksum it is 0.
pub(crate) fn checksum(sum: u32, data: &[u8]) -> u16 {
    !checksum_fold(checksum_sum(data, u64::from(sum)))
}

/// The one's complement sum of `data` as big-endian 16-bit words (an odd last byte padded with
/// zero), added to `sum`, not folded yet. Summed in 32-bit words: the carries between the two
/// halves are the same ones a 16-bit sum makes, once folded (RFC 1071 section 2).
pub(crate) fn checksum_sum(data: &[u8], mut sum: u64) -> u64 {
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        sum += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
    }
    let rest = words.remainder();
    let mut tail = [0u8; 4];
    tail[..rest.len()].copy_from_slice(rest);
    sum + u64::from(u32::from_be_bytes(tail))
}

/// `sum` folded to 16 bits (not complemented).
pub(crate) fn checksum_fold(mut sum: u64) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m').
fn checksum_adjust(csum: u16, old: u16, new: u16) -> u16 {
    let mut sum = u32::from(!csum) + u32::from(!old) + u32::from(new);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// 64-bit FNV-1a: small, deterministic across runs and platforms (flow placement is reproducible).
struct Fnv(u64);
impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        // Final avalanche so that low bits are usable for modulo.
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use super::checksum as csum;

    fn is_pure_tcp_ack(pkt: &[u8]) -> bool {
        PacketInfo::parse(pkt).is_some_and(|info| info.is_pure_tcp_ack(pkt))
    }

    /// An IPv4 TCP packet with valid checksums.
    pub fn tcp4(
        src: [u8; 4],
        dst: [u8; 4],
        sport: u16,
        dport: u16,
        syn_mss: Option<u16>,
    ) -> Vec<u8> {
        let mut tcp = vec![0u8; 20];
        tcp[0..2].copy_from_slice(&sport.to_be_bytes());
        tcp[2..4].copy_from_slice(&dport.to_be_bytes());
        if let Some(mss) = syn_mss {
            tcp[13] = 0x02;
            tcp.extend_from_slice(&[1, 1, 2, 4]);
            tcp.extend_from_slice(&mss.to_be_bytes());
            tcp.extend_from_slice(&[1, 1]);
        } else {
            tcp[13] = 0x10;
        }
        tcp[12] = ((tcp.len() / 4) as u8) << 4;
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&src);
        pseudo.extend_from_slice(&dst);
        pseudo.extend_from_slice(&[0, PROTO_TCP]);
        pseudo.extend_from_slice(&(tcp.len() as u16).to_be_bytes());
        pseudo.extend_from_slice(&tcp);
        let c = csum(0, &pseudo);
        tcp[16..18].copy_from_slice(&c.to_be_bytes());
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, PROTO_TCP, 0, 0];
        ip.extend_from_slice(&src);
        ip.extend_from_slice(&dst);
        let total = (20 + tcp.len()) as u16;
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        let c = csum(0, &ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        ip.extend_from_slice(&tcp);
        ip
    }

    fn tcp_checksum_ok(pkt: &[u8]) -> bool {
        let tcp = &pkt[20..];
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&pkt[12..20]);
        pseudo.extend_from_slice(&[0, PROTO_TCP]);
        pseudo.extend_from_slice(&(tcp.len() as u16).to_be_bytes());
        pseudo.extend_from_slice(tcp);
        csum(0, &pseudo) == 0
    }

    #[test]
    fn pure_acks_are_told_from_data_and_control() {
        let ack = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1000, 80, None);
        assert!(is_pure_tcp_ack(&ack));
        // A SYN, a segment with a payload, FIN and RST are not.
        assert!(!is_pure_tcp_ack(&tcp4(
            [10, 0, 0, 1],
            [10, 0, 0, 2],
            1000,
            80,
            Some(1400)
        )));
        let mut data = ack.clone();
        data.extend_from_slice(b"payload");
        let total = data.len() as u16;
        data[2..4].copy_from_slice(&total.to_be_bytes());
        assert!(!is_pure_tcp_ack(&data));
        for flag in [0x01, 0x04] {
            let mut p = ack.clone();
            p[20 + 13] |= flag;
            assert!(!is_pure_tcp_ack(&p));
        }
        // Not TCP, or not a packet.
        let mut udp = ack.clone();
        udp[9] = PROTO_UDP;
        assert!(!is_pure_tcp_ack(&udp));
        assert!(!is_pure_tcp_ack(&ack[..30]));
        assert!(!is_pure_tcp_ack(&[]));
    }

    #[test]
    fn parses_v4_tcp() {
        let p = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1234, 80, None);
        let i = PacketInfo::parse(&p).unwrap();
        assert_eq!(i.src, "10.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(i.dst, "10.0.0.2".parse::<IpAddr>().unwrap());
        assert_eq!(i.proto, PROTO_TCP);
        assert_eq!(i.ports, Some((1234, 80)));
    }

    #[test]
    fn flow_hash_separates_flows_and_is_stable() {
        let a = PacketInfo::parse(&tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1, 80, None)).unwrap();
        let b = PacketInfo::parse(&tcp4([10, 0, 0, 1], [10, 0, 0, 2], 2, 80, None)).unwrap();
        assert_ne!(a.flow_hash(), b.flow_hash());
        assert_eq!(a.flow_hash(), a.flow_hash());
    }

    #[test]
    fn clamps_mss_and_keeps_checksum_valid() {
        let mut p = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1234, 80, Some(1460));
        assert!(tcp_checksum_ok(&p));
        assert!(clamp_mss(&mut p, 1360));
        assert!(tcp_checksum_ok(&p));
        assert_eq!(u16::from_be_bytes([p[20 + 24], p[20 + 25]]), 1360);
        // Already small enough: untouched.
        assert!(!clamp_mss(&mut p, 1400));
        // Not a SYN: untouched.
        let mut q = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1234, 80, None);
        assert!(!clamp_mss(&mut q, 500));
        // IPv6: 20 bytes less (its header is 20 bytes longer).
        let tcp = &tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1234, 80, Some(1460))[20..];
        let mut v6 = vec![0x60, 0, 0, 0, 0, tcp.len() as u8, 6, 64];
        v6.extend_from_slice(&[0xfd; 32]);
        v6.extend_from_slice(tcp);
        assert!(clamp_mss(&mut v6, 1360));
        assert_eq!(u16::from_be_bytes([v6[40 + 24], v6[40 + 25]]), 1340);
    }

    #[test]
    fn garbage_never_panics() {
        for len in 0..80 {
            let mut v: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            for first in [0x45u8, 0x4f, 0x60, 0x00] {
                if !v.is_empty() {
                    v[0] = first;
                }
                let _ = PacketInfo::parse(&v);
                let _ = clamp_mss(&mut v, 1000);
            }
        }
    }

    #[test]
    fn ipv4_fragments_have_no_ports() {
        let mut p = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1234, 80, None);
        p[6] = 0x20; // MF
        let i = PacketInfo::parse(&p).unwrap();
        assert_eq!(i.ports, None);
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Arbitrary bytes (with a plausible first byte half of the time): parsing and MSS clamping
        /// never panic, and clamping never changes the length.
        #[test]
        fn parse_and_clamp_are_total(mut bytes in proptest::collection::vec(any::<u8>(), 0..120),
                                     first in prop_oneof![Just(0x45u8), Just(0x46), Just(0x60), any::<u8>()],
                                     mss in any::<u16>()) {
            if let Some(b) = bytes.first_mut() {
                *b = first;
            }
            let len = bytes.len();
            let _ = PacketInfo::parse(&bytes);
            let _ = clamp_mss(&mut bytes, mss);
            prop_assert_eq!(bytes.len(), len);
        }
    }
}
