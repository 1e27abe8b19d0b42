//! The capsules on a CONNECT-IP request's stream (RFC 9297 section 3.2: type, length, value,
//! each a varint but the value): ADDRESS_ASSIGN, ADDRESS_REQUEST and ROUTE_ADVERTISEMENT (RFC
//! 9484 section 4.7) and DATAGRAM (RFC 9297 section 3.5). `CapsuleReader` takes the stream's
//! bytes as they arrive: unknown capsules are skipped as the RFC requires, without holding them
//! (of any length); a malformed known one is an error, and the caller aborts the request's
//! stream with H3_DATAGRAM_ERROR / the CONNECT-IP error (never more than the stream).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::varint;

pub const DATAGRAM: u64 = 0x00;
pub const ADDRESS_ASSIGN: u64 = 0x01;
pub const ADDRESS_REQUEST: u64 = 0x02;
pub const ROUTE_ADVERTISEMENT: u64 = 0x03;

/// The longest value of a capsule this end reads: a thousand IPv6 ranges fit, and an IP packet
/// in a DATAGRAM capsule; a longer one is refused rather than buffered (unknown ones of any
/// length are skipped, not buffered).
pub const MAX_KNOWN: usize = 64 * 1024;

/// An address (or prefix) assigned or asked for: ADDRESS_ASSIGN's "Assigned Address",
/// ADDRESS_REQUEST's "Requested Address".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressEntry {
    /// Which request it answers (0: none, an assignment unasked); a request's own ID (not 0).
    pub request_id: u64,
    /// The address, its bits beyond `prefix_len` zero; an unspecified one (0.0.0.0, ::) in a
    /// request asks for any address of that family.
    pub addr: IpAddr,
    pub prefix_len: u8,
}

/// A range of destinations the peer may send to: ROUTE_ADVERTISEMENT's "IP Address Range"
/// (`protocol` 0: every protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpRange {
    pub start: IpAddr,
    pub end: IpAddr,
    pub protocol: u8,
}

impl IpRange {
    /// Every destination of one IP version (`v6`), every protocol.
    pub fn everything(v6: bool) -> IpRange {
        match v6 {
            false => IpRange {
                start: Ipv4Addr::UNSPECIFIED.into(),
                end: Ipv4Addr::BROADCAST.into(),
                protocol: 0,
            },
            true => IpRange {
                start: Ipv6Addr::UNSPECIFIED.into(),
                end: Ipv6Addr::from(u128::MAX).into(),
                protocol: 0,
            },
        }
    }

    /// Whether a packet to `dst` of `protocol` falls in the range.
    pub fn contains(&self, dst: IpAddr, protocol: u8) -> bool {
        (self.protocol == 0 || self.protocol == protocol)
            && family(dst) == family(self.start)
            && ordinal(dst) >= ordinal(self.start)
            && ordinal(dst) <= ordinal(self.end)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capsule {
    /// An HTTP Datagram sent on the stream instead of as a QUIC DATAGRAM.
    Datagram {
        context: u64,
        payload: Vec<u8>,
    },
    AddressAssign(Vec<AddressEntry>),
    AddressRequest(Vec<AddressEntry>),
    RouteAdvertisement(Vec<IpRange>),
}

/// A capsule that breaks the RFC's rules (the request's stream is aborted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsuleError(pub &'static str);

impl std::fmt::Display for CapsuleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for CapsuleError {}

impl Capsule {
    /// Append the capsule, framed (type, length, value), to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut value = Vec::new();
        let kind = match self {
            Capsule::Datagram { context, payload } => {
                varint::write(*context, &mut value);
                value.extend_from_slice(payload);
                DATAGRAM
            }
            Capsule::AddressAssign(list) | Capsule::AddressRequest(list) => {
                for e in list {
                    varint::write(e.request_id, &mut value);
                    put_addr(e.addr, &mut value);
                    value.push(e.prefix_len);
                }
                match self {
                    Capsule::AddressAssign(_) => ADDRESS_ASSIGN,
                    _ => ADDRESS_REQUEST,
                }
            }
            Capsule::RouteAdvertisement(ranges) => {
                for r in ranges {
                    put_addr(r.start, &mut value);
                    value.extend_from_slice(&octets(r.end));
                    value.push(r.protocol);
                }
                ROUTE_ADVERTISEMENT
            }
        };
        varint::write(kind, out);
        varint::write(value.len() as u64, out);
        out.extend_from_slice(&value);
    }

    /// A known capsule from its type and whole value; `Ok(None)` for a type this end does not
    /// know.
    pub fn decode(kind: u64, value: &[u8]) -> Result<Option<Capsule>, CapsuleError> {
        let mut r = Fields(value);
        let c = match kind {
            DATAGRAM => {
                let context = r.varint()?;
                Capsule::Datagram {
                    context,
                    payload: r.0.to_vec(),
                }
            }
            ADDRESS_ASSIGN | ADDRESS_REQUEST => {
                let mut list = Vec::new();
                while !r.0.is_empty() {
                    let request_id = r.varint()?;
                    let addr = r.addr()?;
                    let prefix_len = r.byte()?;
                    if u32::from(prefix_len) > bits(addr) {
                        return Err(CapsuleError("prefix length longer than the address"));
                    }
                    if ordinal(addr) & !mask(addr, prefix_len) != 0 {
                        return Err(CapsuleError("address bits beyond the prefix length"));
                    }
                    if kind == ADDRESS_REQUEST && request_id == 0 {
                        return Err(CapsuleError("address request with request ID 0"));
                    }
                    list.push(AddressEntry {
                        request_id,
                        addr,
                        prefix_len,
                    });
                }
                match kind {
                    ADDRESS_ASSIGN => Capsule::AddressAssign(list),
                    _ if list.is_empty() => {
                        return Err(CapsuleError("address request without an address"))
                    }
                    _ => Capsule::AddressRequest(list),
                }
            }
            ROUTE_ADVERTISEMENT => {
                let mut ranges: Vec<IpRange> = Vec::new();
                while !r.0.is_empty() {
                    let start = r.addr()?;
                    let end = match start {
                        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(r.array::<4>()?)),
                        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(r.array::<16>()?)),
                    };
                    let range = IpRange {
                        start,
                        end,
                        protocol: r.byte()?,
                    };
                    if ordinal(range.start) > ordinal(range.end) {
                        return Err(CapsuleError("route range that ends before it starts"));
                    }
                    // RFC 9484 section 4.7.3: by IP version, then protocol, then address, and
                    // no two of one version and protocol overlapping.
                    if let Some(prev) = ranges.last() {
                        let order = (family(prev.start), prev.protocol)
                            .cmp(&(family(range.start), range.protocol));
                        if order.is_gt()
                            || (order.is_eq() && ordinal(prev.end) >= ordinal(range.start))
                        {
                            return Err(CapsuleError("route ranges out of order or overlapping"));
                        }
                    }
                    ranges.push(range);
                }
                Capsule::RouteAdvertisement(ranges)
            }
            _ => return Ok(None),
        };
        Ok(Some(c))
    }
}

/// The capsules of one stream, from its bytes as they arrive (`push`, then `read` until it
/// returns `Ok(None)`).
#[derive(Debug, Default)]
pub struct CapsuleReader {
    buf: Vec<u8>,
    /// Bytes of an unknown capsule still to pass over.
    skip: u64,
    /// Unknown capsules passed over.
    pub skipped: u64,
}

impl CapsuleReader {
    /// The next bytes of the stream.
    pub fn push(&mut self, mut data: &[u8]) {
        if self.skip > 0 {
            let n = (self.skip.min(data.len() as u64)) as usize;
            self.skip -= n as u64;
            data = &data[n..];
        }
        self.buf.extend_from_slice(data);
    }

    /// The next whole capsule; `Ok(None)` until more bytes arrive.
    pub fn read(&mut self) -> Result<Option<Capsule>, CapsuleError> {
        loop {
            let Some((kind, a)) = varint::read(&self.buf) else {
                return Ok(None);
            };
            let Some((len, b)) = varint::read(&self.buf[a..]) else {
                return Ok(None);
            };
            if kind > ROUTE_ADVERTISEMENT {
                let here = (len.min((self.buf.len() - a - b) as u64)) as usize;
                self.buf.drain(..a + b + here);
                self.skip = len - here as u64;
                self.skipped += 1;
                if self.skip > 0 {
                    return Ok(None);
                }
                continue;
            }
            if len > MAX_KNOWN as u64 {
                return Err(CapsuleError("capsule longer than this end reads"));
            }
            let end = a + b + len as usize;
            if self.buf.len() < end {
                return Ok(None);
            }
            let c = Capsule::decode(kind, &self.buf[a + b..end]);
            self.buf.drain(..end);
            return c;
        }
    }

    /// The stream ended: an error if it ended inside a capsule.
    pub fn finish(&self) -> Result<(), CapsuleError> {
        match self.buf.is_empty() && self.skip == 0 {
            true => Ok(()),
            false => Err(CapsuleError("stream ended inside a capsule")),
        }
    }
}

/// A capsule value's fields, read from the front.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn varint(&mut self) -> Result<u64, CapsuleError> {
        let (v, n) = varint::read(self.0).ok_or(CapsuleError("capsule cut short"))?;
        self.0 = &self.0[n..];
        Ok(v)
    }

    fn byte(&mut self) -> Result<u8, CapsuleError> {
        Ok(self.array::<1>()?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CapsuleError> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(CapsuleError("capsule cut short"))?;
        self.0 = rest;
        Ok(*head)
    }

    /// An IP version byte (4 or 6) and the address it announces.
    fn addr(&mut self) -> Result<IpAddr, CapsuleError> {
        match self.byte()? {
            4 => Ok(IpAddr::V4(Ipv4Addr::from(self.array::<4>()?))),
            6 => Ok(IpAddr::V6(Ipv6Addr::from(self.array::<16>()?))),
            _ => Err(CapsuleError("IP version neither 4 nor 6")),
        }
    }
}

fn put_addr(addr: IpAddr, out: &mut Vec<u8>) {
    out.push(family(addr));
    out.extend_from_slice(&octets(addr));
}

fn octets(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The IP version number of `addr`.
pub fn family(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(_) => 4,
        IpAddr::V6(_) => 6,
    }
}

fn bits(addr: IpAddr) -> u32 {
    match addr {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

/// The address as a number (for ranges and masks; IPv4 in the low 32 bits).
pub(super) fn ordinal(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The bits of `addr`'s family a prefix of `len` covers.
pub(super) fn mask(addr: IpAddr, len: u8) -> u128 {
    let width = bits(addr);
    match u32::from(len).min(width) {
        0 => 0,
        len => (u128::MAX << (128 - len)) >> (128 - width),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4]) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(a))
    }

    fn round_trip(c: Capsule) {
        let mut out = Vec::new();
        c.encode(&mut out);
        let mut r = CapsuleReader::default();
        // Byte by byte: nothing until the last one.
        for (i, b) in out.iter().enumerate() {
            r.push(&[*b]);
            let got = r.read().unwrap();
            match i + 1 == out.len() {
                true => assert_eq!(got.as_ref(), Some(&c)),
                false => assert_eq!(got, None),
            }
        }
        r.finish().unwrap();
    }

    #[test]
    fn capsules_round_trip() {
        round_trip(Capsule::AddressAssign(vec![
            AddressEntry {
                request_id: 0,
                addr: v4([10, 200, 17, 1]),
                prefix_len: 32,
            },
            AddressEntry {
                request_id: 7,
                addr: "fd00:17::".parse().unwrap(),
                prefix_len: 64,
            },
        ]));
        round_trip(Capsule::AddressAssign(vec![]));
        round_trip(Capsule::AddressRequest(vec![AddressEntry {
            request_id: 1,
            addr: v4([0, 0, 0, 0]),
            prefix_len: 32,
        }]));
        round_trip(Capsule::RouteAdvertisement(vec![
            IpRange::everything(false),
            IpRange {
                start: v4([10, 0, 0, 0]),
                end: v4([10, 255, 255, 255]),
                protocol: 0,
            }
            .with_protocol(17),
            IpRange::everything(true),
        ]));
        round_trip(Capsule::Datagram {
            context: 0,
            payload: vec![0x45, 0, 0, 20],
        });
    }

    impl IpRange {
        fn with_protocol(mut self, p: u8) -> IpRange {
            self.protocol = p;
            self
        }
    }

    fn decode(bytes: &[u8]) -> Result<Option<Capsule>, CapsuleError> {
        let mut r = CapsuleReader::default();
        r.push(bytes);
        r.read()
    }

    #[test]
    fn malformed_capsules_are_errors() {
        let cases: [(&[u8], &str); 8] = [
            // ADDRESS_ASSIGN, IP version 5.
            (&[1, 7, 0, 5, 10, 0, 0, 1, 32], "IP version"),
            // Prefix 33 on IPv4.
            (&[1, 7, 0, 4, 10, 0, 0, 1, 33], "longer than"),
            // 10.0.0.1/24: host bits set.
            (&[1, 7, 0, 4, 10, 0, 0, 1, 24], "beyond the prefix"),
            // An entry cut short inside the value.
            (&[1, 5, 0, 4, 10, 0, 0], "cut short"),
            // ADDRESS_REQUEST with request ID 0, and an empty one.
            (&[2, 7, 0, 4, 0, 0, 0, 0, 32], "request ID 0"),
            (&[2, 0], "without an address"),
            // A range 10.0.0.9 - 10.0.0.1.
            (&[3, 10, 4, 10, 0, 0, 9, 10, 0, 0, 1, 0], "ends before"),
            // Longer than this end reads.
            (&[1, 0x80, 0x02, 0, 0], "longer than this end"),
        ];
        for (bytes, why) in cases {
            let e = decode(bytes).unwrap_err();
            assert!(e.0.contains(why), "{bytes:?}: {e}");
        }
        // Ranges out of order, and overlapping.
        for (a, b) in [
            (IpRange::everything(true), IpRange::everything(false)),
            (IpRange::everything(false), IpRange::everything(false)),
        ] {
            let mut out = Vec::new();
            Capsule::RouteAdvertisement(vec![a, b]).encode(&mut out);
            assert!(decode(&out).unwrap_err().0.contains("order"));
        }
        // A stream that ends inside a capsule.
        let mut r = CapsuleReader::default();
        r.push(&[1, 7, 0]);
        assert_eq!(r.read(), Ok(None));
        assert!(r.finish().is_err());
    }

    /// Unknown capsules are passed over, whatever their length and however the bytes arrive,
    /// without being held.
    #[test]
    fn unknown_capsules_are_skipped_unheld() {
        let mut known = Vec::new();
        Capsule::AddressAssign(vec![]).encode(&mut known);
        let mut stream = Vec::new();
        varint::write(0x1ace_79ec, &mut stream);
        varint::write(200_000, &mut stream);
        stream.extend(std::iter::repeat_n(0xab, 200_000));
        stream.extend_from_slice(&known);
        let mut r = CapsuleReader::default();
        let mut got = Vec::new();
        for chunk in stream.chunks(1000) {
            r.push(chunk);
            assert!(r.buf.len() <= 1000 + known.len());
            while let Some(c) = r.read().unwrap() {
                got.push(c);
            }
        }
        assert_eq!(got, [Capsule::AddressAssign(vec![])]);
        assert_eq!(r.skipped, 1);
        r.finish().unwrap();
    }

    #[test]
    fn ranges_contain_their_destinations() {
        let r = IpRange {
            start: v4([10, 0, 0, 0]),
            end: v4([10, 0, 0, 255]),
            protocol: 6,
        };
        assert!(r.contains(v4([10, 0, 0, 7]), 6));
        assert!(!r.contains(v4([10, 0, 0, 7]), 17));
        assert!(!r.contains(v4([10, 0, 1, 0]), 6));
        assert!(!r.contains("::1".parse().unwrap(), 6));
        assert!(IpRange::everything(true).contains("2001:db8::1".parse().unwrap(), 58));
    }

    #[test]
    fn masks() {
        assert_eq!(mask(v4([0; 4]), 24), 0xffff_ff00);
        assert_eq!(mask(v4([0; 4]), 0), 0);
        assert_eq!(mask(v4([0; 4]), 32), 0xffff_ffff);
        let six: IpAddr = "::".parse().unwrap();
        assert_eq!(mask(six, 128), u128::MAX);
        assert_eq!(mask(six, 0), 0);
        assert_eq!(mask(six, 64), u128::MAX << 64);
    }
}
