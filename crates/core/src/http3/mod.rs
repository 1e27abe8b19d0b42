//! The HTTP/3 that CONNECT-IP needs (RFC 9114), sans I/O: frames on a stream, the settings
//! (Extended CONNECT, HTTP Datagrams), QPACK field sections with the static table only. The
//! binary's shell moves the bytes between these and QUIC streams.
//!
//! - `frame`: frames read as a stream's bytes arrive, and written; stream types; error codes.
//! - `qpack`: field sections decoded (static table, literals, Huffman) and encoded.
//! - `server`: the server's side of one connection: stream events in, requests, capsules and
//!   stream or connection errors out. `client`: the client's side, one request.
//! - `uni`: the peer's unidirectional streams, and `body`: an answered request's capsules,
//!   each the same at both ends.
//! - `tables`: the static table and the Huffman code, as the RFCs give them.

pub mod body;
pub mod client;
pub mod frame;
pub mod qpack;
pub mod server;
pub mod tables;
pub mod uni;

pub use frame::{Frame, FrameReader, H3Error, On, Settings};
