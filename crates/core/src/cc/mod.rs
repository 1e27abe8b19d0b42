//! Congestion controllers of our own: pure state machines driven by the QUIC engine's events
//! (packets sent, acknowledged, declared lost) and an injected clock, tested in virtual time
//! (`tests/cc.rs`) against modelled bottlenecks with random loss. The shell plugs them into the
//! engine through a thin adapter (the `mpquic` crate's `quic.rs`).
//!
//! Why our own: quinn's controllers read any loss as congestion (cubic, newreno, and its BBRv1
//! port, which enters recovery on loss). On the links this product is for, loss is mostly random
//! (radio), and a tunnel that halves its rate on every loss is slower than no tunnel (lab
//! scenario 02). RFC 9298 section 7: the outer controller must stay, but should judge congestion
//! by queueing, not by random loss.

// `bbr`: the default, loss-blind beyond its model; `bbr3`: BBRv3, for bottlenecks shared with
// loss-based senders.
pub mod bbr;
pub mod bbr3;
mod delivery;

/// The congestion controllers a configuration names (`congestion_algorithm`): ours, and the
/// QUIC engine's (quinn's, loss-based), which the shell plugs in by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    /// `bbr`: ours (`bbr.rs`), the default: model-based, random loss does not slow it down.
    Bbr,
    /// `bbr3`: ours (`bbr3.rs`, BBRv3): also bounds its volume where probes met more than 2%
    /// loss, so it shares a bottleneck with loss-based flows.
    Bbr3,
    /// The QUIC engine's: `cubic`, `newreno`, and `quinn-bbr` (its BBRv1 port, which enters
    /// recovery on any loss), kept for comparison.
    Cubic,
    Newreno,
    QuinnBbr,
}

impl Congestion {
    /// The names a configuration may use, as `as_str` spells them.
    pub const NAMES: &'static [&'static str] = &["bbr", "bbr3", "cubic", "newreno", "quinn-bbr"];

    pub fn as_str(self) -> &'static str {
        match self {
            Congestion::Bbr => "bbr",
            Congestion::Bbr3 => "bbr3",
            Congestion::Cubic => "cubic",
            Congestion::Newreno => "newreno",
            Congestion::QuinnBbr => "quinn-bbr",
        }
    }

    /// By name; `bbr-model` is `bbr`'s earlier name.
    pub fn parse(s: &str) -> Option<Congestion> {
        match s {
            "bbr-model" => Some(Congestion::Bbr),
            _ => (Self::NAMES.iter().position(|n| *n == s)).map(|i| Self::ALL[i]),
        }
    }

    /// One of ours, which the stripe transport can run outside the QUIC engine.
    pub fn is_ours(self) -> bool {
        matches!(self, Congestion::Bbr | Congestion::Bbr3)
    }

    const ALL: [Congestion; 5] = [
        Congestion::Bbr,
        Congestion::Bbr3,
        Congestion::Cubic,
        Congestion::Newreno,
        Congestion::QuinnBbr,
    ];
}
mod filters;

use std::fmt::Debug;
use std::time::Instant;

pub use bbr::Bbr;
pub use bbr3::Bbr3;

/// What a controller needs to hear from the engine, and what it decides.
pub trait Controller: Debug + Send + Sync {
    /// `bytes` of ack-eliciting data left at `now`.
    fn on_sent(&mut self, now: Instant, bytes: u64);
    /// A packet of `bytes` sent at `sent` was acknowledged at `now`. `app_limited`: the sender
    /// had nothing more to send before this acknowledgement (the rate it shows is not the path's).
    fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool);
    /// The acknowledgements of one ACK frame are all in; `in_flight` is what remains unacked.
    fn on_end_acks(&mut self, now: Instant, in_flight: u64);
    /// Packets were declared lost (`lost_bytes`; the latest sent at `sent`). `persistent`: every
    /// packet over a persistent-congestion period was lost (the path stopped carrying anything).
    fn on_loss(&mut self, now: Instant, sent: Instant, persistent: bool, lost_bytes: u64);
    /// The path's datagram size changed.
    fn on_mtu(&mut self, mtu: u16);
    /// Bytes that may be in flight.
    fn window(&self) -> u64;
    /// The window the tunnel sizes the backlog in front of the path by (its send queue, its
    /// stream's send window): `window()`, except while the controller holds the window down
    /// for a moment (BBR's Drain and ProbeRtt, and the round trips it takes to grow back), when
    /// it is the window the controller returns to. Such a dip is not the path slowing down:
    /// bounded by it, the backlog refused the inner flows' packets as if it were (one upload on
    /// a 50 Mbit/s link with 15 ms of jitter: 394 refused in 12 s, none with this), where
    /// waiting the dip out costs them a bump of delay.
    fn backlog_window(&self) -> u64 {
        self.window()
    }
    /// The window a fresh connection starts with.
    fn initial_window(&self) -> u64;
    /// The rate the controller wants to send at (bytes/s), once it has one.
    fn pacing_rate(&self) -> Option<u64>;
    /// A copy of the controller's state (the engine asks for one for status, or for a migrated
    /// path).
    fn clone_box(&self) -> Box<dyn Controller>;
    /// Keep the bottleneck's queue short for traffic of higher classes sharing the path
    /// (`Bbr::yielding`); a controller without such a mode ignores it.
    fn set_yielding(&mut self, _yielding: bool) {}
    /// The sender had nothing waiting to be sent (its queue was empty) at some point since the
    /// last `on_end_acks`: what it sends is what its traffic offers, not what the path takes. A
    /// controller that does not tell such rounds apart ignores it.
    fn on_idle(&mut self) {}
    /// Packets have lately been acknowledged out of the order they were sent in: the path
    /// reorders, and its delivery-rate samples may run high (`Bbr::reorders`). The sender then
    /// does not save up for bursts after a quiet spell (`Pacer::idle`). A controller that does
    /// not watch for it says no.
    fn reorders(&self) -> bool {
        false
    }
}
