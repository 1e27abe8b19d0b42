//! The link emulator's model: sans-IO, driven by `now`, deterministic per seed.

mod link;
mod rng;
pub mod spec;

pub use link::{Link, LinkStats};
pub use rng::Rng;
pub use spec::{LinkSpec, LinkState};
