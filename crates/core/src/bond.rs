//! A bond: the set of paths of one tunnel, their health, and the policy that picks a path for each
//! inner packet. Both the client and the server drive one `Bond` per tunnel with the same code:
//! the client from its config, the server from the path descriptions the client sends in its hello.

use std::time::{Duration, Instant};

use crate::drops::{DropReason, Drops};
use crate::flow::FlowTable;
use crate::health::{HealthConfig, PathHealth, PathState};
use crate::packet::PacketInfo;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// All traffic on the best (lowest `priority`) path that is up.
    Failover,
    /// Flows spread over the up paths of the best priority, in proportion to `weight`;
    /// a flow stays on its path (no reordering) until that path goes down.
    Balanced,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Failover => "failover",
            Policy::Balanced => "balanced",
        }
    }
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "failover" => Some(Policy::Failover),
            "balanced" => Some(Policy::Balanced),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathSpec {
    pub name: String,
    pub priority: u32,
    pub weight: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathCounters {
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub rx_bytes: u64,
}

#[derive(Debug)]
pub struct Path {
    pub spec: PathSpec,
    /// `None` while the path has no live connection.
    pub health: Option<PathHealth>,
    pub counters: PathCounters,
    pub drops: Drops,
    /// Times a new connection was installed on this path.
    pub connects: u64,
}

impl Path {
    pub fn state(&self) -> Option<PathState> {
        self.health.as_ref().map(|h| h.state())
    }
    fn is_up(&self) -> bool {
        self.state() == Some(PathState::Up)
    }
}

/// A probe the shell must send on `path` with sequence number `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeDue {
    pub path: usize,
    pub seq: u32,
}

/// A path changed state; the shell logs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub path: usize,
    pub from: Option<PathState>,
    pub to: Option<PathState>,
}

const FLOW_IDLE: Duration = Duration::from_secs(60);
const FLOW_CAPACITY: usize = 65_536;

#[derive(Debug)]
pub struct Bond {
    policy: Policy,
    health_cfg: HealthConfig,
    paths: Vec<Path>,
    flows: FlowTable,
    /// Drops not attributable to one path (no path, malformed input...).
    pub drops: Drops,
    last_expire: Option<Instant>,
}

impl Bond {
    pub fn new(policy: Policy, health_cfg: HealthConfig) -> Self {
        Bond {
            policy,
            health_cfg,
            paths: Vec::new(),
            flows: FlowTable::new(FLOW_IDLE, FLOW_CAPACITY),
            drops: Drops::default(),
            last_expire: None,
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Add a path slot (not yet connected). Path indices are stable for the bond's lifetime.
    pub fn add_path(&mut self, spec: PathSpec) -> usize {
        self.paths.push(Path {
            spec,
            health: None,
            counters: PathCounters::default(),
            drops: Drops::default(),
            connects: 0,
        });
        self.paths.len() - 1
    }

    /// Update a path's priority/weight (the server learns them from each hello).
    pub fn set_spec(&mut self, path: usize, spec: PathSpec) {
        self.paths[path].spec = spec;
    }

    pub fn paths(&self) -> &[Path] {
        &self.paths
    }
    pub fn path_mut(&mut self, path: usize) -> &mut Path {
        &mut self.paths[path]
    }
    pub fn find(&self, name: &str) -> Option<usize> {
        self.paths.iter().position(|p| p.spec.name == name)
    }
    pub fn flows(&self) -> &FlowTable {
        &self.flows
    }

    /// A new connection now carries `path`: health starts afresh.
    pub fn connected(&mut self, path: usize, now: Instant) {
        let p = &mut self.paths[path];
        p.health = Some(PathHealth::new(self.health_cfg, now));
        p.connects += 1;
        self.flows.release_path(path);
    }

    /// The path's connection is gone.
    pub fn disconnected(&mut self, path: usize) {
        self.paths[path].health = None;
        self.flows.release_path(path);
    }

    /// Advance time: collects due probes into `probes` and state changes into `changes`.
    pub fn poll(
        &mut self,
        now: Instant,
        probes: &mut Vec<ProbeDue>,
        changes: &mut Vec<Transition>,
    ) {
        for (i, p) in self.paths.iter_mut().enumerate() {
            let Some(h) = p.health.as_mut() else { continue };
            let before = h.state();
            if let Some(seq) = h.poll(now) {
                probes.push(ProbeDue { path: i, seq });
            }
            if h.state() != before {
                changes.push(Transition {
                    path: i,
                    from: Some(before),
                    to: Some(h.state()),
                });
            }
        }
        for c in changes.iter() {
            if c.to == Some(PathState::Down) {
                self.flows.release_path(c.path);
            }
        }
        if self
            .last_expire
            .is_none_or(|t| now >= t + Duration::from_secs(1))
        {
            self.flows.expire(now);
            self.last_expire = Some(now);
        }
    }

    /// The earliest time `poll` has work to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.paths
            .iter()
            .filter_map(|p| p.health.as_ref().map(|h| h.next_deadline()))
            .min()
    }

    /// A reply to our probe arrived on `path`. Returns a transition if the path changed state.
    pub fn on_probe_reply(&mut self, path: usize, seq: u32, now: Instant) -> Option<Transition> {
        let h = self.paths.get_mut(path)?.health.as_mut()?;
        let before = h.state();
        h.on_reply(seq, now);
        (h.state() != before).then_some(Transition {
            path,
            from: Some(before),
            to: Some(h.state()),
        })
    }

    /// Choose the path for an inner packet of `len` bytes and count it as sent there. `None`
    /// (counted as `no_path`) when no path is connected.
    pub fn route(&mut self, info: Option<&PacketInfo>, len: usize, now: Instant) -> Option<usize> {
        let chosen = match self.policy {
            Policy::Failover => self.best_by_priority(),
            Policy::Balanced => self.balanced(info, now),
        };
        match chosen {
            Some(i) => {
                let c = &mut self.paths[i].counters;
                c.tx_packets += 1;
                c.tx_bytes += len as u64;
            }
            None => self.drops.add(DropReason::NoPath),
        }
        chosen
    }

    /// Count a packet received from the peer on `path`.
    pub fn on_received(&mut self, path: usize, len: usize) {
        if let Some(p) = self.paths.get_mut(path) {
            p.counters.rx_packets += 1;
            p.counters.rx_bytes += len as u64;
        }
    }

    /// A packet of `len` bytes the policy had placed on `path` could not be sent.
    pub fn drop_tx(&mut self, path: usize, len: usize, reason: DropReason) {
        if let Some(p) = self.paths.get_mut(path) {
            p.drops.add(reason);
            p.counters.tx_packets = p.counters.tx_packets.saturating_sub(1);
            p.counters.tx_bytes = p.counters.tx_bytes.saturating_sub(len as u64);
        }
    }

    /// A packet received on `path` was refused (spoofed source, malformed, TUN full...).
    pub fn drop_rx(&mut self, path: usize, reason: DropReason) {
        if let Some(p) = self.paths.get_mut(path) {
            p.drops.add(reason);
        }
    }

    /// How long `path` has been unusable: down, or connected but never answered. `None` when it
    /// is up or has no connection (the shell reconnects on a long unusable spell).
    pub fn unusable_for(&self, path: usize, now: Instant) -> Option<Duration> {
        let h = self.paths.get(path)?.health.as_ref()?;
        (h.state() != PathState::Up).then(|| now.saturating_duration_since(h.since()))
    }

    /// Paths eligible for traffic: those that are up or, when none is, any connected path
    /// (a best effort: a mis-judged path is better than a certain black hole).
    fn candidates(&self) -> impl Iterator<Item = usize> + '_ {
        let any_up = self.paths.iter().any(Path::is_up);
        self.paths
            .iter()
            .enumerate()
            .filter(move |(_, p)| {
                if any_up {
                    p.is_up()
                } else {
                    p.health.is_some()
                }
            })
            .map(|(i, _)| i)
    }

    fn best_priority(&self) -> Option<u32> {
        self.candidates().map(|i| self.paths[i].spec.priority).min()
    }

    fn best_by_priority(&self) -> Option<usize> {
        self.candidates()
            .min_by_key(|&i| (self.paths[i].spec.priority, i))
    }

    fn balanced(&mut self, info: Option<&PacketInfo>, now: Instant) -> Option<usize> {
        let prio = self.best_priority()?;
        let Some(info) = info else {
            return self.best_by_priority();
        };
        let key = info.flow_hash();
        if let Some(p) = self.flows.lookup(key, now) {
            if self.candidates().any(|c| c == p) {
                return Some(p);
            }
        }
        // Place a new flow on the eligible path furthest below its weighted share of the flows
        // (counting the new one): w_i/W * (F+1) - f_i, scaled by W to stay in integers. This keeps
        // every path within one flow of its exact share, which "fewest flows per weight" does not.
        let flows = &self.flows;
        let paths = &self.paths;
        let eligible: Vec<usize> = self
            .candidates()
            .filter(|&i| paths[i].spec.priority == prio)
            .collect();
        let weight = |i: usize| i128::from(paths[i].spec.weight.max(1));
        let total_w: i128 = eligible.iter().map(|&i| weight(i)).sum();
        let total_f: i128 = eligible.iter().map(|&i| flows.flows_on(i) as i128).sum();
        let chosen = eligible.iter().copied().max_by(|&a, &b| {
            let deficit =
                |i: usize| weight(i) * (total_f + 1) - flows.flows_on(i) as i128 * total_w;
            // Ties go to the heavier weight, then to the lower index.
            deficit(a)
                .cmp(&deficit(b))
                .then(weight(a).cmp(&weight(b)))
                .then(b.cmp(&a))
        })?;
        self.flows.assign(key, chosen, now);
        Some(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;

    fn spec(name: &str, priority: u32, weight: u32) -> PathSpec {
        PathSpec {
            name: name.into(),
            priority,
            weight,
        }
    }

    fn up_all(b: &mut Bond, now: Instant) {
        let mut probes = Vec::new();
        b.poll(now, &mut probes, &mut Vec::new());
        for p in probes {
            b.on_probe_reply(p.path, p.seq, now);
        }
    }

    #[test]
    fn failover_prefers_lowest_priority_up_path() {
        let t0 = Instant::now();
        let mut b = Bond::new(Policy::Failover, HealthConfig::default());
        let p1 = b.add_path(spec("wan1", 2, 1));
        let p0 = b.add_path(spec("wan0", 1, 1));
        assert_eq!(b.route(None, 100, t0), None);
        assert_eq!(b.drops.get(DropReason::NoPath), 1);
        b.connected(p1, t0);
        // Only a probing path: best effort.
        assert_eq!(b.route(None, 100, t0), Some(p1));
        b.connected(p0, t0);
        up_all(&mut b, t0);
        assert_eq!(b.route(None, 100, t0), Some(p0));
        b.disconnected(p0);
        assert_eq!(b.route(None, 100, t0), Some(p1));
    }

    #[test]
    fn balanced_places_flows_by_weight_and_pins_them() {
        let t0 = Instant::now();
        let mut b = Bond::new(Policy::Balanced, HealthConfig::default());
        let a = b.add_path(spec("a", 1, 2));
        let c = b.add_path(spec("c", 1, 1));
        b.connected(a, t0);
        b.connected(c, t0);
        up_all(&mut b, t0);
        let mut placed = [0usize; 2];
        for port in 0..9u16 {
            let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1000 + port, 80, None);
            let info = PacketInfo::parse(&pkt).unwrap();
            let first = b.route(Some(&info), pkt.len(), t0).unwrap();
            for _ in 0..5 {
                assert_eq!(
                    b.route(Some(&info), pkt.len(), t0),
                    Some(first),
                    "flow pinned"
                );
            }
            placed[first] += 1;
        }
        assert_eq!(placed, [6, 3]);
    }

    #[test]
    fn balanced_keeps_backup_priority_out_until_needed() {
        let t0 = Instant::now();
        let mut b = Bond::new(Policy::Balanced, HealthConfig::default());
        let a = b.add_path(spec("a", 1, 1));
        let backup = b.add_path(spec("backup", 2, 1));
        b.connected(a, t0);
        b.connected(backup, t0);
        up_all(&mut b, t0);
        for port in 0..4u16 {
            let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], port, 80, None);
            let info = PacketInfo::parse(&pkt).unwrap();
            assert_eq!(b.route(Some(&info), 60, t0), Some(a));
        }
        b.disconnected(a);
        let pkt = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 0, 80, None);
        let info = PacketInfo::parse(&pkt).unwrap();
        assert_eq!(b.route(Some(&info), 60, t0), Some(backup));
    }
}
