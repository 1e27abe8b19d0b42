//! Schedulers: the policy that picks a path of a `PathSet` for each inner packet. A new policy is
//! a new implementation of `Scheduler`, registered in `Policy`; the bond and the shells do not
//! change.

use std::time::{Duration, Instant};

use crate::bond::flow::FlowTable;
use crate::bond::spill::Spill;
use crate::packet::PacketInfo;
use crate::path::{Path, PathId, PathSet};
use crate::reorder::reseq::MAX_WAIT;

/// The policies a config can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// All traffic on the best (lowest `priority`) path that is up, but bulk TCP flows beyond
    /// one, which are shared with the other paths of that priority that are free to take
    /// them (`spill`).
    Failover,
    /// Flows spread over the up paths of the best priority, in proportion to `weight`;
    /// a flow stays on its path (no reordering) until that path goes down.
    Balanced,
    /// Each packet on the path where it arrives first, from each path's measured RTT, window,
    /// backlog and rate (`weight` biases the rate): a flow spills onto slower paths as the
    /// faster fill, so one flow gets the sum of the paths. Packets are numbered per flow and
    /// put back in order by the receiver (`reseq.rs`).
    Wlb,
    /// Each packet on the lowest-RTT path with room in its congestion window, else where it
    /// arrives first (as `wlb`); numbered and put back in order the same way.
    MinRtt,
    /// Each packet on the two lowest-RTT up paths (of the best priority): a loss on one is
    /// covered by the other. The receiver hands on the first copy and drops the second (it
    /// counts them, `duplicates`). For traffic that must not wait for a retransmission.
    Redundant,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Policy::Failover,
        Policy::Balanced,
        Policy::Wlb,
        Policy::MinRtt,
        Policy::Redundant,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Failover => "failover",
            Policy::Balanced => "balanced",
            Policy::Wlb => "wlb",
            Policy::MinRtt => "minrtt",
            Policy::Redundant => "redundant",
        }
    }
    /// Whether it spreads one flow's packets over several paths (they are then numbered for
    /// the receiver's resequencer).
    pub fn per_packet(self) -> bool {
        matches!(self, Policy::Wlb | Policy::MinRtt | Policy::Redundant)
    }
    /// Whether a packet it numbers always has a copy on another path: `redundant` copies every
    /// packet, the policies that do not spread a flow number only the copies they send around
    /// a Starlink path's reconfiguration (`path::reconfig`); `wlb` and `minrtt` number packets
    /// they send once.
    pub fn numbers_only_copies(self) -> bool {
        !matches!(self, Policy::Wlb | Policy::MinRtt)
    }
    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.as_str() == s)
    }
    /// A fresh scheduler implementing this policy.
    pub fn scheduler(self) -> Box<dyn Scheduler> {
        match self {
            Policy::Failover => Box::new(Failover::default()),
            Policy::Balanced => Box::new(Balanced::new()),
            Policy::Wlb => Box::new(Wlb),
            Policy::MinRtt => Box::new(MinRtt),
            Policy::Redundant => Box::new(Redundant),
        }
    }
}

pub trait Scheduler: std::fmt::Debug + Send {
    fn policy(&self) -> Policy;
    /// The path for an inner packet of `len` bytes (`info`: its parsed headers, `None` when
    /// unparsable), among `paths.candidates()`. `None` only when there is no candidate.
    fn pick(
        &mut self,
        paths: &PathSet,
        info: Option<&PacketInfo>,
        len: usize,
        now: Instant,
    ) -> Option<PathId>;
    /// A second path for the same packet (`redundant`), after `pick` chose `first`.
    fn also(&mut self, _paths: &PathSet, _first: PathId) -> Option<PathId> {
        None
    }
    /// Packets placed on `path` earlier must be placed afresh (it went down, lost or replaced
    /// its connection).
    fn release(&mut self, _path: PathId) {}
    /// Housekeeping; called at least once a second while the tunnel runs.
    fn poll(&mut self, _now: Instant) {}
    /// Flows currently placed on `path` (status).
    fn flows_on(&self, _path: PathId) -> usize {
        0
    }
    /// Flows moved onto `path` while they ran (status; `spill`).
    fn flows_moved_to(&self, _path: PathId) -> u64 {
        0
    }
}

fn best_priority(paths: &PathSet) -> Option<u32> {
    paths.candidates().map(|i| paths.get(i).spec.priority).min()
}

/// The candidates of the best priority: the paths a spreading policy chooses among.
fn best_candidates(paths: &PathSet) -> impl Iterator<Item = PathId> + '_ {
    let prio = best_priority(paths);
    paths
        .candidates()
        .filter(move |&i| Some(paths.get(i).spec.priority) == prio)
}

/// The candidates of the best priority that a per-packet policy spreads one flow over: those
/// whose packets can be put back in order with the fastest one's. A path whose own delay (half
/// its least RTT: the link, not its queue) exceeds the fastest's by more than the receiver's
/// resequencer waits for a missing packet (`reseq::MAX_WAIT`) delivers each of its packets
/// after the receiver has given up on it: reordered, a loss to the inner TCP. A geostationary
/// path (600 ms) bonded with a 40 ms one under `wlb` took one TCP flow to 0.84 (up) and 0.61
/// (down) of the short path alone, 130-355 retransmissions in 15 s. Such a path carries when
/// the faster ones are gone (it is then among the fastest left).
fn spread_candidates(paths: &PathSet) -> impl Iterator<Item = PathId> + '_ {
    let base = |i: PathId| paths.get(i).health.as_ref().and_then(|h| h.min_rtt());
    let fastest = best_candidates(paths).filter_map(base).min();
    best_candidates(paths).filter(move |&i| match (base(i), fastest) {
        (Some(rtt), Some(fastest)) => rtt.saturating_sub(fastest) / 2 <= MAX_WAIT,
        _ => true,
    })
}

fn best_by_priority(paths: &PathSet) -> Option<PathId> {
    paths
        .candidates()
        .min_by_key(|&i| (paths.get(i).spec.priority, i))
}

/// Everything on the best path, except bulk TCP flows it cannot carry alone, which are
/// shared out over the paths of its priority (`spill`).
#[derive(Debug, Default)]
pub struct Failover {
    spill: Spill,
}

impl Scheduler for Failover {
    fn policy(&self) -> Policy {
        Policy::Failover
    }
    fn pick(
        &mut self,
        paths: &PathSet,
        info: Option<&PacketInfo>,
        len: usize,
        now: Instant,
    ) -> Option<PathId> {
        let home = best_by_priority(paths)?;
        Some(self.spill.pick(paths, home, info, len, now))
    }
    fn release(&mut self, path: PathId) {
        self.spill.release(path);
    }
    fn flows_on(&self, path: PathId) -> usize {
        self.spill.flows_on(path)
    }
    fn flows_moved_to(&self, path: PathId) -> u64 {
        self.spill.moved_to(path)
    }
}

const FLOW_IDLE: Duration = Duration::from_secs(60);
const FLOW_CAPACITY: usize = 65_536;

#[derive(Debug)]
pub struct Balanced {
    flows: FlowTable,
}

impl Balanced {
    pub fn new() -> Self {
        Balanced {
            flows: FlowTable::new(FLOW_IDLE, FLOW_CAPACITY),
        }
    }
}

impl Default for Balanced {
    fn default() -> Self {
        Self::new()
    }
}

impl Balanced {
    /// The eligible path of priority `prio` furthest below its weighted share of the flows
    /// (counting the one being placed): w_i/W * (F+1) - f_i, scaled by W to stay in integers.
    /// This keeps every path within one flow of its exact share, which "fewest flows per
    /// weight" does not. `moving`: the path of a flow being reconsidered, counted without it;
    /// the flow stays unless another path is strictly further below its share.
    fn place(&self, paths: &PathSet, prio: u32, moving: Option<PathId>) -> Option<PathId> {
        let flows = &self.flows;
        let eligible: Vec<PathId> = paths
            .candidates()
            .filter(|&i| paths.get(i).spec.priority == prio)
            .collect();
        let weight = |i: PathId| i128::from(paths.get(i).spec.weight.max(1));
        let on = |i: PathId| flows.flows_on(i) as i128 - i128::from(moving == Some(i));
        let total_w: i128 = eligible.iter().map(|&i| weight(i)).sum();
        let total_f: i128 = eligible.iter().map(|&i| on(i)).sum();
        let deficit = |i: PathId| weight(i) * (total_f + 1) - on(i) * total_w;
        let best = eligible.iter().copied().max_by(|&a, &b| {
            // Ties go to the heavier weight, then to the lower index.
            deficit(a)
                .cmp(&deficit(b))
                .then(weight(a).cmp(&weight(b)))
                .then(b.cmp(&a))
        })?;
        match moving {
            // (A flow on a path of another priority, a backup, goes to the best priority.)
            Some(p) if eligible.contains(&p) && deficit(best) <= deficit(p) => Some(p),
            _ => Some(best),
        }
    }
}

/// How long a flow must have been quiet before it may change paths without being reordered:
/// the largest smoothed RTT among the paths of priority `prio` (what was in flight on the
/// slowest has arrived by then; `DEFAULT_RTT` for a path not measured yet), and at least
/// `SETTLE_MIN`, so that flows do not hop between paths at every short pause of a LAN's RTT.
fn settle_time(paths: &PathSet, prio: u32) -> Duration {
    paths
        .candidates()
        .filter(|&i| paths.get(i).spec.priority == prio)
        .map(|i| {
            paths
                .get(i)
                .health
                .as_ref()
                .and_then(|h| h.srtt())
                .unwrap_or(DEFAULT_RTT)
        })
        .max()
        .unwrap_or(DEFAULT_RTT)
        .max(SETTLE_MIN)
}

const SETTLE_MIN: Duration = Duration::from_millis(100);

impl Scheduler for Balanced {
    fn policy(&self) -> Policy {
        Policy::Balanced
    }

    fn pick(
        &mut self,
        paths: &PathSet,
        info: Option<&PacketInfo>,
        _: usize,
        now: Instant,
    ) -> Option<PathId> {
        let prio = best_priority(paths)?;
        let Some(info) = info else {
            return best_by_priority(paths);
        };
        let key = info.flow_hash();
        let mut moving = None;
        if let Some((p, idle)) = self.flows.lookup_idle(key, now) {
            if paths.candidates().any(|c| c == p) {
                // A flow that paused for longer than any path's RTT has nothing in flight, so
                // it can move without being reordered: back to a repaired path, or to one
                // below its share (a flow moved away when its path failed otherwise stayed on
                // the survivor for good). One that keeps sending stays (a busy TCP flow never
                // moves; per-packet policies move packets, not flows).
                // (The floor first: a busy flow, the common case, does not look at the paths.)
                if idle < SETTLE_MIN || idle < settle_time(paths, prio) {
                    return Some(p);
                }
                moving = Some(p);
            }
        }
        let chosen = self.place(paths, prio, moving)?;
        if moving != Some(chosen) {
            self.flows.assign(key, chosen, now);
        }
        Some(chosen)
    }

    fn release(&mut self, path: PathId) {
        self.flows.release_path(path);
    }

    fn poll(&mut self, now: Instant) {
        self.flows.expire(now);
    }

    fn flows_on(&self, path: PathId) -> usize {
        self.flows.flows_on(path)
    }
}

/// Assumed for a path whose transport has not said yet (a fresh connection).
const DEFAULT_RATE: u64 = 10_000_000;
const DEFAULT_RTT: Duration = Duration::from_millis(100);

/// How long a packet of `len` bytes routed to `p` now waits before it leaves: what does not
/// fit the path's window, at its rate (biased by its weight).
fn drain_time(p: &Path, len: usize) -> Duration {
    let rate = p.load.rate.unwrap_or(DEFAULT_RATE).max(1) * u64::from(p.spec.weight.max(1));
    let queued = p.load.backlog + len as u64;
    let excess = match p.load.window {
        Some(w) => (p.load.in_flight + queued).saturating_sub(w),
        None => queued,
    };
    Duration::from_nanos((excess * 8).saturating_mul(1_000_000_000) / rate)
}

/// When a packet of `len` bytes routed to `p` now would reach the peer, relative to now: half
/// the path's RTT plus its wait to leave.
fn arrival(p: &Path, len: usize) -> Duration {
    p.load.rtt.unwrap_or(DEFAULT_RTT) / 2 + drain_time(p, len)
}

/// The path of the best priority where a packet arrives first (ties: the lower index).
fn earliest_arrival(paths: &PathSet, len: usize) -> Option<PathId> {
    spread_candidates(paths).min_by_key(|&i| {
        let p = paths.get(i);
        (p.load.crowded(), arrival(p, len), i)
    })
}

/// Load balanced by rate: a packet goes where what waits beyond the window drains first at
/// the path's rate (biased by weight), so the paths' queues stay in proportion to their rates;
/// among paths whose windows have room (nothing waits), the lowest RTT. Unlike `minrtt`'s
/// fallback it leaves the RTT out of the drain time: a path is not kept full until its queue
/// has made up the RTT difference (that had one flow over 60 + 30 Mbit/s at 62-76 Mbit/s,
/// inner BBR sizing its window by the faster path's RTT).
/// Tried and measured worse: a fixed split in proportion to the rates (a fair queue over the
/// paths in virtual time) got 24 Mbit/s: the slow path's controller, given only its share,
/// never saw enough to grow its window, and every packet of the flow waited for its queue.
#[derive(Debug, Default)]
pub struct Wlb;

impl Scheduler for Wlb {
    fn policy(&self) -> Policy {
        Policy::Wlb
    }
    fn pick(
        &mut self,
        paths: &PathSet,
        _: Option<&PacketInfo>,
        len: usize,
        _: Instant,
    ) -> Option<PathId> {
        spread_candidates(paths).min_by_key(|&i| {
            let p = paths.get(i);
            let rtt = p.load.rtt.unwrap_or(DEFAULT_RTT);
            (p.load.crowded(), drain_time(p, len), rtt, i)
        })
    }
}

/// Without a window from the transport, a path "has room" while what waits in it would
/// leave within this time at its rate (one packet at least). Short, because a packet sent on
/// the lowest-RTT path behind that wait reaches the peer that much after one sent at the same
/// moment on a path with none: the receiver's resequencer absorbs it.
const ROOM_TIME: Duration = Duration::from_millis(1);

#[derive(Debug)]
pub struct MinRtt;

impl Scheduler for MinRtt {
    fn policy(&self) -> Policy {
        Policy::MinRtt
    }
    fn pick(
        &mut self,
        paths: &PathSet,
        _: Option<&PacketInfo>,
        len: usize,
        _: Instant,
    ) -> Option<PathId> {
        let room = |p: &Path| {
            let room = p.load.room(ROOM_TIME, DEFAULT_RATE);
            room >= len as u64 || (p.load.window.is_none() && p.load.backlog == 0)
        };
        spread_candidates(paths)
            .filter(|&i| room(paths.get(i)))
            .min_by_key(|&i| (paths.get(i).load.rtt.unwrap_or(DEFAULT_RTT), i))
            .or_else(|| earliest_arrival(paths, len))
    }
}

/// The up paths of the best priority, lowest RTT first.
fn by_rtt(paths: &PathSet) -> impl Iterator<Item = PathId> + '_ {
    let mut v: Vec<PathId> = best_candidates(paths).collect();
    v.sort_by_key(|&i| (paths.get(i).load.rtt.unwrap_or(DEFAULT_RTT), i));
    v.into_iter()
}

#[derive(Debug)]
pub struct Redundant;

impl Scheduler for Redundant {
    fn policy(&self) -> Policy {
        Policy::Redundant
    }
    fn pick(
        &mut self,
        paths: &PathSet,
        _: Option<&PacketInfo>,
        _: usize,
        _: Instant,
    ) -> Option<PathId> {
        by_rtt(paths).next()
    }
    fn also(&mut self, paths: &PathSet, first: PathId) -> Option<PathId> {
        by_rtt(paths).find(|&i| i != first)
    }
}
