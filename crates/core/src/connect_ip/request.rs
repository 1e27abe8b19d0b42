//! A CONNECT-IP request judged by the server (RFC 9484 section 4, RFC 9220 Extended CONNECT,
//! RFC 9297 section 3.4 for `capsule-protocol`), and written and its answer checked by a
//! client: what the HTTP/3 layer decoded goes in, a verdict with the HTTP status comes out.
//!
//! Who the client is: the name in its certificate when the connection has one of ours (mutual
//! TLS, as on the native protocol), else the name of the bearer token it presents
//! (`Authorization: Bearer TOKEN`, compared against each configured hash in constant time).

use super::template::{Mismatch, Scope, Template};
use super::token::TokenHash;
use crate::http3::qpack::Field;

/// A request the server takes: who asks, and for what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub identity: String,
    pub scope: Scope,
}

/// A request refused: the status to answer with and why (for the log and the refusal count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub status: u16,
    /// A short reason, one per cause (`refused` counters are keyed by it).
    pub reason: &'static str,
}

const fn refuse(status: u16, reason: &'static str) -> Refused {
    Refused { status, reason }
}

/// The verdict on a request's header `fields`, for a connection whose client certificate
/// names `certified` (if any), against `template` and the configured `tokens` (name, hash).
pub fn judge(
    fields: &[Field],
    template: &Template,
    certified: Option<&str>,
    tokens: &[(String, TokenHash)],
) -> Result<Accepted, Refused> {
    let get = |name: &str| {
        fields
            .iter()
            .find(|(n, _)| n == name.as_bytes())
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    // Pseudo-headers: each once, before the other fields (RFC 9114 section 4.3).
    let mut seen_regular = false;
    for (i, (n, _)) in fields.iter().enumerate() {
        if n.first() == Some(&b':') {
            if seen_regular || fields[..i].iter().any(|(m, _)| m == n) {
                return Err(refuse(400, "malformed_request"));
            }
        } else {
            seen_regular = true;
        }
    }
    if get(":method").as_deref() != Some("CONNECT") {
        return Err(refuse(405, "not_connect"));
    }
    match get(":protocol").as_deref() {
        Some("connect-ip") => {}
        // A plain CONNECT (a TCP tunnel) or another Extended CONNECT protocol.
        _ => return Err(refuse(501, "unknown_protocol")),
    }
    if get(":scheme").as_deref() != Some("https") || get(":authority").is_none() {
        return Err(refuse(400, "malformed_request"));
    }
    let path = get(":path").ok_or(refuse(400, "malformed_request"))?;
    // RFC 9297 section 3.4: the capsule protocol is in use on this stream; its value is a
    // structured boolean, `?1`.
    if get("capsule-protocol")
        .as_deref()
        .is_some_and(|v| v.trim() != "?1")
    {
        return Err(refuse(400, "malformed_request"));
    }
    let scope = template.matches(&path).map_err(|m| match m {
        Mismatch::NotThisPath => refuse(404, "unknown_path"),
        Mismatch::BadScope(_) => refuse(400, "bad_scope"),
    })?;
    let identity = match (certified, get("authorization")) {
        (Some(name), _) => name.to_string(),
        (None, None) => return Err(refuse(401, "no_token")),
        (None, Some(auth)) => {
            let token = bearer(&auth).ok_or(refuse(401, "wrong_token"))?;
            // Every hash is tried (no early exit): the time taken says nothing of which
            // configured token came close.
            let mut found = None;
            for (name, hash) in tokens {
                if hash.verify(token) && found.is_none() {
                    found = Some(name.clone());
                }
            }
            found.ok_or(refuse(401, "wrong_token"))?
        }
    };
    Ok(Accepted { identity, scope })
}

/// The token of an `Authorization: Bearer TOKEN` value (the scheme is case-insensitive).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Our extension, how two mpquic ends find each other over CONNECT-IP (docs/PROTOCOL.md 3c):
/// an mpquic client's hello rides in its request as this field, and an mpquic server that takes
/// it answers with its hello answer in `HELLO_ACK_FIELD`; the session is then the native one
/// (probes, bonding, per-packet policies) in HTTP Datagrams. Any other server ignores the
/// unknown field (RFC 9110 section 5.1) and answers without one: a standard session.
pub const HELLO_FIELD: &str = "mpquic-hello";
pub const HELLO_ACK_FIELD: &str = "mpquic-hello-ack";

/// The value of field `name` (the first, if it came twice).
pub fn field<'a>(fields: &'a [Field], name: &str) -> Option<&'a [u8]> {
    fields
        .iter()
        .find(|(n, _)| n == name.as_bytes())
        .map(|(_, v)| v.as_slice())
}

/// The fields of the server's answer with `status` (a 2xx one says the capsule protocol is on),
/// with an mpquic server's hello answer when the request came with a hello (a refusal's too:
/// it says why).
pub fn answer(status: u16, hello_ack: Option<&str>) -> Vec<(&'static str, String)> {
    let mut f = vec![(":status", status.to_string())];
    if (200..300).contains(&status) {
        f.push(("capsule-protocol", "?1".into()));
    }
    if let Some(a) = hello_ack {
        f.push((HELLO_ACK_FIELD, a.into()));
    }
    f
}

/// A client's request for `path` at `authority`, with a bearer token if it has one, and an
/// mpquic client's hello.
pub fn request<'a>(
    authority: &'a str,
    path: &'a str,
    authorization: Option<&'a str>,
    hello: Option<&'a str>,
) -> Vec<(&'static str, &'a str)> {
    let mut f = vec![
        (":method", "CONNECT"),
        (":protocol", "connect-ip"),
        (":scheme", "https"),
        (":authority", authority),
        (":path", path),
        ("capsule-protocol", "?1"),
    ];
    if let Some(a) = authorization {
        f.push(("authorization", a));
    }
    if let Some(h) = hello {
        f.push((HELLO_FIELD, h));
    }
    f
}

/// The status of the server's answer: `Ok` for 2xx, else the status as an error.
pub fn check_answer(fields: &[Field]) -> Result<u16, String> {
    let status = fields
        .iter()
        .find(|(n, _)| n == b":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
        .ok_or("an answer without a :status")?;
    match status {
        200..=299 => Ok(status),
        _ => Err(format!("the server answered {status}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http3::qpack;

    fn fields(f: &[(&str, &str)]) -> Vec<Field> {
        qpack::decode(&qpack::encode(f.iter().copied()), 1 << 16).unwrap()
    }

    fn tokens() -> Vec<(String, TokenHash)> {
        vec![
            ("phone1".into(), TokenHash::new("mpq_one", &[1; 16])),
            ("laptop".into(), TokenHash::new("mpq_two", &[2; 16])),
        ]
    }

    #[test]
    fn a_request_with_a_token_or_a_certificate_is_taken() {
        let t = Template::default();
        let req = request(
            "vpn.example",
            "/.well-known/masque/ip/*/*/",
            Some("Bearer mpq_two"),
            Some("aGVsbG8"),
        );
        let got = judge(&fields(&req), &t, None, &tokens()).unwrap();
        assert_eq!(got.identity, "laptop");
        // An mpquic client's hello rides along; the verdict is the same.
        assert_eq!(field(&fields(&req), HELLO_FIELD), Some(&b"aGVsbG8"[..]));
        assert_eq!(got.scope, t.matches("/.well-known/masque/ip/*/*/").unwrap());
        let req = request("vpn.example", "/.well-known/masque/ip/*/*/", None, None);
        let got = judge(&fields(&req), &t, Some("site1"), &tokens()).unwrap();
        assert_eq!(got.identity, "site1");
        // The scheme's case does not matter.
        let req = request(
            "vpn.example",
            "/.well-known/masque/ip/*/*/",
            Some("bearer  mpq_one"),
            None,
        );
        assert_eq!(
            judge(&fields(&req), &t, None, &tokens()).unwrap().identity,
            "phone1"
        );
    }

    type Owned = Vec<(&'static str, String)>;

    /// `ok` with field `name` taken out, or given `value` (a pseudo-header among the others).
    fn with(ok: &[(&'static str, &str)], name: &'static str, value: Option<&str>) -> Owned {
        let mut f: Owned = ok
            .iter()
            .filter(|(n, _)| *n != name)
            .map(|(n, v)| (*n, v.to_string()))
            .collect();
        if let Some(v) = value {
            let at = match name.starts_with(':') {
                true => f
                    .iter()
                    .position(|(n, _)| !n.starts_with(':'))
                    .unwrap_or(f.len()),
                false => f.len(),
            };
            f.insert(at, (name, v.to_string()));
        }
        f
    }

    #[test]
    fn each_bad_request_has_its_status_and_reason() {
        let t = Template::default();
        let path = "/.well-known/masque/ip/*/*/";
        let ok = request("vpn.example", path, Some("Bearer mpq_one"), None);
        let cases: Vec<(Owned, u16, &str)> = vec![
            (with(&ok, "authorization", None), 401, "no_token"),
            (
                with(&ok, "authorization", Some("Bearer mpq_three")),
                401,
                "wrong_token",
            ),
            (
                with(&ok, "authorization", Some("Basic bXBx")),
                401,
                "wrong_token",
            ),
            (
                with(&ok, ":protocol", Some("connect-udp")),
                501,
                "unknown_protocol",
            ),
            (with(&ok, ":protocol", None), 501, "unknown_protocol"),
            (with(&ok, ":method", Some("GET")), 405, "not_connect"),
            (
                with(&ok, ":path", Some("/.well-known/masque/udp/*/*/")),
                404,
                "unknown_path",
            ),
            (
                with(&ok, ":path", Some("/.well-known/masque/ip/host.example/*/")),
                400,
                "bad_scope",
            ),
            (with(&ok, ":scheme", Some("http")), 400, "malformed_request"),
            (with(&ok, ":authority", None), 400, "malformed_request"),
            (
                with(&ok, "capsule-protocol", Some("?0")),
                400,
                "malformed_request",
            ),
        ];
        for (f, status, reason) in cases {
            let f: Vec<(&str, &str)> = f.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let got = judge(&fields(&f), &t, None, &tokens());
            assert_eq!(got, Err(refuse(status, reason)), "{f:?}");
        }
        // A pseudo-header twice, or after a regular field.
        let mut twice = ok.clone();
        twice.insert(1, (":method", "CONNECT"));
        let mut late = ok.clone();
        late.push((":path", path));
        for f in [twice, late] {
            assert_eq!(
                judge(&fields(&f), &t, None, &tokens()).unwrap_err().status,
                400
            );
        }
    }

    #[test]
    fn the_answer_and_its_check() {
        let ok = fields(
            &answer(200, None)
                .iter()
                .map(|(n, v)| (*n, v.as_str()))
                .collect::<Vec<_>>(),
        );
        assert_eq!(check_answer(&ok), Ok(200));
        assert_eq!(field(&ok, HELLO_ACK_FIELD), None);
        let ours = answer(200, Some("eyJvayI6dHJ1ZX0"));
        let ours: Vec<(&str, &str)> = ours.iter().map(|(n, v)| (*n, v.as_str())).collect();
        assert_eq!(
            field(&fields(&ours), HELLO_ACK_FIELD),
            Some(&b"eyJvayI6dHJ1ZX0"[..])
        );
        assert_eq!(answer(401, None).len(), 1);
        let no = fields(&[(":status", "401")]);
        assert_eq!(check_answer(&no), Err("the server answered 401".into()));
        assert!(check_answer(&fields(&[("server", "x")])).is_err());
    }
}
