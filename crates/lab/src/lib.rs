//! mpquic-lab: link emulator, lab topologies and scenario runner (docs/LAB.md).
//!
//! - `emu`: the emulator's model (crate `mpquic-linkmodel`, sans-IO, tested in virtual time);
//! - `bridge`: its I/O shell (AF_PACKET, one thread per path direction; frames read from a
//!   shared ring, `packet_ring`), with `timing`
//!   (arrival times from kernel stamps, the adaptive spin before deadlines);
//! - `topo`: namespaces and links of a lab, one or more clients (`mpquic-lab up/show/down/set/link`);
//! - `scenario`: scenario and VPN definition files;
//! - `runner`: `mpquic-lab run SCENARIO.yaml --out DIR` (lab, traffic, schedule, sampling);
//! - `mpquic_conf`: mpquic's PKI and configurations for a lab (`mpquic-lab configs`);
//! - `sut`: the systems under test started in a lab (mpquic, other VPNs from commands);
//! - `report`, `plot`: report.md and the PNG plots from results.json (`mpquic-lab plot DIR`);
//! - `nat`: a carrier-grade NAT on a path (`mpquic-lab nat`), mappings dropped on a rebind;
//! - `flood`: spoofed unauthenticated traffic at a server (`mpquic-lab flood`);
//! - `voice`, `web`: a voice-like call and web-like transfers for scenarios (`mpquic-lab voice`,
//!   `mpquic-lab web`), with the figures each is judged by;
//! - `stalls`: how long inner TCP flows go without progress, from the receiver's ACKs
//!   (`mpquic-lab stalls`, beside each TCP transfer).

pub mod bridge;
pub mod flood;
/// The link model, from its own crate (shared with the core's simulator).
pub use mpquic_linkmodel as emu;
pub mod mpquic_conf;
pub mod nat;
pub mod packet_ring;
pub mod plot;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod stalls;
pub mod sut;
pub mod timing;
pub mod topo;
pub mod voice;
pub mod web;
