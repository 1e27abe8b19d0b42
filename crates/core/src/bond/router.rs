//! One tunnel's decisions in one place: the `PathSet` and the lanes that schedule over it, kept
//! in step (every path event reaches every lane's bond). A lane is one traffic class of the
//! tunnel: its bond (scheduler, numbering, drops that belong to no path) and the resequencer for
//! the peer's numbered packets of that class; a tunnel without classes has one. The paths (one
//! connection, prober and health each) are shared by all lanes. An inner packet goes classify
//! (the shell picks the lane) -> the lane's bond (scheduler picks a path) -> path (the shell's
//! transport sends). The client and each server session drive one `Router` each, through the
//! same shell code.

use std::time::{Duration, Instant};

use crate::bond::scheduler::Policy;
use crate::bond::{Bond, Route};
use crate::drops::DropReason;
use crate::packet::PacketInfo;
use crate::path::delivery::Counts;
use crate::path::health::{HealthConfig, HealthMode, PeerView};
use crate::path::{PathId, PathLoad, PathSet, PathSpec, ProbeDue, Transition};
use crate::reorder::reseq::{self, Resequencer, Verdict};
use crate::wire;

/// How many slots a tunnel keeps per path it may use, counting retired ones (`path_within`).
const RETIRED_SLOTS: usize = 4;

/// One traffic class of a tunnel: lane 0 is the first class (or the only lane of a tunnel
/// without classes), and the order of the lanes is the classes' priority.
#[derive(Debug)]
pub struct Lane {
    bond: Bond,
    /// Puts the peer's per-packet bonded flows of this class back in order; under the other
    /// policies, whose numbered packets are copies only (`copies`), keeps each one's first copy
    /// and hands it on at once (the client chose the policy for both directions, and a change
    /// between the two kinds needs a restart). Per lane, because each lane's bond numbers its
    /// own flows.
    reseq: Resequencer,
    /// Inner packets of this lane sent (routed to a path, copies not counted) and delivered.
    pub counters: LaneCounters,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneCounters {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
}

impl Lane {
    fn new(policy: Policy) -> Lane {
        Lane {
            bond: Bond::new(policy),
            reseq: Resequencer::copies_only(!policy.per_packet()),
            counters: LaneCounters::default(),
        }
    }
    pub fn bond(&self) -> &Bond {
        &self.bond
    }
    pub fn reseq(&self) -> &Resequencer {
        &self.reseq
    }
}

#[derive(Debug)]
pub struct Router {
    paths: PathSet,
    /// Never empty; at most `wire::MAX_LANES`.
    lanes: Vec<Lane>,
}

impl Router {
    /// A router with one lane scheduling by `policy`.
    pub fn new(policy: Policy, health: HealthConfig) -> Self {
        Router {
            paths: PathSet::new(health),
            lanes: vec![Lane::new(policy)],
        }
    }

    /// One more lane (the next class, below the others in priority), scheduling by `policy`
    /// over the same paths. Returns its index; `None` when the router has `wire::MAX_LANES`.
    pub fn add_lane(&mut self, policy: Policy) -> Option<usize> {
        if self.lanes.len() >= wire::MAX_LANES {
            return None;
        }
        self.lanes.push(Lane::new(policy));
        Some(self.lanes.len() - 1)
    }

    pub fn paths(&self) -> &PathSet {
        &self.paths
    }
    /// Where the wall clock stands, for links that reconfigure on its schedule
    /// (`path::reconfig`).
    pub(crate) fn set_wall_clock(&mut self, clock: crate::path::reconfig::WallClock) {
        self.paths.set_wall_clock(clock);
    }
    /// The lanes, in priority order (never empty).
    pub fn lanes(&self) -> &[Lane] {
        &self.lanes
    }
    /// The first lane's bond (a tunnel without classes has only that one).
    pub fn bond(&self) -> &Bond {
        &self.lanes[0].bond
    }

    /// The transport's view of `id`'s capacity (before routing a batch).
    pub fn set_load(&mut self, id: PathId, load: PathLoad) {
        self.paths.set_load(id, load);
    }

    /// `id`'s data budget was used up (it carries only as a backup now), or starts again
    /// (`PathSet::set_used_up`).
    pub fn set_used_up(&mut self, id: PathId, used_up: bool, now: Option<Instant>) {
        self.paths.set_used_up(id, used_up, now);
    }

    /// A bonded packet (`wire::BOND_DATA`) of `lane` arrived on `id`: deliver it now, hold
    /// it, or drop it as a duplicate; then take `released`. A lane the router does not have
    /// (the shell checks `lanes()` first) drops it as a duplicate would be.
    pub fn on_bonded(
        &mut self,
        lane: usize,
        id: PathId,
        slot: u16,
        seq: u32,
        pkt: &[u8],
        now: Instant,
    ) -> Verdict {
        let up = self
            .paths
            .iter()
            .filter(|(_, p)| p.is_up())
            .map(|(i, _)| i.index());
        let Some(l) = self.lanes.get_mut(lane) else {
            return Verdict::Duplicate;
        };
        l.reseq.set_active(up);
        l.reseq.on_packet(now, id.index(), slot, seq, pkt)
    }

    /// Packets the resequencers released (after `on_bonded` or `poll`), in order within each
    /// lane, with the lane and the path each arrived on.
    pub fn released(&mut self) -> Option<(usize, PathId, Vec<u8>)> {
        for (lane, l) in self.lanes.iter_mut().enumerate() {
            if let Some((i, pkt)) = l.reseq.ready() {
                let id = self.paths.ids().nth(i)?;
                return Some((lane, id, pkt));
            }
        }
        None
    }

    /// The id of the path called `spec.name`, added if new; its spec is refreshed (the server
    /// learns priority and weight from each hello). `None` when the set is full.
    pub fn path(&mut self, spec: PathSpec) -> Option<PathId> {
        self.path_within(spec, usize::MAX)
    }

    /// As `path`, but a new path is refused (`None`) once the tunnel has `limit` paths in use
    /// (the server's bound per session, `sessions::MAX_PATHS_PER_SESSION`). Retired paths do
    /// not count, but keep their slot; a client renaming its paths on every reload would grow
    /// the set without end, so the slots are bounded too (`limit` x `RETIRED_SLOTS`).
    pub fn path_within(&mut self, spec: PathSpec, limit: usize) -> Option<PathId> {
        if let Some(id) = self.paths.find(&spec.name) {
            self.paths.set_spec(id, spec);
            return Some(id);
        }
        let live = self.paths.iter().filter(|(_, p)| !p.retired).count();
        if live >= limit || self.paths.len() >= limit.saturating_mul(RETIRED_SLOTS) {
            return None;
        }
        self.paths.add(spec)
    }

    /// A new connection carries `id`.
    pub fn connected(&mut self, id: PathId, now: Instant) -> Transition {
        let t = self.paths.connected(id, now);
        self.tell_lanes(&t);
        t
    }

    /// The round trip `id`'s new connection measured in its handshake (`PathHealth::set_rtt_hint`).
    pub fn handshake_rtt(&mut self, id: PathId, rtt: Option<Duration>) {
        self.paths.handshake_rtt(id, rtt);
    }

    /// The connection of `id` is gone.
    pub fn disconnected(&mut self, id: PathId) -> Transition {
        let t = self.paths.disconnected(id);
        self.tell_lanes(&t);
        t
    }

    /// `lane` schedules by `policy` from now on (`Bond::set_policy`).
    pub fn set_policy(&mut self, lane: usize, policy: Policy) -> Result<(), String> {
        match self.lanes.get_mut(lane) {
            Some(l) => l.bond.set_policy(policy),
            None => Err(format!("no lane {lane}")),
        }
    }

    /// The paths connected from now on judge their health so (`PathSet::set_health_mode`).
    pub fn set_health_mode(&mut self, mode: HealthMode) {
        self.paths.set_health_mode(mode);
    }

    /// Every lane with a per-packet policy schedules by failover from now on, its packets
    /// unnumbered: for a peer that takes bare IP packets only, learnt before anything was
    /// routed (`TunnelCore::peer_speaks_ip_only`). Whether a lane changed.
    pub fn unbond(&mut self) -> bool {
        let mut changed = false;
        for l in &mut self.lanes {
            if l.bond.policy().per_packet() {
                l.bond = Bond::new(Policy::Failover);
                changed = true;
            }
        }
        changed
    }

    /// `id` was taken out of the configuration (`PathSet::retire`).
    pub fn retire(&mut self, id: PathId) -> Transition {
        let t = self.paths.retire(id);
        self.tell_lanes(&t);
        t
    }

    /// Advance time: due probes into `probes`, state changes into `changes` (for the log).
    pub fn poll(
        &mut self,
        now: Instant,
        probes: &mut Vec<ProbeDue>,
        changes: &mut Vec<Transition>,
    ) {
        let first = changes.len();
        self.paths.poll(now, probes, changes);
        for t in &changes[first..] {
            self.tell_lanes(t);
        }
        let up = self.paths.iter().filter(|(_, p)| p.is_up());
        let rtts = up.filter_map(|(_, p)| {
            let h = p.health.as_ref()?;
            Some((h.srtt()?, h.view().rttvar))
        });
        let wait = reseq::wait_for(rtts);
        for l in &mut self.lanes {
            l.bond.poll(now);
            l.reseq.set_max_wait(wait);
            l.reseq.poll(now);
        }
    }

    /// The earliest time `poll` has work to do; the shell sleeps until then (or until an event).
    pub fn next_deadline(&self) -> Option<Instant> {
        let lanes = self.lanes.iter();
        let lanes = lanes.flat_map(|l| [l.bond.next_deadline(), l.reseq.next_deadline()]);
        [self.paths.next_deadline()]
            .into_iter()
            .chain(lanes)
            .flatten()
            .min()
    }

    pub fn on_probe_reply(
        &mut self,
        id: PathId,
        seq: u32,
        counts: Option<Counts>,
        now: Instant,
    ) -> Option<Transition> {
        let t = self.paths.on_probe_reply(id, seq, counts, now);
        self.tell_bond(t)
    }

    /// A datagram with an inner packet (or an FEC repair) arrived on `id` (`PathSet::on_arrived`).
    pub fn on_arrived(&mut self, id: PathId) {
        self.paths.on_arrived(id);
    }

    /// The peer's probe arrived on `id` (on a follower, its view may change the path's state).
    pub fn on_peer_probe(
        &mut self,
        id: PathId,
        seq: u32,
        view: Option<&PeerView>,
        now: Instant,
    ) -> Option<Transition> {
        let t = self.paths.on_peer_probe(id, seq, view, now);
        self.tell_bond(t)
    }

    /// `id`'s connection's packet counts (`PathSet::on_data_counters`).
    pub fn on_data_counters(
        &mut self,
        id: PathId,
        now: Instant,
        sent: u64,
        lost: u64,
    ) -> Option<Transition> {
        let t = self.paths.on_data_counters(id, now, sent, lost);
        self.tell_bond(t)
    }

    /// `id` stopped acknowledging its data (`ackwatch.rs`): down now.
    pub fn declare_down(
        &mut self,
        id: PathId,
        now: Instant,
        silent_for: std::time::Duration,
    ) -> Option<Transition> {
        let t = self.paths.declare_down(id, now, silent_for);
        self.tell_bond(t)
    }

    /// A path event's transition reaches every lane's bond (the one rule that keeps them in
    /// step).
    fn tell_bond(&mut self, t: Option<Transition>) -> Option<Transition> {
        if let Some(t) = &t {
            self.tell_lanes(t);
        }
        t
    }

    fn tell_lanes(&mut self, t: &Transition) {
        self.lanes.iter_mut().for_each(|l| l.bond.on_transition(t));
    }

    /// The path for an inner packet of `lane` (of `len` bytes), counted as sent there; `None`
    /// (counted as `no_path` in the lane) when no path is connected, or the lane does not
    /// exist (counted as `malformed` in the first).
    pub fn route(
        &mut self,
        lane: usize,
        info: Option<&PacketInfo>,
        len: usize,
        now: Instant,
    ) -> Option<Route> {
        let Some(l) = self.lanes.get_mut(lane) else {
            self.lanes[0].bond.drops.add(DropReason::Malformed);
            return None;
        };
        let route = l.bond.route(&mut self.paths, info, len, now)?;
        l.counters.tx_packets += 1;
        l.counters.tx_bytes += len as u64;
        Some(route)
    }

    /// An inner packet of `lane` was delivered from `id`.
    pub fn on_received(&mut self, lane: usize, id: PathId, len: usize, now: Instant) {
        self.paths.on_received(id, len, now);
        if let Some(l) = self.lanes.get_mut(lane) {
            l.counters.rx_packets += 1;
            l.counters.rx_bytes += len as u64;
        }
    }

    /// True once after a packet woke a quiet tunnel: probes are due now, so the shell must not
    /// go on sleeping until the deadline it had (a quiet probe interval away).
    pub fn take_woken(&mut self) -> bool {
        self.paths.take_woken()
    }

    /// Paths recognised as Starlink, or no longer, since the last call (`PathSet::take_recognised`).
    pub fn take_recognised(&mut self, into: &mut Vec<(PathId, bool)>) {
        into.extend(self.paths.take_recognised());
    }
    pub fn drop_tx(&mut self, id: PathId, len: usize, reason: DropReason) {
        self.paths.drop_tx(id, len, reason);
    }
    pub fn drop_tx_batch(&mut self, id: PathId, packets: u64, bytes: u64, reason: DropReason) {
        self.paths.drop_tx_batch(id, packets, bytes, reason);
    }
    /// `n` packets of `lane` dropped before a path was chosen (e.g. oversized at the TUN
    /// read), or after the path (refused by the TUN device); the first lane's when there is
    /// no such lane.
    pub fn drop_unrouted(&mut self, lane: usize, reason: DropReason, n: u64) {
        let l = match self.lanes.get_mut(lane) {
            Some(l) => l,
            None => &mut self.lanes[0],
        };
        l.bond.drops.add_n(reason, n);
    }
    pub fn drop_on(&mut self, id: PathId, reason: DropReason, n: u64) {
        self.paths.drop_on(id, reason, n);
    }
    pub fn ce_marked(&mut self, id: PathId, n: u64) {
        self.paths.ce_marked(id, n);
    }
    pub fn unusable_for(&self, id: PathId, now: Instant) -> Option<Duration> {
        self.paths.unusable_for(id, now)
    }

    /// Reliable mode, `id` just went down: the moment from which what it sent may not have
    /// arrived, when another path is up to carry it again (`None`: no other path is up, so the
    /// dead path's stream is the best hope for those packets; see `reliable.rs`).
    pub fn hand_over_since(&self, id: PathId, now: Instant) -> Option<Instant> {
        self.paths.hand_over_since(id, now)
    }

    /// Another path is up to take what `id` sent lately (`hand_over_since`).
    pub fn can_hand_over(&self, id: PathId) -> bool {
        self.paths.can_hand_over(id)
    }

    /// `n` packets of `id` were sent again on the live paths (`hand_over_since`).
    pub fn handed_over(&mut self, id: PathId, n: u64) {
        self.paths.handed_over(id, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;
    use crate::{PathLoad, PathState, Role};

    fn spec(name: &str, priority: u32, weight: u32) -> PathSpec {
        PathSpec {
            name: name.into(),
            priority,
            weight,
            ..Default::default()
        }
    }

    /// A router with paths `a` and `b`, both connected and up at `now`.
    fn two_up(policy: Policy, a: PathSpec, b: PathSpec, now: Instant) -> (Router, PathId, PathId) {
        let mut r = Router::new(policy, HealthConfig::default());
        let (a, b) = (r.path(a).unwrap(), r.path(b).unwrap());
        r.connected(a, now);
        r.connected(b, now);
        up_all(&mut r, now);
        (r, a, b)
    }

    fn up_all(r: &mut Router, now: Instant) {
        let mut probes = Vec::new();
        r.poll(now, &mut probes, &mut Vec::new());
        for p in probes {
            r.on_probe_reply(p.path, p.seq, None, now);
        }
    }

    #[test]
    fn a_dead_path_hands_over_only_when_another_is_up() {
        let t0 = Instant::now();
        let (mut r, a, b) = two_up(Policy::Failover, spec("a", 1, 1), spec("b", 2, 1), t0);
        // a goes silent: polled past its silence bound, it is down and b is up.
        let later = t0 + Duration::from_secs(2);
        let mut changes = Vec::new();
        let mut probes = Vec::new();
        // A packet on a (the primary) now and then: it is the path's last sent when it dies.
        let t = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1000, 80, None);
        let info = PacketInfo::parse(&t);
        let mut down_at = None;
        for ms in (100..=2000).step_by(100) {
            let now = t0 + Duration::from_millis(ms);
            if ms % 300 == 0 && r.paths().get(a).is_up() {
                let routed = r.route(0, info.as_ref(), t.len(), now);
                assert_eq!(routed.map(|x| x.path), Some(a));
            }
            r.poll(now, &mut probes, &mut changes);
            for p in probes.drain(..).filter(|p| p.path == b) {
                r.on_probe_reply(p.path, p.seq, None, now);
            }
            if !r.paths().get(a).is_up() {
                down_at.get_or_insert(now);
            }
        }
        assert!(!r.paths().get(a).is_up() && r.paths().get(b).is_up());
        // a could hand over to b; b, alone up, has nobody to keep copies for.
        assert!(r.can_hand_over(a) && !r.can_hand_over(b));
        // Long after, nothing a sent is in question any more: it keeps its connection.
        assert_eq!(r.hand_over_since(a, later), None);
        // As it went down, what it sent in its silence and a round trip before goes again.
        let later = down_at.expect("a went down");
        let since = r.hand_over_since(a, later).expect("b is up");
        let back = later - since;
        assert!(
            back > Duration::from_millis(300) && back < Duration::from_secs(2),
            "{back:?}"
        );
        r.handed_over(a, 7);
        assert_eq!(r.paths().get(a).counters.handed_over, 7);
        // b dies too: nobody to hand over to.
        r.disconnected(b);
        assert_eq!(r.hand_over_since(a, later), None);
        assert!(!r.can_hand_over(a));
    }

    /// A backup carries nothing while a primary is up, whatever the policy and its priority;
    /// an `overflow` backup takes what the primary cannot (its queue half full); a path whose
    /// budget is used up is a backup; the server follows the role the client's probes carry.
    #[test]
    fn backups_carry_only_what_the_primaries_cannot() {
        let t0 = Instant::now();
        let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1000, 80, None);
        let info = PacketInfo::parse(&pkt).unwrap();
        let role = |role| PathSpec {
            role,
            ..spec("b", 1, 1)
        };
        for policy in [
            Policy::Failover,
            Policy::Balanced,
            Policy::Wlb,
            Policy::MinRtt,
        ] {
            // The backup has the better priority: still idle while the primary is up.
            let (mut r, a, b) = two_up(policy, spec("a", 2, 1), role(Role::Backup), t0);
            for _ in 0..50 {
                assert_eq!(r.route(0, Some(&info), 100, t0).map(|x| x.path), Some(a));
            }
            r.disconnected(a);
            assert_eq!(r.route(0, Some(&info), 100, t0).map(|x| x.path), Some(b));
        }
        let (mut r, a, b) = two_up(Policy::Wlb, spec("a", 1, 1), role(Role::Overflow), t0);
        let load = |backlog| PathLoad {
            backlog,
            backlog_limit: Some(100_000),
            ..Default::default()
        };
        r.set_load(a, load(10_000));
        assert_eq!(r.route(0, Some(&info), 100, t0).map(|x| x.path), Some(a));
        r.set_load(a, load(60_000));
        assert_eq!(r.route(0, Some(&info), 100, t0).map(|x| x.path), Some(b));
        // A primary used up is a backup, and behind the configured ones: the overflow path
        // now carries alone.
        r.set_load(a, load(0));
        r.set_used_up(a, true, Some(t0));
        assert_eq!(r.paths().get(a).role(), Role::Backup);
        assert_eq!(r.route(0, Some(&info), 100, t0).map(|x| x.path), Some(b));
        // The client's probe says the role; a follower takes it.
        let mut probes = Vec::new();
        r.poll(t0 + Duration::from_secs(1), &mut probes, &mut Vec::new());
        let view = probes.iter().find(|p| p.path == a).expect("a probe").view;
        assert_eq!(view.role, Some(Role::Backup));
        let mut server = Router::new(Policy::Wlb, HealthConfig::default());
        let s = server.path(spec("a", 1, 1)).unwrap();
        server.connected(s, t0);
        server.on_peer_probe(s, 1, Some(&view), t0);
        assert_eq!(server.paths().get(s).spec.role, Role::Backup);
    }

    #[test]
    fn failover_prefers_lowest_priority_up_path() {
        let t0 = Instant::now();
        let mut r = Router::new(Policy::Failover, HealthConfig::default());
        let p1 = r.path(spec("wan1", 2, 1)).unwrap();
        let p0 = r.path(spec("wan0", 1, 1)).unwrap();
        assert_eq!(r.route(0, None, 100, t0).map(|r| r.path), None);
        assert_eq!(r.bond().drops.get(DropReason::NoPath), 1);
        r.connected(p1, t0);
        // Only a probing path: best effort.
        assert_eq!(r.route(0, None, 100, t0).map(|r| r.path), Some(p1));
        r.connected(p0, t0);
        up_all(&mut r, t0);
        assert_eq!(r.route(0, None, 100, t0).map(|r| r.path), Some(p0));
        r.disconnected(p0);
        assert_eq!(r.route(0, None, 100, t0).map(|r| r.path), Some(p1));
        assert_eq!(r.paths().get(p1).counters.tx_packets, 2);
    }

    #[test]
    fn balanced_places_flows_by_weight_and_pins_them() {
        let t0 = Instant::now();
        let (mut r, a, _) = two_up(Policy::Balanced, spec("a", 1, 2), spec("c", 1, 1), t0);
        let mut placed = [0usize; 2];
        for port in 0..9u16 {
            let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1000 + port, 80, None);
            let info = PacketInfo::parse(&pkt).unwrap();
            let first = r
                .route(0, Some(&info), pkt.len(), t0)
                .map(|r| r.path)
                .unwrap();
            for _ in 0..5 {
                assert_eq!(
                    r.route(0, Some(&info), pkt.len(), t0).map(|r| r.path),
                    Some(first),
                    "flow pinned"
                );
            }
            placed[first.index()] += 1;
        }
        assert_eq!(placed, [6, 3]);
        assert_eq!(r.bond().flows_on(a), 6);
        // A path that goes away loses its flows; they are placed afresh on what is left.
        r.disconnected(a);
        assert_eq!(r.bond().flows_on(a), 0);
    }

    /// Flows moved off a failed path come back once it is up again, each at a pause longer
    /// than the paths' RTT (so none is reordered); a flow that keeps sending stays put.
    #[test]
    fn balanced_flows_return_to_a_repaired_path_at_a_pause() {
        let t0 = Instant::now();
        let (mut r, a, b) = two_up(Policy::Balanced, spec("a", 1, 1), spec("b", 1, 1), t0);
        let flow = |port: u16| {
            let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], port, 80, None);
            PacketInfo::parse(&pkt).unwrap()
        };
        let route = |r: &mut Router, port: u16, now: Instant| {
            r.route(0, Some(&flow(port)), 100, now)
                .map(|x| x.path)
                .unwrap()
        };
        // a is gone: all four flows on b.
        r.disconnected(a);
        for port in 0..4 {
            assert_eq!(route(&mut r, port, t0), b);
        }
        // a is back.
        r.connected(a, t0);
        up_all(&mut r, t0);
        // Busy flows (a packet every millisecond) stay on b.
        let mut now = t0;
        for _ in 0..500 {
            now += Duration::from_millis(1);
            for port in 0..4 {
                assert_eq!(route(&mut r, port, now), b, "a busy flow does not move");
            }
        }
        // After a pause of a second, half of them go back to a, one at a time, and stay.
        now += Duration::from_secs(1);
        let placed: Vec<PathId> = (0..4).map(|port| route(&mut r, port, now)).collect();
        assert_eq!(placed.iter().filter(|&&p| p == a).count(), 2, "{placed:?}");
        for port in 0..4 {
            now += Duration::from_millis(1);
            assert_eq!(
                route(&mut r, port, now),
                placed[port as usize],
                "pinned again"
            );
        }
        assert_eq!((r.bond().flows_on(a), r.bond().flows_on(b)), (2, 2));
        // Balanced now: another pause moves nobody.
        now += Duration::from_secs(1);
        for port in 0..4 {
            assert_eq!(route(&mut r, port, now), placed[port as usize]);
        }
    }

    /// A new connection replacing an up path's live one (a reconnect at another packet size)
    /// keeps the path up and its flows where they are.
    #[test]
    fn replacing_an_up_paths_connection_keeps_it_up_and_its_flows() {
        let t0 = Instant::now();
        let (mut r, a, _) = two_up(Policy::Balanced, spec("a", 1, 1), spec("b", 1, 1), t0);
        for port in 0..4u16 {
            let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], port, 80, None);
            r.route(0, Some(&PacketInfo::parse(&pkt).unwrap()), 100, t0);
        }
        assert_eq!(r.bond().flows_on(a), 2);
        let t = r.connected(a, t0 + Duration::from_secs(1));
        assert_eq!((t.from, t.to), (Some(PathState::Up), Some(PathState::Up)));
        assert!(r.paths().get(a).is_up());
        assert_eq!(r.bond().flows_on(a), 2);
        assert_eq!(r.paths().get(a).connects, 2);
        // A path that is not up starts afresh.
        r.disconnected(a);
        r.connected(a, t0 + Duration::from_secs(2));
        assert_eq!(r.paths().get(a).state(), Some(PathState::Probing));
    }

    #[test]
    fn balanced_keeps_backup_priority_out_until_needed() {
        let t0 = Instant::now();
        let (mut r, a, backup) =
            two_up(Policy::Balanced, spec("a", 1, 1), spec("backup", 2, 1), t0);
        for port in 0..4u16 {
            let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], port, 80, None);
            let info = PacketInfo::parse(&pkt).unwrap();
            assert_eq!(r.route(0, Some(&info), 60, t0).map(|r| r.path), Some(a));
        }
        r.disconnected(a);
        let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 0, 80, None);
        let info = PacketInfo::parse(&pkt).unwrap();
        assert_eq!(
            r.route(0, Some(&info), 60, t0).map(|r| r.path),
            Some(backup)
        );
    }

    #[test]
    fn a_silent_path_goes_down_at_its_deadline() {
        // The shell sleeps until next_deadline(): the deadline must include the moment a
        // silent path is declared down, not only the next probe.
        let t0 = Instant::now();
        let mut r = Router::new(Policy::Failover, HealthConfig::default());
        let a = r.path(spec("a", 1, 1)).unwrap();
        r.connected(a, t0);
        up_all(&mut r, t0);
        let mut now = t0;
        let mut down_at = None;
        for _ in 0..100 {
            now = r.next_deadline().expect("a connected path has a deadline");
            let mut changes = Vec::new();
            r.poll(now, &mut Vec::new(), &mut changes);
            if changes.iter().any(|t| t.to == Some(crate::PathState::Down)) {
                down_at = Some(now);
                break;
            }
        }
        let down_after = HealthConfig::default().down_after_min;
        let late = down_at.expect("went down").duration_since(t0) - down_after;
        assert!(
            late <= Duration::from_millis(1),
            "declared down {late:?} late"
        );
        assert!(now > t0);
    }

    #[test]
    fn a_retired_path_is_out_of_use_and_comes_back_under_its_id() {
        let now = Instant::now();
        let (mut r, a, b) = two_up(Policy::Failover, spec("a", 1, 1), spec("b", 2, 1), now);
        let t = r.retire(a);
        assert_eq!(t.to, None);
        assert!(r.paths().get(a).retired);
        // Out of use: everything goes to b.
        assert_eq!(r.route(0, None, 100, now).map(|r| r.path), Some(b));
        // A retired path leaves room under the limit; configured again, it is the same id.
        assert!(r.path_within(spec("c", 3, 1), 2).is_some());
        assert_eq!(r.path_within(spec("a", 1, 5), 3), Some(a));
        assert!(!r.paths().get(a).retired);
        assert_eq!(r.paths().get(a).spec.weight, 5);
        // Renamed paths cannot grow the set without end.
        let mut added = 0;
        for i in 0..100 {
            if let Some(id) = r.path_within(spec(&format!("x{i}"), 9, 1), 4) {
                r.retire(id);
                added += 1;
            }
        }
        assert!(r.paths().len() <= 4 * RETIRED_SLOTS, "{added} added");
    }
}
