//! QUIC key updates, counted. quinn updates a connection's 1-RTT keys on its own: the first
//! time after 10-1000 packets (so every connection that carries traffic exercises the
//! mechanism early), then before the AEAD's confidentiality limit (RFC 9001 6.6: 2^23 packets
//! for AES-GCM, ~12 GB of full packets). Nothing of that is visible through quinn's API, so the
//! crypto session is wrapped here to count it: status and metrics show the count, and the
//! end-to-end test asserts that keys changed under traffic without a lost packet.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use quinn::crypto::{
    ClientConfig, ExportKeyingMaterialError, HeaderKey, KeyPair, Keys, PacketKey, ServerConfig,
    Session, UnsupportedVersion,
};
use quinn_proto::transport_parameters::TransportParameters;
use quinn_proto::{ConnectError, ConnectionId, Side, TransportError};

/// Key updates since start, process-wide (the first 1-RTT keys of a connection are not one).
static UPDATES: AtomicU64 = AtomicU64::new(0);

pub fn updates() -> u64 {
    UPDATES.load(Ordering::Relaxed)
}

/// A client's QUIC crypto whose sessions count their key updates.
pub struct CountedClient<C>(pub Arc<C>);

impl<C: ClientConfig + 'static> ClientConfig for CountedClient<C> {
    fn start_session(
        self: Arc<Self>,
        version: u32,
        server_name: &str,
        params: &TransportParameters,
    ) -> Result<Box<dyn Session>, ConnectError> {
        let inner = self.0.clone().start_session(version, server_name, params)?;
        Ok(Box::new(Counted { inner, keys: 0 }))
    }
}

/// A server's QUIC crypto whose sessions count their key updates.
pub struct CountedServer<S>(pub Arc<S>);

impl<S: ServerConfig + 'static> ServerConfig for CountedServer<S> {
    fn initial_keys(
        &self,
        version: u32,
        dst_cid: &ConnectionId,
    ) -> Result<Keys, UnsupportedVersion> {
        self.0.initial_keys(version, dst_cid)
    }
    fn retry_tag(&self, version: u32, orig_dst_cid: &ConnectionId, packet: &[u8]) -> [u8; 16] {
        self.0.retry_tag(version, orig_dst_cid, packet)
    }
    fn start_session(
        self: Arc<Self>,
        version: u32,
        params: &TransportParameters,
    ) -> Box<dyn Session> {
        let inner = self.0.clone().start_session(version, params);
        Box::new(Counted { inner, keys: 0 })
    }
}

struct Counted {
    inner: Box<dyn Session>,
    /// Next 1-RTT key generations handed out: quinn takes one when the handshake completes
    /// and one at each key update.
    keys: u64,
}

impl Session for Counted {
    fn next_1rtt_keys(&mut self) -> Option<KeyPair<Box<dyn PacketKey>>> {
        let keys = self.inner.next_1rtt_keys()?;
        self.keys += 1;
        if self.keys > 1 {
            UPDATES.fetch_add(1, Ordering::Relaxed);
        }
        Some(keys)
    }
    fn initial_keys(&self, dst_cid: &ConnectionId, side: Side) -> Keys {
        self.inner.initial_keys(dst_cid, side)
    }
    fn handshake_data(&self) -> Option<Box<dyn Any>> {
        self.inner.handshake_data()
    }
    fn peer_identity(&self) -> Option<Box<dyn Any>> {
        self.inner.peer_identity()
    }
    fn early_crypto(&self) -> Option<(Box<dyn HeaderKey>, Box<dyn PacketKey>)> {
        self.inner.early_crypto()
    }
    fn early_data_accepted(&self) -> Option<bool> {
        self.inner.early_data_accepted()
    }
    fn is_handshaking(&self) -> bool {
        self.inner.is_handshaking()
    }
    fn read_handshake(&mut self, buf: &[u8]) -> Result<bool, TransportError> {
        self.inner.read_handshake(buf)
    }
    fn transport_parameters(&self) -> Result<Option<TransportParameters>, TransportError> {
        self.inner.transport_parameters()
    }
    fn write_handshake(&mut self, buf: &mut Vec<u8>) -> Option<Keys> {
        self.inner.write_handshake(buf)
    }
    fn is_valid_retry(&self, orig_dst_cid: &ConnectionId, header: &[u8], payload: &[u8]) -> bool {
        self.inner.is_valid_retry(orig_dst_cid, header, payload)
    }
    fn export_keying_material(
        &self,
        output: &mut [u8],
        label: &[u8],
        context: &[u8],
    ) -> Result<(), ExportKeyingMaterialError> {
        self.inner.export_keying_material(output, label, context)
    }
}
