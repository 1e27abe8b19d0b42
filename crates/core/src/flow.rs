//! Flow table: remembers which path each inner flow (5-tuple hash) was given, so a TCP flow keeps
//! one path (no reordering) until that path goes down or the flow goes idle. Bounded: when full,
//! the stalest entry is evicted.

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Entry {
    path: usize,
    last_seen: Instant,
}

#[derive(Debug)]
pub struct FlowTable {
    entries: HashMap<u64, Entry>,
    idle_timeout: Duration,
    capacity: usize,
    /// Active flows per path index, kept in step with `entries`.
    per_path: Vec<usize>,
    pub evictions: u64,
}

impl FlowTable {
    pub fn new(idle_timeout: Duration, capacity: usize) -> Self {
        FlowTable {
            entries: HashMap::new(),
            idle_timeout,
            capacity: capacity.max(1),
            per_path: Vec::new(),
            evictions: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Flows currently pinned to `path`.
    pub fn flows_on(&self, path: usize) -> usize {
        self.per_path.get(path).copied().unwrap_or(0)
    }

    /// The path a flow is pinned to, refreshing its idle timer.
    pub fn lookup(&mut self, key: u64, now: Instant) -> Option<usize> {
        let e = self.entries.get_mut(&key)?;
        e.last_seen = now;
        Some(e.path)
    }

    pub fn assign(&mut self, key: u64, path: usize, now: Instant) {
        if !self.entries.contains_key(&key) && self.entries.len() >= self.capacity {
            self.evict_stalest();
        }
        if let Some(old) = self.entries.insert(
            key,
            Entry {
                path,
                last_seen: now,
            },
        ) {
            self.dec(old.path);
        }
        if self.per_path.len() <= path {
            self.per_path.resize(path + 1, 0);
        }
        self.per_path[path] += 1;
    }

    /// Drop flows idle for longer than the idle timeout.
    pub fn expire(&mut self, now: Instant) {
        let timeout = self.idle_timeout;
        let per_path = &mut self.per_path;
        self.entries.retain(|_, e| {
            let keep = now.saturating_duration_since(e.last_seen) <= timeout;
            if !keep {
                per_path[e.path] -= 1;
            }
            keep
        });
    }

    /// Forget every flow on `path` (it went down or away), so they are placed afresh.
    pub fn release_path(&mut self, path: usize) {
        self.entries.retain(|_, e| e.path != path);
        if let Some(n) = self.per_path.get_mut(path) {
            *n = 0;
        }
    }

    fn dec(&mut self, path: usize) {
        self.per_path[path] -= 1;
    }

    fn evict_stalest(&mut self) {
        if let Some((&k, _)) = self.entries.iter().min_by_key(|(_, e)| e.last_seen) {
            let e = self.entries.remove(&k).expect("key just seen");
            self.dec(e.path);
            self.evictions += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_expires_and_bounds() {
        let t0 = Instant::now();
        let mut ft = FlowTable::new(Duration::from_secs(10), 2);
        ft.assign(1, 0, t0);
        ft.assign(2, 1, t0 + Duration::from_secs(1));
        assert_eq!(ft.lookup(1, t0 + Duration::from_secs(2)), Some(0));
        ft.assign(3, 1, t0 + Duration::from_secs(3)); // evicts flow 2 (stalest)
        assert_eq!(ft.len(), 2);
        assert_eq!(ft.evictions, 1);
        assert_eq!(ft.flows_on(1), 1);
        ft.expire(t0 + Duration::from_millis(12_500));
        assert_eq!(ft.len(), 1);
        assert_eq!(ft.flows_on(0), 0);
        ft.release_path(1);
        assert!(ft.is_empty());
        assert_eq!(ft.flows_on(1), 0);
    }
}
