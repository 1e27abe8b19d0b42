//! The server's session rules, sans-IO: which session a new path joins, when a session is
//! replaced or forgotten, which address it gets, and how many paths it may have. A session is one
//! running client instance: its identity (certificate CN) and the session id its process drew at
//! start, so a restarted client (new id) replaces its old session at once, while NAT rebinding,
//! new ports and reconnections of the same process join the session they belong to.
//!
//! The registry is generic over what the shell keeps per session (`S`: its tunnel, timers...).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use crate::addressing::{self, AddressPlan};
use crate::classify::Prefix;

/// A session with no connected path for this long is forgotten (its address becomes free):
/// long enough for a site whose links all dropped to come back to the session it had.
pub const SESSION_LINGER: Duration = Duration::from_secs(120);

/// Where a session's client is, as the shell sees it (`Registry::expire`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// At least one path connected.
    Connected,
    /// No path connected: an outage or a killed process; kept for `SESSION_LINGER`.
    Away,
    /// No path connected, and the client said it was stopping: nothing to wait for.
    Left,
}
/// The session name of a client instance: its identity (certificate CN), and the instance (its
/// TUN device's name) when the client says which: one certificate per site serves several
/// instances (seed 000: one per traffic class), each its own session and address.
pub fn session_name(identity: &str, instance: Option<&str>) -> String {
    match instance {
        Some(i) => format!("{identity}/{i}"),
        None => identity.to_string(),
    }
}

/// Paths one session may have: far more WAN links (x pipes) than a site has, small enough that a
/// misbehaving or hostile client cannot grow a session's path table without bound.
pub const MAX_PATHS_PER_SESSION: usize = 64;

struct Entry<S> {
    id: u64,
    addr: Ipv4Addr,
    value: S,
    /// Last time the session had a connected path.
    last_connected: Instant,
}

/// What a path's hello leads to: the session it joins and that session's address.
pub struct Join<S> {
    pub value: S,
    pub addr: Ipv4Addr,
    /// The session was created by this hello (`false`: the path joins a running one).
    pub created: bool,
    /// The old session of the same identity (the client restarted), already removed: the shell
    /// closes it.
    pub replaced: Option<S>,
}

pub struct Registry<S> {
    by_name: HashMap<String, Entry<S>>,
    by_addr: HashMap<Ipv4Addr, String>,
    /// Last address each client had, so a reconnecting client gets it back.
    remembered: HashMap<String, Ipv4Addr>,
    /// Site LAN prefixes routed to sessions (routed LANs), longest first.
    routes: Vec<(Prefix, String)>,
}

impl<S> Default for Registry<S> {
    fn default() -> Self {
        Registry {
            by_name: HashMap::new(),
            by_addr: HashMap::new(),
            remembered: HashMap::new(),
            routes: Vec::new(),
        }
    }
}

impl<S: Clone> Registry<S> {
    /// The session a path of client `name` with session `id` belongs to: the existing one, or a
    /// new one (made by `make(addr)`) with an address from `plan`, replacing any older session of
    /// the same name. Refused (with the reason for the client) when no address can be given.
    /// `name` is the client's `identity`, or `identity/instance` for one of several instances
    /// of a site (`session_name`): each is a session of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn join(
        &mut self,
        plan: &AddressPlan,
        name: &str,
        identity: &str,
        id: u64,
        requested_addr: Option<&str>,
        now: Instant,
        make: impl FnOnce(Ipv4Addr) -> S,
    ) -> Result<Join<S>, String> {
        if let Some(e) = self.by_name.get(name).filter(|e| e.id == id) {
            return Ok(Join {
                value: e.value.clone(),
                addr: e.addr,
                created: false,
                replaced: None,
            });
        }
        // A new session id from a known identity: the client restarted. Its old session's address
        // counts as free for it; the old session goes only once the new one has an address (a
        // refused attempt leaves the running session alone).
        let owner = |a: Ipv4Addr| self.by_addr.get(&a).filter(|n| *n != name).cloned();
        let addr = addressing::assign(
            plan,
            owner,
            &self.remembered,
            name,
            identity,
            requested_addr,
        )?;
        let replaced = self.remove(name);
        let value = make(addr);
        self.insert(name, id, addr, value.clone(), now);
        Ok(Join {
            value,
            addr,
            created: true,
            replaced,
        })
    }

    /// Client `name` had `addr` before this server knew it (the server restarted): it gets it
    /// back if it is free, as if the server had remembered it (`addressing::assign`).
    pub fn remember(&mut self, name: &str, addr: Ipv4Addr) {
        self.remembered.entry(name.to_string()).or_insert(addr);
    }

    /// The session owning `addr` (the server's TUN routing): its tunnel address, else the
    /// longest of the site LAN prefixes (IPv4 or IPv6) routed to a session that holds it. A
    /// client's IPv6 tunnel address is looked up by the IPv4 one it names (`Ipv6Plan`).
    pub fn by_addr(&self, addr: impl Into<IpAddr>) -> Option<&S> {
        let addr = addr.into();
        let own = match addr {
            IpAddr::V4(a) => self.by_addr.get(&a),
            IpAddr::V6(_) => None,
        };
        let name = own.or_else(|| {
            self.routes
                .iter()
                .find(|(p, _)| p.contains(addr))
                .map(|(_, n)| n)
        })?;
        self.by_name.get(name).map(|e| &e.value)
    }

    /// Route `prefixes` (a site's LAN, announced by the client and allowed by the server's
    /// configuration) to session `name`, in place of what it had. Refused when one overlaps a
    /// prefix routed to another session (two instances of one site announcing the same LAN).
    pub fn set_routes(&mut self, name: &str, prefixes: &[Prefix]) -> Result<(), String> {
        for p in prefixes {
            if let Some((q, other)) = self.routes.iter().find(|(q, n)| n != name && p.overlaps(q)) {
                return Err(format!(
                    "LAN prefix {p} overlaps {q}, routed to client `{other}`"
                ));
            }
        }
        self.routes.retain(|(_, n)| n != name);
        self.routes
            .extend(prefixes.iter().map(|p| (*p, name.to_string())));
        self.routes.sort_by_key(|r| std::cmp::Reverse(r.0.len));
        Ok(())
    }

    /// Every session with its name and address, in name order.
    pub fn sessions(&self) -> Vec<(&str, Ipv4Addr, &S)> {
        let mut v: Vec<_> = self
            .by_name
            .iter()
            .map(|(n, e)| (n.as_str(), e.addr, &e.value))
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v
    }

    /// Forget the sessions whose client left, and those without a connected path for longer
    /// than `SESSION_LINGER` (`presence(s)`: where s's client is now). Returns them with their
    /// names and addresses.
    pub fn expire(
        &mut self,
        now: Instant,
        presence: impl Fn(&S) -> Presence,
    ) -> Vec<(String, Ipv4Addr, S)> {
        let mut stale = Vec::new();
        for (name, e) in self.by_name.iter_mut() {
            match presence(&e.value) {
                Presence::Connected => e.last_connected = now,
                Presence::Left => stale.push(name.clone()),
                Presence::Away => {
                    if now.saturating_duration_since(e.last_connected) > SESSION_LINGER {
                        stale.push(name.clone());
                    }
                }
            }
        }
        stale
            .into_iter()
            .filter_map(|n| {
                let addr = self.by_name.get(&n)?.addr;
                Some((n.clone(), addr, self.remove(&n)?))
            })
            .collect()
    }

    /// Remove every session (shutdown).
    pub fn drain(&mut self) -> Vec<S> {
        self.by_addr.clear();
        self.routes.clear();
        self.by_name.drain().map(|(_, e)| e.value).collect()
    }

    fn insert(&mut self, name: &str, id: u64, addr: Ipv4Addr, value: S, now: Instant) {
        self.by_addr.insert(addr, name.to_string());
        self.remembered.insert(name.to_string(), addr);
        self.by_name.insert(
            name.to_string(),
            Entry {
                id,
                addr,
                value,
                last_connected: now,
            },
        );
    }

    /// End session `name` (replaced, expired, or the server's rules for it changed on a
    /// reload: its client then rejoins as a new session, under the new rules).
    pub fn remove(&mut self, name: &str) -> Option<S> {
        let e = self.by_name.remove(name)?;
        self.by_addr.remove(&e.addr);
        self.routes.retain(|(_, n)| n != name);
        Some(e.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> AddressPlan {
        AddressPlan {
            tun_addr: Ipv4Addr::new(10, 0, 0, 254),
            prefix: 24,
            fixed: vec![("fixed".into(), Ipv4Addr::new(10, 0, 0, 50))],
        }
    }

    fn new_addr(j: &Join<u32>) -> Option<(Ipv4Addr, Option<u32>)> {
        j.created.then_some((j.addr, j.replaced))
    }

    #[test]
    fn paths_join_their_session_and_a_restart_replaces_it() {
        let t0 = Instant::now();
        let mut r: Registry<u32> = Registry::default();
        let p = plan();
        let a = r.join(&p, "site1", "site1", 7, None, t0, |_| 1).unwrap();
        assert_eq!(new_addr(&a), Some((Ipv4Addr::new(10, 0, 0, 1), None)));
        // A second path of the same process joins the same session.
        let b = r.join(&p, "site1", "site1", 7, None, t0, |_| 2).unwrap();
        assert!(!b.created && b.value == 1 && b.addr == Ipv4Addr::new(10, 0, 0, 1));
        // Another client gets another address.
        let c = r.join(&p, "site2", "site2", 9, None, t0, |_| 3).unwrap();
        assert_eq!(new_addr(&c), Some((Ipv4Addr::new(10, 0, 0, 2), None)));
        // site1 restarted (new session id): the old session is replaced, the address kept.
        let d = r.join(&p, "site1", "site1", 8, None, t0, |_| 4).unwrap();
        assert_eq!(new_addr(&d), Some((Ipv4Addr::new(10, 0, 0, 1), Some(1))));
        assert_eq!(r.by_addr(Ipv4Addr::new(10, 0, 0, 1)), Some(&4));
        assert_eq!(r.sessions().len(), 2);
    }

    #[test]
    fn a_previous_address_is_a_wish_and_a_new_reservation_wins() {
        let t0 = Instant::now();
        let mut r: Registry<u32> = Registry::default();
        // A server that restarted: the client names the address it had, and gets it back.
        r.remember("site1", Ipv4Addr::new(10, 0, 0, 7));
        let a = r
            .join(&plan(), "site1", "site1", 7, None, t0, |_| 1)
            .unwrap();
        assert_eq!(a.addr, Ipv4Addr::new(10, 0, 0, 7));
        // A reload reserved another address for it and closed its session (`remove`): it
        // rejoins naming its old address, and is given the reserved one, not refused.
        r.remove("site1");
        r.remember("site1", Ipv4Addr::new(10, 0, 0, 7));
        let mut p = plan();
        p.fixed.push(("site1".into(), Ipv4Addr::new(10, 0, 0, 60)));
        let b = r.join(&p, "site1", "site1", 7, None, t0, |_| 2).unwrap();
        assert_eq!(new_addr(&b), Some((Ipv4Addr::new(10, 0, 0, 60), None)));
        // A wish never takes another client's address.
        r.remember("site2", Ipv4Addr::new(10, 0, 0, 60));
        let c = r.join(&p, "site2", "site2", 9, None, t0, |_| 3).unwrap();
        assert_ne!(c.addr, Ipv4Addr::new(10, 0, 0, 60));
    }

    #[test]
    fn site_lans_route_to_their_session_longest_prefix_first() {
        let t0 = Instant::now();
        let mut r: Registry<u32> = Registry::default();
        let p = plan();
        r.join(&p, "site1", "site1", 7, None, t0, |_| 1).unwrap();
        r.join(&p, "site2", "site2", 9, None, t0, |_| 2).unwrap();
        let pfx = |s: &str| Prefix::parse(s).unwrap();
        r.set_routes("site1", &[pfx("192.168.0.0/16")]).unwrap();
        r.set_routes("site2", &[pfx("172.16.5.0/24")]).unwrap();
        assert_eq!(r.by_addr(Ipv4Addr::new(192, 168, 9, 2)), Some(&1));
        assert_eq!(r.by_addr(Ipv4Addr::new(172, 16, 5, 1)), Some(&2));
        assert_eq!(r.by_addr(Ipv4Addr::new(172, 16, 6, 1)), None);
        // Another session may not take a prefix inside (or around) one routed elsewhere.
        let e = r.set_routes("site2", &[pfx("192.168.9.0/24")]).unwrap_err();
        assert!(e.contains("routed to client `site1`"), "{e}");
        assert_eq!(r.by_addr(Ipv4Addr::new(172, 16, 5, 1)), Some(&2));
        // The session's own tunnel address wins; a restart replaces the routes with the session.
        assert_eq!(r.by_addr(Ipv4Addr::new(10, 0, 0, 2)), Some(&2));
        r.join(&p, "site1", "site1", 8, None, t0, |_| 3).unwrap();
        assert_eq!(r.by_addr(Ipv4Addr::new(192, 168, 9, 2)), None);
        r.set_routes("site2", &[pfx("192.168.9.0/24")]).unwrap();
        assert_eq!(r.by_addr(Ipv4Addr::new(192, 168, 9, 2)), Some(&2));
        // IPv6 site LANs the same way, beside IPv4 ones; an IPv4 prefix never holds an IPv6
        // address (nor the other way round).
        let v6 = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap();
        r.set_routes("site2", &[pfx("192.168.9.0/24"), pfx("fd00:50::/32")])
            .unwrap();
        r.set_routes("site1", &[pfx("fd00:50:1::/64")]).unwrap_err();
        r.set_routes("site1", &[pfx("fd00:51::/64"), pfx("fc00::/7")])
            .unwrap_err();
        r.set_routes("site1", &[pfx("fd00:51::/64")]).unwrap();
        assert_eq!(r.by_addr(v6("fd00:50:7::9")), Some(&2));
        assert_eq!(r.by_addr(v6("fd00:51::9")), Some(&3));
        assert_eq!(r.by_addr(v6("fd00:52::9")), None);
        assert_eq!(r.by_addr(v6("::ffff:192.168.9.2")), None);
    }

    #[test]
    fn instances_of_one_identity_are_sessions_of_their_own() {
        let t0 = Instant::now();
        let mut r: Registry<u32> = Registry::default();
        let p = plan();
        let cr = session_name("site1", Some("cr2"));
        let br = session_name("site1", Some("br2"));
        assert_eq!(cr, "site1/cr2");
        let a = r.join(&p, &cr, "site1", 7, None, t0, |_| 1).unwrap();
        // Another instance (its own process: its own session id) is not a restart of the first.
        let b = r.join(&p, &br, "site1", 9, None, t0, |_| 2).unwrap();
        assert!(b.created && b.replaced.is_none());
        assert_ne!(a.addr, b.addr);
        assert_eq!(r.sessions().len(), 2);
        // Restarting one instance replaces only that one.
        let c = r.join(&p, &br, "site1", 10, None, t0, |_| 3).unwrap();
        assert_eq!(c.replaced, Some(2));
        assert_eq!(r.by_addr(a.addr), Some(&1));
    }

    #[test]
    fn a_refused_restart_keeps_the_running_session() {
        let t0 = Instant::now();
        let mut r: Registry<u32> = Registry::default();
        let p = plan();
        r.join(&p, "fixed", "fixed", 1, None, t0, |_| 1).unwrap();
        // The restarted process asks for an address it may not have: refused, and the session
        // of the running process is not torn down by a bad attempt.
        let e = r.join(&p, "fixed", "fixed", 2, Some("10.0.0.9/24"), t0, |_| 2);
        assert!(e.is_err_and(|e| e.contains("clients:")));
        assert_eq!(r.by_addr(Ipv4Addr::new(10, 0, 0, 50)), Some(&1));
    }

    /// Sessions `a` (value 1, address .1) and `b` (value 2, address .2), joined at the returned
    /// instant.
    fn a_and_b(p: &AddressPlan) -> (Registry<u32>, Instant) {
        let t0 = Instant::now();
        let mut r: Registry<u32> = Registry::default();
        r.join(p, "a", "a", 1, None, t0, |_| 1).unwrap();
        r.join(p, "b", "b", 1, None, t0, |_| 2).unwrap();
        (r, t0)
    }

    #[test]
    fn sessions_without_paths_expire_after_the_linger() {
        let p = plan();
        let (mut r, t0) = a_and_b(&p);
        // `a` keeps a path, `b` has none.
        let presence = |s: &u32| match *s {
            1 => Presence::Connected,
            _ => Presence::Away,
        };
        assert!(r.expire(t0 + SESSION_LINGER, presence).is_empty());
        let gone = r.expire(t0 + SESSION_LINGER + Duration::from_secs(1), presence);
        assert_eq!(gone, vec![("b".to_string(), Ipv4Addr::new(10, 0, 0, 2), 2)]);
        assert!(r.by_addr(Ipv4Addr::new(10, 0, 0, 2)).is_none());
        // A returning client gets its remembered address back.
        let j = r.join(&p, "b", "b", 5, None, t0, |_| 3).unwrap();
        assert_eq!(new_addr(&j), Some((Ipv4Addr::new(10, 0, 0, 2), None)));
    }

    #[test]
    fn a_session_whose_client_left_ends_at_once() {
        let (mut r, t0) = a_and_b(&plan());
        // `b`'s client closed its paths saying it was stopping; `a` is away (no path).
        let presence = |s: &u32| match *s {
            2 => Presence::Left,
            _ => Presence::Away,
        };
        let gone = r.expire(t0 + Duration::from_secs(1), presence);
        assert_eq!(gone, vec![("b".to_string(), Ipv4Addr::new(10, 0, 0, 2), 2)]);
        assert_eq!(r.sessions().len(), 1);
    }

    #[test]
    fn the_path_bound_is_enforced_by_the_router() {
        let mut r = crate::Router::new(crate::Policy::Failover, Default::default());
        let spec = |i: usize| crate::PathSpec {
            name: format!("p{i}"),
            priority: 1,
            weight: 1,
            ..Default::default()
        };
        for i in 0..MAX_PATHS_PER_SESSION {
            assert!(r.path_within(spec(i), MAX_PATHS_PER_SESSION).is_some());
        }
        assert!(r.path_within(spec(999), MAX_PATHS_PER_SESSION).is_none());
        // A known path is still found (its spec refreshed) at the bound.
        assert!(r.path_within(spec(3), MAX_PATHS_PER_SESSION).is_some());
    }
}
