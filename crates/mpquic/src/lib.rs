//! mpquic: multipath QUIC VPN. See README.md and docs/.
//!
//! The library holds everything the `mpquic` command runs (src/main.rs is its command line):
//! the client and server shells, their transports and I/O, configuration and control. It is a
//! library so the fuzz targets (fuzz/) reach the parsers that files and peers feed (the
//! configuration loader, the hello, the control socket and the dashboard), and so the
//! in-process tests (tests/inprocess.rs) run whole clients and servers on the in-memory
//! network (`io::memnet`).

mod budgets;
pub mod client;
pub mod config;
pub mod control;
pub mod harness;
pub mod hello;
pub mod io;
pub mod lane;
pub mod pki;
pub mod runtime;
pub mod server;
/// The status report's types live in their own crate, shared with the lab.
pub use mpquic_status as status;
mod tls;
pub mod transport;
mod tunnel;
