//! Flow table: remembers which path each inner flow (5-tuple hash) was given, so a TCP flow keeps
//! one path (no reordering) until that path goes down or the flow goes idle. Bounded: when full,
//! the least recently used flow is evicted.
//!
//! The flows are kept in a doubly linked list in use order (in a slab, no allocation per flow
//! once warm), so both eviction and idle expiry take the list's head: O(1) per flow, never a scan
//! of the table for a new flow.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::path::PathId;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    key: u64,
    path: PathId,
    last_seen: Instant,
    /// Bytes the flow sent since the last `mark_bulk`; whether it sent enough in the interval
    /// before that (`warm`), and in the two before that (`bulk`: a flow that keeps sending,
    /// `spill`).
    bytes: u64,
    warm: bool,
    bulk: bool,
    prev: u32,
    next: u32,
}

/// What `lookup_sending` found of a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub path: PathId,
    pub idle: Duration,
    pub bulk: bool,
}

#[derive(Debug)]
pub struct FlowTable {
    index: HashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Least recently used first.
    head: u32,
    tail: u32,
    idle_timeout: Duration,
    capacity: usize,
    /// Active flows per path index, kept in step with the list.
    per_path: Vec<usize>,
    pub evictions: u64,
}

impl FlowTable {
    pub fn new(idle_timeout: Duration, capacity: usize) -> Self {
        FlowTable {
            index: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            idle_timeout,
            capacity: capacity.clamp(1, NIL as usize - 1),
            per_path: Vec::new(),
            evictions: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Flows currently pinned to `path`.
    pub fn flows_on(&self, path: PathId) -> usize {
        self.per_path.get(path.index()).copied().unwrap_or(0)
    }

    /// The path a flow is pinned to, refreshing its idle timer.
    pub fn lookup(&mut self, key: u64, now: Instant) -> Option<PathId> {
        self.lookup_idle(key, now).map(|(p, _)| p)
    }

    /// The path a flow is pinned to and how long it had been idle, refreshing its idle timer.
    pub fn lookup_idle(&mut self, key: u64, now: Instant) -> Option<(PathId, Duration)> {
        let i = *self.index.get(&key)?;
        let n = &mut self.nodes[i as usize];
        let idle = now.saturating_duration_since(n.last_seen);
        n.last_seen = now;
        let path = n.path;
        self.move_to_tail(i);
        Some((path, idle))
    }

    /// The path a flow is pinned to, how long it had been idle and whether it is a bulk
    /// flow (`mark_bulk`); refreshes its idle timer and adds `len` bytes to what it sent.
    pub fn lookup_sending(&mut self, key: u64, len: usize, now: Instant) -> Option<Seen> {
        let i = *self.index.get(&key)?;
        let n = &mut self.nodes[i as usize];
        let seen = Seen {
            path: n.path,
            idle: now.saturating_duration_since(n.last_seen),
            bulk: n.bulk,
        };
        n.last_seen = now;
        n.bytes += len as u64;
        self.move_to_tail(i);
        Some(seen)
    }

    /// Marks as bulk the flows that sent at least `min_bytes` since the last call and in the
    /// interval before it (and the others not: a short transfer is not bulk however fast),
    /// starts counting again, and returns how many bulk flows each path has (indexed by
    /// `PathId::index`). A scan of the table: call it once per interval.
    pub fn mark_bulk(&mut self, min_bytes: u64) -> Vec<usize> {
        let mut per_path = vec![0; self.per_path.len()];
        let mut i = self.head;
        while i != NIL {
            let n = &mut self.nodes[i as usize];
            let sent = n.bytes >= min_bytes;
            n.bulk = sent && n.warm;
            n.warm = sent;
            n.bytes = 0;
            if n.bulk {
                per_path[n.path.index()] += 1;
            }
            i = n.next;
        }
        per_path
    }

    pub fn assign(&mut self, key: u64, path: PathId, now: Instant) {
        if let Some(&i) = self.index.get(&key) {
            let old = self.nodes[i as usize].path;
            self.dec(old);
            self.nodes[i as usize].path = path;
            self.nodes[i as usize].last_seen = now;
            self.move_to_tail(i);
        } else {
            if self.index.len() >= self.capacity {
                self.remove(self.head);
                self.evictions += 1;
            }
            let node = Node {
                key,
                path,
                last_seen: now,
                bytes: 0,
                warm: false,
                bulk: false,
                prev: NIL,
                next: NIL,
            };
            let i = match self.free.pop() {
                Some(i) => {
                    self.nodes[i as usize] = node;
                    i
                }
                None => {
                    self.nodes.push(node);
                    (self.nodes.len() - 1) as u32
                }
            };
            self.index.insert(key, i);
            self.link_tail(i);
        }
        if self.per_path.len() <= path.index() {
            self.per_path.resize(path.index() + 1, 0);
        }
        self.per_path[path.index()] += 1;
    }

    /// Drop flows idle for longer than the idle timeout.
    pub fn expire(&mut self, now: Instant) {
        while self.head != NIL {
            let n = &self.nodes[self.head as usize];
            if now.saturating_duration_since(n.last_seen) <= self.idle_timeout {
                break;
            }
            self.remove(self.head);
        }
    }

    /// Forget every flow on `path` (it went down or away), so they are placed afresh. A scan,
    /// but only on a path event.
    pub fn release_path(&mut self, path: PathId) {
        let mut i = self.head;
        while i != NIL {
            let next = self.nodes[i as usize].next;
            if self.nodes[i as usize].path == path {
                self.remove(i);
            }
            i = next;
        }
    }

    fn dec(&mut self, path: PathId) {
        self.per_path[path.index()] -= 1;
    }

    fn remove(&mut self, i: u32) {
        let n = self.nodes[i as usize];
        self.unlink(i);
        self.index.remove(&n.key);
        self.dec(n.path);
        self.free.push(i);
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn link_tail(&mut self, i: u32) {
        self.nodes[i as usize].prev = self.tail;
        self.nodes[i as usize].next = NIL;
        match self.tail {
            NIL => self.head = i,
            t => self.nodes[t as usize].next = i,
        }
        self.tail = i;
    }

    fn move_to_tail(&mut self, i: u32) {
        if self.tail != i {
            self.unlink(i);
            self.link_tail(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::path::{PathSet, PathSpec};

    fn ids(n: usize) -> Vec<PathId> {
        let mut s = PathSet::new(Default::default());
        (0..n)
            .map(|i| {
                s.add(PathSpec {
                    name: format!("p{i}"),
                    priority: 1,
                    weight: 1,
                    ..Default::default()
                })
                .unwrap()
            })
            .collect()
    }

    #[test]
    fn pins_expires_and_bounds() {
        let p = ids(2);
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut ft = FlowTable::new(s(10), 2);
        ft.assign(1, p[0], t0);
        ft.assign(2, p[1], t0 + s(1));
        assert_eq!(ft.lookup(1, t0 + s(2)), Some(p[0]));
        ft.assign(3, p[1], t0 + s(3)); // evicts flow 2 (least recently used)
        assert_eq!(ft.len(), 2);
        assert_eq!(ft.evictions, 1);
        assert_eq!(ft.lookup(2, t0 + s(3)), None);
        assert_eq!(ft.flows_on(p[1]), 1);
        ft.expire(t0 + Duration::from_millis(12_500));
        assert_eq!(ft.len(), 1);
        assert_eq!(ft.flows_on(p[0]), 0);
        ft.release_path(p[1]);
        assert!(ft.is_empty());
        assert_eq!(ft.flows_on(p[1]), 0);
    }

    #[test]
    fn reassigning_moves_the_count_and_slots_are_reused() {
        let p = ids(2);
        let t0 = Instant::now();
        let mut ft = FlowTable::new(Duration::from_secs(10), 4);
        for k in 0..4 {
            ft.assign(k, p[0], t0);
        }
        ft.assign(2, p[1], t0);
        assert_eq!((ft.flows_on(p[0]), ft.flows_on(p[1])), (3, 1));
        ft.release_path(p[0]);
        assert_eq!(ft.len(), 1);
        for k in 10..13 {
            ft.assign(k, p[1], t0);
        }
        assert_eq!(ft.nodes.len(), 4, "freed slots reused");
        assert_eq!(ft.flows_on(p[1]), 4);
        // Full: the least recently used (flow 2, refreshed before the others were added) goes.
        ft.assign(20, p[0], t0);
        assert_eq!(ft.lookup(2, t0), None);
        assert_eq!(ft.len(), 4);
    }

    #[test]
    fn a_flow_is_bulk_after_two_intervals_of_sending() {
        let p = ids(2);
        let t0 = Instant::now();
        let mut ft = FlowTable::new(Duration::from_secs(10), 8);
        ft.assign(1, p[0], t0);
        ft.assign(2, p[1], t0);
        let send = |ft: &mut FlowTable, k: u64, n: usize| {
            for _ in 0..n {
                ft.lookup_sending(k, 1000, t0).unwrap();
            }
        };
        send(&mut ft, 1, 20);
        send(&mut ft, 2, 20);
        assert_eq!(
            ft.mark_bulk(10_000),
            vec![0, 0],
            "one interval is not enough"
        );
        send(&mut ft, 1, 20);
        send(&mut ft, 2, 5);
        assert_eq!(ft.mark_bulk(10_000), vec![1, 0]);
        assert!(ft.lookup_sending(1, 0, t0).unwrap().bulk);
        assert_eq!(ft.mark_bulk(10_000), vec![0, 0], "it stopped");
    }
}
