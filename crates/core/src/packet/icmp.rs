//! "Packet too big" for inner senders (ICMP type 3 code 4, RFC 1191; ICMPv6 type 2, RFC 8201):
//! when a path can carry less than an inner packet (its MTU fell, `pmtu.rs`), the tunnel drops
//! the packet, counts it, and tells the sender the size that fits, as a router on the way would,
//! so the sender's TCP lowers its segment size at once instead of retransmitting into a black
//! hole.
//!
//! The message is sent in the name of the packet's destination: that address routes back
//! through the tunnel on both sides, so reverse-path filters pass it, and conntrack/NAT treat it
//! as related to the flow.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::packet::checksum;

const PROTO_ICMP: u8 = 1;
const PROTO_ICMPV6: u8 = 58;
/// IPv4: how much of the packet the message quotes (a reply within the 576-byte minimum).
const V4_QUOTE: usize = 576 - 20 - 8;
/// IPv6: within the 1280-byte minimum MTU.
const V6_QUOTE: usize = 1280 - 40 - 8;
const V6_MIN_MTU: u32 = 1280;

/// The "too big" reply to `pkt` for a next hop of `mtu` bytes, or `None` where none is due:
/// not a well-formed IP packet, an IPv4 packet that may be fragmented (no DF), a non-first
/// fragment, an ICMP error itself, or a source that is not a single host.
pub fn too_big(pkt: &[u8], mtu: u16) -> Option<Vec<u8>> {
    match pkt.first()? >> 4 {
        4 => too_big_v4(pkt, mtu),
        6 => too_big_v6(pkt, mtu),
        _ => None,
    }
}

fn too_big_v4(pkt: &[u8], mtu: u16) -> Option<Vec<u8>> {
    let ihl = usize::from(pkt.first()? & 0x0f) * 4;
    if ihl < 20 || pkt.len() < ihl {
        return None;
    }
    let frag = u16::from_be_bytes([pkt[6], pkt[7]]);
    let dont_fragment = frag & 0x4000 != 0;
    if !dont_fragment || frag & 0x1fff != 0 {
        return None;
    }
    let src = Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]);
    let dst = Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]);
    if !is_host_v4(src) {
        return None;
    }
    // Never an error about an ICMP error (RFC 1122 3.2.2): only echo, timestamp and the like.
    if pkt[9] == PROTO_ICMP && pkt.get(ihl).is_none_or(|&t| !matches!(t, 0 | 8 | 13 | 14)) {
        return None;
    }
    let quote = &pkt[..pkt.len().min(V4_QUOTE)];
    let total = 20 + 8 + quote.len();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&[0x45, 0xc0]);
    out.extend_from_slice(&(total as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0x40, 0, 64, PROTO_ICMP, 0, 0]);
    out.extend_from_slice(&dst.octets());
    out.extend_from_slice(&src.octets());
    let c = checksum(0, &out);
    out[10..12].copy_from_slice(&c.to_be_bytes());
    out.extend_from_slice(&[3, 4, 0, 0, 0, 0]);
    out.extend_from_slice(&mtu.to_be_bytes());
    out.extend_from_slice(quote);
    let c = checksum(0, &out[20..]);
    out[22..24].copy_from_slice(&c.to_be_bytes());
    Some(out)
}

fn is_host_v4(a: Ipv4Addr) -> bool {
    !(a.is_unspecified() || a.is_broadcast() || a.is_multicast() || a.is_loopback())
}

fn too_big_v6(pkt: &[u8], mtu: u16) -> Option<Vec<u8>> {
    if pkt.len() < 40 {
        return None;
    }
    let mut s = [0u8; 16];
    let mut d = [0u8; 16];
    s.copy_from_slice(&pkt[8..24]);
    d.copy_from_slice(&pkt[24..40]);
    let (src, dst) = (Ipv6Addr::from(s), Ipv6Addr::from(d));
    if src.is_unspecified() || src.is_multicast() || src.is_loopback() {
        return None;
    }
    // An ICMPv6 error (types below 128) right after the header gets no error back.
    if pkt[6] == PROTO_ICMPV6 && pkt.get(40).is_none_or(|&t| t < 128) {
        return None;
    }
    // A multicast destination would make our source a multicast address.
    if dst.is_multicast() {
        return None;
    }
    let quote = &pkt[..pkt.len().min(V6_QUOTE)];
    let len = 8 + quote.len();
    let mut out = Vec::with_capacity(40 + len);
    out.extend_from_slice(&[0x60, 0, 0, 0]);
    out.extend_from_slice(&(len as u16).to_be_bytes());
    out.extend_from_slice(&[PROTO_ICMPV6, 64]);
    out.extend_from_slice(&dst.octets());
    out.extend_from_slice(&src.octets());
    out.extend_from_slice(&[2, 0, 0, 0]);
    out.extend_from_slice(&u32::from(mtu).max(V6_MIN_MTU).to_be_bytes());
    out.extend_from_slice(quote);
    let mut pseudo = 0u32;
    for w in out[8..40].chunks(2) {
        pseudo += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    pseudo += len as u32 + u32::from(PROTO_ICMPV6);
    let c = checksum(pseudo, &out[40..]);
    out[42..44].copy_from_slice(&c.to_be_bytes());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;
    use crate::PacketInfo;

    #[test]
    fn ipv4_with_df_gets_frag_needed_from_its_destination() {
        let mut p = tcp4([10, 0, 0, 2], [192, 0, 2, 9], 40000, 443, None);
        p.resize(1400, 0);
        p[2..4].copy_from_slice(&1400u16.to_be_bytes());
        let r = too_big(&p, 1300).expect("a reply");
        let info = PacketInfo::parse(&r).expect("well-formed");
        assert_eq!(info.src.to_string(), "192.0.2.9");
        assert_eq!(info.dst.to_string(), "10.0.0.2");
        assert_eq!(info.proto, PROTO_ICMP);
        assert_eq!(r.len(), 576);
        assert_eq!(&r[20..22], &[3, 4]);
        assert_eq!(u16::from_be_bytes([r[26], r[27]]), 1300);
        // Both checksums verify (sum over the covered bytes is all ones).
        assert_eq!(checksum(0, &r[..20]), 0);
        assert_eq!(checksum(0, &r[20..]), 0);
        // The quote starts with the original header.
        assert_eq!(&r[28..48], &p[..20]);
    }

    #[test]
    fn no_reply_where_none_is_due() {
        let p = tcp4([10, 0, 0, 2], [192, 0, 2, 9], 1, 2, None);
        let mut no_df = p.clone();
        no_df[6] = 0;
        assert_eq!(too_big(&no_df, 1300), None);
        let mut frag = p.clone();
        frag[7] = 1;
        assert_eq!(too_big(&frag, 1300), None);
        let mut icmp_err = p.clone();
        icmp_err[9] = PROTO_ICMP;
        icmp_err[20] = 3;
        assert_eq!(too_big(&icmp_err, 1300), None);
        let mut echo = icmp_err.clone();
        echo[20] = 8;
        assert!(too_big(&echo, 1300).is_some());
        let mut bcast = p.clone();
        bcast[12..16].copy_from_slice(&[255; 4]);
        assert_eq!(too_big(&bcast, 1300), None);
        assert_eq!(too_big(&[], 1300), None);
        assert_eq!(too_big(&[0x45, 0, 0], 1300), None);
        assert_eq!(too_big(&[0x60; 20], 1300), None);
    }

    #[test]
    fn ipv6_gets_packet_too_big_with_a_valid_checksum() {
        let mut p = vec![0u8; 1500];
        p[0] = 0x60;
        p[4..6].copy_from_slice(&1460u16.to_be_bytes());
        p[6] = 6;
        p[7] = 64;
        p[8..24].copy_from_slice(&"fd00::2".parse::<Ipv6Addr>().unwrap().octets());
        p[24..40].copy_from_slice(&"2001:db8::9".parse::<Ipv6Addr>().unwrap().octets());
        let r = too_big(&p, 1100).expect("a reply");
        assert_eq!(r.len(), 1280);
        assert_eq!(&r[40..42], &[2, 0]);
        assert_eq!(u32::from_be_bytes([r[44], r[45], r[46], r[47]]), 1280);
        let info = PacketInfo::parse(&r).expect("well-formed");
        assert_eq!(info.src.to_string(), "2001:db8::9");
        let mut pseudo = 0u32;
        for w in r[8..40].chunks(2) {
            pseudo += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        pseudo += (r.len() - 40) as u32 + u32::from(PROTO_ICMPV6);
        assert_eq!(checksum(pseudo, &r[40..]), 0);
        // An ICMPv6 error gets none.
        let mut err = p.clone();
        err[6] = PROTO_ICMPV6;
        err[40] = 1;
        assert_eq!(too_big(&err, 1100), None);
    }
}
