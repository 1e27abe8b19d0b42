//! An HTTP Datagram in a QUIC DATAGRAM frame (RFC 9297 section 2.1): the quarter stream ID of
//! the request it belongs to (its stream ID / 4: requests are client-initiated bidirectional
//! streams), then, for CONNECT-IP, a context ID (RFC 9484 section 6); context 0 carries one full
//! IP packet, other contexts are extensions this end did not negotiate (dropped, counted).

use crate::varint;

/// The context whose payload is an IP packet.
pub const IP_CONTEXT: u64 = 0;

/// The prefix of a datagram and where its payload starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    /// The request's stream ID (the quarter stream ID times four).
    pub stream_id: u64,
    pub context: u64,
    /// Bytes the prefix takes.
    pub len: usize,
}

/// The prefix of a QUIC DATAGRAM's payload; `None` when it is cut short.
pub fn parse(buf: &[u8]) -> Option<Prefix> {
    let (quarter, a) = varint::read(buf)?;
    let (context, b) = varint::read(&buf[a..])?;
    Some(Prefix {
        // A quarter stream ID above 2^60 - 1 has no stream: refused as cut short would be.
        stream_id: quarter.checked_mul(4).filter(|s| *s <= varint::MAX)?,
        context,
        len: a + b,
    })
}

/// The prefix of request `stream_id`'s IP packets (context 0), to put in front of each.
pub fn ip_prefix(stream_id: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(9);
    varint::write(stream_id / 4, &mut out);
    varint::write(IP_CONTEXT, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_round_trips_and_a_short_one_is_refused() {
        for id in [0u64, 4, 252, 256, 65_536, 1 << 40] {
            let p = ip_prefix(id);
            let mut d = p.clone();
            d.extend_from_slice(&[0x45, 0, 0, 20]);
            let got = parse(&d).unwrap();
            assert_eq!(
                got,
                Prefix {
                    stream_id: id,
                    context: 0,
                    len: p.len()
                }
            );
            assert_eq!(&d[got.len..], [0x45, 0, 0, 20]);
            assert_eq!(parse(&p[..p.len() - 1]), None);
        }
        // Quarter stream ID 1 (stream 4), context 2.
        assert_eq!(
            parse(&[0x01, 0x02]).map(|p| (p.stream_id, p.context)),
            Some((4, 2))
        );
        assert_eq!(parse(&[]), None);
    }
}
