//! The MPTCP lane's request and answer (`tcp_lane: mptcp`): what the client says first on a
//! lane connection (inside TLS) and what the server answers once it has tried the destination.
//!
//! The client sends its request and, without waiting, what the LAN host sent (a lane
//! connection costs its handshakes, not a round trip more for the request); the server opens
//! the TCP connection to the destination, answers, and relays. A refused or unreachable
//! destination is answered so, and the client resets the LAN host's connection.
//!
//! Request: version (1), family (4 or 6), the destination's address (4 or 16 bytes) and port
//! (u16, big-endian). Answer: version (1), outcome (`Outcome`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const VERSION: u8 = 1;
/// The longest request (IPv6).
pub const MAX_REQUEST: usize = 2 + 16 + 2;
pub const ANSWER_LEN: usize = 2;

/// What became of the server's connection to the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Connected,
    /// The destination answered with a reset.
    Refused,
    /// No route, or the destination's network or host unreachable (ICMP).
    Unreachable,
    /// No answer within the server's connect timeout.
    TimedOut,
    /// The server does not open connections there (loopback, unspecified, multicast,
    /// broadcast: its own host, not the internet).
    NotAllowed,
}

impl Outcome {
    fn to_wire(self) -> u8 {
        match self {
            Outcome::Connected => 0,
            Outcome::Refused => 1,
            Outcome::Unreachable => 2,
            Outcome::TimedOut => 3,
            Outcome::NotAllowed => 4,
        }
    }

    fn from_wire(b: u8) -> Option<Outcome> {
        Some(match b {
            0 => Outcome::Connected,
            1 => Outcome::Refused,
            2 => Outcome::Unreachable,
            3 => Outcome::TimedOut,
            4 => Outcome::NotAllowed,
            _ => return None,
        })
    }

    /// The outcomes other than `Connected`, in the order counters keep them.
    pub const FAILURES: [Outcome; 4] = [
        Outcome::Refused,
        Outcome::Unreachable,
        Outcome::TimedOut,
        Outcome::NotAllowed,
    ];

    /// Where a failure is in `FAILURES` (`None` for `Connected`).
    pub fn failure_index(self) -> Option<usize> {
        Outcome::FAILURES.iter().position(|o| *o == self)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Connected => "connected",
            Outcome::Refused => "refused",
            Outcome::Unreachable => "unreachable",
            Outcome::TimedOut => "timed_out",
            Outcome::NotAllowed => "not_allowed",
        }
    }
}

pub fn encode_request(dst: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_REQUEST);
    out.push(VERSION);
    match dst.ip() {
        IpAddr::V4(a) => {
            out.push(4);
            out.extend_from_slice(&a.octets());
        }
        IpAddr::V6(a) => {
            out.push(6);
            out.extend_from_slice(&a.octets());
        }
    }
    out.extend_from_slice(&dst.port().to_be_bytes());
    out
}

/// A request read so far: `Ok(None)` until it is whole, then the destination and the bytes it
/// took (what follows is the LAN host's data). An unknown version or family is an error.
pub fn decode_request(buf: &[u8]) -> Result<Option<(SocketAddr, usize)>, &'static str> {
    let (Some(&version), Some(&family)) = (buf.first(), buf.get(1)) else {
        return Ok(None);
    };
    if version != VERSION {
        return Err("unknown lane version");
    }
    let len = match family {
        4 => 4,
        6 => 16,
        _ => return Err("unknown address family"),
    };
    let Some(rest) = buf.get(2..2 + len + 2) else {
        return Ok(None);
    };
    let port = u16::from_be_bytes([rest[len], rest[len + 1]]);
    let ip = match family {
        4 => IpAddr::V4(Ipv4Addr::new(rest[0], rest[1], rest[2], rest[3])),
        _ => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&rest[..16]);
            IpAddr::V6(Ipv6Addr::from(o))
        }
    };
    Ok(Some((SocketAddr::new(ip, port), 2 + len + 2)))
}

pub fn encode_answer(o: Outcome) -> [u8; ANSWER_LEN] {
    [VERSION, o.to_wire()]
}

pub fn decode_answer(b: &[u8; ANSWER_LEN]) -> Option<Outcome> {
    (b[0] == VERSION).then_some(())?;
    Outcome::from_wire(b[1])
}

/// Whether the server opens a connection to `dst` for a client: not to its own host or to
/// addresses that are no single host on the internet.
pub fn allowed(dst: SocketAddr) -> bool {
    let ip = dst.ip();
    let v4_bad =
        |a: Ipv4Addr| a.is_loopback() || a.is_unspecified() || a.is_multicast() || a.is_broadcast();
    dst.port() != 0
        && match ip {
            IpAddr::V4(a) => !v4_bad(a),
            IpAddr::V6(a) => {
                !(a.is_loopback() || a.is_unspecified() || a.is_multicast())
                    && a.to_ipv4_mapped().is_none_or(|m| !v4_bad(m))
            }
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_answers_round_trip_and_bad_ones_are_errors() {
        for dst in ["203.0.113.7:443", "[2001:db8::1]:80"] {
            let dst: SocketAddr = dst.parse().unwrap();
            let mut wire = encode_request(dst);
            let n = wire.len();
            for cut in 0..n {
                assert_eq!(decode_request(&wire[..cut]), Ok(None), "{cut}");
            }
            wire.extend_from_slice(b"GET /");
            assert_eq!(decode_request(&wire), Ok(Some((dst, n))));
        }
        assert_eq!(
            encode_request("10.0.0.1:22".parse().unwrap()),
            [1, 4, 10, 0, 0, 1, 0, 22]
        );
        assert!(decode_request(&[2, 4]).is_err());
        assert!(decode_request(&[1, 5]).is_err());
        for o in [
            Outcome::Connected,
            Outcome::Refused,
            Outcome::Unreachable,
            Outcome::TimedOut,
            Outcome::NotAllowed,
        ] {
            assert_eq!(decode_answer(&encode_answer(o)), Some(o));
        }
        assert_eq!(decode_answer(&[1, 9]), None);
        assert_eq!(decode_answer(&[0, 0]), None);
    }

    #[test]
    fn the_server_opens_no_connection_to_its_own_host() {
        for bad in [
            "127.0.0.1:80",
            "0.0.0.0:80",
            "224.0.0.1:80",
            "255.255.255.255:80",
            "[::1]:80",
            "[::ffff:127.0.0.1]:80",
            "8.8.8.8:0",
        ] {
            assert!(!allowed(bad.parse().unwrap()), "{bad}");
        }
        for good in ["8.8.8.8:53", "10.99.0.1:5201", "[2001:db8::1]:443"] {
            assert!(allowed(good.parse().unwrap()), "{good}");
        }
    }
}
