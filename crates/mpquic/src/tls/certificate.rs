//! What the product reads from a certificate: its name (CN), serial and expiry. The server
//! names a client by its CN, revokes by CN or serial, and status shows when each certificate
//! expires.

use rustls::pki_types::CertificateDer;

/// A certificate's facts.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    /// The subject's common name, if it has one.
    pub name: Option<String>,
    /// The serial, hex (`normal_serial`).
    pub serial: String,
    /// The end of its validity, Unix time.
    pub not_after_unix: i64,
}

/// The facts of a DER certificate; `None` if it does not parse.
pub fn facts(der: &CertificateDer<'_>) -> Option<Facts> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let name = (cert.subject().iter_common_name().next())
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_string);
    let hex: String = cert
        .raw_serial()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Some(Facts {
        name,
        serial: normal_serial(&hex),
        not_after_unix: cert.validity().not_after.timestamp(),
    })
}

impl Facts {
    /// As status shows it, in `role` (`certificate`, `ca`, `client`).
    pub fn status(&self, role: &str) -> crate::status::CertificateStatus {
        crate::status::CertificateStatus {
            role: role.into(),
            name: self.name.clone().unwrap_or_default(),
            serial: self.serial.clone(),
            expires_unix: self.not_after_unix,
        }
    }
}

/// A serial as the product compares it: lower-case hex without separators or leading zeros
/// (`openssl x509 -serial` prints `0A1B`, other tools `0a:1b`; a DER integer may carry a
/// leading zero byte).
pub fn normal_serial(hex: &str) -> String {
    let digits: String = (hex.chars())
        .filter(|c| *c != ':')
        .map(|c| c.to_ascii_lowercase())
        .collect();
    match digits.trim_start_matches('0') {
        "" => "0".into(),
        s => s.into(),
    }
}

/// The facts of the first certificate the peer of `conn` presented (a client's, to the
/// server).
pub fn of_peer(conn: &quinn::Connection) -> Option<Facts> {
    let any = conn.peer_identity()?;
    let certs = any.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    facts(certs.first()?)
}

/// The facts of the first certificate in a PEM file (this instance's own, its CA).
pub fn of_file(path: &std::path::Path) -> Option<Facts> {
    facts(super::load_certs(path).ok()?.first()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_compare_in_one_spelling() {
        assert_eq!(normal_serial("0A:1b"), "a1b");
        assert_eq!(normal_serial("00a1B"), "a1b");
        assert_eq!(normal_serial("000"), "0");
    }
}
