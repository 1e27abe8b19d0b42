//! mpquic-lab: link emulator, lab topologies and scenario runner (issue 3, in progress).
//!
//! Done: the emulator's model (`emu`), tested in virtual time (`tests/emu_model.rs`).
//! Next: the I/O shell that bridges a lab's WAN links through the model, `up/show/down/set`,
//! the scenario runner and the scenario catalogue.

pub mod emu;
