//! Traffic classes (seed 000 sections 3 and 6-8): which class an inner packet belongs to.
//!
//! The client classifies each packet it reads from its TUN device by the rules of its `classes:`
//! (first class with a matching rule wins; a packet no rule matches goes to the default class and
//! is counted). The server cannot run the client's rules on the answers (addresses and ports are
//! the other way round, and answers rarely carry the DSCP of the request), so it learns: each
//! packet arriving in class c marks its flow's reply direction as c (`FlowClasses`), and a packet
//! from its TUN device goes to the class its flow was marked with, else to the default class.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::packet::PacketInfo;

/// An address prefix (IPv4 or IPv6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    pub addr: IpAddr,
    pub len: u8,
}

/// `a.b.c.d/len` or `x::y/len`, as `parse` reads it.
impl std::fmt::Display for Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl Prefix {
    /// `a.b.c.d/len`, `x::y/len`, or a bare address (a host).
    pub fn parse(s: &str) -> Option<Prefix> {
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (a.trim(), Some(l.trim())),
            None => (s.trim(), None),
        };
        let addr: IpAddr = a.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match l {
            Some(l) => l.parse().ok().filter(|l| *l <= max)?,
            None => max,
        };
        Some(Prefix { addr, len })
    }

    /// The prefix with its host bits cleared (`192.168.1.7/24` -> `192.168.1.0/24`).
    pub fn network(&self) -> Prefix {
        let addr = match self.addr {
            IpAddr::V4(a) => IpAddr::V4((u32::from(a) & crate::addressing::mask(self.len)).into()),
            IpAddr::V6(a) => IpAddr::V6((u128::from(a) & mask6(self.len)).into()),
        };
        Prefix { addr, ..*self }
    }

    /// Every address of `other` is in this prefix.
    pub fn covers(&self, other: &Prefix) -> bool {
        self.len <= other.len && self.contains(other.addr)
    }

    /// The two share an address (one covers the other).
    pub fn overlaps(&self, other: &Prefix) -> bool {
        self.covers(other) || other.covers(self)
    }

    pub fn contains(&self, a: IpAddr) -> bool {
        match (self.addr, a) {
            (IpAddr::V4(p), IpAddr::V4(a)) => {
                let m = crate::addressing::mask(self.len);
                u32::from(p) & m == u32::from(a) & m
            }
            (IpAddr::V6(p), IpAddr::V6(a)) => {
                let m = mask6(self.len);
                u128::from(p) & m == u128::from(a) & m
            }
            _ => false,
        }
    }
}

/// The IPv6 netmask of a prefix length, as a number.
fn mask6(len: u8) -> u128 {
    match len {
        0 => 0,
        l => u128::MAX << (128 - u32::from(l.min(128))),
    }
}

/// One rule: every criterion it has must hold (an empty list is no criterion); within a
/// criterion, any listed value will do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rule {
    pub dscp: Vec<u8>,
    pub protocol: Vec<u8>,
    pub src: Vec<Prefix>,
    pub dst: Vec<Prefix>,
    /// Inclusive port ranges.
    pub src_port: Vec<(u16, u16)>,
    pub dst_port: Vec<(u16, u16)>,
    /// Either port (the service's port whichever way the packet goes).
    pub port: Vec<(u16, u16)>,
}

impl Rule {
    pub fn matches(&self, p: &PacketInfo) -> bool {
        let in_ranges = |r: &[(u16, u16)], v: Option<u16>| {
            r.is_empty() || v.is_some_and(|v| r.iter().any(|(a, b)| (*a..=*b).contains(&v)))
        };
        let sport = p.ports.map(|(s, _)| s);
        let dport = p.ports.map(|(_, d)| d);
        (self.dscp.is_empty() || self.dscp.contains(&p.dscp))
            && (self.protocol.is_empty() || self.protocol.contains(&p.proto))
            && (self.src.is_empty() || self.src.iter().any(|n| n.contains(p.src)))
            && (self.dst.is_empty() || self.dst.iter().any(|n| n.contains(p.dst)))
            && in_ranges(&self.src_port, sport)
            && in_ranges(&self.dst_port, dport)
            && (self.port.is_empty()
                || in_ranges(&self.port, sport)
                || in_ranges(&self.port, dport))
    }
}

/// The client's classifier: per class (in priority order) its rules; one class is the default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classifier {
    rules: Vec<Vec<Rule>>,
    default: usize,
}

impl Classifier {
    /// `rules[c]`: class c's rules (the default class's are ignored: it takes what no other
    /// class matches). `default < rules.len()`.
    pub fn new(rules: Vec<Vec<Rule>>, default: usize) -> Self {
        assert!(default < rules.len().max(1));
        Classifier { rules, default }
    }

    pub fn default_class(&self) -> usize {
        self.default
    }

    /// Class `c`'s rules (empty for the default class: it takes what no other matches).
    pub fn rules(&self, c: usize) -> &[Rule] {
        match c == self.default {
            true => &[],
            false => self.rules.get(c).map_or(&[], Vec::as_slice),
        }
    }

    /// How many classes there are.
    pub fn classes(&self) -> usize {
        self.rules.len().max(1)
    }

    /// The class of a packet and whether a rule matched it (`false`: the default class because
    /// nothing matched, or the packet could not be parsed).
    pub fn classify(&self, info: Option<&PacketInfo>) -> (usize, bool) {
        let Some(info) = info else {
            return (self.default, false);
        };
        for (c, rules) in self.rules.iter().enumerate() {
            if c != self.default && rules.iter().any(|r| r.matches(info)) {
                return (c, true);
            }
        }
        (self.default, false)
    }
}

/// The IP protocol number of a name (`tcp`, `udp`, `icmp`, `icmpv6`, `sctp`, `gre`, `esp`) or
/// of a number.
pub fn protocol_number(s: &str) -> Option<u8> {
    Some(match s.trim().to_ascii_lowercase().as_str() {
        "icmp" => 1,
        "tcp" => 6,
        "udp" => 17,
        "gre" => 47,
        "esp" => 50,
        "icmpv6" | "ipv6-icmp" => 58,
        "sctp" => 132,
        n => n.parse().ok()?,
    })
}

/// The server's memory of which class each flow's answers belong to: bounded (at most
/// `2 * capacity` flows), forgotten after one to two `idle` periods without a packet. Two
/// generations, so marking and lookup are O(1) and expiry never scans: marks go to the current
/// generation; when it is full or `idle` old, it becomes the previous one and the previous one
/// is dropped.
#[derive(Debug)]
pub struct FlowClasses {
    current: HashMap<u64, u8>,
    previous: HashMap<u64, u8>,
    started: Option<Instant>,
    idle: Duration,
    capacity: usize,
}

/// Flows remembered per generation (a site's concurrent flows, with room).
pub const FLOW_CLASSES_CAPACITY: usize = 16 * 1024;
/// A flow without packets for this long (to twice it) goes back to the default class.
pub const FLOW_CLASSES_IDLE: Duration = Duration::from_secs(60);

impl Default for FlowClasses {
    fn default() -> Self {
        FlowClasses::new(FLOW_CLASSES_IDLE, FLOW_CLASSES_CAPACITY)
    }
}

impl FlowClasses {
    pub fn new(idle: Duration, capacity: usize) -> Self {
        FlowClasses {
            current: HashMap::new(),
            previous: HashMap::new(),
            started: None,
            idle,
            capacity: capacity.max(1),
        }
    }

    /// A packet of class `class` arrived: its answers (`key` = the packet's `reply_hash`) go
    /// back in that class.
    pub fn mark(&mut self, key: u64, class: u8, now: Instant) {
        self.rotate(now);
        if self.current.len() >= self.capacity && !self.current.contains_key(&key) {
            self.started = None;
            self.rotate(now);
        }
        self.current.insert(key, class);
    }

    /// The class a packet with flow hash `key` was marked with.
    pub fn class_of(&mut self, key: u64, now: Instant) -> Option<u8> {
        self.rotate(now);
        if let Some(c) = self.current.get(&key) {
            return Some(*c);
        }
        let c = self.previous.remove(&key)?;
        // Still in use: carried into the current generation.
        if self.current.len() < self.capacity {
            self.current.insert(key, c);
        }
        Some(c)
    }

    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn rotate(&mut self, now: Instant) {
        let age = self.started.map(|t| now.saturating_duration_since(t));
        match age {
            Some(a) if a < self.idle => return,
            // Two periods without a rotation: both generations are stale.
            Some(a) if a >= self.idle * 2 => {
                self.current.clear();
                self.previous.clear();
            }
            _ => self.previous = std::mem::take(&mut self.current),
        }
        self.started = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn udp4(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, tos: u8) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        p[0] = 0x45;
        p[1] = tos;
        p[2..4].copy_from_slice(&28u16.to_be_bytes());
        p[9] = 17;
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        p[20..22].copy_from_slice(&sport.to_be_bytes());
        p[22..24].copy_from_slice(&dport.to_be_bytes());
        p
    }

    fn info(p: &[u8]) -> PacketInfo {
        PacketInfo::parse(p).unwrap()
    }

    #[test]
    fn prefixes() {
        let p = Prefix::parse("10.1.0.0/16").unwrap();
        assert!(p.contains("10.1.2.3".parse().unwrap()));
        assert!(!p.contains("10.2.0.1".parse().unwrap()));
        assert!(!p.contains("::1".parse().unwrap()));
        assert!(Prefix::parse("0.0.0.0/0")
            .unwrap()
            .contains("1.2.3.4".parse().unwrap()));
        let h = Prefix::parse("fd00::1").unwrap();
        assert_eq!(h.len, 128);
        assert!(Prefix::parse("fd00::/8")
            .unwrap()
            .contains("fd12::9".parse().unwrap()));
        assert!(Prefix::parse("10.0.0.0/33").is_none());
        assert!(Prefix::parse("nonsense").is_none());
    }

    #[test]
    fn first_matching_class_wins_and_the_rest_is_default() {
        let voice = Rule {
            dscp: vec![46],
            ..Default::default()
        };
        let sip = Rule {
            protocol: vec![17],
            port: vec![(5060, 5061)],
            ..Default::default()
        };
        let backup = Rule {
            dst: vec![Prefix::parse("192.0.2.0/24").unwrap()],
            dst_port: vec![(873, 873)],
            ..Default::default()
        };
        // critical, default, bulk (the default class's rules are ignored).
        let c = Classifier::new(vec![vec![voice, sip], vec![], vec![backup]], 1);
        let ef = udp4([10, 0, 0, 1], [192, 0, 2, 9], 4000, 873, 46 << 2);
        assert_eq!(
            c.classify(Some(&info(&ef))),
            (0, true),
            "DSCP EF before bulk"
        );
        let sip_reply = udp4([10, 0, 0, 1], [8, 8, 8, 8], 5060, 40000, 0);
        assert_eq!(c.classify(Some(&info(&sip_reply))), (0, true));
        let rsync = udp4([10, 0, 0, 1], [192, 0, 2, 9], 4000, 873, 0);
        assert_eq!(c.classify(Some(&info(&rsync))), (2, true));
        let web = udp4([10, 0, 0, 1], [192, 0, 2, 9], 4000, 443, 0);
        assert_eq!(c.classify(Some(&info(&web))), (1, false));
        assert_eq!(c.classify(None), (1, false));
    }

    #[test]
    fn protocol_names() {
        assert_eq!(protocol_number("ICMP"), Some(1));
        assert_eq!(protocol_number("udp"), Some(17));
        assert_eq!(protocol_number("89"), Some(89));
        assert_eq!(protocol_number("ospf"), None);
    }

    #[test]
    fn answers_follow_the_class_of_their_request() {
        let now = Instant::now();
        let mut f = FlowClasses::new(Duration::from_secs(60), 4);
        let req = info(&udp4([10, 0, 0, 1], [8, 8, 8, 8], 5000, 53, 0));
        let ans = info(&udp4([8, 8, 8, 8], [10, 0, 0, 1], 53, 5000, 0));
        f.mark(req.reply_hash(), 2, now);
        assert_eq!(f.class_of(ans.flow_hash(), now), Some(2));
        assert_eq!(
            f.class_of(req.flow_hash(), now),
            None,
            "only the other direction"
        );
        // Still there one period later (moved to the previous generation, then carried back).
        let later = now + Duration::from_secs(61);
        assert_eq!(f.class_of(ans.flow_hash(), later), Some(2));
        // Forgotten after two idle periods without packets.
        let much_later = later + Duration::from_secs(121);
        assert_eq!(f.class_of(ans.flow_hash(), much_later), None);
    }

    #[test]
    fn flow_memory_is_bounded() {
        let now = Instant::now();
        let mut f = FlowClasses::new(Duration::from_secs(60), 100);
        for k in 0..10_000u64 {
            f.mark(k, (k % 3) as u8, now);
            assert!(f.len() <= 200);
        }
        // The latest marks are kept.
        assert_eq!(f.class_of(9_999, now), Some((9_999 % 3) as u8));
    }
}
