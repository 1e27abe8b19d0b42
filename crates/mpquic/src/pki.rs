//! `mpquic pki`: a minimal CA for one deployment. The CA signs one certificate per server and per
//! client; a client's identity is the certificate's common name (`--name`). Keys are written 0600.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

const CA_VALIDITY_DAYS: i64 = 3650;
const LEAF_VALIDITY_DAYS: i64 = 825;

fn write_file(path: &Path, contents: &str, mode: u32) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(contents.as_bytes())?;
    Ok(())
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::days(1);
    params.not_after = now + Duration::days(days);
}

fn dn(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn.push(DnType::OrganizationName, "mpquic");
    dn
}

/// Names must be usable as file names and as certificate common names.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if !ok || name == "ca" {
        bail!("invalid name `{name}`: use letters, digits, '-', '_' or '.' (and not `ca`)");
    }
    Ok(())
}

pub fn init(dir: &Path, force: bool) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let (crt, key) = (dir.join("ca.crt"), dir.join("ca.key"));
    if crt.exists() && !force {
        bail!(
            "{} already exists; refusing to replace a CA (every certificate it signed would stop working). Use --force to replace it",
            crt.display()
        );
    }
    let key_pair = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = dn("mpquic CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, CA_VALIDITY_DAYS);
    let cert = params.self_signed(&key_pair)?;
    write_file(&key, &key_pair.serialize_pem(), 0o600)?;
    write_file(&crt, &cert.pem(), 0o644)?;
    println!("wrote {} and {}", crt.display(), key.display());
    Ok(())
}

fn load_ca(dir: &Path) -> Result<(Certificate, KeyPair)> {
    let crt = dir.join("ca.crt");
    let key = dir.join("ca.key");
    let ca_pem = std::fs::read_to_string(&crt).with_context(|| {
        format!(
            "cannot read {} (run `mpquic pki init --dir {}` first)",
            crt.display(),
            dir.display()
        )
    })?;
    let key_pem =
        std::fs::read_to_string(&key).with_context(|| format!("cannot read {}", key.display()))?;
    let key_pair = KeyPair::from_pem(&key_pem).context("ca.key is not a valid private key")?;
    let params = CertificateParams::from_ca_cert_pem(&ca_pem)
        .context("ca.crt is not a valid CA certificate")?;
    // Re-signing the parsed parameters yields an issuer with the same name and key, which is all
    // rcgen needs to sign leaves that verify against the original ca.crt.
    let ca = params.self_signed(&key_pair)?;
    Ok((ca, key_pair))
}

pub enum Kind {
    Server { sans: Vec<String> },
    Client,
}

pub fn issue(dir: &Path, name: &str, kind: Kind) -> Result<(PathBuf, PathBuf)> {
    check_name(name)?;
    let (ca, ca_key) = load_ca(dir)?;
    let (sans, eku) = match kind {
        Kind::Server { sans } => {
            let mut all = vec![name.to_string()];
            all.extend(sans);
            (all, ExtendedKeyUsagePurpose::ServerAuth)
        }
        Kind::Client => (vec![name.to_string()], ExtendedKeyUsagePurpose::ClientAuth),
    };
    let mut params = CertificateParams::new(sans).context("invalid --san")?;
    params.distinguished_name = dn(name);
    params.extended_key_usages = vec![eku];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    validity(&mut params, LEAF_VALIDITY_DAYS);
    let key_pair = KeyPair::generate()?;
    let cert = params.signed_by(&key_pair, &ca, &ca_key)?;
    let (crt_path, key_path) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    write_file(&key_path, &key_pair.serialize_pem(), 0o600)?;
    write_file(&crt_path, &cert.pem(), 0o644)?;
    println!("wrote {} and {}", crt_path.display(), key_path.display());
    Ok((crt_path, key_path))
}

/// `mpquic pki token NAME`: a bearer token for a CONNECT-IP client that has no certificate
/// (32 random bytes, `mpq_` and hex), and the server's `masque_tokens` entry for it (a salted
/// hash: the server's file never holds the token). Returns (token, entry).
pub fn token(name: &str) -> Result<(String, String)> {
    check_name(name)?;
    let rand = rustls::crypto::aws_lc_rs::default_provider().secure_random;
    let mut secret = [0u8; 32];
    let mut salt = [0u8; mpquic_core::connect_ip::token::SALT_LEN];
    rand.fill(&mut secret)
        .and_then(|()| rand.fill(&mut salt))
        .map_err(|_| anyhow::anyhow!("no random numbers from the system"))?;
    let token = format!("mpq_{}", mpquic_core::connect_ip::token::hex(&secret));
    let hash = mpquic_core::connect_ip::token::TokenHash::new(&token, &salt);
    let entry = format!("- name: {name}\n  hash: {hash}");
    Ok((token, entry))
}
