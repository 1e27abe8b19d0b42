//! Tunnel address assignment on the server: pure, so every rule is unit-tested.

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr};

/// The server's tunnel network and the addresses reserved for named clients (`clients:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressPlan {
    /// The server's own tunnel address.
    pub tun_addr: Ipv4Addr,
    pub prefix: u8,
    /// Fixed addresses by client name (certificate CN).
    pub fixed: Vec<(String, Ipv4Addr)>,
}

/// IPv6 inside the tunnel (a dual-stack `tun_cidr`): a client's IPv6 address is the server's
/// IPv6 network with the client's IPv4 host number (10.200.17.5/24 with fd00:17::/64 gives
/// fd00:17::5). So the IPv4 assignment (reservations, requests, memory) decides both, nothing
/// more is kept per client, and the server finds a client from either address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Plan {
    net4: u32,
    prefix4: u8,
    net6: u128,
    prefix6: u8,
}

impl Ipv6Plan {
    /// The plan for a server at `v4` and `v6` (each address/prefix length). Refused when the
    /// IPv6 network has fewer host numbers than the IPv4 one, or when the server's IPv6
    /// address is a host number a client could get.
    pub fn new(v4: (Ipv4Addr, u8), v6: (Ipv6Addr, u8)) -> Result<Ipv6Plan, String> {
        let (host_bits4, host_bits6) = (32 - u32::from(v4.1), 128 - u32::from(v6.1));
        if v6.1 > 128 || host_bits6 < host_bits4 {
            return Err(format!(
                "the IPv6 network /{} has fewer host numbers than the IPv4 /{} (each client's IPv6 address carries its IPv4 host number)",
                v6.1, v4.1
            ));
        }
        let plan = Ipv6Plan {
            net4: u32::from(v4.0) & mask(v4.1),
            prefix4: v4.1,
            net6: u128::from(v6.0) & mask6(v6.1),
            prefix6: v6.1,
        };
        let host6 = u128::from(v6.0) & !mask6(v6.1);
        let host4 = u32::from(v4.0) & !mask(v4.1);
        if host6 < 1 << host_bits4 && host6 != u128::from(host4) {
            return Err(format!(
                "the server's IPv6 address {} would be a client's (host number {host6}); use its IPv4 host number: {}/{}",
                v6.0,
                plan.v6_of(v4.0),
                v6.1
            ));
        }
        Ok(plan)
    }

    /// The IPv6 address that goes with tunnel address `v4`.
    pub fn v6_of(&self, v4: Ipv4Addr) -> Ipv6Addr {
        Ipv6Addr::from(self.net6 | u128::from(u32::from(v4) & !mask(self.prefix4)))
    }

    /// The IPv4 tunnel address that goes with `v6`, if `v6` is a client's.
    pub fn v4_of(&self, v6: Ipv6Addr) -> Option<Ipv4Addr> {
        let v6 = u128::from(v6);
        let host = v6 & !mask6(self.prefix6);
        let room = 1u128 << (32 - u32::from(self.prefix4));
        (v6 & mask6(self.prefix6) == self.net6 && host < room)
            .then(|| Ipv4Addr::from(self.net4 | host as u32))
    }

    pub fn prefix6(&self) -> u8 {
        self.prefix6
    }
}

/// `x:y::z/len`.
pub fn parse_cidr6(s: &str) -> Option<(Ipv6Addr, u8)> {
    let (a, p) = s.split_once('/')?;
    let addr: Ipv6Addr = a.trim().parse().ok()?;
    let prefix: u8 = p.trim().parse().ok()?;
    (prefix <= 128).then_some((addr, prefix))
}

fn mask6(prefix: u8) -> u128 {
    match prefix {
        0 => 0,
        p => u128::MAX << (128 - u32::from(p.min(128))),
    }
}

/// `a.b.c.d/len`.
pub fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (a, p) = s.split_once('/')?;
    let addr: Ipv4Addr = a.trim().parse().ok()?;
    let prefix: u8 = p.trim().parse().ok()?;
    (prefix <= 32).then_some((addr, prefix))
}

/// The network mask of a prefix length, as a number.
pub fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

/// The tunnel address for client session `name` (`identity`, or `identity/instance` for one of
/// several instances of a site): its reserved one from `clients:` (listed by `name`, else by
/// `identity`), else the one it asks for when free and allowed, else the one it had before,
/// else the lowest free one (preferring addresses no other client had). `owner(a)` names the
/// connected client using address `a`.
pub fn assign(
    scfg: &AddressPlan,
    owner: impl Fn(Ipv4Addr) -> Option<String>,
    remembered: &HashMap<String, Ipv4Addr>,
    name: &str,
    identity: &str,
    requested: Option<&str>,
) -> Result<Ipv4Addr, String> {
    let net = u32::from(scfg.tun_addr) & mask(scfg.prefix);
    let bcast = net | !mask(scfg.prefix);
    let reserved_for = |a: Ipv4Addr| {
        scfg.fixed
            .iter()
            .find(|(_, r)| *r == a)
            .map(|(n, _)| n.as_str())
    };
    let usable = |a: Ipv4Addr| {
        let x = u32::from(a);
        x & mask(scfg.prefix) == net && x != net && x != bcast && a != scfg.tun_addr
    };
    let free = |a: Ipv4Addr| {
        owner(a).is_none() && reserved_for(a).is_none_or(|n| n == name || n == identity)
    };
    let requested = match requested {
        Some(r) => Some(
            parse_cidr(r)
                .map(|(a, _)| a)
                .ok_or_else(|| format!("requested address `{r}` is not a.b.c.d/len"))?,
        ),
        None => None,
    };
    let fixed = (scfg.fixed.iter().find(|(n, _)| n == name))
        .or_else(|| scfg.fixed.iter().find(|(n, _)| n == identity));
    if let Some((_, fixed)) = fixed {
        if let Some(r) = requested.filter(|r| r != fixed) {
            return Err(format!(
                "this client's address is {fixed} (server `clients:` list); it asked for {r}: change its tun_cidr or remove it"
            ));
        }
        if let Some(other) = owner(*fixed) {
            return Err(format!("address {fixed} is in use by client `{other}`"));
        }
        return Ok(*fixed);
    }
    if let Some(r) = requested {
        if !usable(r) {
            return Err(format!(
                "requested address {r} is not a usable host address in the server's {}/{}",
                Ipv4Addr::from(net),
                scfg.prefix
            ));
        }
        if let Some(o) = reserved_for(r) {
            return Err(format!(
                "requested address {r} is reserved for client `{o}`"
            ));
        }
        if let Some(o) = owner(r) {
            return Err(format!("requested address {r} is in use by client `{o}`"));
        }
        return Ok(r);
    }
    if let Some(prev) = remembered.get(name).copied().filter(|a| free(*a)) {
        return Ok(prev);
    }
    let taken_by_memory = |a: Ipv4Addr| remembered.iter().any(|(n, r)| *r == a && n != name);
    let hosts = || {
        (net + 1..bcast)
            .map(Ipv4Addr::from)
            .filter(|a| usable(*a) && free(*a))
    };
    hosts()
        .find(|a| !taken_by_memory(*a))
        .or_else(|| hosts().next())
        .ok_or_else(|| {
            format!(
                "address pool {}/{} is exhausted",
                Ipv4Addr::from(net),
                scfg.prefix
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scfg(prefix: u8, clients: &[(&str, [u8; 4])]) -> AddressPlan {
        AddressPlan {
            tun_addr: Ipv4Addr::new(10, 0, 0, 254),
            prefix,
            fixed: clients
                .iter()
                .map(|(n, a)| (n.to_string(), Ipv4Addr::from(*a)))
                .collect(),
        }
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn pool_request_reservation_memory_and_exhaustion() {
        let s = scfg(24, &[("fixed", [10, 0, 0, 1])]);
        let none = |_| None;
        let mem = HashMap::new();
        // Pool: lowest free, skipping the reservation.
        assert_eq!(assign(&s, none, &mem, "a", "a", None), Ok(ip("10.0.0.2")));
        // The reserved client gets its address, and only that one.
        assert_eq!(
            assign(&s, none, &mem, "fixed", "fixed", None),
            Ok(ip("10.0.0.1"))
        );
        assert!(
            assign(&s, none, &mem, "fixed", "fixed", Some("10.0.0.9/24"))
                .unwrap_err()
                .contains("clients:")
        );
        // Requests: honoured when free and allowed.
        assert_eq!(
            assign(&s, none, &mem, "a", "a", Some("10.0.0.9/24")),
            Ok(ip("10.0.0.9"))
        );
        assert!(assign(&s, none, &mem, "a", "a", Some("10.0.0.1/24"))
            .unwrap_err()
            .contains("reserved for client `fixed`"));
        assert!(assign(&s, none, &mem, "a", "a", Some("10.0.0.254/24"))
            .unwrap_err()
            .contains("not a usable"));
        assert!(assign(&s, none, &mem, "a", "a", Some("10.0.0.255/24"))
            .unwrap_err()
            .contains("not a usable"));
        assert!(assign(&s, none, &mem, "a", "a", Some("192.168.0.1/24"))
            .unwrap_err()
            .contains("not a usable"));
        assert!(assign(&s, none, &mem, "a", "a", Some("garbage"))
            .unwrap_err()
            .contains("not a.b.c.d/len"));
        let used = |a: Ipv4Addr| (a == ip("10.0.0.9")).then(|| "b".to_string());
        assert!(assign(&s, used, &mem, "a", "a", Some("10.0.0.9/24"))
            .unwrap_err()
            .contains("in use by client `b`"));
        // Memory: a returning client gets its old address; others avoid it while possible.
        let mem: HashMap<String, Ipv4Addr> = [
            ("a".to_string(), ip("10.0.0.7")),
            ("b".to_string(), ip("10.0.0.2")),
        ]
        .into();
        assert_eq!(assign(&s, none, &mem, "a", "a", None), Ok(ip("10.0.0.7")));
        assert_eq!(assign(&s, none, &mem, "c", "c", None), Ok(ip("10.0.0.3")));
        // Exhaustion: a /30 has two hosts, one is the server's (.254 is outside, so both are free).
        let small = AddressPlan {
            tun_addr: ip("10.0.0.2"),
            prefix: 30,
            ..scfg(30, &[])
        };
        let full = |a: Ipv4Addr| (a == ip("10.0.0.1")).then(|| "x".to_string());
        assert!(assign(&small, full, &HashMap::new(), "a", "a", None)
            .unwrap_err()
            .contains("exhausted"));
    }

    #[test]
    fn instances_of_a_site() {
        // One reservation per instance (`site/instance`), or one for the identity.
        let s = scfg(24, &[("site/cr2", [10, 0, 0, 1]), ("solo", [10, 0, 0, 3])]);
        let none = |_| None;
        let mem = HashMap::new();
        assert_eq!(
            assign(&s, none, &mem, "site/cr2", "site", None),
            Ok(ip("10.0.0.1"))
        );
        // Another instance of the site: a request is honoured, the pool otherwise.
        assert_eq!(
            assign(&s, none, &mem, "site/br2", "site", Some("10.0.0.5/24")),
            Ok(ip("10.0.0.5"))
        );
        assert_eq!(
            assign(&s, none, &mem, "site/df2", "site", None),
            Ok(ip("10.0.0.2"))
        );
        // The identity's reservation applies to an instance not listed by itself.
        assert_eq!(
            assign(&s, none, &mem, "solo/mpq0", "solo", None),
            Ok(ip("10.0.0.3"))
        );
        let used = |a: Ipv4Addr| (a == ip("10.0.0.3")).then(|| "solo/mpq0".to_string());
        assert!(assign(&s, used, &mem, "solo/mpq1", "solo", None)
            .unwrap_err()
            .contains("in use by client `solo/mpq0`"));
    }

    #[test]
    fn ipv6_addresses_carry_the_ipv4_host_number() {
        let v4 = (Ipv4Addr::new(10, 200, 17, 254), 24);
        let v6 = |s: &str| parse_cidr6(s).unwrap();
        let plan = Ipv6Plan::new(v4, v6("fd00:17::fe/64")).unwrap();
        let c: Ipv6Addr = "fd00:17::5".parse().unwrap();
        assert_eq!(plan.v6_of(Ipv4Addr::new(10, 200, 17, 5)), c);
        assert_eq!(plan.v4_of(c), Some(Ipv4Addr::new(10, 200, 17, 5)));
        // Outside the network, or a host number no IPv4 address has.
        assert_eq!(plan.v4_of("fd00:18::5".parse().unwrap()), None);
        assert_eq!(plan.v4_of("fd00:17::1:5".parse().unwrap()), None);
        // The server's own IPv6 address must not be a client's.
        let e = Ipv6Plan::new(v4, v6("fd00:17::1/64")).unwrap_err();
        assert!(e.contains("fd00:17::fe/64"), "{e}");
        assert!(Ipv6Plan::new(v4, v6("fd00:17::1:0/64")).is_ok());
        // Room for every IPv4 host number.
        assert!(Ipv6Plan::new(v4, v6("fd00:17::fe/121")).is_err());
        assert!(Ipv6Plan::new(v4, v6("fd00:17::fe/120")).is_ok());
    }
}
