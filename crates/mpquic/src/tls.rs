//! TLS 1.3 for QUIC, mutual authentication: the server proves itself with a certificate from the
//! deployment's CA, and so does every client. A client's identity is its certificate's CN.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

/// ALPN of this protocol version; a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"mpquic/4";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
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

pub fn server_crypto(cert: &Path, key: &Path, client_ca: &Path) -> Result<rustls::ServerConfig> {
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots(client_ca)?), provider())
            .build()
            .context("cannot build the client verifier")?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .context("server certificate and key do not match")?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

pub fn client_crypto(
    ca: Option<&Path>,
    insecure_skip_verify: bool,
    cert_key: Option<(&Path, &Path)>,
) -> Result<rustls::ClientConfig> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?;
    let builder = if insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoServerVerification(provider())))
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
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// The common name of the first certificate the peer presented: a client's identity.
pub fn peer_common_name(conn: &quinn::Connection) -> Option<String> {
    let any = conn.peer_identity()?;
    let certs = any.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(certs.first()?.as_ref()).ok()?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    Some(cn)
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
