//! Bearer tokens for CONNECT-IP clients that have no certificate of ours (`Authorization:
//! Bearer TOKEN`). The server's file holds each token only as `sha256:SALT:DIGEST` (hex): the
//! SHA-256 of the salt then the token. A token is 32 random bytes (`mpquic pki token` makes
//! one), so one round of a hash is enough to make the file useless to whoever reads it (a slow
//! password hash guards guessable secrets; these are not guessable), and a request costs the
//! server one hash per configured token, compared in constant time.

use aws_lc_rs::constant_time::verify_slices_are_equal;
use aws_lc_rs::digest::{Context, SHA256, SHA256_OUTPUT_LEN};

/// Salt bytes a new hash takes.
pub const SALT_LEN: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenHash {
    salt: Vec<u8>,
    digest: [u8; SHA256_OUTPUT_LEN],
}

impl TokenHash {
    /// The hash of `token` under `salt` (the caller draws the salt at random).
    pub fn new(token: &str, salt: &[u8]) -> TokenHash {
        TokenHash {
            salt: salt.to_vec(),
            digest: digest(salt, token),
        }
    }

    /// `sha256:SALT:DIGEST` as the server's file holds it.
    pub fn parse(s: &str) -> Result<TokenHash, String> {
        let hint = "expected sha256:SALT:DIGEST in hex, as `mpquic pki token NAME` prints it";
        let mut parts = s.split(':');
        let (Some("sha256"), Some(salt), Some(digest), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(hint.into());
        };
        let salt = unhex(salt).filter(|s| s.len() >= 8).ok_or(hint)?;
        let digest = unhex(digest)
            .and_then(|d| <[u8; SHA256_OUTPUT_LEN]>::try_from(d).ok())
            .ok_or(hint)?;
        Ok(TokenHash { salt, digest })
    }

    /// Whether `token` is the one hashed, in time independent of where they differ.
    pub fn verify(&self, token: &str) -> bool {
        verify_slices_are_equal(&digest(&self.salt, token), &self.digest).is_ok()
    }
}

impl std::fmt::Display for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}:{}", hex(&self.salt), hex(&self.digest))
    }
}

fn digest(salt: &[u8], token: &str) -> [u8; SHA256_OUTPUT_LEN] {
    let mut c = Context::new(&SHA256);
    c.update(salt);
    c.update(token.as_bytes());
    let mut out = [0; SHA256_OUTPUT_LEN];
    out.copy_from_slice(c.finish().as_ref());
    out
}

/// Lower-case hex, as the hashes are written (and `mpquic pki token` writes tokens).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_verifies_its_token_only_and_round_trips_as_text() {
        let h = TokenHash::new("mpq_secret", &[7; SALT_LEN]);
        assert!(h.verify("mpq_secret"));
        assert!(!h.verify("mpq_secreT") && !h.verify("") && !h.verify("mpq_secret "));
        let text = h.to_string();
        assert!(text.starts_with("sha256:07070707"));
        assert_eq!(TokenHash::parse(&text), Ok(h.clone()));
        // The same token under another salt hashes differently.
        assert_ne!(
            TokenHash::new("mpq_secret", &[8; SALT_LEN]).to_string(),
            text
        );
    }

    #[test]
    fn malformed_hashes_are_refused_with_a_hint() {
        let good = TokenHash::new("t", &[1; SALT_LEN]).to_string();
        let (_, rest) = good.split_once(':').unwrap();
        for bad in [
            "",
            "mpq_plaintexttoken",
            &format!("md5:{rest}"),
            &format!("{good}:00"),
            &good[..good.len() - 2],
            &good.replace("sha256:01", "sha256:0g"),
            "sha256:01:00",
        ] {
            let e = TokenHash::parse(bad).unwrap_err();
            assert!(e.contains("mpquic pki token"), "{bad}: {e}");
        }
    }
}
