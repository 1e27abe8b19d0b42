//! mpquic-core: everything in mpquic that decides, with no sockets, no async runtime and an
//! injected clock (`now: Instant` arguments). The I/O shell in the `mpquic` crate feeds it events;
//! the deterministic simulator in `tests/sim.rs` feeds it modelled links in virtual time.

pub mod ackwatch;
pub mod addressing;
pub mod admission;
pub mod bond;
pub mod budget;
pub mod cc;
pub mod classify;
pub mod coalesce;
pub mod connect_ip;
pub mod drops;
pub mod fec;
pub mod flow;
pub mod harness;
pub mod health;
pub mod http3;
pub mod icmp;
pub mod loss;
pub mod mtu;
pub mod pacing;
pub mod packet;
pub mod paths;
pub mod playout;
pub mod pmtu;
pub mod reassembly;
pub mod reconnect;
pub mod recovery;
pub mod reliable;
pub mod reseq;
pub mod router;
pub mod scheduler;
pub mod sendq;
pub mod sessions;
pub mod standby;
pub mod stripe;
pub mod tunnel;
pub mod varint;
pub mod wire;

pub use bond::{Bond, Route};
pub use drops::{DropReason, Drops};
pub use health::{HealthConfig, HealthMode, PathHealth, PathState, PeerView};
pub use packet::PacketInfo;
pub use paths::{PathCounters, PathId, PathLoad, PathSet, PathSpec, ProbeDue, Transition};
pub use router::Router;
pub use scheduler::{Policy, Scheduler};
