//! Revoked client certificates (`revoked:` in the server's file): refused at the handshake,
//! after the CA's verification, with TLS's `certificate_revoked` alert, so the client's log
//! says why. A reload replaces the list (the server builds a new TLS configuration), and the
//! server closes the running sessions of clients it now revokes.

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, Error, SignatureScheme};

use super::certificate::{self, Facts};

/// The TLS alert a revoked client gets (RFC 8446 6.2: `certificate_revoked`); QUIC carries it
/// as the transport error 0x100 + 44, which is how the server tells this refusal from others.
pub const ALERT: u8 = 44;

/// Whether `revoked` (normalized as the config loader does) names this certificate.
pub fn is_revoked(revoked: &[String], cert: &Facts) -> bool {
    revoked.iter().any(|r| match r.strip_prefix("serial:") {
        Some(serial) => serial == cert.serial,
        None => cert.name.as_deref() == Some(r.as_str()),
    })
}

/// The CA's verifier, then the list.
#[derive(Debug)]
pub struct Verifier {
    pub inner: Arc<dyn ClientCertVerifier>,
    pub revoked: Vec<String>,
}

impl ClientCertVerifier for Verifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }
    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        match certificate::facts(end_entity) {
            Some(f) if is_revoked(&self.revoked, &f) => {
                tracing::warn!(client = f.name.as_deref().unwrap_or("?"), serial = %f.serial, "revoked certificate refused");
                Err(Error::InvalidCertificate(CertificateError::Revoked))
            }
            _ => Ok(verified),
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_or_a_serial_revokes() {
        let cert = Facts {
            name: Some("site1".into()),
            serial: "a1b".into(),
            not_after_unix: 0,
        };
        assert!(is_revoked(&["site1".into()], &cert));
        assert!(is_revoked(&["x".into(), "serial:a1b".into()], &cert));
        assert!(!is_revoked(&["site2".into(), "serial:a1c".into()], &cert));
        // A name that looks like a serial is a name.
        assert!(!is_revoked(&["a1b".into()], &cert));
    }
}
