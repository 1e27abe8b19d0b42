//! Which new connections the server takes on, before anyone has authenticated: the only state
//! an unauthenticated peer can make the server hold is a handshake in flight, so those are
//! bounded, in all and per source address.
//!
//! - Below `RETRY_ABOVE` handshakes in flight, every Initial is taken (one round trip, as
//!   clients expect).
//! - From there on, a source that has not proved its address (a QUIC Retry token echoed back)
//!   is sent a Retry: a stateless answer, so a flood from spoofed sources, whose answers go
//!   nowhere, makes no handshake state at all, and a real client comes back one round trip
//!   later with the token.
//! - At `MAX_HANDSHAKES`, new Initials are dropped unanswered (a client resends its Initial),
//!   and one source may not hold more than `PER_SOURCE` handshakes (a site's paths and pipes
//!   connecting at once stay well below it).
//!
//! Every decision other than taking the connection is counted by the shell, by reason.

use std::collections::HashMap;
use std::net::IpAddr;

/// Handshakes in flight above which unvalidated sources get a Retry.
pub const RETRY_ABOVE: usize = 64;
/// Handshakes in flight at which new Initials are dropped.
pub const MAX_HANDSHAKES: usize = 1024;
/// Handshakes one source address may have in flight (a session may have 64 paths).
pub const PER_SOURCE: u32 = 64;

/// What to do with a new connection attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Take it: its handshake runs (call `done` when it ends, either way).
    Accept,
    /// Answer with a stateless Retry (counted `retry`).
    Retry,
    /// Drop it unanswered (counted by the reason).
    Ignore(&'static str),
}

/// Handshakes in flight, in all and per source.
#[derive(Debug, Default)]
pub struct Admission {
    in_flight: usize,
    per_source: HashMap<IpAddr, u32>,
}

impl Admission {
    /// A new connection attempt from `src`; `validated`: it echoed a Retry token, so `src` is
    /// really where it is.
    pub fn on_initial(&mut self, src: IpAddr, validated: bool) -> Verdict {
        if self.in_flight >= MAX_HANDSHAKES {
            return Verdict::Ignore("handshake_overload");
        }
        if self.in_flight >= RETRY_ABOVE && !validated {
            return Verdict::Retry;
        }
        let n = self.per_source.entry(src).or_default();
        if *n >= PER_SOURCE {
            return Verdict::Ignore("handshakes_per_source");
        }
        *n += 1;
        self.in_flight += 1;
        Verdict::Accept
    }

    /// The handshake of an accepted attempt from `src` ended (done, failed or timed out).
    pub fn done(&mut self, src: IpAddr) {
        if let Some(n) = self.per_source.get_mut(&src) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(&src);
            }
            self.in_flight -= 1;
        }
    }

    /// Handshakes in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Sources with a handshake in flight (bounded by `MAX_HANDSHAKES`).
    pub fn sources(&self) -> usize {
        self.per_source.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(n: u32) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + n))
    }

    #[test]
    fn a_spoofed_flood_gets_retries_and_makes_bounded_state() {
        let mut a = Admission::default();
        // Spoofed sources never finish their handshakes.
        let verdicts: Vec<_> = (0..100_000).map(|n| a.on_initial(ip(n), false)).collect();
        assert!(verdicts[..RETRY_ABOVE]
            .iter()
            .all(|v| *v == Verdict::Accept));
        assert!(verdicts[RETRY_ABOVE..].iter().all(|v| *v == Verdict::Retry));
        assert_eq!((a.in_flight(), a.sources()), (RETRY_ABOVE, RETRY_ABOVE));
        // A real client, validated by its Retry token, still gets in.
        assert_eq!(a.on_initial(ip(1 << 20), true), Verdict::Accept);
    }

    #[test]
    fn validated_sources_are_bounded_in_all_and_each() {
        let mut a = Admission::default();
        for _ in 0..PER_SOURCE {
            assert_eq!(a.on_initial(ip(1), true), Verdict::Accept);
        }
        assert_eq!(
            a.on_initial(ip(1), true),
            Verdict::Ignore("handshakes_per_source")
        );
        for n in 2.. {
            if a.in_flight() == MAX_HANDSHAKES {
                break;
            }
            assert_eq!(a.on_initial(ip(n), true), Verdict::Accept);
        }
        assert_eq!(
            a.on_initial(ip(0), true),
            Verdict::Ignore("handshake_overload")
        );
        // Handshakes that end free their places.
        a.done(ip(1));
        assert_eq!(a.on_initial(ip(1), true), Verdict::Accept);
    }

    #[test]
    fn done_returns_to_empty_and_ignores_strangers() {
        let mut a = Admission::default();
        for n in 0..10 {
            assert_eq!(a.on_initial(ip(n % 3), false), Verdict::Accept);
        }
        a.done(ip(99));
        for n in 0..10 {
            a.done(ip(n % 3));
        }
        assert_eq!((a.in_flight(), a.sources()), (0, 0));
    }
}
