//! The key exchange groups this side offers and accepts, and a count of the ones its
//! handshakes negotiated (status, metrics and the log show it, so an operator can see that
//! post-quantum keys are in use rather than trust a setting).
//!
//! Post-quantum (`tls_post_quantum: true`, the default): the hybrid X25519MLKEM768 first, so
//! a recorded session stays secret from whoever later breaks X25519 alone; X25519 and P-256
//! beside it for peers that lack the hybrid (rustls's client sends the hybrid's X25519 half as
//! a second share, so a classic server answers without another round trip). Classic: X25519
//! and P-256 only, for a peer whose middleboxes choke on the larger ClientHello (the hybrid
//! share is 1216 bytes, which takes the ClientHello over one QUIC Initial).

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};

use rustls::crypto::aws_lc_rs::kx_group;
use rustls::crypto::{ActiveKeyExchange, CompletedKeyExchange, SharedSecret, SupportedKxGroup};
use rustls::{Error, NamedGroup, ProtocolVersion};

/// Handshakes completed with each group, process-wide.
static NEGOTIATED: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// The groups, wrapped to count; built once (rustls wants `&'static`).
static POST_QUANTUM: LazyLock<[Counted; 3]> = LazyLock::new(|| {
    [
        Counted(kx_group::X25519MLKEM768),
        Counted(kx_group::X25519),
        Counted(kx_group::SECP256R1),
    ]
});
static CLASSIC: LazyLock<[Counted; 2]> =
    LazyLock::new(|| [Counted(kx_group::X25519), Counted(kx_group::SECP256R1)]);

/// The groups, in preference order.
pub fn groups(post_quantum: bool) -> Vec<&'static dyn SupportedKxGroup> {
    let all: &'static [Counted] = match post_quantum {
        true => &*POST_QUANTUM,
        false => &*CLASSIC,
    };
    all.iter().map(|g| g as &dyn SupportedKxGroup).collect()
}

/// Handshakes completed so far, by group name (`X25519MLKEM768`, `X25519`, ...).
pub fn negotiated() -> BTreeMap<String, u64> {
    NEGOTIATED.lock().map(|m| m.clone()).unwrap_or_default()
}

/// Whether a group protects against a quantum adversary (the hybrids do).
pub fn is_post_quantum(group: NamedGroup) -> bool {
    matches!(
        group,
        NamedGroup::X25519MLKEM768 | NamedGroup::secp256r1MLKEM768 | NamedGroup::MLKEM768
    )
}

fn record(group: NamedGroup) {
    let name = format!("{group:?}");
    tracing::info!(
        group = %name,
        post_quantum = is_post_quantum(group),
        "TLS key exchange"
    );
    if let Ok(mut m) = NEGOTIATED.lock() {
        *m.entry(name).or_default() += 1;
    }
}

#[derive(Debug)]
struct Counted(&'static dyn SupportedKxGroup);

impl SupportedKxGroup for Counted {
    fn start(&self) -> Result<Box<dyn ActiveKeyExchange>, Error> {
        Ok(Box::new(CountedActive(self.0.start()?)))
    }
    /// The server's side: it completes at once with the group it chose.
    fn start_and_complete(&self, peer_pub_key: &[u8]) -> Result<CompletedKeyExchange, Error> {
        let done = self.0.start_and_complete(peer_pub_key)?;
        record(done.group);
        Ok(done)
    }
    fn name(&self) -> NamedGroup {
        self.0.name()
    }
    fn fips(&self) -> bool {
        self.0.fips()
    }
    fn usable_for_version(&self, version: ProtocolVersion) -> bool {
        self.0.usable_for_version(version)
    }
}

/// The client's side: it started a share and completes the one the server chose.
struct CountedActive(Box<dyn ActiveKeyExchange>);

impl ActiveKeyExchange for CountedActive {
    fn complete(self: Box<Self>, peer_pub_key: &[u8]) -> Result<SharedSecret, Error> {
        let group = self.0.group();
        let secret = self.0.complete(peer_pub_key)?;
        record(group);
        Ok(secret)
    }
    fn hybrid_component(&self) -> Option<(NamedGroup, &[u8])> {
        self.0.hybrid_component()
    }
    /// The server chose the classic half of the hybrid share the client sent.
    fn complete_hybrid_component(
        self: Box<Self>,
        peer_pub_key: &[u8],
    ) -> Result<SharedSecret, Error> {
        let group = self.0.hybrid_component().map(|(g, _)| g);
        let secret = self.0.complete_hybrid_component(peer_pub_key)?;
        if let Some(g) = group {
            record(g);
        }
        Ok(secret)
    }
    fn pub_key(&self) -> &[u8] {
        self.0.pub_key()
    }
    fn group(&self) -> NamedGroup {
        self.0.group()
    }
}
