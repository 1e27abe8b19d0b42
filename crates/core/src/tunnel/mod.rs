//! One tunnel's decisions, sans-IO: the client's tunnel and each client session's on the
//! server. `TunnelCore` owns the `Router` (paths, health, bond, resequencer), each path's FEC
//! and its packet-size watch, and the sources a peer may use; it takes received datagrams and
//! stream packets (`receive.rs`), inner packets to protect on their way out, path events and the
//! time (`timers.rs`), and says what to deliver to the TUN device, what to send on which path and
//! when it next has work. The binary's `tunnel.rs` keeps connections, locks and wake-ups; the
//! simulator (`tests/sim.rs`) drives this same state machine over modelled links.

mod metering;
mod receive;
mod send;
mod timers;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Instant;

use crate::classify::Prefix;
use crate::fec::{self, FecMode};
use crate::path::ackwatch::AckWatch;
use crate::path::pmtu::{PathMtu, Resize};
use crate::recovery::{Carry, Recovery};
use crate::wire::FEC_DATA_HEADER;
use crate::{DropReason, HealthConfig, HealthMode, PacketInfo, PathId, PathSpec, Policy, Router};

pub use receive::{Deliver, Received, Recorded};
pub use send::{Outgoing, PathPicks, Routing, SecondCopy};
pub use timers::Polled;

/// The inner sources a client may send from (server side): its tunnel address, and the site
/// LAN prefixes routed to it (routed LANs).
#[derive(Debug, Clone)]
pub struct Sources {
    pub addr: Ipv4Addr,
    /// A dual-stack tunnel: the client's IPv6 address.
    pub addr6: Option<Ipv6Addr>,
    pub lans: Vec<Prefix>,
}

impl Sources {
    pub fn allows(&self, src: IpAddr) -> bool {
        src == IpAddr::V4(self.addr)
            || self.addr6.is_some_and(|a| src == IpAddr::V6(a))
            || self.lans.iter().any(|p| p.contains(src))
    }
}

/// What a path's live connection reports about itself (the shell reads it from its transport).
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkStats {
    /// Cumulative packets the connection sent and lost (FEC `auto` follows them).
    pub sent_packets: u64,
    pub lost_packets: u64,
    /// Of those lost, the ones that arrived after all (reordering taken for loss).
    pub spurious_lost: u64,
    /// The UDP payload its packets fill, and the largest the link could carry.
    pub udp_payload: Option<u16>,
    pub link_payload: Option<u16>,
    /// The largest datagram it takes (what is left of `udp_payload` after its framing).
    pub max_datagram: Option<usize>,
    /// Packets its peer has newly acknowledged (`ackwatch.rs`; `None`: a transport that does
    /// not say). A repeated ACK frame is no proof of life: it may acknowledge nothing new.
    pub acks: Option<u64>,
    /// Its own RTT estimate.
    pub rtt: Option<std::time::Duration>,
    /// Bytes it has carried on its link, both directions, IP and UDP headers included (what a
    /// metered link counts: `data_budget`); `None`: a transport that does not count them.
    pub wire_bytes: Option<u64>,
}

/// FEC on one path: what we send (encoder) and what we receive (decoder). Kept across
/// reconnections: its counters are the path's, and group numbers simply continue.
pub struct PathFec {
    pub enc: fec::Encoder,
    pub dec: fec::Decoder,
}

/// A path's packet size (`pmtu.rs`): watched by the side that probes, acted on by its shell
/// (`take_resize`: reconnect with smaller, or again with larger, packets).
#[derive(Default)]
pub struct PathSize {
    pub watch: Option<PathMtu>,
    pending: Option<Resize>,
    /// ICMP "too big" answers sent for packets this path's transport refused.
    pub too_big_sent: u64,
}

pub struct TunnelCore {
    router: Router,
    fec_mode: FecMode,
    /// By `PathId::index()`.
    fec: Vec<PathFec>,
    /// By lane: whether FEC protects the lane's packets (a traffic class in datagram mode with
    /// `fec`; the lanes share each path's FEC groups).
    protect_lanes: Vec<bool>,
    sizes: Vec<PathSize>,
    /// This side probes its paths (the client): it also watches their packet size.
    watch_mtu: bool,
    /// Server side: inner packets from the peer must come from these sources.
    expect_src: Option<Sources>,
    /// `transport_mode: auto`: how each path carries inner packets now (`recovery.rs`), by
    /// `PathId::index()`; empty for a fixed mode.
    recovery: Vec<Recovery>,
    adaptive: bool,
    /// The watch over each path's ACKs (`ackwatch.rs`), by `PathId::index()`.
    acks: Vec<AckWatch>,
    /// The peer speaks IP only (`HealthMode::Transport`: a standard CONNECT-IP client): every
    /// datagram must be a bare IP packet, a control frame of ours from it is malformed.
    plain: bool,
    /// Metered paths' budgets (`metering.rs`), by `PathId::index()`; `None`: not metered.
    meters: Vec<Option<metering::Metered>>,
    /// Wall-clock seconds since the epoch, for the budgets (`set_wall_clock`).
    wall: i64,
    /// The peer reads counted probe replies (its hello said `counts`): ours carry this side's
    /// counts for the path (`path/delivery.rs`).
    counted_replies: bool,
}

impl TunnelCore {
    pub fn new(
        policy: Policy,
        health: HealthMode,
        fec: FecMode,
        expect_src: Option<Sources>,
    ) -> TunnelCore {
        TunnelCore {
            router: Router::new(
                policy,
                HealthConfig {
                    mode: health,
                    ..Default::default()
                },
            ),
            fec_mode: fec,
            fec: Vec::new(),
            protect_lanes: vec![fec != FecMode::Off],
            sizes: Vec::new(),
            watch_mtu: health == HealthMode::Probe,
            expect_src,
            recovery: Vec::new(),
            adaptive: false,
            acks: Vec::new(),
            plain: health == HealthMode::Transport,
            meters: Vec::new(),
            wall: 0,
            counted_replies: false,
        }
    }

    /// Each path chooses how it carries inner packets from its loss (`transport_mode: auto`):
    /// `poll` reports the changes (`Polled::carry`), `carry` says the current choice.
    pub fn adaptive(mut self) -> TunnelCore {
        self.adaptive = true;
        self
    }

    /// One more lane (the tunnel's next traffic class, below the others), scheduling by
    /// `policy` over the same paths: its packets carry the lane's header (`wire::CLASSED`),
    /// protected by the paths' FEC if `fec` (and the tunnel has an FEC mode). Returns the
    /// lane; `None` past `wire::MAX_LANES`.
    pub fn add_lane(&mut self, policy: Policy, fec: bool) -> Option<usize> {
        let lane = self.router.add_lane(policy)?;
        self.protect_lanes.push(fec);
        Some(lane)
    }

    /// Whether FEC protects `lane`'s packets (the first lane's: set here; at start it is
    /// whether the tunnel has an FEC mode).
    pub fn set_lane_fec(&mut self, lane: usize, fec: bool) {
        if let Some(p) = self.protect_lanes.get_mut(lane) {
            *p = fec;
        }
    }

    pub fn protects(&self, lane: usize) -> bool {
        self.fec_mode != FecMode::Off && self.protect_lanes.get(lane).copied().unwrap_or(false)
    }

    /// How `path` carries inner packets now: `None` in a fixed mode.
    pub fn carry(&self, path: PathId) -> Option<Carry> {
        self.recovery(path).map(Recovery::carry)
    }

    /// `path`'s adaptive recovery state (`transport_mode: auto`).
    pub fn recovery(&self, path: PathId) -> Option<&Recovery> {
        self.recovery.get(path.index())
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Routing and drop accounting still reach the router directly.
    pub fn router_mut(&mut self) -> &mut Router {
        &mut self.router
    }

    pub fn fec_mode(&self) -> FecMode {
        self.fec_mode
    }

    pub fn expect_src(&self) -> Option<&Sources> {
        self.expect_src.as_ref()
    }

    /// Over CONNECT-IP a client learns what its server is from the first answer (our hello
    /// answer in it, `connect_ip::request::HELLO_ACK_FIELD`, or none); until then its tunnel is
    /// set for a standard server (`HealthMode::Transport`). An mpquic server: the paths
    /// connected from now on are probed, and bond, as on the native protocol. The size watch
    /// stays off: there each connection's own MTU discovery sizes its packets.
    pub fn peer_speaks_mpquic(&mut self) {
        self.router.set_health_mode(HealthMode::Probe);
        self.plain = false;
    }

    /// The peer's hello asked for counted probe replies (a client that judges its paths by
    /// what they deliver): this side's replies carry its counts from now on.
    pub fn peer_reads_counts(&mut self) {
        self.counted_replies = true;
    }

    /// A standard server: it takes bare IP packets only, so a lane with a per-packet policy
    /// schedules by failover (its packets would carry a bond header). Whether one did.
    pub fn peer_speaks_ip_only(&mut self) -> bool {
        self.router.unbond()
    }

    /// Whether this side watches its paths' packet size (the prober, the client).
    pub fn watches_mtu(&self) -> bool {
        self.watch_mtu
    }

    /// The id of the path `spec` names, created if new (its spec refreshed). `None` when the
    /// tunnel already has `limit` paths and this one is new.
    pub fn path(&mut self, spec: PathSpec, limit: usize) -> Option<PathId> {
        let id = self.router.path_within(spec, limit)?;
        let mode = self.fec_mode;
        if self.fec.len() <= id.index() {
            self.fec.resize_with(id.index() + 1, || PathFec {
                enc: fec::Encoder::new(mode),
                dec: fec::Decoder::new(),
            });
        }
        if self.sizes.len() <= id.index() {
            self.sizes.resize_with(id.index() + 1, Default::default);
        }
        if self.adaptive && self.recovery.len() <= id.index() {
            self.recovery.resize_with(id.index() + 1, Default::default);
        }
        if self.acks.len() <= id.index() {
            self.acks.resize_with(id.index() + 1, Default::default);
        }
        Some(id)
    }

    /// `path`'s watch over its ACKs (status: the times it took the path out of use).
    pub fn ack_watch(&self, path: PathId) -> Option<&AckWatch> {
        self.acks.get(path.index())
    }

    /// Inner packets left on `path` now: the core watches for their ACKs. Returns whether
    /// the core's deadline moved earlier.
    fn on_sent(&mut self, path: PathId, now: Instant) -> bool {
        self.acks
            .get_mut(path.index())
            .is_some_and(|w| w.on_sent(now))
    }

    pub fn fec(&self, path: PathId) -> Option<&PathFec> {
        self.fec.get(path.index())
    }

    pub fn size(&self, path: PathId) -> Option<&PathSize> {
        self.sizes.get(path.index())
    }

    /// A new connection carries `path`, with packets of `link.udp_payload`: the size watch
    /// starts over at that size.
    pub fn connected(&mut self, path: PathId, link: LinkStats, now: Instant) {
        self.router.connected(path, now);
        self.router.handshake_rtt(path, link.rtt);
        self.meter_reconnected(path);
        if let (Some(payload), Some(ceiling), true) =
            (link.udp_payload, link.link_payload, self.watch_mtu)
        {
            let size = &mut self.sizes[path.index()];
            size.pending = None;
            match &mut size.watch {
                Some(w) => w.reset(payload, now),
                None => size.watch = Some(PathMtu::new(ceiling, payload, now)),
            }
        }
    }

    /// The connection of `path` is gone: an outage, whatever its size watch was waiting for.
    pub fn disconnected(&mut self, path: PathId) {
        self.router.disconnected(path);
        self.with_watch(path, PathMtu::on_outage);
    }

    /// Protect `packet`, leaving on `path` now, with the path's FEC: the header to send in front
    /// of it (`None`: bare), repair packets of a group it closed appended to `repairs`. The bool
    /// says a group was opened (the timers have a new deadline).
    pub fn protect(
        &mut self,
        path: PathId,
        packet: &[u8],
        now: Instant,
        repairs: &mut Vec<Vec<u8>>,
    ) -> (Option<[u8; FEC_DATA_HEADER]>, bool) {
        if self.fec_mode == FecMode::Off {
            return (None, false);
        }
        let Some(f) = self.fec.get_mut(path.index()) else {
            return (None, false);
        };
        let idle = f.enc.deadline().is_none();
        let header = f.enc.on_data(now, packet, repairs);
        (header, idle && header.is_some())
    }

    /// `n` repair packets of `path` the transport did not take.
    pub fn repairs_refused(&mut self, path: PathId, n: u64) {
        if let Some(f) = self.fec.get_mut(path.index()) {
            f.enc.refused(n);
        }
    }

    /// An ICMP "too big" was sent for a packet `path`'s transport refused.
    pub fn too_big_sent(&mut self, path: PathId) {
        if let Some(s) = self.sizes.get_mut(path.index()) {
            s.too_big_sent += 1;
        }
    }

    /// Connecting `path` with packets of `payload` failed (a larger size tried): the size
    /// watch takes it as too big for now, unless the path went down meanwhile. Returns whether
    /// it counted.
    pub fn resize_failed(&mut self, path: PathId, payload: u16, now: Instant) -> bool {
        let mut counted = false;
        self.with_watch(path, |w| counted = w.on_resize_failed(payload, now));
        counted
    }

    /// `path` could be connected only at the smallest packet size (`PathMtu::on_fallback`).
    pub fn fell_back(&mut self, path: PathId) {
        self.with_watch(path, PathMtu::on_fallback);
    }

    /// A size change the watch decided for `path` (reconnect it with packets of this UDP
    /// payload at most), once.
    pub fn take_resize(&mut self, path: PathId) -> Option<Resize> {
        self.sizes.get_mut(path.index())?.pending.take()
    }

    fn with_watch(&mut self, path: PathId, f: impl FnOnce(&mut PathMtu)) {
        if let Some(w) = self
            .sizes
            .get_mut(path.index())
            .and_then(|s| s.watch.as_mut())
        {
            f(w);
        }
    }

    /// What every path transition means beyond the router: a path that went down fails
    /// whatever its size watch waits for, for the outage alone.
    fn on_transition(&mut self, t: &crate::Transition) {
        if t.to == Some(crate::PathState::Down) {
            self.with_watch(t.path, PathMtu::on_outage);
        }
    }

    /// An inner packet passes the source check (server side): counted and refused if not.
    fn check_source(&mut self, path: PathId, info: Option<&PacketInfo>) -> bool {
        let Some(expect) = &self.expect_src else {
            return true;
        };
        let reason = match info {
            None => DropReason::Malformed,
            Some(i) if !expect.allows(i.src) => DropReason::SpoofedSource,
            Some(_) => return true,
        };
        self.router.drop_on(path, reason, 1);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;
    use crate::path::reconfig::WallClock;
    use crate::wire;

    fn server_core() -> (TunnelCore, PathId) {
        let sources = Sources {
            addr: Ipv4Addr::new(10, 9, 0, 2),
            addr6: None,
            lans: vec![Prefix::parse("192.168.10.0/24").unwrap()],
        };
        let mut core = TunnelCore::new(
            Policy::Failover,
            HealthMode::Follow,
            FecMode::Off,
            Some(sources),
        );
        let spec = PathSpec {
            name: "wan1".into(),
            priority: 1,
            weight: 1,
            ..Default::default()
        };
        let id = core.path(spec, 4).unwrap();
        core.connected(id, LinkStats::default(), Instant::now());
        (core, id)
    }

    /// A metered path counts its connections' bytes (each from zero), warns, and is a backup
    /// once its budget is used up, until its period starts again.
    #[test]
    fn a_used_up_budget_makes_the_path_a_backup_until_the_next_period() {
        use crate::path::budget::{Budget, Period, Standing};
        let mut core = TunnelCore::new(Policy::Failover, HealthMode::Transport, FecMode::Off, None);
        let spec = |name: &str, priority| PathSpec {
            name: name.into(),
            priority,
            weight: 1,
            ..Default::default()
        };
        let (a, b) = (
            core.path(spec("lte", 1), 2).unwrap(),
            core.path(spec("dsl", 2), 2).unwrap(),
        );
        let now = Instant::now();
        core.connected(a, LinkStats::default(), now);
        core.connected(b, LinkStats::default(), now);
        let day = 86_400;
        let budget = Budget {
            limit: 1_000_000,
            period: Period::Day,
            warn_at: 0.8,
        };
        core.set_budget(a, Some(budget), None, 10 * day);
        let mut out = Recorded::default();
        let mut polled = Polled::default();
        let mut poll = |core: &mut TunnelCore, wire: u64, wall: i64| {
            core.set_wall_clock(WallClock::new(
                Instant::now(),
                std::time::Duration::from_secs(wall as u64),
            ));
            let link = LinkStats {
                wire_bytes: Some(wire),
                ..Default::default()
            };
            core.poll(now, |_| Some(link), &mut out, &mut polled);
            std::mem::take(&mut polled.budgets)
        };
        let route = |core: &mut TunnelCore| {
            let p = tcp4([10, 9, 0, 2], [1, 1, 1, 1], 1000, 80, None);
            core.router_mut()
                .route(0, None, p.len(), now)
                .map(|r| r.path)
        };
        assert_eq!(poll(&mut core, 500_000, 10 * day), vec![]);
        assert_eq!(route(&mut core), Some(a));
        assert_eq!(
            poll(&mut core, 850_000, 10 * day + 60),
            vec![(a, Standing::Warn)]
        );
        // A new connection counts from zero.
        core.connected(a, LinkStats::default(), now);
        assert_eq!(
            poll(&mut core, 150_000, 10 * day + 120),
            vec![(a, Standing::Exhausted)]
        );
        assert_eq!(core.meter(a).unwrap().usage.used, 1_000_000);
        assert_eq!(route(&mut core), Some(b), "used up: the other path carries");
        assert_eq!(
            poll(&mut core, 150_000, 11 * day),
            vec![(a, Standing::Within)]
        );
        assert_eq!(route(&mut core), Some(a), "a new day, a new budget");
    }

    /// A standard CONNECT-IP peer's tunnel (`HealthMode::Transport`): its path up from the
    /// connection, its IP packets delivered, anything that reads as one of our control frames
    /// (a probe, a bonded or FEC frame) dropped as malformed and not answered.
    #[test]
    fn a_plain_peer_gets_ip_packets_through_and_nothing_else() {
        let mut core = TunnelCore::new(Policy::Failover, HealthMode::Transport, FecMode::Off, None);
        let spec = PathSpec {
            name: "masque".into(),
            priority: 1,
            weight: 1,
            ..Default::default()
        };
        let id = core.path(spec, 1).unwrap();
        let now = Instant::now();
        core.connected(id, LinkStats::default(), now);
        assert_eq!(
            core.router().paths().get(id).state(),
            Some(crate::PathState::Up)
        );
        let mut out = Recorded::default();
        let p = tcp4([10, 9, 0, 2], [1, 1, 1, 1], 1000, 80, None);
        let _ = core.on_datagram(id, &p, now, &mut out);
        let probe = wire::encode_probe(wire::PROBE, 1);
        let bonded = [&wire::encode_bonded(0, 1)[..], &p].concat();
        for frame in [&probe[..], &bonded] {
            let got = core.on_datagram(id, frame, now, &mut out);
            assert!(got.transition.is_none());
        }
        assert_eq!(out.delivered.len(), 1);
        assert!(out.answers.is_empty(), "{:?}", out.answers);
        let drops = &core.router().paths().get(id).drops;
        assert_eq!(drops.get(DropReason::Malformed), 2);
    }

    /// A CONNECT-IP client's tunnel starts set for a standard server and learns from the first
    /// answer what its server is: an mpquic server's paths are probed (not up until a probe
    /// comes back) and its control frames answered; a standard server's lanes give up a
    /// per-packet policy (its packets would carry a bond header) and its paths are up with
    /// their connection.
    #[test]
    fn a_connect_ip_client_learns_what_its_server_speaks() {
        let spec = PathSpec {
            name: "wan1".into(),
            priority: 1,
            weight: 1,
            ..Default::default()
        };
        let now = Instant::now();
        let mut core = TunnelCore::new(Policy::Wlb, HealthMode::Transport, FecMode::Off, None);
        let id = core.path(spec.clone(), 2).unwrap();
        core.peer_speaks_mpquic();
        core.connected(id, LinkStats::default(), now);
        let state = core.router().paths().get(id).state();
        assert_ne!(state, Some(crate::PathState::Up));
        let mut out = Recorded::default();
        let _ = core.on_datagram(id, &wire::encode_probe(wire::PROBE, 1), now, &mut out);
        assert_eq!(out.answers.len(), 1);
        assert_eq!(core.router().bond().policy(), Policy::Wlb);
        assert!(!core.watches_mtu());

        let mut core = TunnelCore::new(Policy::Wlb, HealthMode::Transport, FecMode::Off, None);
        let id = core.path(spec, 2).unwrap();
        assert!(core.peer_speaks_ip_only());
        assert_eq!(core.router().bond().policy(), Policy::Failover);
        assert!(!core.peer_speaks_ip_only(), "nothing left to change");
        core.connected(id, LinkStats::default(), now);
        let state = core.router().paths().get(id).state();
        assert_eq!(state, Some(crate::PathState::Up));
    }

    #[test]
    fn a_server_delivers_only_the_clients_sources_and_counts_the_rest() {
        let (mut core, id) = server_core();
        let now = Instant::now();
        let mut out = Recorded::default();
        for src in [[10, 9, 0, 2], [192, 168, 10, 7], [10, 9, 0, 3]] {
            // A bare IP packet is its own datagram.
            let p = tcp4(src, [1, 1, 1, 1], 1000, 80, None);
            let _ = core.on_datagram(id, &p, now, &mut out);
        }
        // A truncated IPv4 header, and a datagram of no known kind.
        let _ = core.on_datagram(id, &[0x45, 0, 1], now, &mut out);
        let _ = core.on_datagram(id, &[0xff, 0xff], now, &mut out);
        assert_eq!(out.delivered.len(), 2);
        let drops = &core.router().paths().get(id).drops;
        assert_eq!(drops.get(DropReason::SpoofedSource), 1);
        assert_eq!(drops.get(DropReason::Malformed), 2);
    }
}
