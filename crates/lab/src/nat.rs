//! A carrier-grade NAT in front of a path's client end, in the emulator: the client's UDP and
//! TCP source ports are mapped to external ports on the way out, and the server's answers are
//! mapped back on the way in; an answer to a port with no mapping is dropped (counted). A
//! `rebind` forgets every mapping at once, as when a CGNAT renews its mappings or a modem's NAT
//! restarts: the client's next packet gets a new external port, and whatever the server still
//! sends to the old one is lost.
//!
//! Why in the emulator and not nftables in the client's namespace: a NAT on the sending host
//! rewrites ports before the kernel segments UDP GSO batches, and on this kernel (6.18) with the
//! WAN interface's checksum offload off (as the emulator needs) every segment of such a batch
//! then leaves with a wrong UDP checksum: a lab that loses every full-size burst, which no CGNAT
//! does (it sees finished packets). Here the frames are whole and the checksums are updated
//! incrementally (RFC 1624).
//!
//! The mapping is endpoint-independent (one external port per internal address and port,
//! whatever the destination), the external address is the internal one (only ports change: the
//! lab has one address per WAN), ports are drawn at random from 20000-40000 (a seeded
//! generator: the same seed, the same ports), and a mapping idle for `timeout` expires.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::emu::Rng;

const UDP: u8 = 17;
const TCP: u8 = 6;
const PORTS: std::ops::Range<u16> = 20000..40000;

/// What the NAT has done, for `mpquic-lab stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct NatStats {
    /// Mappings made (a new one after every rebind or expiry).
    pub mappings: u64,
    pub rebinds: u64,
    /// Packets from the server to an external port with no mapping (dropped).
    pub unmapped_drops: u64,
    /// Mappings that expired (idle longer than the timeout).
    pub expired: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Internal {
    proto: u8,
    addr: IpAddr,
    port: u16,
}

#[derive(Debug, Clone, Copy)]
struct Mapping {
    external: u16,
    last_used: Instant,
}

pub struct Nat {
    rng: Rng,
    timeout: Option<Duration>,
    out: HashMap<Internal, Mapping>,
    /// (protocol, external port) -> the internal side.
    back: HashMap<(u8, u16), Internal>,
    pub stats: NatStats,
}

/// Where the transport header of an IP packet starts, its protocol, and the offset of the
/// transport checksum field; None for what the NAT does not translate (other protocols,
/// non-first fragments, packets too short).
fn transport(ip: &[u8]) -> Option<(usize, u8, usize)> {
    let (l4, proto) = match ip.first()? >> 4 {
        4 => {
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            let frag_offset = u16::from_be_bytes([*ip.get(6)?, *ip.get(7)?]) & 0x1fff;
            if ihl < 20 || frag_offset != 0 {
                return None;
            }
            (ihl, *ip.get(9)?)
        }
        6 => (40, *ip.get(6)?),
        _ => return None,
    };
    let csum = match proto {
        UDP => l4 + 6,
        TCP => l4 + 16,
        _ => return None,
    };
    (ip.len() >= csum + 2).then_some((l4, proto, csum))
}

fn addr(ip: &[u8], source: bool) -> IpAddr {
    if ip[0] >> 4 == 4 {
        let o = if source { 12 } else { 16 };
        IpAddr::from(<[u8; 4]>::try_from(&ip[o..o + 4]).expect("4 bytes"))
    } else {
        let o = if source { 8 } else { 24 };
        IpAddr::from(<[u8; 16]>::try_from(&ip[o..o + 16]).expect("16 bytes"))
    }
}

/// Replace the 16-bit word at `at` with `new`, keeping the transport checksum at `csum` right
/// (RFC 1624: HC' = ~(~HC + ~m + m')). A UDP/IPv4 checksum of 0 means "none" and stays 0; a
/// computed 0 is sent as 0xffff.
fn rewrite_port(ip: &mut [u8], proto: u8, at: usize, csum: usize, new: u16) {
    let old = u16::from_be_bytes([ip[at], ip[at + 1]]);
    ip[at..at + 2].copy_from_slice(&new.to_be_bytes());
    let hc = u16::from_be_bytes([ip[csum], ip[csum + 1]]);
    if proto == UDP && hc == 0 && ip[0] >> 4 == 4 {
        return;
    }
    let mut sum = u32::from(!hc) + u32::from(!old) + u32::from(new);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let mut folded = !(sum as u16);
    if proto == UDP && folded == 0 {
        folded = 0xffff;
    }
    ip[csum..csum + 2].copy_from_slice(&folded.to_be_bytes());
}

fn expired(timeout: Option<Duration>, m: &Mapping, now: Instant) -> bool {
    timeout.is_some_and(|t| now.saturating_duration_since(m.last_used) > t)
}

impl Nat {
    pub fn new(seed: u64, timeout: Option<Duration>) -> Nat {
        Nat {
            rng: Rng::new(seed ^ 0x6e61_7400),
            timeout,
            out: HashMap::new(),
            back: HashMap::new(),
            stats: NatStats::default(),
        }
    }

    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Forget every mapping (the next outbound packet of each flow gets a new external port).
    pub fn rebind(&mut self) {
        self.forget();
        self.stats.rebinds += 1;
    }

    pub fn forget(&mut self) {
        self.out.clear();
        self.back.clear();
    }

    /// A client-to-server packet (an IP packet, no link header): its source port mapped to the
    /// flow's external port (a new one when it has none).
    pub fn outbound(&mut self, ip: &mut [u8], now: Instant) {
        let Some((l4, proto, csum)) = transport(ip) else {
            return;
        };
        let key = Internal {
            proto,
            addr: addr(ip, true),
            port: u16::from_be_bytes([ip[l4], ip[l4 + 1]]),
        };
        let external = match self.out.get_mut(&key) {
            Some(m) if !expired(self.timeout, m, now) => {
                m.last_used = now;
                m.external
            }
            stale => {
                if let Some(old) = stale.map(|m| m.external) {
                    self.back.remove(&(proto, old));
                    self.stats.expired += 1;
                }
                let external = self.free_port(proto);
                self.out.insert(
                    key,
                    Mapping {
                        external,
                        last_used: now,
                    },
                );
                self.back.insert((proto, external), key);
                self.stats.mappings += 1;
                external
            }
        };
        rewrite_port(ip, proto, l4, csum, external);
    }

    /// A server-to-client packet: its destination port mapped back to the internal one; false
    /// when the port has no (live) mapping: the packet is to be dropped.
    pub fn inbound(&mut self, ip: &mut [u8], now: Instant) -> bool {
        let Some((l4, proto, csum)) = transport(ip) else {
            return true;
        };
        let external = u16::from_be_bytes([ip[l4 + 2], ip[l4 + 3]]);
        let Some(internal) = self.back.get(&(proto, external)).copied() else {
            self.stats.unmapped_drops += 1;
            return false;
        };
        let live = self
            .out
            .get(&internal)
            .is_some_and(|m| m.external == external && !expired(self.timeout, m, now));
        if !live {
            self.stats.unmapped_drops += 1;
            return false;
        }
        rewrite_port(ip, proto, l4 + 2, csum, internal.port);
        true
    }

    fn free_port(&mut self, proto: u8) -> u16 {
        let span = u64::from(PORTS.end - PORTS.start);
        loop {
            let port = PORTS.start + (self.rng.next_u64() % span) as u16;
            if !self.back.contains_key(&(proto, port)) {
                return port;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4/UDP packet with a correct checksum.
    fn udp4(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, payload: &[u8]) -> Vec<u8> {
        let len = 28 + payload.len();
        let mut p = vec![0u8; len];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        p[8] = 64;
        p[9] = UDP;
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        p[20..22].copy_from_slice(&sport.to_be_bytes());
        p[22..24].copy_from_slice(&dport.to_be_bytes());
        p[24..26].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        p[28..].copy_from_slice(payload);
        let c = udp4_checksum(&p);
        p[26..28].copy_from_slice(&c.to_be_bytes());
        p
    }

    /// The checksum the packet should carry (computed with its checksum field as zero).
    fn udp4_checksum(p: &[u8]) -> u16 {
        let mut sum = 0u32;
        let mut add = |b: &[u8]| {
            for c in b.chunks(2) {
                sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
            }
        };
        add(&p[12..20]);
        add(&[0, UDP]);
        add(&p[24..26]);
        let mut l4 = p[20..].to_vec();
        l4[6] = 0;
        l4[7] = 0;
        add(&l4);
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        match !(sum as u16) {
            0 => 0xffff,
            c => c,
        }
    }

    fn port(p: &[u8], dst: bool) -> u16 {
        let o = if dst { 22 } else { 20 };
        u16::from_be_bytes([p[o], p[o + 1]])
    }

    const CLIENT: [u8; 4] = [10, 10, 1, 2];
    const SERVER: [u8; 4] = [10, 99, 0, 1];

    #[test]
    fn maps_out_and_back_with_correct_checksums() {
        let mut nat = Nat::new(1, None);
        let t = Instant::now();
        for payload in [&b"hello"[..], &[0xff; 1400][..], &[0u8; 3][..]] {
            let mut out = udp4(CLIENT, 43000, SERVER, 45017, payload);
            nat.outbound(&mut out, t);
            let ext = port(&out, false);
            assert!(PORTS.contains(&ext));
            assert_eq!(u16::from_be_bytes([out[26], out[27]]), udp4_checksum(&out));
            let mut back = udp4(SERVER, 45017, CLIENT, ext, payload);
            assert!(nat.inbound(&mut back, t));
            assert_eq!(port(&back, true), 43000);
            assert_eq!(
                u16::from_be_bytes([back[26], back[27]]),
                udp4_checksum(&back)
            );
        }
        assert_eq!(nat.stats.mappings, 1, "one flow, one mapping");
    }

    #[test]
    fn rebind_moves_the_flow_and_drops_answers_to_the_old_port() {
        let mut nat = Nat::new(7, None);
        let t = Instant::now();
        let mut a = udp4(CLIENT, 43000, SERVER, 45017, b"x");
        nat.outbound(&mut a, t);
        let old = port(&a, false);
        nat.rebind();
        let mut late = udp4(SERVER, 45017, CLIENT, old, b"y");
        assert!(!nat.inbound(&mut late, t), "the old mapping is gone");
        let mut b = udp4(CLIENT, 43000, SERVER, 45017, b"x");
        nat.outbound(&mut b, t);
        let new = port(&b, false);
        assert_ne!(old, new);
        let mut answer = udp4(SERVER, 45017, CLIENT, new, b"y");
        assert!(nat.inbound(&mut answer, t));
        assert_eq!(
            nat.stats,
            NatStats {
                mappings: 2,
                rebinds: 1,
                unmapped_drops: 1,
                expired: 0
            }
        );
    }

    #[test]
    fn idle_mappings_expire() {
        let mut nat = Nat::new(3, Some(Duration::from_secs(30)));
        let t = Instant::now();
        let mut a = udp4(CLIENT, 43000, SERVER, 45017, b"x");
        nat.outbound(&mut a, t);
        let first = port(&a, false);
        let later = t + Duration::from_secs(31);
        let mut answer = udp4(SERVER, 45017, CLIENT, first, b"y");
        assert!(!nat.inbound(&mut answer, later));
        let mut b = udp4(CLIENT, 43000, SERVER, 45017, b"x");
        nat.outbound(&mut b, later);
        assert_ne!(port(&b, false), first);
        assert_eq!(nat.stats.expired, 1);
    }

    #[test]
    fn zero_udp_checksum_stays_zero_and_other_protocols_pass() {
        let mut nat = Nat::new(1, None);
        let t = Instant::now();
        let mut p = udp4(CLIENT, 43000, SERVER, 45017, b"x");
        p[26] = 0;
        p[27] = 0;
        nat.outbound(&mut p, t);
        assert_eq!(&p[26..28], &[0, 0]);
        let mut icmp = p.clone();
        icmp[9] = 1;
        let before = icmp.clone();
        nat.outbound(&mut icmp, t);
        assert_eq!(icmp, before);
        assert!(nat.inbound(&mut icmp, t), "not translated, not dropped");
    }
}
