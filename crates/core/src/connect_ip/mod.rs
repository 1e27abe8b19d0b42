//! IP proxying over HTTP/3 (CONNECT-IP, RFC 9484), the parts that decide and parse, for the
//! server that serves standard clients and the client that dials standard servers:
//!
//! - `capsule`: the capsules on a request's stream (RFC 9297 section 3.2): ADDRESS_ASSIGN,
//!   ADDRESS_REQUEST, ROUTE_ADVERTISEMENT and DATAGRAM parsed and written, unknown ones skipped
//!   without being buffered, malformed ones an error (the caller aborts the request's stream).
//! - `datagram`: an HTTP Datagram's prefix in a QUIC DATAGRAM frame (the request's quarter
//!   stream ID, then the context ID; context 0 carries a full IP packet).
//! - `template`: the URI template a request's path is matched against (`{target}`,
//!   `{ipproto}`), and the scope it asks for.
//! - `request`: a request judged (who asks, for what, or the status that refuses it), a
//!   client's request written and the answer checked.
//! - `token`: the salted hashes of the bearer tokens clients without a certificate present.

pub mod capsule;
pub mod datagram;
pub mod request;
pub mod template;
pub mod token;

pub use capsule::{AddressEntry, Capsule, CapsuleError, CapsuleReader, IpRange};
pub use template::{Scope, Template};
pub use token::TokenHash;
