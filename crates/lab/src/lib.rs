//! mpquic-lab: link emulator, lab topologies and scenario runner (issue 3, in progress).
//!
//! - `emu`: the emulator's model, sans-IO, tested in virtual time (`tests/emu_model.rs`);
//! - `bridge`: its I/O shell (AF_PACKET, one thread per path direction);
//! - `topo`: namespaces and links of a lab (`mpquic-lab up/show/down/set`).
//!
//! - `scenario`, `runner`: `mpquic-lab run SCENARIO.yaml --out DIR` (results.json, report.md).
//!
//! Next: PNG plots, the full scenario catalogue, other VPNs as systems under test.

pub mod bridge;
pub mod emu;
pub mod plot;
pub mod runner;
pub mod scenario;
pub mod topo;
