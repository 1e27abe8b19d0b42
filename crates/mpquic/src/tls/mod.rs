//! TLS 1.3 for QUIC (the build has no TLS 1.2), mutual authentication: the server proves itself
//! with a certificate from the deployment's CA, and so does every client. A client's identity is
//! its certificate's CN. The key exchange is post-quantum by default (`key_exchange.rs`); the
//! server refuses revoked clients (`revocation.rs`); both sides build their configuration from
//! the files again at each reload, so certificates rotate without a restart; what handshakes
//! negotiated, key updates and certificate expiry are counted for status (`key_exchange.rs`,
//! `key_update.rs`, `certificate.rs`).

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

pub mod certificate;
pub mod key_exchange;
pub mod key_update;
pub mod revocation;

pub use certificate::normal_serial;

/// ALPN of this protocol version; a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"mpquic/4";
/// HTTP/3's (RFC 9114), on the CONNECT-IP endpoint.
pub const ALPN_H3: &[u8] = b"h3";
/// The MPTCP lane's connections (`lane/`).
pub const ALPN_LANE: &[u8] = b"mpquic-lane/1";

/// What `mpquic status` shows of TLS: the key exchange and the certificates in use.
pub fn status(
    post_quantum: bool,
    certificates: Vec<crate::status::CertificateStatus>,
) -> crate::status::TlsStatus {
    crate::status::TlsStatus {
        post_quantum,
        key_exchanges: key_exchange::negotiated(),
        key_updates: key_update::updates(),
        certificates,
    }
}

/// This instance's certificate and its CA as just loaded, for status; one close to its end
/// (or past it) is logged as a warning.
pub fn loaded(cert: Option<&Path>, ca: Option<&Path>) -> Vec<crate::status::CertificateStatus> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let mut out = Vec::new();
    for (role, path) in [("certificate", cert), ("ca", ca)] {
        let Some(f) = path.and_then(certificate::of_file) else {
            continue;
        };
        let c = f.status(role);
        let days = c.days_left(now);
        if days < crate::status::EXPIRY_WARNING_DAYS {
            tracing::warn!(role, name = %c.name, days_left = days, file = %path.unwrap_or(Path::new("")).display(), "certificate expires soon");
        }
        out.push(c);
    }
    out
}

/// aws-lc-rs with the key exchange groups `tls_post_quantum` chooses (`key_exchange.rs`).
fn provider(post_quantum: bool) -> Arc<CryptoProvider> {
    // aws-lc seeds its random generator on first use, from CPU jitter: 22-24 ms on the lab
    // machine. Done here, while the instance sets up, the first handshake does not wait for
    // it (measured: a client's first handshake on a veth 26-28 ms without, 1.6-1.8 with).
    static SEEDED: std::sync::Once = std::sync::Once::new();
    SEEDED.call_once(|| {
        let _ = rustls::crypto::aws_lc_rs::default_provider()
            .secure_random
            .fill(&mut [0u8; 32]);
    });
    Arc::new(CryptoProvider {
        kx_groups: key_exchange::groups(post_quantum),
        ..rustls::crypto::aws_lc_rs::default_provider()
    })
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("cannot read certificates from {}", path.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("{} is not a PEM certificate file", path.display()))?;
    if certs.is_empty() {
        bail!("{} contains no certificate", path.display());
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path)
        .with_context(|| format!("cannot read a private key from {}", path.display()))
}

fn roots(ca: &Path) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    for c in load_certs(ca)? {
        store
            .add(c)
            .with_context(|| format!("{} is not a usable CA certificate", ca.display()))?;
    }
    Ok(store)
}

/// The server's TLS from its files (read now: a reload calls this again, so a rotated
/// certificate, key or CA takes effect for the next handshakes) and its `revoked:` list.
pub fn server_crypto(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
    post_quantum: bool,
    revoked: &[String],
    served: Served,
) -> Result<rustls::ServerConfig> {
    let provider = provider(post_quantum);
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots(client_ca)?), provider.clone());
    let verifier = match served {
        Served::Native | Served::Lane => verifier,
        // A certificate, when one is presented, is still verified (and checked against
        // `revoked`); without one the request's bearer token must name the client.
        Served::Http3 => verifier.allow_unauthenticated(),
    };
    let verifier = verifier
        .build()
        .context("cannot build the client verifier")?;
    let verifier = Arc::new(revocation::Verifier {
        inner: verifier,
        revoked: revoked.to_vec(),
    });
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .context("server certificate and key do not match")?;
    cfg.alpn_protocols = vec![alpn(served).to_vec()];
    Ok(cfg)
}

fn alpn(served: Served) -> &'static [u8] {
    match served {
        Served::Native => ALPN,
        Served::Http3 => ALPN_H3,
        Served::Lane => ALPN_LANE,
    }
}

/// What a server endpoint speaks: the native protocol (a client certificate required), or
/// HTTP/3 for standard CONNECT-IP clients (a certificate optional: a bearer token instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    Native,
    Http3,
    /// The MPTCP lane (TLS over a TCP/MPTCP connection; a client certificate required).
    Lane,
}

pub fn client_crypto(
    ca: Option<&Path>,
    insecure_skip_verify: bool,
    cert_key: Option<(&Path, &Path)>,
    post_quantum: bool,
    served: Served,
) -> Result<rustls::ClientConfig> {
    let provider = provider(post_quantum);
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])?;
    let builder = if insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoServerVerification(provider)))
    } else {
        let ca = ca.ok_or_else(|| anyhow!("tls_ca_file is required to verify the server"))?;
        builder.with_root_certificates(roots(ca)?)
    };
    let mut cfg = match cert_key {
        Some((c, k)) => builder
            .with_client_auth_cert(load_certs(c)?, load_key(k)?)
            .context("client certificate and key do not match")?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![alpn(served).to_vec()];
    Ok(cfg)
}

/// `tls_insecure_skip_verify: true`: any server certificate is accepted, but handshake signatures
/// are still checked (the channel stays encrypted, only the server's identity is unknown).
#[derive(Debug)]
struct NoServerVerification(Arc<CryptoProvider>);

impl ServerCertVerifier for NoServerVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki;
    use rustls::{ClientConnection, NamedGroup, ServerConnection};

    /// A deployment's files: CA, the server's and one client's certificate.
    fn files() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        pki::init(dir.path(), false).unwrap();
        pki::issue(dir.path(), "srv", pki::Kind::Server { sans: vec![] }).unwrap();
        pki::issue(dir.path(), "site1", pki::Kind::Client).unwrap();
        dir
    }

    /// One TLS 1.3 handshake in memory between the configurations the product builds; the
    /// group it negotiated, as each side saw it.
    fn handshake(dir: &Path, client_pq: bool, server_pq: bool) -> (NamedGroup, NamedGroup) {
        let d = |f: &str| dir.join(f);
        let server = server_crypto(
            &d("srv.crt"),
            &d("srv.key"),
            &d("ca.crt"),
            server_pq,
            &[],
            Served::Native,
        )
        .unwrap();
        let client = client_crypto(
            Some(&d("ca.crt")),
            false,
            Some((&d("site1.crt"), &d("site1.key"))),
            client_pq,
            Served::Native,
        )
        .unwrap();
        let mut c =
            ClientConnection::new(Arc::new(client), ServerName::try_from("srv").unwrap()).unwrap();
        let mut s = ServerConnection::new(Arc::new(server)).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets().unwrap();
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets().unwrap();
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
        }
        assert!(
            !c.is_handshaking() && !s.is_handshaking(),
            "handshake did not finish"
        );
        let group = |g: Option<&'static dyn rustls::crypto::SupportedKxGroup>| g.unwrap().name();
        (
            group(c.negotiated_key_exchange_group()),
            group(s.negotiated_key_exchange_group()),
        )
    }

    #[test]
    fn post_quantum_by_default_and_classic_when_either_side_turns_it_off() {
        let dir = files();
        let pq = NamedGroup::X25519MLKEM768;
        let before = key_exchange::negotiated();
        assert_eq!(handshake(dir.path(), true, true), (pq, pq));
        // Counted on both sides (other tests may handshake at the same time: at least 2).
        let after = key_exchange::negotiated();
        let n =
            |m: &std::collections::BTreeMap<String, u64>| *m.get("X25519MLKEM768").unwrap_or(&0);
        assert!(n(&after) >= n(&before) + 2, "{before:?} -> {after:?}");
        for (c, s) in [(true, false), (false, true), (false, false)] {
            let x = NamedGroup::X25519;
            assert_eq!(
                handshake(dir.path(), c, s),
                (x, x),
                "client pq {c}, server pq {s}"
            );
        }
        assert!(key_exchange::is_post_quantum(pq));
        assert!(!key_exchange::is_post_quantum(NamedGroup::X25519));
    }

    #[test]
    fn the_default_configuration_asks_for_post_quantum_keys() {
        let parse = |text: &str| crate::config::Config::parse(text, Path::new("t.yaml")).unwrap();
        let client = "role: client\nremote_addr: 1.2.3.4\ntls_ca_file: ca\n";
        assert!(parse(client).tls_post_quantum);
        assert!(!parse(&format!("{client}tls_post_quantum: false\n")).tls_post_quantum);
    }
}
