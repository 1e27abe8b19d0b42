//! Putting a path's or a bond's packets back in order at the receiver: `reseq` (the bond's
//! resequencer across paths), `reassembly` (a path's stream of frames from QUIC's chunks),
//! `playout` (a stream's frames released at a steady delay).

pub mod playout;
pub mod reassembly;
pub mod reseq;
