//! The link model of mpquic's lab: one direction of an imperfect link (rate, delay, jitter,
//! loss and loss bursts, duplication, reordering, queues, per-flow caps, MTU, black holes, and recorded
//! delay, loss and capacity replayed: `trace`),
//! sans-IO, driven by `now`, deterministic per seed. The emulator (`mpquic-lab`) runs it on real
//! frames; the core's simulator (`crates/core/tests/sim.rs`) runs the tunnel over it in virtual
//! time, so both test against the same links.

mod link;
mod rng;
pub mod spec;
pub mod trace;
mod units;

pub use link::{Link, LinkStats};
pub use rng::Rng;
pub use spec::{Dir, LinkSpec, LinkState};
