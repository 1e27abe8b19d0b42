//! The paths of one tunnel and what is known about each: its spec (name, priority, weight), its
//! health (probed independently of any traffic), its counters and drops. A `PathSet` is shared
//! by every bond that schedules over it (one prober per path, however many bonds), so a path's
//! state lives here once and the bonds only decide where packets go.
//!
//! A path's state beside the set: `health` (probes, RTT, up/down), `ackwatch` (failover from
//! the data's acknowledgements), `loss` (recent loss rate), `pmtu` (path MTU watch),
//! `reconnect` (when to dial again), `reconfig` (links that reconfigure on a schedule:
//! Starlink), `budget` (a metered path's data budget), `standby` (one
//! path at a time, for a server that does not bond).

pub mod ackwatch;
pub mod budget;
pub mod delivery;
pub mod health;
pub mod loss;
pub mod pmtu;
pub mod reconfig;
pub mod reconnect;
pub mod standby;

use std::fmt;
use std::time::{Duration, Instant};

use crate::drops::{DropReason, Drops};
use crate::path::delivery::{Counts, Direction};
use crate::path::health::{HealthConfig, HealthMode, PathHealth, PathState, PeerView};
use crate::role::Role;

/// A path of one `PathSet`: stable for the set's lifetime (paths are added, never removed, so an
/// id never comes to mean another path; a path taken out of the configuration is `retired`, and
/// comes back under its old id if it is configured again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PathId(u16);

impl PathId {
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    /// The id of the `index`th path added (for tests of what keys on ids).
    #[cfg(test)]
    pub(crate) fn nth(index: u16) -> PathId {
        PathId(index)
    }
}

impl fmt::Display for PathId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "path#{}", self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PathSpec {
    pub name: String,
    pub priority: u32,
    pub weight: u32,
    /// `role` (the client's configuration; on the server, what the client's hello and probes
    /// say).
    pub role: Role,
    /// `rate_limit` (bits/s each way; the transport paces under it): shown, not scheduled by.
    pub rate_limit: Option<u64>,
    /// The link is paid by the byte (a `data_budget` on the client; on the server, what the
    /// client's hello says): bulk flows are not moved onto it (`bond::spill`).
    pub metered: bool,
    /// `link` (the client's configuration; on the server, what the client's hello says): a
    /// Starlink path gets copies of small packets across its reconfigurations (`reconfig`).
    pub link: reconfig::LinkKind,
    /// `link` unset (`auto`): the prober recognises a Starlink link by how it changes at the
    /// boundaries (`reconfig::detect`), and the path is then treated as one (`Path::link`).
    pub detect_link: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathCounters {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Inner packets (and FEC repairs) that arrived from the peer, before any check: what
    /// this side tells the prober in its counted probe replies (`delivery.rs`).
    pub arrived: u64,
    /// Reliable mode: packets this path had sent when it went down, sent again on a live path.
    pub handed_over: u64,
    /// Packets routed to this path that were copied to another across its reconfigurations
    /// (`reconfig`).
    pub reconfig_copies: u64,
    /// ... and copied to another while this path was losing data (`bond::copies`).
    pub loss_copies: u64,
    /// ... and copied to a spare path, whatever this one did (`bond::copies`).
    pub spare_copies: u64,
    /// Inner packets the path's sender marked "congestion experienced" instead of letting them
    /// wait on towards a drop (`packet::ecn`, `sendq`).
    pub ce_marked: u64,
}

/// Why a packet routed to a path was copied to another (`bond::copies`), as its counters say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyReason {
    /// Around the path's reconfiguration (`reconfig`).
    Reconfig,
    /// While the path was losing data.
    Loss,
    /// On a spare path (of the same priority, a primary, not metered), whatever this one did.
    Spare,
}

/// A path's recent throughput (bits/s each way), from its counters over windows of at least
/// `THROUGHPUT_WINDOW` (sampled by `PathSet::poll`): what `mpquic status` shows as the path's
/// rate and share now, where the counters only tell totals since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Throughput {
    pub tx_bps: u64,
    pub rx_bps: u64,
    /// The window's start: when, and the tx and rx byte counters then.
    mark: Option<(Instant, u64, u64)>,
}

pub const THROUGHPUT_WINDOW: Duration = Duration::from_secs(1);

impl Throughput {
    fn sample(&mut self, now: Instant, c: &PathCounters) {
        let Some((at, tx, rx)) = self.mark else {
            self.mark = Some((now, c.tx_bytes, c.rx_bytes));
            return;
        };
        let dt = now.saturating_duration_since(at);
        if dt < THROUGHPUT_WINDOW {
            return;
        }
        let bps = |bytes: u64| (u128::from(bytes) * 8 * 1_000_000 / dt.as_micros().max(1)) as u64;
        self.tx_bps = bps(c.tx_bytes.saturating_sub(tx));
        self.rx_bps = bps(c.rx_bytes.saturating_sub(rx));
        self.mark = Some((now, c.tx_bytes, c.rx_bytes));
    }
}

/// What the transport says of a path's capacity, for the schedulers that spread packets by it
/// (`scheduler::Wlb`, `scheduler::MinRtt`). The shell refreshes it before routing each batch;
/// routing a packet adds it to `backlog` until the next refresh.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathLoad {
    /// The rate the path's congestion controller sends at (bits/s).
    pub rate: Option<u64>,
    /// The transport's smoothed RTT.
    pub rtt: Option<Duration>,
    /// Bytes waiting in the transport for the controller to let them out.
    pub backlog: u64,
    /// The congestion window and what is in flight in it, when the transport says.
    pub window: Option<u64>,
    pub in_flight: u64,
    /// The most the transport can hold waiting (beyond it, it refuses packets), if bounded.
    pub backlog_limit: Option<u64>,
}

impl PathLoad {
    /// Its waiting packets fill half the transport's queue or more: another path is better
    /// unless all are like it (the queue's end is where packets are refused, and our rate
    /// estimates are not exact enough to run it to the brim).
    pub fn crowded(&self) -> bool {
        self.backlog_limit.is_some_and(|l| self.backlog * 2 >= l)
    }

    /// Bytes the path can take now before they wait: room left in its window (less what waits
    /// for it already); without a window, what it sends in `within` at its rate, less the
    /// backlog.
    pub fn room(&self, within: Duration, default_rate: u64) -> u64 {
        match self.window {
            Some(w) => w.saturating_sub(self.in_flight + self.backlog),
            None => {
                let rate = self.rate.unwrap_or(default_rate);
                let r = (rate / 8).saturating_mul(within.as_micros() as u64) / 1_000_000;
                r.saturating_sub(self.backlog)
            }
        }
    }
}

#[derive(Debug)]
pub struct Path {
    pub spec: PathSpec,
    pub load: PathLoad,
    /// `None` while the path has no live connection.
    pub health: Option<PathHealth>,
    pub counters: PathCounters,
    /// Recent bits/s each way (`Throughput`).
    pub throughput: Throughput,
    pub drops: Drops,
    /// Times a new connection was installed on this path.
    pub connects: u64,
    /// Taken out of the configuration (a reload): no connection, not shown, not scheduled.
    pub retired: bool,
    /// The smoothed RTT its probes measured when its last connection went away: a redial
    /// starts its handshake timers from it.
    pub last_srtt: Option<Duration>,
    /// Its data budget is used up (`budget.rs`): it carries only as a backup until the budget's
    /// period ends.
    pub used_up: bool,
    /// Times it answered its probes while delivering nothing one way (`delivery.rs`), and was
    /// taken down for it.
    pub delivery_stalls: u64,
    /// What its probes show of Starlink's reconfigurations (a prober, `spec.detect_link`):
    /// kept across its connections, as it is the link's.
    pub detector: reconfig::detect::Detector,
    /// Its link was recognised as Starlink: by `detector`, or (the server) as the client's
    /// probes say.
    pub recognised: bool,
    /// When an inner packet was last routed to it (`count_tx`).
    pub last_tx: Option<Instant>,
    /// When its connection last declared a packet lost (not one found spurious), and its
    /// count of lost packets then (`PathSet::on_data_counters`).
    pub last_data_loss: Option<Instant>,
    data_lost: u64,
}

impl Path {
    /// The kind of link it runs over: as configured, or as recognised (`recognised`).
    pub fn link(&self) -> reconfig::LinkKind {
        match (self.spec.link, self.recognised) {
            (reconfig::LinkKind::Other, true) => reconfig::LinkKind::Starlink,
            (kind, _) => kind,
        }
    }

    pub fn state(&self) -> Option<PathState> {
        self.health.as_ref().map(|h| h.state())
    }
    pub fn is_up(&self) -> bool {
        self.state() == Some(PathState::Up)
    }
    /// Which paths carry first: 0 the primaries, 1 the backups, 2 the paths whose budget is
    /// used up (`candidates`).
    pub(crate) fn tier(&self) -> u8 {
        match (self.used_up, self.spec.role) {
            (true, _) => 2,
            (false, Role::Primary) => 0,
            (false, _) => 1,
        }
    }
    /// Its role now: the configured one, or backup while its data budget is used up.
    pub fn role(&self) -> Role {
        match self.used_up {
            true => Role::Backup,
            false => self.spec.role,
        }
    }
    /// The RTT its probes measured: its live connection's, or the one it had when its last
    /// connection went away.
    pub fn srtt(&self) -> Option<Duration> {
        self.health
            .as_ref()
            .and_then(PathHealth::srtt)
            .or(self.last_srtt)
    }
}

/// A probe the shell must send on `path` with sequence number `seq`, carrying this side's
/// `view` of the path for the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeDue {
    pub path: PathId,
    pub seq: u32,
    pub view: PeerView,
}

/// A path changed state (`None`: no connection); the shell logs it and tells the bonds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub path: PathId,
    pub from: Option<PathState>,
    pub to: Option<PathState>,
}

impl Transition {
    /// Whether packets placed on the path before are now in the wrong place: it left `Up`, lost
    /// its connection, or got a new one (a fresh connection starts in `Probing`).
    pub fn invalidates_placements(&self) -> bool {
        self.to != Some(PathState::Up)
    }
}

/// Paths are addressed by a 16-bit id; a tunnel with more is a configuration error caught long
/// before (the config allows far fewer), so `add` refuses rather than wraps.
const MAX_PATHS: usize = u16::MAX as usize;

#[derive(Debug)]
pub struct PathSet {
    health_cfg: HealthConfig,
    paths: Vec<Path>,
    /// The last inner packet sent or received on any path (or when the set was first polled).
    last_activity: Option<Instant>,
    /// No inner packet for `quiet_after`: every path probes at the quiet interval.
    quiet: bool,
    /// A quiet set woke since the shell last asked (`take_woken`): probes are due now, earlier
    /// than the deadline the shell may be sleeping until.
    woken: bool,
    /// The wall clock, for links that reconfigure on its schedule (`reconfig`); `None` until
    /// the shell gives it.
    wall_clock: Option<reconfig::WallClock>,
    /// Paths whose link was recognised as Starlink (true) or no longer (false) since the shell
    /// last asked (`take_recognised`).
    recognised: Vec<(PathId, bool)>,
}

impl PathSet {
    pub fn new(health_cfg: HealthConfig) -> Self {
        PathSet {
            health_cfg,
            paths: Vec::new(),
            last_activity: None,
            quiet: false,
            woken: false,
            wall_clock: None,
            recognised: Vec::new(),
        }
    }

    /// Where the wall clock stands (the shell says it now and then: the clocks drift apart).
    pub fn set_wall_clock(&mut self, clock: reconfig::WallClock) {
        self.wall_clock = Some(clock);
        for i in 0..self.paths.len() {
            self.tell_reconfigures(PathId(i as u16));
        }
    }

    /// Tell path `id`'s health whether its link reconfigures on the wall clock's schedule
    /// (`PathHealth::set_reconfigures`).
    fn tell_reconfigures(&mut self, id: PathId) {
        let clock = self.reconfig_clock(id);
        if let Some(h) = self.paths[id.index()].health.as_mut() {
            h.set_reconfigures(clock);
        }
    }

    /// The wall clock, for a path whose link reconfigures on its schedule (`reconfig`:
    /// Starlink); `None` for any other, or before the shell gave the clock.
    pub fn reconfig_clock(&self, id: PathId) -> Option<reconfig::WallClock> {
        let starlink = self.paths[id.index()].link() == reconfig::LinkKind::Starlink;
        self.wall_clock.filter(|_| starlink)
    }

    /// Paths whose link was recognised as Starlink (true), or no longer is (false), since the
    /// last call (the shell logs them).
    pub fn take_recognised(&mut self) -> std::vec::Drain<'_, (PathId, bool)> {
        self.recognised.drain(..)
    }

    /// Path `id`'s link is recognised as Starlink, or no longer: from now on it is treated as
    /// one (`reconfig_clock`), or not.
    fn recognise(&mut self, id: PathId, starlink: bool) {
        let p = &mut self.paths[id.index()];
        if p.recognised != starlink {
            p.recognised = starlink;
            if p.spec.link == reconfig::LinkKind::Other {
                self.recognised.push((id, starlink));
            }
            self.tell_reconfigures(id);
        }
    }

    /// An inner packet was sent or received: a quiet set wakes every path to the fast interval.
    fn note_activity(&mut self, now: Instant) {
        self.last_activity = Some(now);
        if self.quiet {
            self.quiet = false;
            self.woken = true;
            for h in self.paths.iter_mut().filter_map(|p| p.health.as_mut()) {
                h.set_quiet(false, now);
            }
        }
    }

    /// No inner packet either way for `quiet_after` (probes slow down; so does the MTU watch).
    pub fn is_quiet(&self) -> bool {
        self.quiet
    }

    /// True once after the set woke from quiet: the shell must poll now rather than sleep until
    /// the deadline it had (a quiet probe interval away).
    pub fn take_woken(&mut self) -> bool {
        std::mem::take(&mut self.woken)
    }

    /// Quiet after `quiet_after` without an inner packet.
    fn update_quiet(&mut self, now: Instant) {
        let since = *self.last_activity.get_or_insert(now);
        if !self.quiet && now.saturating_duration_since(since) >= self.health_cfg.quiet_after {
            self.quiet = true;
            for h in self.paths.iter_mut().filter_map(|p| p.health.as_mut()) {
                h.set_quiet(true, now);
            }
        }
    }

    /// Add a path slot (not yet connected). `None` when the set is full.
    pub fn add(&mut self, spec: PathSpec) -> Option<PathId> {
        if self.paths.len() >= MAX_PATHS {
            return None;
        }
        self.paths.push(Path {
            spec,
            load: PathLoad::default(),
            health: None,
            counters: PathCounters::default(),
            throughput: Throughput::default(),
            drops: Drops::default(),
            connects: 0,
            retired: false,
            last_srtt: None,
            used_up: false,
            delivery_stalls: 0,
            detector: Default::default(),
            recognised: false,
            last_tx: None,
            last_data_loss: None,
            data_lost: 0,
        });
        Some(PathId((self.paths.len() - 1) as u16))
    }

    /// The transport's view of a path's capacity now (`PathLoad`).
    pub fn set_load(&mut self, id: PathId, load: PathLoad) {
        self.paths[id.index()].load = load;
    }

    /// Update a path's priority/weight (the server learns them from each hello); a retired
    /// path configured again is back.
    pub fn set_spec(&mut self, id: PathId, spec: PathSpec) {
        let p = &mut self.paths[id.index()];
        p.spec = spec;
        p.retired = false;
        self.tell_reconfigures(id);
    }

    /// The paths connected from now on judge their health so (`TunnelCore::peer_speaks_mpquic`).
    pub fn set_health_mode(&mut self, mode: HealthMode) {
        self.health_cfg.mode = mode;
    }

    /// The path was taken out of the configuration: its connection is gone for good (until it
    /// is configured again, `set_spec`).
    pub fn retire(&mut self, id: PathId) -> Transition {
        let t = self.disconnected(id);
        self.paths[id.index()].retired = true;
        t
    }

    pub fn get(&self, id: PathId) -> &Path {
        &self.paths[id.index()]
    }
    pub fn len(&self) -> usize {
        self.paths.len()
    }
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }
    pub fn ids(&self) -> impl Iterator<Item = PathId> {
        (0..self.paths.len() as u16).map(PathId)
    }
    pub fn iter(&self) -> impl Iterator<Item = (PathId, &Path)> {
        self.ids().zip(self.paths.iter())
    }
    pub fn find(&self, name: &str) -> Option<PathId> {
        self.iter()
            .find(|(_, p)| p.spec.name == name)
            .map(|(i, _)| i)
    }

    /// A new connection now carries `id`: health starts afresh, unless the path is up and the
    /// new connection replaces its live one (make before break: the client reconnecting at
    /// another packet size, whose handshake just crossed the path). The path then stays up:
    /// starting afresh took it out of use for a probe's round trip, and `balanced` moved its
    /// flows for good (scenario 14: path 1, repaired, lost its flows again 2 s later when it
    /// went back to full-size packets).
    pub fn connected(&mut self, id: PathId, now: Instant) -> Transition {
        let p = &mut self.paths[id.index()];
        let from = p.state();
        if from == Some(PathState::Up) {
            p.connects += 1;
            return Transition {
                path: id,
                from,
                to: from,
            };
        }
        self.close_health(id);
        let p = &mut self.paths[id.index()];
        let mut h = PathHealth::new(self.health_cfg, now);
        if self.quiet {
            h.set_quiet(true, now);
        }
        p.health = Some(h);
        p.connects += 1;
        let to = p.state();
        self.tell_reconfigures(id);
        Transition { path: id, from, to }
    }

    /// The round trip `id`'s new connection measured in its handshake: its health bounds the
    /// silence before the first reply by it (`PathHealth::set_rtt_hint`; a path that stayed up
    /// through the reconnection goes on by its probes' measure, which comes first).
    pub fn handshake_rtt(&mut self, id: PathId, rtt: Option<Duration>) {
        if let Some(h) = self
            .paths
            .get_mut(id.index())
            .and_then(|p| p.health.as_mut())
        {
            h.set_rtt_hint(rtt);
        }
    }

    /// The path's connection is gone.
    pub fn disconnected(&mut self, id: PathId) -> Transition {
        self.close_health(id);
        let p = &mut self.paths[id.index()];
        let from = p.state();
        if let Some(rtt) = p.health.as_ref().and_then(PathHealth::srtt) {
            p.last_srtt = Some(rtt);
        }
        p.health = None;
        Transition {
            path: id,
            from,
            to: None,
        }
    }

    /// `id`'s connection goes away: what its probes showed so far stays with the link (the
    /// probes it lost in a burst that took it down are the burst's evidence).
    fn close_health(&mut self, id: PathId) {
        let p = &mut self.paths[id.index()];
        if let Some(h) = p.health.as_mut() {
            h.abandon_probes();
            Self::observe_probes(p);
        }
    }

    /// Hand path `p`'s probe fates to its detector, when it recognises its link.
    fn observe_probes(p: &mut Path) {
        let detect = p.spec.detect_link && p.spec.link == reconfig::LinkKind::Other;
        if let Some(h) = p.health.as_mut() {
            for o in h.take_outcomes().filter(|_| detect) {
                p.detector.observe(o);
            }
        }
    }

    /// Advance time: collects due probes into `probes` and state changes into `changes`.
    pub fn poll(
        &mut self,
        now: Instant,
        probes: &mut Vec<ProbeDue>,
        changes: &mut Vec<Transition>,
    ) {
        self.update_quiet(now);
        let mut recognised = Vec::new();
        for (i, p) in self.paths.iter_mut().enumerate() {
            p.throughput.sample(now, &p.counters);
            let id = PathId(i as u16);
            Self::observe_probes(p);
            let detect = p.spec.detect_link && p.spec.link == reconfig::LinkKind::Other;
            if let Some(clock) = self.wall_clock.filter(|_| detect) {
                if p.detector.poll(now, &clock) {
                    recognised.push((id, p.detector.detected()));
                }
            }
            let (role, link) = (p.role(), p.link());
            let Some(h) = p.health.as_mut() else { continue };
            let before = h.state();
            if let Some(seq) = h.poll(now) {
                h.on_probe_sent(seq, p.counters.tx_packets as u32);
                probes.push(ProbeDue {
                    path: id,
                    seq,
                    view: PeerView {
                        role: Some(role),
                        link: Some(link),
                        ..h.view()
                    },
                });
            }
            if h.state() != before {
                changes.push(Transition {
                    path: id,
                    from: Some(before),
                    to: Some(h.state()),
                });
            }
        }
        for (id, starlink) in recognised {
            self.recognise(id, starlink);
        }
    }

    /// The earliest time `poll` has work to do (a probe, a silence that takes a path down, or
    /// the moment the tunnel goes quiet).
    pub fn next_deadline(&self) -> Option<Instant> {
        let health = self
            .paths
            .iter()
            .filter_map(|p| p.health.as_ref().map(|h| h.next_deadline()))
            .min()?;
        let quiet_at = match (self.quiet, self.last_activity) {
            (false, Some(t)) => Some(t + self.health_cfg.quiet_after),
            _ => None,
        };
        Some(quiet_at.map_or(health, |q| q.min(health)))
    }

    /// A reply to our probe arrived on `id`, with the peer's counts for the path when it sends
    /// them. Returns a transition if the path changed state.
    pub fn on_probe_reply(
        &mut self,
        id: PathId,
        seq: u32,
        counts: Option<Counts>,
        now: Instant,
    ) -> Option<Transition> {
        let arrived = self.paths.get(id.index())?.counters.arrived as u32;
        let t = self.health_event(id, |h| match counts {
            Some(c) => h.on_counted_reply(seq, now, c, arrived),
            None => h.on_reply(seq, now),
        });
        self.count_stall(id, t)
    }

    /// A transition that the delivery watch caused (the path is now `stalled`) is counted.
    fn count_stall(&mut self, id: PathId, t: Option<Transition>) -> Option<Transition> {
        let p = &mut self.paths[id.index()];
        if t.is_some() && p.health.as_ref().is_some_and(|h| h.stalled().is_some()) {
            p.delivery_stalls += 1;
        }
        t
    }

    /// The counts this side gives the peer in its probe replies on `id` (`delivery.rs`).
    pub fn counts(&self, id: PathId) -> Counts {
        let c = self
            .paths
            .get(id.index())
            .map(|p| p.counters)
            .unwrap_or_default();
        Counts {
            sent: c.tx_packets as u32,
            arrived: c.arrived as u32,
        }
    }

    /// The way `id` stopped delivering while its probes were answered, when it did: its
    /// connection is to be replaced now (`health::PathHealth::stalled`).
    pub fn stalled(&self, id: PathId) -> Option<Direction> {
        self.paths.get(id.index())?.health.as_ref()?.stalled()
    }

    /// A datagram carrying an inner packet (or an FEC repair) arrived on `id`.
    pub fn on_arrived(&mut self, id: PathId) {
        if let Some(p) = self.paths.get_mut(id.index()) {
            p.counters.arrived += 1;
        }
    }

    /// The peer's probe arrived on `id` (a follower adopts its view). Returns a transition if the
    /// path changed state.
    pub fn on_peer_probe(
        &mut self,
        id: PathId,
        seq: u32,
        view: Option<&PeerView>,
        now: Instant,
    ) -> Option<Transition> {
        // The server schedules by the role the client has for the path now (its budget may
        // have been used up since the hello).
        if let (Some(role), Some(p)) = (view.and_then(|v| v.role), self.paths.get_mut(id.index())) {
            p.spec.role = role;
        }
        // And treats its link as the client does (a link the client recognised as Starlink).
        if let Some(link) = view
            .and_then(|v| v.link)
            .filter(|_| id.index() < self.paths.len())
        {
            self.recognise(id, link == reconfig::LinkKind::Starlink);
        }
        self.health_event(id, |h| h.on_peer_probe(seq, view, now))
    }

    fn health_event(&mut self, id: PathId, f: impl FnOnce(&mut PathHealth)) -> Option<Transition> {
        let h = self.paths.get_mut(id.index())?.health.as_mut()?;
        let before = h.state();
        f(h);
        (h.state() != before).then_some(Transition {
            path: id,
            from: Some(before),
            to: Some(h.state()),
        })
    }

    /// `id`'s connection has sent and lost this many packets (`PathHealth::on_data_counters`);
    /// a path found losing its data while its probes pass counts as a delivery stall.
    pub fn on_data_counters(
        &mut self,
        id: PathId,
        now: Instant,
        sent: u64,
        lost: u64,
    ) -> Option<Transition> {
        if let Some(p) = self.paths.get_mut(id.index()) {
            // A new connection counts from zero: a lower count is its first.
            if lost > p.data_lost {
                p.last_data_loss = Some(now);
            }
            p.data_lost = lost;
        }
        let t = self.health_event(id, |h| h.on_data_counters(now, sent, lost));
        self.count_stall(id, t)
    }

    /// Whether `id`'s connection declared a packet lost within `within` of `now`.
    pub fn lost_data_within(&self, id: PathId, now: Instant, within: Duration) -> bool {
        (self.paths.get(id.index()))
            .and_then(|p| p.last_data_loss)
            .is_some_and(|t| now.saturating_duration_since(t) < within)
    }

    /// `id` stopped acknowledging its data: down now (`PathHealth::declare_down`).
    pub fn declare_down(
        &mut self,
        id: PathId,
        now: Instant,
        silent_for: Duration,
    ) -> Option<Transition> {
        self.health_event(id, |h| h.declare_down(now, silent_for))
    }

    /// Count a packet of `len` bytes sent on `id`.
    pub fn count_tx(&mut self, id: PathId, len: usize, now: Instant) {
        self.count_bytes(id, len);
        self.paths[id.index()].last_tx = Some(now);
        self.note_activity(now);
    }

    /// `len` bytes more routed to `id`: its backlog and counters (`count_tx`, `count_copy`).
    fn count_bytes(&mut self, id: PathId, len: usize) {
        let p = &mut self.paths[id.index()];
        p.load.backlog += len as u64;
        p.counters.tx_packets += 1;
        p.counters.tx_bytes += len as u64;
    }

    /// A packet of `len` bytes routed to `first` was copied to `second` (`bond::copies`), for
    /// `why`. The copy counts in `second`'s traffic but not as its own: a path that carries
    /// copies alone has nothing to hand over when it goes down (the originals went on
    /// `first`), so it keeps its connection (`hand_over_since`).
    pub fn count_copy(&mut self, first: PathId, second: PathId, why: CopyReason, len: usize) {
        let c = &mut self.paths[first.index()].counters;
        match why {
            CopyReason::Reconfig => c.reconfig_copies += 1,
            CopyReason::Loss => c.loss_copies += 1,
            CopyReason::Spare => c.spare_copies += 1,
        }
        self.count_bytes(second, len);
    }

    /// Count a packet received from the peer on `id`.
    pub fn on_received(&mut self, id: PathId, len: usize, now: Instant) {
        let c = &mut self.paths[id.index()].counters;
        c.rx_packets += 1;
        c.rx_bytes += len as u64;
        self.note_activity(now);
    }

    /// A packet of `len` bytes counted as sent on `id` could not be sent after all.
    pub fn drop_tx(&mut self, id: PathId, len: usize, reason: DropReason) {
        self.drop_tx_batch(id, 1, len as u64, reason);
    }

    /// `packets` packets (`bytes` in all) counted as sent on `id` were lost before leaving
    /// (e.g. queued on a stream that failed).
    pub fn drop_tx_batch(&mut self, id: PathId, packets: u64, bytes: u64, reason: DropReason) {
        let p = &mut self.paths[id.index()];
        p.drops.add_n(reason, packets);
        p.counters.tx_packets = p.counters.tx_packets.saturating_sub(packets);
        p.counters.tx_bytes = p.counters.tx_bytes.saturating_sub(bytes);
    }

    /// `n` packets sent on `id` were marked "congestion experienced" by its sender's queue.
    pub fn ce_marked(&mut self, id: PathId, n: u64) {
        let c = &mut self.paths[id.index()].counters;
        c.ce_marked = c.ce_marked.saturating_add(n);
    }

    /// A packet received on `id` (or meant for it) was refused (spoofed source, malformed, TUN
    /// full, a batch lost with its stream...).
    pub fn drop_on(&mut self, id: PathId, reason: DropReason, n: u64) {
        self.paths[id.index()].drops.add_n(reason, n);
    }

    /// How long `id` has been unusable: down, or connected but never answered. `None` when it
    /// is up or has no connection (the shell reconnects on a long unusable spell).
    pub fn unusable_for(&self, id: PathId, now: Instant) -> Option<Duration> {
        let h = self.paths.get(id.index())?.health.as_ref()?;
        (h.state() != PathState::Up).then(|| now.saturating_duration_since(h.since()))
    }

    /// How long `id` has been up (`None`: it is not).
    pub fn up_for(&self, id: PathId, now: Instant) -> Option<Duration> {
        let h = self.paths.get(id.index())?.health.as_ref()?;
        (h.state() == PathState::Up).then(|| now.saturating_duration_since(h.since()))
    }

    /// `id` just went down: the moment from which what it sent may not have arrived, when
    /// another path is up to carry it again and it did send something since (`None`: no other
    /// path is up, so the dead path's stream is the best hope for those packets, see
    /// `reliable.rs`; or it carried nothing in that time). Only then does the shell close the
    /// path's connection (and, in reliable mode, send those packets again): a path that carried
    /// nothing has nothing to deliver late, and keeps its connection for when its probes are
    /// answered again. Closed, a failover's backup over LTE (whose delivery stops for up to
    /// 0.9 s in the recordings) waited out a new handshake at each such gap, often a second
    /// with its first packet lost in the gap.
    pub fn hand_over_since(&self, id: PathId, now: Instant) -> Option<Instant> {
        let p = self.paths.get(id.index())?;
        let h = p.health.as_ref()?;
        let since = crate::reliable::unconfirmed_since(now, h.silence_at_down(), h.srtt());
        (self.can_hand_over(id) && p.last_tx.is_some_and(|t| t >= since)).then_some(since)
    }

    /// Another path is up to take what `id` sent lately, should `id` go down now.
    pub fn can_hand_over(&self, id: PathId) -> bool {
        self.iter().any(|(p, path)| p != id && path.is_up())
    }

    pub fn handed_over(&mut self, id: PathId, n: u64) {
        if let Some(p) = self.paths.get_mut(id.index()) {
            p.counters.handed_over += n;
        }
    }

    /// Paths eligible for traffic: the primary paths that are up; while none is, the backups
    /// that are up; while none of those is either, the paths whose data budget is used up.
    /// The `overflow` backups join the primaries while every primary that is up is crowded.
    /// When no path is up, any connected path (a best effort: a mis-judged path is better
    /// than a certain black hole).
    pub fn candidates(&self) -> impl Iterator<Item = PathId> + '_ {
        let best = self
            .paths
            .iter()
            .filter(|p| p.is_up())
            .map(Path::tier)
            .min();
        let all_crowded = self
            .paths
            .iter()
            .filter(|p| p.is_up() && p.tier() == 0)
            .all(|p| p.load.crowded());
        self.iter()
            .filter(move |(_, p)| match best {
                None => p.health.is_some(),
                Some(best) => {
                    p.is_up()
                        && (p.tier() == best
                            || (best == 0 && all_crowded && p.role() == Role::Overflow))
                }
            })
            .map(|(i, _)| i)
    }

    /// A path's data budget was used up (`true`) or starts again (`false`). `now`: when (the
    /// peer hears of its role with a probe at once, so the server stops sending on it too);
    /// `None` for a path set up so (no probe needed yet).
    pub fn set_used_up(&mut self, id: PathId, used_up: bool, now: Option<Instant>) {
        let p = &mut self.paths[id.index()];
        let changed = p.used_up != used_up;
        p.used_up = used_up;
        if let (true, Some(now), Some(h)) = (changed, now, p.health.as_mut()) {
            h.probe_now(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_is_measured_over_windows_of_a_second() {
        let t0 = Instant::now();
        let mut t = Throughput::default();
        let mut c = PathCounters::default();
        t.sample(t0, &c);
        c.tx_bytes = 1_000_000;
        c.rx_bytes = 10_000;
        // Too soon: the last figures stand (none yet).
        t.sample(t0 + Duration::from_millis(500), &c);
        assert_eq!((t.tx_bps, t.rx_bps), (0, 0));
        c.tx_bytes = 2_000_000;
        t.sample(t0 + Duration::from_secs(2), &c);
        assert_eq!((t.tx_bps, t.rx_bps), (8_000_000, 40_000));
        // Quiet since: zero after the next window.
        t.sample(t0 + Duration::from_secs(3), &c);
        assert_eq!((t.tx_bps, t.rx_bps), (0, 0));
    }
}
