//! The MPTCP lane (`tcp_lane: mptcp`): a traffic class's TCP connections carried over kernel
//! MPTCP instead of the tunnel, one lane connection per LAN connection, its subflows on the
//! client's paths; TLS 1.3 with the client's certificate inside. The server opens the TCP
//! connection to the destination and relays (`serve.rs`); the client takes the LAN host's
//! connection (`carry.rs`). The request and answer are the core's (`tcp_lane.rs`).

mod ahead;
pub mod carry;
pub mod client;
mod counted;
mod dial;
pub mod endpoints;
mod netlink;
mod nft;
pub mod serve;
mod socket;
mod subflows;
pub mod tproxy;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use mpquic_core::tcp_lane::Outcome;

/// Counts kept by `Outcome::failure_index`, by the outcome's name (status).
fn failures(counts: &[AtomicU64; 4]) -> BTreeMap<String, u64> {
    (Outcome::FAILURES.iter())
        .zip(counts)
        .map(|(o, c)| (o.as_str().to_string(), c.load(Ordering::Relaxed)))
        .collect()
}
