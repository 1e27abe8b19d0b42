//! Bulk TCP flows shared out over the paths of equal rank, under `failover` (the default
//! policy). Failover sends everything on its best path (lowest `priority`, then the first
//! configured); a second path of the same priority stood by unused however many bulk flows
//! queued on the first. Now, when the best path carries two or more bulk flows and another up
//! path of the same priority is free to share them (a primary with no data budget and no
//! rate limit: a link the site pays for by the byte is not filled with bulk unasked), one flow
//! is moved there to see what it carries; from then on, once a second, bulk flows are moved
//! from the path where each gets least to the one where one more would still get more
//! (by a margin), until each path's flows get about the same. A flow moves whole (no
//! reordering beyond the moment it moves), and only a bulk one: a single flow, a call, a
//! web page's short transfers and everything that is not TCP stay on the best path, where
//! they have the lowest delay. A moved flow that pauses for half a second (the link under it
//! stalled) comes back to the best path.
//!
//! Why by flows and not by packets: a flow spread packet by packet over a steady link and a
//! bursty one (LTE stops delivering for up to 0.9 s) waits for the bursty one's packets at
//! the receiver; over Starlink + LTE that got less than Starlink alone (docs/BENCHMARKS.md,
//! "Real links"), where 16 flows spread by what each link carries got the links' sum.

use std::time::{Duration, Instant};

use crate::bond::flow::FlowTable;
use crate::packet::PacketInfo;
use crate::path::{PathId, PathSet};
use crate::Role;

/// How often the flows' rates are looked at and moves decided: the paths' throughput
/// window (`path::THROUGHPUT_WINDOW`), so that each look sees a rate measured since the last.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// After a look that moved flows, the next is this much later: the rates seen one window
/// after a move still partly show the flows where they were.
const SETTLE_AFTER_MOVE: Duration = Duration::from_secs(2);
/// A flow that sent at least this much in each of two looks' intervals is a bulk flow
/// (128 kbit/s: sixteen flows share a 4 Mbit/s link at 250 each).
const BULK_BYTES: u64 = 16_000;
/// Only flows that send packets of at least this size are followed (data, not ACKs).
const DATA_PACKET: usize = 1000;
/// A move is made only when the flows of the path moved to would still get this much more
/// each (5/4) than those of the path moved from: no moves back and forth on noise.
const MARGIN: (u64, u64) = (5, 4);
/// The last bulk flow on a path other than the best moves off it only if it would get this
/// much more (4x) elsewhere: it is what that path carries at all.
const LAST_FLOW_MARGIN: (u64, u64) = (4, 1);
/// At most this many flows move at one look.
const MAX_MOVES: u32 = 4;
/// A path that carried a flow tried on it worse than the best path would have is not tried
/// again for this long.
const SHUN: Duration = Duration::from_secs(30);
/// Flows not seen for this long are forgotten.
const FLOW_IDLE: Duration = Duration::from_secs(10);
const FLOW_CAPACITY: usize = 4096;
/// A moved flow returns to the best path after pausing at least this long (the largest RTT
/// among the paths when longer: what was in flight has arrived by then): the path under it
/// has stalled (TCP waits out a retransmission timeout, 200 ms at least, and more after one
/// lost again). Not at a shorter pause: a flow moved onto a slower link overflows its queue
/// at first and waits for a timeout there, and sent home at that wait (at 100 ms) no moved
/// download stayed on LTE long enough to carry anything (1 MB in 14 s over Starlink + LTE).
const RETURN_PAUSE: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Move {
    from: PathId,
    to: PathId,
    left: u32,
}

#[derive(Debug)]
pub struct Spill {
    /// The TCP flows that send data, with the path each is on (the best path unless moved).
    flows: FlowTable,
    next_look: Option<Instant>,
    /// Whether the last look found a path to share with: else every flow is on the best path
    /// and none is followed (a tunnel with one path pays nothing for this).
    active: bool,
    /// Moves decided at the last look, made at the next packets of bulk flows on `from`.
    pending: Option<Move>,
    /// How long a moved flow's pause must be for it to return to the best path.
    settle: Duration,
    shunned: Vec<(PathId, Instant)>,
    /// Flows moved so far, by the path moved to (status).
    moved_to: Vec<u64>,
}

impl Default for Spill {
    fn default() -> Self {
        Spill {
            flows: FlowTable::new(FLOW_IDLE, FLOW_CAPACITY),
            next_look: None,
            active: false,
            pending: None,
            settle: RETURN_PAUSE,
            shunned: Vec::new(),
            moved_to: Vec::new(),
        }
    }
}

/// Whether `id` may take bulk flows from a best path of priority `prio`: up among the
/// candidates, of that priority, a primary now (not a backup, nor a path whose budget is used
/// up), and neither metered (a data budget) nor rate limited.
fn shares(paths: &PathSet, id: PathId, prio: u32) -> bool {
    let p = paths.get(id);
    p.spec.priority == prio
        && p.role() == Role::Primary
        && !p.spec.metered
        && p.spec.rate_limit.is_none()
        && paths.candidates().any(|c| c == id)
}

impl Spill {
    /// The path for a packet whose best path is `home`.
    pub fn pick(
        &mut self,
        paths: &PathSet,
        home: PathId,
        info: Option<&PacketInfo>,
        len: usize,
        now: Instant,
    ) -> PathId {
        let Some(info) = info.filter(|i| i.proto == crate::packet::PROTO_TCP) else {
            return home;
        };
        if self.next_look.is_none_or(|t| now >= t) {
            self.look(paths, home, now);
        }
        if !self.active {
            return home;
        }
        let key = info.flow_hash();
        let prio = paths.get(home).spec.priority;
        if let Some(seen) = self.flows.lookup_sending(key, len, now) {
            let usable = |p: PathId| p == home || shares(paths, p, prio);
            if seen.idle < self.settle && usable(seen.path) {
                if let Some(m) = self.pending.as_mut() {
                    if seen.bulk && m.from == seen.path && m.left > 0 && usable(m.to) {
                        m.left -= 1;
                        let to = m.to.index();
                        if self.moved_to.len() <= to {
                            self.moved_to.resize(to + 1, 0);
                        }
                        self.moved_to[to] += 1;
                        self.flows.assign(key, m.to, now);
                        return m.to;
                    }
                }
                return seen.path;
            }
            // Its path is gone or no longer of the best rank, or the flow paused: it starts
            // again on the best path.
            if seen.path != home {
                self.flows.assign(key, home, now);
            }
            return home;
        }
        if len >= DATA_PACKET {
            self.flows.assign(key, home, now);
        }
        home
    }

    /// Once a second: which flows are bulk, what each path's get, and the moves to make.
    fn look(&mut self, paths: &PathSet, home: PathId, now: Instant) {
        self.next_look = Some(now + LOOK_EVERY);
        self.pending = None;
        let prio = paths.get(home).spec.priority;
        let mut group = vec![home];
        group.extend(
            paths
                .candidates()
                .filter(|&i| i != home && shares(paths, i, prio)),
        );
        self.active = paths.get(home).role() == Role::Primary && group.len() > 1;
        if !self.active {
            self.flows = FlowTable::new(FLOW_IDLE, FLOW_CAPACITY);
            return;
        }
        self.flows.expire(now);
        self.settle = group
            .iter()
            .filter_map(|&i| paths.get(i).srtt())
            .max()
            .unwrap_or(RETURN_PAUSE)
            .max(RETURN_PAUSE);
        let per_path = self
            .flows
            .mark_bulk(BULK_BYTES * LOOK_EVERY.as_secs().max(1));
        let n = |p: PathId| per_path.get(p.index()).copied().unwrap_or(0) as u64;
        if group.iter().map(|&p| n(p)).sum::<u64>() < 2 {
            return;
        }
        self.shunned.retain(|&(_, until)| now < until);
        let shunned = |p: PathId| self.shunned.iter().any(|&(s, _)| s == p);
        // A path that carries no bulk flow yet gets one to try, from the path with the most.
        let crowded = group.iter().copied().max_by_key(|&p| (n(p), p == home));
        let idle = group.iter().copied().find(|&p| n(p) == 0 && !shunned(p));
        if let (Some(from), Some(to)) = (crowded, idle) {
            if n(from) >= 2 {
                self.pending = Some(Move { from, to, left: 1 });
                self.next_look = Some(now + SETTLE_AFTER_MOVE);
                return;
            }
        }
        // Then from the path whose flows get least each to the one where one more would
        // still get most, while the margin holds (each path's rate taken as it is: a full
        // path's flows share what it carries).
        let rate = |p: PathId| paths.get(p).throughput.tx_bps;
        let Some(from) = group
            .iter()
            .copied()
            .filter(|&p| n(p) > 0)
            .min_by(|&a, &b| (rate(a) * n(b)).cmp(&(rate(b) * n(a))))
        else {
            return;
        };
        let Some(to) = group
            .iter()
            .copied()
            .filter(|&p| p != from)
            .max_by(|&a, &b| (rate(a) * (n(b) + 1)).cmp(&(rate(b) * (n(a) + 1))))
        else {
            return;
        };
        // The best path keeps one bulk flow at least (the path the rest starts on); another
        // path gives up its last only for a far better rate elsewhere, since with it goes all
        // that path carries (a full path that gains a flow carries no more).
        let margin = |nf: u64| match (nf, from == home) {
            (1, false) => LAST_FLOW_MARGIN,
            _ => MARGIN,
        };
        let keep = u64::from(from == home);
        let (mut nf, mut nt, mut k) = (n(from), n(to), 0);
        while k < MAX_MOVES
            && nf > keep
            && u128::from(rate(to)) * u128::from(nf) * u128::from(margin(nf).1)
                > u128::from(rate(from)) * u128::from(nt + 1) * u128::from(margin(nf).0)
        {
            nf -= 1;
            nt += 1;
            k += 1;
        }
        if k == 0 {
            return;
        }
        if nf == 0 && from != home {
            // Its last flow leaves: what it carried was not worth a flow.
            self.shunned.push((from, now + SHUN));
        }
        self.pending = Some(Move { from, to, left: k });
        self.next_look = Some(now + SETTLE_AFTER_MOVE);
    }

    /// `path` went down or away: its flows start again on the best path.
    pub fn release(&mut self, path: PathId) {
        self.flows.release_path(path);
    }

    /// Flows moved onto `path` so far (status).
    pub fn moved_to(&self, path: PathId) -> u64 {
        self.moved_to.get(path.index()).copied().unwrap_or(0)
    }

    /// Flows followed on `path` (status).
    pub fn flows_on(&self, path: PathId) -> usize {
        self.flows.flows_on(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;
    use crate::{HealthConfig, PathSpec};

    const STEP: Duration = Duration::from_millis(10);

    /// A fluid model of TCP flows over paths `a` and `b` (`b` as `spec_b` says) of `caps`
    /// bits/s: each path that carries flows delivers its capacity, shared equally by them, and
    /// each flow sends what it gets as 1200-byte packets through `Spill::pick`, which says
    /// where its next packets go. Returns the flows on each path at the end and the moves.
    fn run(caps: [u64; 2], flows: usize, secs: u64, spec_b: PathSpec) -> ([usize; 2], u64) {
        let t0 = Instant::now();
        let mut paths = PathSet::new(HealthConfig::default());
        let a = paths
            .add(PathSpec {
                name: "a".into(),
                priority: 1,
                weight: 1,
                ..Default::default()
            })
            .unwrap();
        let b = paths.add(spec_b).unwrap();
        paths.connected(a, t0);
        paths.connected(b, t0);
        let packets: Vec<Vec<u8>> = (0..flows)
            .map(|f| tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1000 + f as u16, 80, None))
            .collect();
        let infos: Vec<PacketInfo> = packets
            .iter()
            .map(|p| PacketInfo::parse(p).unwrap())
            .collect();
        let mut spill = Spill::default();
        let mut on = vec![a; flows];
        let mut credit = vec![0u64; flows];
        let mut probes = Vec::new();
        let mut now = t0;
        while now < t0 + Duration::from_secs(secs) {
            paths.poll(now, &mut probes, &mut Vec::new());
            for p in probes.drain(..) {
                paths.on_probe_reply(p.path, p.seq, None, now);
            }
            let count = |p: PathId| on.iter().filter(|&&x| x == p).count() as u64;
            let (na, nb) = (count(a), count(b));
            for f in 0..flows {
                let (cap, n) = match on[f] == a {
                    true => (caps[0], na),
                    false => (caps[1], nb),
                };
                credit[f] += cap / 8 * STEP.as_millis() as u64 / 1000 / n.max(1);
                while credit[f] >= 1200 {
                    credit[f] -= 1200;
                    let to = spill.pick(&paths, a, Some(&infos[f]), 1200, now);
                    paths.count_tx(to, 1200, now);
                    on[f] = to;
                }
            }
            now += STEP;
        }
        let count = |p: PathId| on.iter().filter(|&&x| x == p).count();
        ([count(a), count(b)], spill.moved_to.iter().sum())
    }

    fn b(priority: u32) -> PathSpec {
        PathSpec {
            name: "b".into(),
            priority,
            weight: 1,
            ..Default::default()
        }
    }

    #[test]
    fn sixteen_flows_share_two_links_by_what_each_carries() {
        // 30 + 10 Mbit/s: a quarter of the flows (4) on b gives each flow the same.
        let ([on_a, on_b], moves) = run([30_000_000, 10_000_000], 16, 15, b(1));
        assert!((3..=5).contains(&on_b), "{on_a} / {on_b}");
        assert!(moves <= 8, "{moves} moves");
        // The other way round: most go to b.
        let ([on_a, on_b], _) = run([10_000_000, 30_000_000], 16, 15, b(1));
        assert!((3..=5).contains(&on_a), "{on_a} / {on_b}");
        // A small link beside a large one keeps the one flow that fills it, though that flow
        // gets more than the others.
        let ([on_a, on_b], _) = run([100_000_000, 8_000_000], 16, 15, b(1));
        assert_eq!((on_a, on_b), (15, 1));
    }

    #[test]
    fn one_flow_and_other_ranks_stay_on_the_best_path() {
        assert_eq!(run([30_000_000, 10_000_000], 1, 10, b(1)), ([1, 0], 0));
        // A path of another priority, a backup, a metered or rate-limited one: no flow moves.
        assert_eq!(run([30_000_000, 10_000_000], 8, 10, b(2)).0, [8, 0]);
        let backup = PathSpec {
            role: Role::Backup,
            ..b(1)
        };
        assert_eq!(run([30_000_000, 10_000_000], 8, 10, backup).0, [8, 0]);
        let metered = PathSpec {
            metered: true,
            ..b(1)
        };
        assert_eq!(run([30_000_000, 10_000_000], 8, 10, metered).0, [8, 0]);
        let limited = PathSpec {
            rate_limit: Some(5_000_000),
            ..b(1)
        };
        assert_eq!(run([30_000_000, 10_000_000], 8, 10, limited).0, [8, 0]);
    }

    #[test]
    fn a_path_that_carries_little_is_tried_once_and_left_alone() {
        // b carries 0.2 Mbit/s: the flow tried there comes back, and b is not tried again
        // within `SHUN`.
        let ([on_a, on_b], moves) = run([30_000_000, 200_000], 4, 20, b(1));
        assert_eq!((on_a, on_b), (4, 0));
        assert_eq!(moves, 2, "tried once, moved back once");
    }
}
