//! Tunnel address assignment on the server: pure, so every rule is unit-tested.

use std::collections::HashMap;
use std::net::Ipv4Addr;

/// The server's tunnel network and the addresses reserved for named clients (`clients:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressPlan {
    /// The server's own tunnel address.
    pub tun_addr: Ipv4Addr,
    pub prefix: u8,
    /// Fixed addresses by client name (certificate CN).
    pub fixed: Vec<(String, Ipv4Addr)>,
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
}
