//! Forward error correction between the bond and a path's transport: Reed-Solomon groups of
//! inner packets with repair packets, per path (a group's packets share one path, so they see
//! that path's loss). Sans-IO: the shell hands the encoder each packet it sends on the path and
//! sends the repair packets it returns; it hands the decoder each FEC datagram it receives and
//! delivers what it recovers.
//!
//! - Data packets are sent and delivered at once, never held for their group: a 4-byte header
//!   in front (`wire::FEC_DATA`) and a copy kept by the encoder until the group closes.
//! - A group closes after `k` packets or `MAX_GROUP_DELAY`, whichever is first; its `m` repair
//!   packets follow at once. A partial group's repairs cover only the packets it has (its header
//!   carries the real `k`), so a lone ping is protected within `MAX_GROUP_DELAY`.
//! - `auto` picks `m` from the loss measured on the path (`redundancy.rs`): none on a clean
//!   path (packets go bare, no header, no copy), more as loss grows.
//! - The decoder keeps a bounded number of groups for a bounded time whatever arrives, and
//!   recovers a missing packet as soon as any `k` of the group's `k + m` shards are in.
//!
//! Wire format: docs/PROTOCOL.md ("FEC"), with test vectors in `wire.rs`.

mod codec;
pub mod decoder;
mod encoder;
pub mod redundancy;

use std::fmt;
use std::time::Duration;

pub use decoder::Decoder;
pub use encoder::Encoder;

/// Bounds of a group (also what the wire accepts): GF(2^8) allows 256 shards in all.
pub const MAX_DATA: usize = 64;
pub const MAX_REPAIR: usize = 32;
/// Data packets per group in `auto` mode: the seed's stripe default (10 data shards).
pub const AUTO_DATA: usize = 10;
/// A group is closed (its repairs sent) this long after its first packet even when not full,
/// so slow traffic is protected within milliseconds. It bounds how late a rebuilt packet is;
/// shorter closes more partial groups at low rates, which cost more repair per data packet
/// (5 ms measured 54% overhead at 10 Mbit/s and 5% loss where full groups need 40%).
pub const MAX_GROUP_DELAY: Duration = Duration::from_millis(10);

/// How much redundancy a tunnel's paths carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FecMode {
    /// No FEC: packets go bare.
    #[default]
    Off,
    /// Groups of `AUTO_DATA`, repair count from each path's measured loss (none when clean).
    Auto,
    /// Always `k` data and `m` repair packets per group.
    Fixed { k: u8, m: u8 },
}

impl FecMode {
    /// `off`, `auto` or `K/M` (e.g. `10/2`).
    pub fn parse(s: &str) -> Result<FecMode, String> {
        match s.trim() {
            "off" => return Ok(FecMode::Off),
            "auto" => return Ok(FecMode::Auto),
            _ => {}
        }
        let bad = || format!("fec must be off, auto or K/M (e.g. 10/2), not {s:?}");
        let (k, m) = s.trim().split_once('/').ok_or_else(bad)?;
        let k: usize = k.trim().parse().map_err(|_| bad())?;
        let m: usize = m.trim().parse().map_err(|_| bad())?;
        FecMode::fixed(k, m)
    }

    /// A fixed `k`/`m`, within the bounds of the wire format.
    pub fn fixed(k: usize, m: usize) -> Result<FecMode, String> {
        if !(1..=MAX_DATA).contains(&k) {
            return Err(format!("FEC data shards must be 1..={MAX_DATA}, not {k}"));
        }
        if m > MAX_REPAIR {
            return Err(format!(
                "FEC repair shards must be 0..={MAX_REPAIR}, not {m}"
            ));
        }
        if m == 0 {
            return Ok(FecMode::Off);
        }
        Ok(FecMode::Fixed {
            k: k as u8,
            m: m as u8,
        })
    }
}

impl fmt::Display for FecMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FecMode::Off => f.write_str("off"),
            FecMode::Auto => f.write_str("auto"),
            FecMode::Fixed { k, m } => write!(f, "{k}/{m}"),
        }
    }
}

/// What FEC did on one path (both directions: the encoder counts what it sent, the decoder
/// what it received and recovered).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FecCounters {
    /// Data packets sent with an FEC header, and their bytes.
    pub protected_packets: u64,
    pub protected_bytes: u64,
    /// Repair packets sent, and their bytes (the overhead).
    pub repair_sent: u64,
    pub repair_bytes: u64,
    /// Repair packets the transport refused (full buffer, too large): counted, not retried.
    pub repair_refused: u64,
    /// Repair packets received.
    pub repair_received: u64,
    /// Lost data packets rebuilt from repair packets and delivered.
    pub recovered: u64,
    /// Groups that ended with data missing and too few shards to rebuild it, and the data
    /// packets known lost in them (the residual loss FEC could not hide).
    pub unrecoverable_groups: u64,
    pub unrecovered_packets: u64,
    /// FEC datagrams that contradict their group (size or count mismatch): dropped.
    pub inconsistent: u64,
}

impl FecCounters {
    /// Repair bytes per protected data byte (0.2 = 20% more on the wire).
    pub fn overhead(&self) -> f64 {
        if self.protected_bytes == 0 {
            0.0
        } else {
            self.repair_bytes as f64 / self.protected_bytes as f64
        }
    }
}
