//! Standard MASQUE CONNECT-IP (RFC 9484 over HTTP/3, RFC 9114/9297/9220): the server's endpoint
//! for standard clients (`listen.rs`: its own UDP address, ALPN `h3`; `serve.rs`: one HTTP/3
//! connection's driver). The protocol itself is the core's, sans I/O
//! (`mpquic_core::http3`, `mpquic_core::connect_ip`); here are only the QUIC streams around it.
//! An accepted request becomes a session's path like any other: a `QuicTransport` carrying the
//! session's IP packets as HTTP Datagrams (`QuicTransport::http_datagrams`).

mod dial;
mod listen;
mod serve;
mod shared;
mod streams;

pub(crate) use dial::request;
pub use listen::{settings, MasqueListener};
