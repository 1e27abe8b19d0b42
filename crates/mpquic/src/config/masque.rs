//! The server's CONNECT-IP keys (`masque_listen`, `masque_template`, `masque_tokens`): where
//! standard MASQUE clients are served, the URI template their requests must match, and the
//! bearer tokens of those without a certificate of ours (docs/OPERATIONS.md "Serving standard
//! CONNECT-IP clients").

use std::net::SocketAddr;

use mpquic_core::connect_ip::template::{self, Template};
use mpquic_core::connect_ip::token::TokenHash;
use serde::Deserialize;

use super::checker::Checker;
use super::RawConfig;

/// One `masque_tokens` entry: the client's name and its token's hash.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawToken {
    name: String,
    hash: String,
}

/// CONNECT-IP on the server (`masque_listen` set).
#[derive(Debug, Clone)]
pub struct MasqueServer {
    /// Its own UDP address (HTTP/3, ALPN `h3`), e.g. port 443.
    pub listen: SocketAddr,
    pub template: Template,
    /// The clients without a certificate: each token's name (the client's, in status and
    /// logs) and its hash. Reloadable.
    pub tokens: Vec<(String, TokenHash)>,
}

/// The `masque_*` keys of a server listening for its own protocol on `native` (and stripe on
/// `stripe`); `None` without `masque_listen`.
pub(super) fn server(
    raw: &RawConfig,
    c: &mut Checker,
    native: SocketAddr,
    stripe: Option<SocketAddr>,
) -> Option<MasqueServer> {
    let Some(listen) = raw.masque_listen else {
        for (key, set) in [
            ("masque_template", raw.masque_template.is_some()),
            ("masque_tokens", !raw.masque_tokens.is_empty()),
        ] {
            if set {
                c.at(
                    key,
                    format!("`{key}` is set but `masque_listen` is not"),
                    Some("add e.g. masque_listen: 0.0.0.0:443 to serve CONNECT-IP clients".into()),
                );
            }
        }
        return None;
    };
    for (other, what) in [(Some(native), "the QUIC port"), (stripe, "the stripe port")] {
        if other.is_some_and(|o| o.port() == listen.port() && overlaps(o, listen)) {
            c.at(
                "masque_listen",
                format!("`masque_listen`: {listen} is {what}"),
                Some("CONNECT-IP needs a UDP port of its own, e.g. 443".into()),
            );
        }
    }
    let template =
        match Template::parse(raw.masque_template.as_deref().unwrap_or(template::DEFAULT)) {
            Ok(t) => t,
            Err(e) => {
                c.at(
                    "masque_template",
                    format!("`masque_template`: {e}"),
                    Some(format!(
                        "a path, optionally with {{target}} and {{ipproto}}, e.g. {}",
                        template::DEFAULT
                    )),
                );
                Template::parse(template::DEFAULT).expect("the default template parses")
            }
        };
    Some(MasqueServer {
        listen,
        template,
        tokens: tokens(raw, c),
    })
}

/// Two addresses that would take the same port: equal, or one of them the wildcard.
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified()
}

fn tokens(raw: &RawConfig, c: &mut Checker) -> Vec<(String, TokenHash)> {
    let mut out: Vec<(String, TokenHash)> = Vec::new();
    for (i, t) in raw.masque_tokens.iter().enumerate() {
        let name = t.name.trim();
        if name.is_empty() || name.len() > 64 || name.chars().any(|ch| ch.is_control()) {
            c.at(
                &format!("masque_tokens[{i}].name"),
                format!("`{}` is not a client name", t.name),
                Some("1 to 64 printable characters, e.g. phone1".into()),
            );
            continue;
        }
        if out.iter().any(|(n, _)| n == name) {
            c.at(
                &format!("masque_tokens[{i}].name"),
                format!("token `{name}`: duplicate name"),
                Some("each client gets its own token: mpquic pki token NAME".into()),
            );
            continue;
        }
        match TokenHash::parse(t.hash.trim()) {
            Ok(h) => out.push((name.to_string(), h)),
            Err(e) => c.at(
                &format!("masque_tokens[{i}].hash"),
                format!("token `{name}`: {e}"),
                None,
            ),
        }
    }
    out
}

/// A client that speaks CONNECT-IP (`protocol: masque`) to a standard server, or to an mpquic
/// server's `masque_listen`.
#[derive(Debug, Clone, PartialEq)]
pub struct MasqueClient {
    /// `masque_token`: the bearer token (`mpquic pki token`); without it, the certificate.
    pub token: Option<String>,
    /// `masque_path`: the request's path (the server's URI template with its variables filled,
    /// `*` for everything).
    pub path: String,
}

/// The path a client asks for by default: the default template for the whole IP space.
pub const DEFAULT_PATH: &str = "/.well-known/masque/ip/*/*/";

/// A client's `protocol`, `masque_token` and `masque_path` (and the server's `masque_*`
/// keys, refused here); `None` for the native protocol.
pub(super) fn client(raw: &RawConfig, c: &mut Checker) -> Option<MasqueClient> {
    for (key, set) in [
        ("masque_listen", raw.masque_listen.is_some()),
        ("masque_template", raw.masque_template.is_some()),
        ("masque_tokens", !raw.masque_tokens.is_empty()),
    ] {
        if set {
            c.at(
                key,
                format!("`{key}` is a server option"),
                Some("a client speaks CONNECT-IP with protocol: masque".into()),
            );
        }
    }
    let masque = match raw.protocol.as_deref() {
        None | Some("native") => false,
        Some("masque") => true,
        Some(other) => {
            c.unknown_value("protocol", "protocol", other, &["native", "masque"]);
            false
        }
    };
    if !masque {
        for (key, set) in [
            ("masque_token", raw.masque_token.is_some()),
            ("masque_path", raw.masque_path.is_some()),
        ] {
            if set {
                c.at(
                    key,
                    format!("`{key}` is set but `protocol` is not masque"),
                    Some("add protocol: masque to speak CONNECT-IP".into()),
                );
            }
        }
        return None;
    }
    let path = raw
        .masque_path
        .clone()
        .unwrap_or_else(|| DEFAULT_PATH.into());
    if !path.starts_with('/') || path.chars().any(|ch| ch.is_whitespace() || ch.is_control()) {
        c.at(
            "masque_path",
            format!("`masque_path`: `{path}` is not a request path"),
            Some(format!(
                "e.g. {DEFAULT_PATH}, or the server's template with * for its variables"
            )),
        );
    }
    let token = raw.masque_token.as_deref().map(str::trim);
    if token.is_some_and(|t| t.is_empty() || t.contains(char::is_whitespace)) {
        c.at(
            "masque_token",
            "`masque_token` is not a token".into(),
            Some("the token `mpquic pki token NAME` printed, e.g. mpq_0f9e...".into()),
        );
    }
    Some(MasqueClient {
        token: token.map(str::to_string),
        path,
    })
}

/// The client's CONNECT-IP keys on a server.
pub(super) fn not_on_server(raw: &RawConfig, c: &mut Checker) {
    for (key, set) in [
        ("protocol", raw.protocol.is_some()),
        ("masque_token", raw.masque_token.is_some()),
        ("masque_path", raw.masque_path.is_some()),
    ] {
        if set {
            c.at(
                key,
                format!("`{key}` is a client option"),
                Some("a server serves CONNECT-IP on masque_listen".into()),
            );
        }
    }
}
