//! `classes:` (client): traffic classes in priority order, each with its `match` rules and its own
//! bond settings; validated into `ClassConfig`s and the core's `Classifier`. Without `classes:`
//! the client has one implicit class made of the top-level keys.

use mpquic_core::classify::{protocol_number, Classifier, Prefix, Rule};
use mpquic_core::fec::FecMode;
use mpquic_core::Policy;

use super::checker::Checker;
use super::{
    ClassConfig, Congestion, NumOrText, OneOrMany, RawClass, RawConfig, RawRule, TransportMode,
};

/// Classes a client may declare: each is a lane of the tunnel (`wire::MAX_LANES`).
pub const MAX_CLASSES: usize = mpquic_core::wire::MAX_LANES;

/// The classes of a client whose top-level keys make `top` (the implicit class's settings and
/// every class's defaults).
pub(super) fn classes(
    raw: &RawConfig,
    c: &mut Checker,
    top: ClassConfig,
    congestion: Congestion,
    stripe: bool,
    tun_name: &str,
) -> (Vec<ClassConfig>, Classifier) {
    if raw.classes.is_empty() {
        return (vec![top], Classifier::new(vec![Vec::new()], 0));
    }
    if stripe {
        c.at(
            "classes",
            "`classes` cannot be used with `transport: stripe` paths yet".into(),
            Some("run one instance per class (its own tun_name) for stripe paths".into()),
        );
    }
    if raw.classes.len() > MAX_CLASSES {
        c.at(
            &format!("classes[{MAX_CLASSES}]"),
            format!("{} classes: at most {MAX_CLASSES}", raw.classes.len()),
            None,
        );
    }
    let mut out: Vec<ClassConfig> = Vec::new();
    let mut rules = Vec::new();
    let mut default = None;
    for (i, rc) in raw.classes.iter().enumerate() {
        let at = |key: &str| format!("classes[{i}].{key}");
        let valid_name = !rc.name.is_empty()
            && rc.name.len() <= 15
            && rc
                .name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_');
        if !valid_name {
            c.at(
                &at("name"),
                format!("class name `{}` is not valid", rc.name),
                Some("use 1-15 letters, digits, '-' or '_', e.g. critical".into()),
            );
        }
        if let Some(t) = &rc.tun_name {
            let taken = t == tun_name || out.iter().any(|o| o.tun_name.as_ref() == Some(t));
            if !valid_interface(t) || taken {
                c.at(
                    &at("tun_name"),
                    format!("`tun_name`: `{t}` is not a valid interface name of its own"),
                    Some("1-15 characters without '/' or spaces, not the instance's or another class's device".into()),
                );
            }
        }
        if out.iter().any(|o| o.name == rc.name) {
            c.at(
                &at("name"),
                format!("class `{}`: duplicate name", rc.name),
                None,
            );
        }
        // A class with its own device and no rules takes what that device reads, not the rest.
        if rc.rules.is_empty() && rc.tun_name.is_none() {
            match default {
                None => default = Some(i),
                Some(d) => c.at(
                    &format!("classes[{i}]"),
                    format!(
                        "class `{}` has no `match` rules, and neither has `{}`: only one class takes the packets no rule matches",
                        rc.name, raw.classes[d].name
                    ),
                    Some("give one of them `match` rules".into()),
                ),
            }
        }
        rules.push(
            rc.rules
                .iter()
                .enumerate()
                .map(|(j, r)| rule(r, c, &format!("classes[{i}].match[{j}]")))
                .collect::<Vec<_>>(),
        );
        // The classes share each path's connection, so its congestion controller and its
        // FEC groups: one controller for all, one FEC mode for the classes that use FEC.
        if let Some(cc) = rc.congestion_algorithm.filter(|cc| *cc != congestion) {
            c.at(
                &format!("classes[{i}].congestion_algorithm"),
                format!(
                    "`congestion_algorithm: {}` in class `{}`: the classes share each path's connection and its congestion controller ({})",
                    cc.as_str(), rc.name, congestion.as_str()
                ),
                Some("set congestion_algorithm at the top level, or run the class as an instance of its own (its own tun_name and file)".into()),
            );
        }
        let k = class(rc, c, &top, i);
        let other_fec = out.iter().find(|o| o.fec != FecMode::Off && o.fec != k.fec);
        if let Some(o) = other_fec.filter(|_| k.fec != FecMode::Off) {
            c.at(
                &format!("classes[{i}].fec"),
                format!(
                    "`fec: {}` in class `{}`, `fec: {}` in class `{}`: the classes share each path's FEC groups",
                    k.fec, rc.name, o.fec, o.name
                ),
                Some("give every class that uses FEC the same mode (or set it at the top level)".into()),
            );
        }
        out.push(k);
    }
    let Some(default) = default else {
        c.at(
            "classes",
            "no default class: every class has `match` rules".into(),
            Some("add a class without `match` (e.g. `- name: default`): it takes the packets no rule matches".into()),
        );
        return (out, Classifier::new(rules, 0));
    };
    (out, Classifier::new(rules, default))
}

/// One class's settings, defaulting to the top-level keys.
fn class(rc: &RawClass, c: &mut Checker, top: &ClassConfig, i: usize) -> ClassConfig {
    let at = |key: &str| format!("classes[{i}].{key}");
    let policy = match rc.multipath_policy.as_deref() {
        None => top.policy,
        Some(s) => Policy::parse(s).unwrap_or_else(|| {
            let names: Vec<&str> = Policy::ALL.iter().map(|p| p.as_str()).collect();
            c.unknown_value(&at("multipath_policy"), "policy", s, &names);
            top.policy
        }),
    };
    let fec = match rc.fec.as_deref() {
        None => top.fec,
        Some(f) => FecMode::parse(f).unwrap_or_else(|e| {
            c.at(&at("fec"), format!("`fec`: {e}"), None);
            FecMode::Off
        }),
    };
    // FEC is for datagram mode: a class that asks for it runs in datagram mode unless it says
    // otherwise (then it is an error, as at the top level).
    let mode = match (rc.transport_mode, fec != FecMode::Off) {
        (Some(m), _) => m,
        (None, true) => TransportMode::Datagram,
        (None, false) => top.mode,
    };
    if fec != FecMode::Off && mode.has_stream() {
        c.at(
            &at("fec"),
            "`fec` needs `transport_mode: datagram`".into(),
            Some("auto and reliable modes retransmit what is lost on their streams; use fec: off, or transport_mode: datagram".into()),
        );
    }
    ClassConfig {
        name: rc.name.clone(),
        tun_name: rc.tun_name.clone(),
        explicit: true,
        policy,
        mode,
        fec,
        tcp_lane: super::lane::lane(rc.tcp_lane.as_deref(), &at("tcp_lane"), c),
    }
}

fn rule(r: &RawRule, c: &mut Checker, at: &str) -> Rule {
    let key = |k: &str| format!("{at}.{k}");
    let mut out = Rule::default();
    let list =
        |v: &Option<OneOrMany<NumOrText>>| v.as_ref().map(OneOrMany::to_vec).unwrap_or_default();
    for v in list(&r.dscp) {
        match dscp(&v) {
            Some(d) => out.dscp.push(d),
            None => c.at(
                &key("dscp"),
                format!("`dscp`: `{v}` is not a DSCP value"),
                Some("use 0-63 or a name: ef, af11..af43, cs0..cs7, be".into()),
            ),
        }
    }
    for v in list(&r.protocol) {
        match protocol_number(&v.to_string()) {
            Some(p) => out.protocol.push(p),
            None => c.at(
                &key("protocol"),
                format!("`protocol`: `{v}` is not an IP protocol"),
                Some("use tcp, udp, icmp, icmpv6, sctp, gre, esp or a number 0-255".into()),
            ),
        }
    }
    for (k, v, dst) in [("src", &r.src, &mut out.src), ("dst", &r.dst, &mut out.dst)] {
        for p in v.as_ref().map(OneOrMany::to_vec).unwrap_or_default() {
            match Prefix::parse(&p) {
                Some(n) => dst.push(n),
                None => c.at(
                    &key(k),
                    format!("`{k}`: `{p}` is not an address or prefix"),
                    Some("e.g. 192.0.2.0/24, 2001:db8::/32 or 198.51.100.7".into()),
                ),
            }
        }
    }
    for (k, v, dst) in [
        ("src_port", &r.src_port, &mut out.src_port),
        ("dst_port", &r.dst_port, &mut out.dst_port),
        ("port", &r.port, &mut out.port),
    ] {
        for p in list(v) {
            match port_range(&p) {
                Some(range) => dst.push(range),
                None => c.at(
                    &key(k),
                    format!("`{k}`: `{p}` is not a port or range"),
                    Some("e.g. 5060 or 16384-32767".into()),
                ),
            }
        }
    }
    if !has_any(r) {
        c.at(
            at,
            "an empty rule would match every packet".into(),
            Some("give it dscp, protocol, src, dst, src_port, dst_port or port; the class without `match` takes the rest".into()),
        );
    }
    out
}

fn has_any(r: &RawRule) -> bool {
    r.dscp.is_some()
        || r.protocol.is_some()
        || r.src.is_some()
        || r.dst.is_some()
        || r.src_port.is_some()
        || r.dst_port.is_some()
        || r.port.is_some()
}

fn valid_interface(name: &str) -> bool {
    !name.is_empty() && name.len() <= 15 && !name.contains(['/', ' '])
}

/// A DSCP number (0-63) or a per-hop behaviour's name (RFC 2474, 2597, 3246).
fn dscp(v: &NumOrText) -> Option<u8> {
    match v {
        NumOrText::Num(n) => u8::try_from(*n).ok().filter(|n| *n < 64),
        NumOrText::Text(t) => {
            let t = t.trim().to_ascii_lowercase();
            if let Ok(n) = t.parse::<u8>() {
                return (n < 64).then_some(n);
            }
            match t.as_str() {
                "ef" => Some(46),
                "be" | "default" => Some(0),
                "va" | "voice-admit" => Some(44),
                _ => {
                    if let Some(x) = t.strip_prefix("cs") {
                        let x: u8 = x.parse().ok().filter(|x| *x <= 7)?;
                        return Some(x * 8);
                    }
                    let xy = t.strip_prefix("af")?.as_bytes();
                    let (x, y) = match xy {
                        [x @ b'1'..=b'4', y @ b'1'..=b'3'] => (x - b'0', y - b'0'),
                        _ => return None,
                    };
                    Some(x * 8 + y * 2)
                }
            }
        }
    }
}

/// `5060` or `16384-32767`.
fn port_range(v: &NumOrText) -> Option<(u16, u16)> {
    match v {
        NumOrText::Num(n) => u16::try_from(*n).ok().map(|p| (p, p)),
        NumOrText::Text(t) => {
            let (a, b) = match t.split_once('-') {
                Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
                None => {
                    let p = t.trim().parse().ok()?;
                    (p, p)
                }
            };
            (a <= b).then_some((a, b))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dscp_names() {
        let t = |s: &str| dscp(&NumOrText::Text(s.into()));
        assert_eq!(t("EF"), Some(46));
        assert_eq!(t("af41"), Some(34));
        assert_eq!(t("af11"), Some(10));
        assert_eq!(t("cs6"), Some(48));
        assert_eq!(t("cs8"), None);
        assert_eq!(t("af44"), None);
        assert_eq!(dscp(&NumOrText::Num(63)), Some(63));
        assert_eq!(dscp(&NumOrText::Num(64)), None);
    }

    #[test]
    fn port_ranges() {
        assert_eq!(port_range(&NumOrText::Num(5060)), Some((5060, 5060)));
        assert_eq!(
            port_range(&NumOrText::Text("16384-32767".into())),
            Some((16384, 32767))
        );
        assert_eq!(port_range(&NumOrText::Text("9-1".into())), None);
        assert_eq!(port_range(&NumOrText::Num(70000)), None);
    }
}
