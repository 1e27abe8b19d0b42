//! Schedulers: the policy that picks a path of a `PathSet` for each inner packet. A new policy is
//! a new implementation of `Scheduler`, registered in `Policy`; the bond and the shells do not
//! change.

use std::time::{Duration, Instant};

use crate::flow::FlowTable;
use crate::packet::PacketInfo;
use crate::paths::{PathId, PathSet};

/// The policies a config can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// All traffic on the best (lowest `priority`) path that is up.
    Failover,
    /// Flows spread over the up paths of the best priority, in proportion to `weight`;
    /// a flow stays on its path (no reordering) until that path goes down.
    Balanced,
}

impl Policy {
    pub const ALL: [Policy; 2] = [Policy::Failover, Policy::Balanced];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Failover => "failover",
            Policy::Balanced => "balanced",
        }
    }
    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL.into_iter().find(|p| p.as_str() == s)
    }
    /// A fresh scheduler implementing this policy.
    pub fn scheduler(self) -> Box<dyn Scheduler> {
        match self {
            Policy::Failover => Box::new(Failover),
            Policy::Balanced => Box::new(Balanced::new()),
        }
    }
}

pub trait Scheduler: std::fmt::Debug + Send {
    fn policy(&self) -> Policy;
    /// The path for an inner packet (`info`: its parsed headers, `None` when unparsable), among
    /// `paths.candidates()`. `None` only when there is no candidate.
    fn pick(&mut self, paths: &PathSet, info: Option<&PacketInfo>, now: Instant) -> Option<PathId>;
    /// Packets placed on `path` earlier must be placed afresh (it went down, lost or replaced
    /// its connection).
    fn release(&mut self, _path: PathId) {}
    /// Housekeeping; called at least once a second while the tunnel runs.
    fn poll(&mut self, _now: Instant) {}
    /// Flows currently placed on `path` (status).
    fn flows_on(&self, _path: PathId) -> usize {
        0
    }
}

fn best_priority(paths: &PathSet) -> Option<u32> {
    paths.candidates().map(|i| paths.get(i).spec.priority).min()
}

fn best_by_priority(paths: &PathSet) -> Option<PathId> {
    paths
        .candidates()
        .min_by_key(|&i| (paths.get(i).spec.priority, i))
}

#[derive(Debug)]
pub struct Failover;

impl Scheduler for Failover {
    fn policy(&self) -> Policy {
        Policy::Failover
    }
    fn pick(&mut self, paths: &PathSet, _: Option<&PacketInfo>, _: Instant) -> Option<PathId> {
        best_by_priority(paths)
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

impl Scheduler for Balanced {
    fn policy(&self) -> Policy {
        Policy::Balanced
    }

    fn pick(&mut self, paths: &PathSet, info: Option<&PacketInfo>, now: Instant) -> Option<PathId> {
        let prio = best_priority(paths)?;
        let Some(info) = info else {
            return best_by_priority(paths);
        };
        let key = info.flow_hash();
        if let Some(p) = self.flows.lookup(key, now) {
            if paths.candidates().any(|c| c == p) {
                return Some(p);
            }
        }
        // Place a new flow on the eligible path furthest below its weighted share of the flows
        // (counting the new one): w_i/W * (F+1) - f_i, scaled by W to stay in integers. This keeps
        // every path within one flow of its exact share, which "fewest flows per weight" does not.
        let flows = &self.flows;
        let eligible: Vec<PathId> = paths
            .candidates()
            .filter(|&i| paths.get(i).spec.priority == prio)
            .collect();
        let weight = |i: PathId| i128::from(paths.get(i).spec.weight.max(1));
        let total_w: i128 = eligible.iter().map(|&i| weight(i)).sum();
        let total_f: i128 = eligible.iter().map(|&i| flows.flows_on(i) as i128).sum();
        let chosen = eligible.iter().copied().max_by(|&a, &b| {
            let deficit =
                |i: PathId| weight(i) * (total_f + 1) - flows.flows_on(i) as i128 * total_w;
            // Ties go to the heavier weight, then to the lower index.
            deficit(a)
                .cmp(&deficit(b))
                .then(weight(a).cmp(&weight(b)))
                .then(b.cmp(&a))
        })?;
        self.flows.assign(key, chosen, now);
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
