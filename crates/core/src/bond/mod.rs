//! A bond: one stream of inner packets scheduled over a `PathSet`. It owns the scheduler (the
//! policy) and the drops that belong to no path; the paths themselves, their health and their
//! counters live in the `PathSet`, which several bonds (traffic classes) may share. Both the
//! client and the server drive their bonds with the same code.
//!
//! Beside the bond: `scheduler` (the policies), `flow` (the flow table that pins flows to
//! paths), `spill` (bulk flows shared out over paths of equal rank under `failover`), `copies` (second copies of small real-time packets where one path would lose them),
//! `router` (one tunnel's path set and the lanes that schedule over it).

pub mod copies;
pub mod flow;
pub mod router;
pub mod scheduler;
pub mod spill;

use std::time::{Duration, Instant};

use crate::bond::copies::{Copies, Why};
use crate::bond::scheduler::{Policy, Scheduler};
use crate::drops::{DropReason, Drops};
use crate::packet::PacketInfo;
use crate::path::{PathId, PathSet, Transition};
use crate::reorder::reseq::Sequencer;

/// How often the scheduler's housekeeping (flow expiry) runs.
const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// Where an inner packet goes: its path, and for per-packet policies its flow slot and
/// sequence number (`wire::BOND_DATA`), which must reach the peer with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub path: PathId,
    /// A second path for a copy of the packet: `redundant`'s, or a small packet's copy
    /// (`copies`: around a Starlink path's reconfiguration, or while `path` loses).
    pub also: Option<PathId>,
    /// `also` carries the traffic as much as `path` (`redundant`), rather than a copy alone:
    /// only then does it count as having data in flight there (its ACK watch, its hand-over).
    pub also_carries: bool,
    pub seq: Option<(u16, u32)>,
}

#[derive(Debug)]
pub struct Bond {
    scheduler: Box<dyn Scheduler>,
    /// Each flow's packets numbered for the receiver's resequencer: every packet under a
    /// per-packet policy, the copied ones under any other (made at the first packet numbered).
    sequencer: Option<Sequencer>,
    /// Drops not attributable to one path (no path, malformed input...).
    pub drops: Drops,
    last_housekeeping: Option<Instant>,
    /// Second copies of small real-time packets (not under the per-packet policies, which
    /// spread every packet already and number them all).
    copies: Copies,
}

impl Bond {
    pub fn new(policy: Policy) -> Self {
        Bond {
            scheduler: policy.scheduler(),
            sequencer: None,
            drops: Drops::default(),
            last_housekeeping: None,
            copies: Copies::default(),
        }
    }

    pub fn policy(&self) -> Policy {
        self.scheduler.policy()
    }

    /// Schedule by `policy` from now on (a reload): a fresh scheduler (flows are placed
    /// anew), the same drops and numbering. Refused between a per-packet policy and another:
    /// the peer's resequencer and the packets' header (and so the TUN MTU) depend on it.
    pub fn set_policy(&mut self, policy: Policy) -> Result<(), String> {
        let now = self.policy();
        if policy.per_packet() != now.per_packet() {
            return Err(format!(
                "multipath_policy {} -> {}: between a per-packet policy (wlb, minrtt, redundant) and another needs a restart",
                now.as_str(),
                policy.as_str()
            ));
        }
        if policy != now {
            self.scheduler = policy.scheduler();
        }
        Ok(())
    }

    /// Flows the scheduler has placed on `path` (status).
    pub fn flows_on(&self, path: PathId) -> usize {
        self.scheduler.flows_on(path)
    }

    /// Flows the scheduler moved onto `path` while they ran (status; `spill`).
    pub fn flows_moved_to(&self, path: PathId) -> u64 {
        self.scheduler.flows_moved_to(path)
    }

    /// Choose the path for an inner packet of `len` bytes and count it as sent there. `None`
    /// (counted as `no_path`) when no path is connected.
    pub fn route(
        &mut self,
        paths: &mut PathSet,
        info: Option<&PacketInfo>,
        len: usize,
        now: Instant,
    ) -> Option<Route> {
        let Some(path) = self.scheduler.pick(paths, info, len, now) else {
            self.drops.add(DropReason::NoPath);
            return None;
        };
        paths.count_tx(path, len, now);
        let redundant = self.scheduler.also(paths, path);
        let also = match redundant {
            Some(second) => {
                paths.count_tx(second, len, now);
                Some(second)
            }
            None => {
                let copy = match self.policy().per_packet() {
                    true => copies::near_boundary_path(paths, path, info, len, now)
                        .map(|p| (p, Why::Reconfig)),
                    false => self.copies.path(paths, path, info, len, now),
                };
                copy.map(|(second, why)| {
                    paths.count_copy(path, second, why, len);
                    second
                })
            }
        };
        // A per-packet policy numbers every packet; any other numbers the packets it copies
        // (`copies`), so that the receiver keeps the first copy only.
        let numbered = self.policy().per_packet() || also.is_some();
        let seq = numbered.then(|| {
            let slot = Sequencer::slot(info.map(PacketInfo::flow_hash));
            (self.sequencer.get_or_insert_with(Sequencer::default)).next(slot, now)
        });
        Some(Route {
            path,
            also,
            also_carries: redundant.is_some(),
            seq,
        })
    }

    /// A path changed state: placements on a path that is no longer up are forgotten.
    pub fn on_transition(&mut self, t: &Transition) {
        if t.invalidates_placements() {
            self.scheduler.release(t.path);
        }
    }

    /// Housekeeping, at most once a second however often it is called.
    pub fn poll(&mut self, now: Instant) {
        if self
            .last_housekeeping
            .is_none_or(|t| now >= t + HOUSEKEEPING)
        {
            self.scheduler.poll(now);
            self.last_housekeeping = Some(now);
        }
    }

    /// When `poll` next has work (housekeeping), if it has been called before.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.last_housekeeping.map(|t| t + HOUSEKEEPING)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_changes_within_its_kind_only() {
        let mut b = Bond::new(Policy::Failover);
        b.drops.add(DropReason::NoPath);
        assert_eq!(b.set_policy(Policy::Balanced), Ok(()));
        assert_eq!(b.policy(), Policy::Balanced);
        assert_eq!(b.drops.get(DropReason::NoPath), 1, "drops kept");
        assert!(b.set_policy(Policy::Wlb).is_err());
        assert_eq!(b.policy(), Policy::Balanced);
        let mut b = Bond::new(Policy::Wlb);
        assert_eq!(b.set_policy(Policy::MinRtt), Ok(()));
        assert!(b.policy().per_packet());
        assert!(b.set_policy(Policy::Failover).is_err());
    }
}
