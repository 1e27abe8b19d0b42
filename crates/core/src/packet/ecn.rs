//! Explicit congestion notification (RFC 3168) on inner packets: a sender's queue that has
//! held a packet long marks it "congestion experienced" instead of waiting until it must drop
//! it, when the packet's sender said it understands the mark (ECT(0) or ECT(1)).
//!
//! Why: a loss tells an inner TCP flow to slow down too, but costs it a round trip with
//! nothing delivered (its cumulative ACK waits for the retransmission, which waits behind the
//! queue): sixteen uploads over a replayed Starlink link stalled for 200-300 ms at every loss.
//! A mark slows the flow as much and loses nothing. Flows that do not negotiate ECN are not
//! touched: their packets are dropped where they were before.

/// The ECN field's values (the low two bits of IPv4's TOS and IPv6's traffic class).
const NOT_ECT: u8 = 0b00;
const CE: u8 = 0b11;

/// The ECN field of an IPv4 or IPv6 packet (`None`: neither, or too short).
fn field(pkt: &[u8]) -> Option<u8> {
    match pkt.first()? >> 4 {
        4 if pkt.len() >= 20 => Some(pkt[1] & 0b11),
        6 if pkt.len() >= 40 => Some((pkt[1] >> 4) & 0b11),
        _ => None,
    }
}

/// Whether the packet's sender takes ECN marks and it carries none yet (ECT(0) or ECT(1)).
pub fn is_ect(pkt: &[u8]) -> bool {
    field(pkt).is_some_and(|f| f != NOT_ECT && f != CE)
}

/// Mark an ECN-capable packet "congestion experienced", its IPv4 header checksum adjusted
/// (RFC 1624). Returns whether it marked it: not for a packet that is not ECN-capable or
/// carries the mark already.
pub fn mark_ce(pkt: &mut [u8]) -> bool {
    if !is_ect(pkt) {
        return false;
    }
    if pkt[0] >> 4 == 6 {
        pkt[1] |= CE << 4;
        return true;
    }
    let old = u16::from_be_bytes([pkt[0], pkt[1]]);
    pkt[1] |= CE;
    let new = u16::from_be_bytes([pkt[0], pkt[1]]);
    let csum = u16::from_be_bytes([pkt[10], pkt[11]]);
    let csum = super::checksum_adjust(csum, old, new);
    pkt[10..12].copy_from_slice(&csum.to_be_bytes());
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::checksum;
    use crate::packet::tests::tcp4;

    fn with_ecn4(ecn: u8) -> Vec<u8> {
        let mut p = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 40000, 5201, None);
        p[1] = (p[1] & !0b11) | ecn;
        p[10..12].fill(0);
        let c = checksum(0, &p[..20]);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p
    }

    #[test]
    fn an_ecn_capable_ipv4_packet_is_marked_and_its_checksum_stays_valid() {
        for ect in [0b10, 0b01] {
            let mut p = with_ecn4(ect);
            let before = p.clone();
            assert!(mark_ce(&mut p));
            assert_eq!(p[1] & 0b11, CE);
            assert_eq!(checksum(0, &p[..20]), 0, "header checksum valid");
            // Nothing else changed.
            assert_eq!(p[..1], before[..1]);
            assert_eq!(p[2..10], before[2..10]);
            assert_eq!(p[12..], before[12..]);
            // Marked once: a second call finds it marked.
            assert!(!mark_ce(&mut p));
        }
    }

    #[test]
    fn a_packet_without_ecn_is_not_touched() {
        let mut p = with_ecn4(NOT_ECT);
        let before = p.clone();
        assert!(!is_ect(&p) && !mark_ce(&mut p));
        assert_eq!(p, before);
        let mut short = vec![0x45, 0x02, 0, 0];
        assert!(!mark_ce(&mut short));
        assert!(!mark_ce(&mut []));
        let mut other = vec![0x12; 60];
        assert!(!mark_ce(&mut other));
    }

    #[test]
    fn an_ecn_capable_ipv6_packet_is_marked() {
        // Version 6, traffic class 0xa2 (DSCP 40, ECT(0)), flow label 0x12345.
        let mut p = vec![0u8; 40];
        p[0] = 0x6a;
        p[1] = 0x21;
        p[2] = 0x23;
        p[3] = 0x45;
        assert!(is_ect(&p) && mark_ce(&mut p));
        assert_eq!([p[0], p[1], p[2], p[3]], [0x6a, 0x31, 0x23, 0x45]);
        assert!(!mark_ce(&mut p));
        // Not-ECT.
        p[1] = 0x01;
        assert!(!mark_ce(&mut p));
    }
}
