//! Why a packet was not delivered. Every drop in the system is counted under one of these reasons;
//! status, metrics and the dashboard iterate `DropReason::ALL`, so there is no second list to drift.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Larger than the path can carry as one datagram.
    Oversized,
    /// No connected path to send on.
    NoPath,
    /// Server: inner destination belongs to no connected client.
    NoRoute,
    /// A bounded queue was full (backpressure, never unbounded buffering).
    QueueFull,
    /// Inner source address is not the sending client's tunnel address.
    SpoofedSource,
    /// Bytes that are not a valid IP packet or protocol message.
    Malformed,
    /// The QUIC engine refused the datagram or the stream write failed.
    SendFailed,
    /// The kernel refused a packet written to the TUN device (not a packet it accepts there).
    TunRefused,
    /// A packet of the path's session whose tag did not verify (forged, corrupted, or sealed
    /// with another key: `stripe.rs`).
    Unauthenticated,
    /// A packet of the path's session seen before, or too old for the replay window.
    Replayed,
}

impl DropReason {
    pub const ALL: [DropReason; 10] = [
        DropReason::Oversized,
        DropReason::NoPath,
        DropReason::NoRoute,
        DropReason::QueueFull,
        DropReason::SpoofedSource,
        DropReason::Malformed,
        DropReason::SendFailed,
        DropReason::TunRefused,
        DropReason::Unauthenticated,
        DropReason::Replayed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Oversized => "oversized",
            DropReason::NoPath => "no_path",
            DropReason::NoRoute => "no_route",
            DropReason::QueueFull => "queue_full",
            DropReason::SpoofedSource => "spoofed_source",
            DropReason::Malformed => "malformed",
            DropReason::SendFailed => "send_failed",
            DropReason::TunRefused => "tun_refused",
            DropReason::Unauthenticated => "unauthenticated",
            DropReason::Replayed => "replayed",
        }
    }

    fn index(self) -> usize {
        DropReason::ALL
            .iter()
            .position(|r| *r == self)
            .expect("every reason is in ALL")
    }
}

/// Counters by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drops([u64; DropReason::ALL.len()]);

impl Drops {
    pub fn add(&mut self, r: DropReason) {
        self.add_n(r, 1);
    }
    pub fn add_n(&mut self, r: DropReason, n: u64) {
        self.0[r.index()] += n;
    }
    pub fn get(&self, r: DropReason) -> u64 {
        self.0[r.index()]
    }
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    pub fn iter(&self) -> impl Iterator<Item = (DropReason, u64)> + '_ {
        DropReason::ALL.iter().map(|r| (*r, self.get(*r)))
    }
    pub fn merge(&mut self, other: &Drops) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a += b;
        }
    }
}
