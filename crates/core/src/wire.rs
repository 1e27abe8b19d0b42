//! Datagram wire format (docs/PROTOCOL.md). A QUIC DATAGRAM payload is either a bare inner IP
//! packet, recognised by its version nibble (4 or 6), or a control message whose first byte is a
//! type below 0x10, which no IP packet can start with. Data therefore carries zero framing bytes.

pub const PROBE: u8 = 0x01;
pub const PROBE_REPLY: u8 = 0x02;
pub const PROBE_LEN: usize = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Datagram<'a> {
    Packet(&'a [u8]),
    Probe(u32),
    ProbeReply(u32),
}

/// Classify a received datagram. `None` for anything malformed (counted by the caller).
pub fn decode(buf: &[u8]) -> Option<Datagram<'_>> {
    let first = *buf.first()?;
    match first >> 4 {
        4 | 6 => return Some(Datagram::Packet(buf)),
        0 => {}
        _ => return None,
    }
    if buf.len() != PROBE_LEN {
        return None;
    }
    let seq = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    match first {
        PROBE => Some(Datagram::Probe(seq)),
        PROBE_REPLY => Some(Datagram::ProbeReply(seq)),
        _ => None,
    }
}

pub fn encode_probe(kind: u8, seq: u32) -> [u8; PROBE_LEN] {
    let s = seq.to_be_bytes();
    [kind, s[0], s[1], s[2], s[3]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors() {
        assert_eq!(encode_probe(PROBE, 0x01020304), [0x01, 1, 2, 3, 4]);
        assert_eq!(decode(&[0x01, 0, 0, 0, 9]), Some(Datagram::Probe(9)));
        assert_eq!(decode(&[0x02, 0, 0, 1, 0]), Some(Datagram::ProbeReply(256)));
        assert_eq!(decode(&[0x45, 0]), Some(Datagram::Packet(&[0x45, 0])));
        assert_eq!(decode(&[0x60]), Some(Datagram::Packet(&[0x60])));
        assert_eq!(decode(&[]), None);
        assert_eq!(decode(&[0x01, 0, 0]), None);
        assert_eq!(decode(&[0x03, 0, 0, 0, 0]), None);
        assert_eq!(decode(&[0x20, 0, 0, 0, 0]), None);
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
            prop_assert_eq!(super::decode(&p), Some(super::Datagram::Probe(seq)));
        }
    }
}
