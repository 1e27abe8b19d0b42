//! The URI template of a CONNECT-IP request (RFC 9484 section 3): the server's path with the
//! optional variables `{target}` (the destinations the client asks to reach: `*`, an address or
//! a prefix, percent-encoded) and `{ipproto}` (`*` or an IP protocol number), matched against a
//! request's `:path`; the default is the well-known `/.well-known/masque/ip/{target}/{ipproto}/`.
//! A variable left out of the template means `*` (clients that do no flow forwarding, such as
//! quic-go's connect-ip-go, are given a template without variables).

use std::net::IpAddr;

use super::capsule;

pub const DEFAULT: &str = "/.well-known/masque/ip/{target}/{ipproto}/";

/// A template split into its literal parts and variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Target,
    Ipproto,
}

/// What a request asks to reach: `None` for `*` (everything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope {
    /// An address or a prefix (address, length).
    pub target: Option<(IpAddr, u8)>,
    pub protocol: Option<u8>,
}

/// Why a request's path does not name a CONNECT-IP scope this server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    /// The path is not the template's (HTTP 404).
    NotThisPath,
    /// The template's path with a target or protocol that is not valid (HTTP 400).
    BadScope(&'static str),
}

impl Template {
    /// A template from the configuration: an absolute path (with an optional query) holding
    /// `{target}` and `{ipproto}` at most once each, two variables never side by side.
    pub fn parse(s: &str) -> Result<Template, String> {
        if !s.starts_with('/') {
            return Err(format!("{s:?} is not an absolute path (starts with /)"));
        }
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Literal(rest[..open].to_string()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("{s:?}: a {{ without its }}"))?;
            let var = match &rest[open + 1..open + close] {
                "target" => Part::Target,
                "ipproto" => Part::Ipproto,
                other => {
                    return Err(format!(
                        "{s:?}: unknown variable {{{other}}} (CONNECT-IP has {{target}} and {{ipproto}})"
                    ))
                }
            };
            if parts.contains(&var) {
                return Err(format!("{s:?}: a variable given twice"));
            }
            if matches!(parts.last(), Some(Part::Target | Part::Ipproto)) {
                return Err(format!(
                    "{s:?}: two variables side by side cannot be told apart"
                ));
            }
            parts.push(var);
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Literal(rest.to_string()));
        }
        if parts
            .iter()
            .any(|p| matches!(p, Part::Literal(l) if l.contains('}')))
        {
            return Err(format!("{s:?}: a }} without its {{"));
        }
        Ok(Template { parts })
    }

    /// The path a client asks for `scope` with (its target and protocol filled in).
    pub fn expand(&self, scope: Scope) -> String {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Literal(l) => out.push_str(l),
                Part::Target => match scope.target {
                    None => out.push('*'),
                    Some((addr, len)) if len == full(addr) => {
                        out.push_str(&encode(&addr.to_string()))
                    }
                    Some((addr, len)) => out.push_str(&encode(&format!("{addr}/{len}"))),
                },
                Part::Ipproto => match scope.protocol {
                    None => out.push('*'),
                    Some(p) => out.push_str(&p.to_string()),
                },
            }
        }
        out
    }

    /// The scope a request's `:path` asks for.
    pub fn matches(&self, path: &str) -> Result<Scope, Mismatch> {
        let mut rest = path;
        let mut target = None;
        let mut ipproto = None;
        for (i, p) in self.parts.iter().enumerate() {
            match p {
                Part::Literal(l) => {
                    rest = rest.strip_prefix(l.as_str()).ok_or(Mismatch::NotThisPath)?;
                }
                var => {
                    // A variable runs to the next literal (or the end): a value holds no '/'
                    // unencoded, nor the literal's first character.
                    let end = match self.parts.get(i + 1) {
                        Some(Part::Literal(l)) => rest
                            .find(l.chars().next().unwrap_or('/'))
                            .ok_or(Mismatch::NotThisPath)?,
                        _ => rest.len(),
                    };
                    let value = &rest[..end];
                    if value.is_empty() || value.contains('/') {
                        return Err(Mismatch::NotThisPath);
                    }
                    match var {
                        Part::Target => target = Some(value),
                        _ => ipproto = Some(value),
                    }
                    rest = &rest[end..];
                }
            }
        }
        if !rest.is_empty() {
            return Err(Mismatch::NotThisPath);
        }
        Ok(Scope {
            target: parse_target(&decode(target.unwrap_or("*")))?,
            protocol: match decode(ipproto.unwrap_or("*")).as_str() {
                "*" => None,
                p => Some(p.parse().map_err(|_| Mismatch::BadScope("ipproto"))?),
            },
        })
    }
}

impl Default for Template {
    fn default() -> Template {
        Template::parse(DEFAULT).expect("the default template")
    }
}

fn full(addr: IpAddr) -> u8 {
    match addr {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

/// `*`, an address, or a prefix whose bits beyond its length are zero. A DNS name is refused:
/// this server proxies by address.
fn parse_target(t: &str) -> Result<Option<(IpAddr, u8)>, Mismatch> {
    if t == "*" {
        return Ok(None);
    }
    let (addr, len) = match t.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (t, None),
    };
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| Mismatch::BadScope("target (an address or prefix, or *)"))?;
    let len = match len {
        None => full(addr),
        Some(l) => l
            .parse::<u8>()
            .ok()
            .filter(|l| *l <= full(addr))
            .ok_or(Mismatch::BadScope("target prefix length"))?,
    };
    if capsule::ordinal(addr) & !capsule::mask(addr, len) != 0 {
        return Err(Mismatch::BadScope(
            "target prefix with bits beyond its length",
        ));
    }
    Ok(Some((addr, len)))
}

/// Percent-decoding (RFC 3986); a malformed escape is kept as it is (and then fails to parse).
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).and_then(|c| hex(*c)),
            b.get(i + 2).and_then(|c| hex(*c)),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encoding of what a path segment cannot hold as it is (`/`, `:`, `%`).
fn encode(s: &str) -> String {
    s.replace('%', "%25")
        .replace('/', "%2F")
        .replace(':', "%3A")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_template_matches_the_rfc_forms() {
        let t = Template::default();
        let any = Scope {
            target: None,
            protocol: None,
        };
        assert_eq!(t.matches("/.well-known/masque/ip/*/*/"), Ok(any));
        assert_eq!(t.expand(any), "/.well-known/masque/ip/*/*/");
        let s = t
            .matches("/.well-known/masque/ip/192.0.2.0%2F24/17/")
            .unwrap();
        assert_eq!(s.target, Some(("192.0.2.0".parse().unwrap(), 24)));
        assert_eq!(s.protocol, Some(17));
        assert_eq!(t.matches(&t.expand(s)), Ok(s));
        let six = t
            .matches("/.well-known/masque/ip/2001%3Adb8%3A%3A1/*/")
            .unwrap();
        assert_eq!(six.target, Some(("2001:db8::1".parse().unwrap(), 128)));
        assert_eq!(t.matches(&t.expand(six)), Ok(six));
        assert_eq!(
            t.matches("/.well-known/masque/udp/*/*/"),
            Err(Mismatch::NotThisPath)
        );
        assert_eq!(
            t.matches("/.well-known/masque/ip/*/*"),
            Err(Mismatch::NotThisPath)
        );
        assert_eq!(
            t.matches("/.well-known/masque/ip/*/*/x"),
            Err(Mismatch::NotThisPath)
        );
        assert_eq!(
            t.matches("/.well-known/masque/ip//*/"),
            Err(Mismatch::NotThisPath)
        );
        assert!(matches!(
            t.matches("/.well-known/masque/ip/example.com/*/"),
            Err(Mismatch::BadScope(_))
        ));
        assert!(matches!(
            t.matches("/.well-known/masque/ip/*/300/"),
            Err(Mismatch::BadScope(_))
        ));
        assert!(matches!(
            t.matches("/.well-known/masque/ip/10.0.0.1%2F24/*/"),
            Err(Mismatch::BadScope(_))
        ));
    }

    #[test]
    fn templates_without_variables_serve_everything() {
        let t = Template::parse("/vpn").unwrap();
        let any = Scope {
            target: None,
            protocol: None,
        };
        assert_eq!(t.matches("/vpn"), Ok(any));
        assert_eq!(t.matches("/vpn/"), Err(Mismatch::NotThisPath));
        assert_eq!(t.expand(any), "/vpn");
        let t = Template::parse("/ip/{target}").unwrap();
        assert_eq!(t.matches("/ip/10.0.0.0%2F8").unwrap().protocol, None);
    }

    #[test]
    fn templates_with_a_query() {
        let t = Template::parse("/vpn?t={target}&i={ipproto}").unwrap();
        let s = t.matches("/vpn?t=*&i=6").unwrap();
        assert_eq!((s.target, s.protocol), (None, Some(6)));
        assert_eq!(t.expand(s), "/vpn?t=*&i=6");
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        for (t, why) in [
            ("vpn/{target}/{ipproto}", "absolute"),
            ("/vpn/{target}{ipproto}", "side by side"),
            ("/vpn/{target}/{target}/{ipproto}", "twice"),
            ("/vpn/{host}/{ipproto}/{target}", "unknown variable"),
            ("/vpn/{target/{ipproto}", "unknown variable"),
            ("/vpn/{target}/{ipproto}/}", "without its {"),
        ] {
            let e = Template::parse(t).unwrap_err();
            assert!(e.contains(why), "{t}: {e}");
        }
    }
}
