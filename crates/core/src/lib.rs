//! mpquic-core: everything in mpquic that decides, with no sockets, no async runtime and an
//! injected clock (`now: Instant` arguments). The I/O shell in the `mpquic` crate feeds it events;
//! the deterministic simulator in `tests/sim.rs` feeds it modelled links in virtual time.

pub mod addressing;
pub mod admission;
pub mod bond;
pub mod cc;
pub mod classify;
pub mod connect_ip;
pub mod drops;
pub mod fec;
pub mod harness;
pub mod http3;
pub mod pacing;
pub mod packet;
pub mod path;
pub mod recovery;
pub mod reliable;
pub mod reorder;
pub mod role;
pub mod sendq;
pub mod sessions;
pub mod stripe;
pub mod tcp_lane;
pub mod tunnel;
pub mod varint;
pub mod wire;

pub use bond::router::Router;
pub use bond::scheduler::{Policy, Scheduler};
pub use bond::{Bond, Route};
pub use drops::{DropReason, Drops};
pub use packet::PacketInfo;
pub use path::health::{HealthConfig, HealthMode, PathHealth, PathState, PeerView};
pub use path::{PathCounters, PathId, PathLoad, PathSet, PathSpec, ProbeDue, Transition};
pub use role::Role;
