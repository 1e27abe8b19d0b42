//! The nftables rules that take a lane class's TCP connections from the LAN (TPROXY), written
//! from the traffic classes' rules so the kernel picks the same connections the classifier
//! would: classes are tried in order, the first whose rule matches wins (`Classifier`); the
//! lane's class goes to the lane's listener, an earlier class is left alone (the tunnel takes
//! it). IPv4; packets from the tunnel's and the paths' own devices, and to this host, are not
//! taken.

use std::fmt::Write;

use mpquic_core::classify::{Classifier, Rule};

/// One instance's lane table: its TUN device (which names the table, and whose packets are not
/// taken), the lane's classes (indices), the transparent listener's port, and the mark (also
/// the policy routing table's number).
#[derive(Debug, Clone)]
pub struct Table {
    pub tun: String,
    pub lanes: Vec<usize>,
    pub port: u16,
    pub mark: u32,
}

impl Table {
    pub fn name(&self) -> String {
        format!(
            "mpquic_lane_{}",
            (self.tun).replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        )
    }

    /// `nft -f` input creating the table: connections already taken keep their mark (`socket
    /// transparent`), new ones of the lane's classes (of `classifier`) arriving on any device
    /// but the tunnel's and `not_from` go to the port with the mark; an earlier table of the
    /// same name is replaced.
    pub fn ruleset(&self, not_from: &[String], classifier: &Classifier) -> String {
        ruleset(self, not_from, classifier)
    }
}

fn ruleset(table: &Table, not_from: &[String], classifier: &Classifier) -> String {
    let Table {
        tun,
        lanes,
        port,
        mark,
    } = table;
    let t = table.name();
    let mut skip: Vec<String> = vec!["lo".into(), tun.clone()];
    skip.extend(not_from.iter().cloned());
    let ifaces = skip
        .iter()
        .map(|i| format!("\"{i}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let mut out = String::new();
    let _ = writeln!(
        out,
        "table ip {t} {{}}\ndelete table ip {t}\ntable ip {t} {{"
    );
    let _ = writeln!(
        out,
        "  chain prerouting {{\n    type filter hook prerouting priority mangle; policy accept;"
    );
    let _ = writeln!(
        out,
        "    meta l4proto tcp socket transparent 1 meta mark set {mark:#x} accept"
    );
    // Only new connections from the LAN to elsewhere.
    let _ = writeln!(
        out,
        "    iifname {{ {ifaces} }} return\n    meta l4proto != tcp return\n    fib daddr type local return"
    );
    let take = format!("meta l4proto tcp tproxy to :{port} meta mark set {mark:#x} accept");
    let last = lanes
        .iter()
        .copied()
        .filter(|&c| c != classifier.default_class())
        .max();
    for c in 0..classifier.classes() {
        if c == classifier.default_class() {
            continue;
        }
        let verdict = match lanes.contains(&c) {
            true => take.as_str(),
            false => "return",
        };
        for r in classifier.rules(c) {
            for m in matches(r) {
                let _ = writeln!(out, "    {m}{verdict}");
            }
        }
        // Past the last lane class, only the default class could still be one.
        if Some(c) == last && !lanes.contains(&classifier.default_class()) {
            break;
        }
    }
    if lanes.contains(&classifier.default_class()) {
        let _ = writeln!(out, "    {take}");
    }
    out.push_str("  }\n}\n");
    out
}

/// The nft match expressions of one rule (several when it says `port`: either port), each
/// ending in a space; none when it cannot match IPv4 TCP.
fn matches(r: &Rule) -> Vec<String> {
    if !r.protocol.is_empty() && !r.protocol.contains(&6) {
        return Vec::new();
    }
    let v4 = |p: &[mpquic_core::classify::Prefix]| -> Option<String> {
        let v: Vec<String> = p
            .iter()
            .filter(|p| p.addr.is_ipv4())
            .map(|p| p.to_string())
            .collect();
        (!v.is_empty()).then(|| v.join(", "))
    };
    let mut base = String::new();
    if !r.dscp.is_empty() {
        let d: Vec<String> = r.dscp.iter().map(|d| d.to_string()).collect();
        let _ = write!(base, "ip dscp {{ {} }} ", d.join(", "));
    }
    for (key, prefixes) in [("saddr", &r.src), ("daddr", &r.dst)] {
        if prefixes.is_empty() {
            continue;
        }
        match v4(prefixes) {
            Some(set) => {
                let _ = write!(base, "ip {key} {{ {set} }} ");
            }
            // IPv6 prefixes only: no IPv4 packet matches.
            None => return Vec::new(),
        }
    }
    let ranges = |r: &[(u16, u16)]| {
        r.iter()
            .map(|(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (key, set) in [("sport", &r.src_port), ("dport", &r.dst_port)] {
        if !set.is_empty() {
            let _ = write!(base, "tcp {key} {{ {} }} ", ranges(set));
        }
    }
    if r.port.is_empty() {
        return vec![base];
    }
    ["sport", "dport"]
        .iter()
        .map(|k| format!("{base}tcp {k} {{ {} }} ", ranges(&r.port)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpquic_core::classify::Prefix;

    fn rule() -> Rule {
        Rule {
            dscp: vec![],
            protocol: vec![],
            src: vec![],
            dst: vec![],
            src_port: vec![],
            dst_port: vec![],
            port: vec![],
        }
    }

    #[test]
    fn the_lane_class_is_taken_after_the_classes_before_it_are_left_alone() {
        let critical = Rule {
            dscp: vec![46],
            ..rule()
        };
        let voip = Rule {
            protocol: vec![17],
            ..rule()
        };
        let bulk = Rule {
            dst: vec![
                Prefix::parse("203.0.113.0/24").unwrap(),
                Prefix::parse("2001:db8::/32").unwrap(),
            ],
            port: vec![(80, 80), (8000, 8080)],
            ..rule()
        };
        let c = Classifier::new(vec![vec![critical, voip], vec![bulk], vec![]], 2);
        let table = |lanes: &[usize], mark| Table {
            tun: "mpq0".into(),
            lanes: lanes.to_vec(),
            port: 40000,
            mark,
        };
        let r = table(&[1], 0x4d51).ruleset(&["wan1".into(), "wan2".into()], &c);
        assert!(
            r.starts_with("table ip mpquic_lane_mpq0 {}\ndelete table ip mpquic_lane_mpq0\n"),
            "{r}"
        );
        assert!(
            r.contains("iifname { \"lo\", \"mpq0\", \"wan1\", \"wan2\" } return"),
            "{r}"
        );
        assert!(r.contains("    ip dscp { 46 } return\n"), "{r}");
        assert!(!r.contains("l4proto 17"), "a UDP rule takes no TCP: {r}");
        assert!(r.contains("    ip daddr { 203.0.113.0/24 } tcp sport { 80, 8000-8080 } meta l4proto tcp tproxy to :40000 meta mark set 0x4d51 accept\n"), "{r}");
        assert!(
            r.contains("tcp dport { 80, 8000-8080 } meta l4proto tcp tproxy"),
            "{r}"
        );
        assert_eq!(
            r.matches("tproxy").count(),
            2,
            "the default class is not taken: {r}"
        );
        // The default class as the lane: everything the others do not match.
        let r = table(&[2], 1).ruleset(&[], &c);
        assert!(r.contains("tcp sport { 80, 8000-8080 } return"), "{r}");
        assert!(
            r.ends_with("    meta l4proto tcp tproxy to :40000 meta mark set 0x1 accept\n  }\n}\n"),
            "{r}"
        );
    }
}
