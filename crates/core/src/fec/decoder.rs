//! The receiving side of FEC on one path: remembers the recent groups' shards and rebuilds a
//! missing data packet as soon as any `k` of a group's `k + m` shards are in. Bounded whatever
//! arrives: at most `MAX_GROUPS` groups, `MAX_BYTES` of shards, each group for `MAX_AGE`.
//!
//! Data packets are delivered by the shell as they arrive; the decoder only says whether a
//! packet is new (a packet it already rebuilt, or a duplicate, is not delivered twice).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::codec::Codecs;
use super::encoder::LEN_PREFIX;
use super::{FecCounters, MAX_DATA, MAX_REPAIR};
use crate::wire::Repair;

/// Groups remembered at once: about 14 ms of groups of 10 at 1 Gbit/s, far longer at the
/// rates of the lossy links FEC is for. Older ones are let go first.
pub const MAX_GROUPS: usize = 128;
/// Shard bytes held at once, whatever the peer sends.
pub const MAX_BYTES: usize = 4 << 20;
/// A group is forgotten this long after its first shard arrived (its repairs follow its data
/// within `MAX_GROUP_DELAY` plus the path's reordering).
pub const MAX_AGE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
struct Group {
    id: u16,
    first: Instant,
    /// From its first repair: data count, repair count, shard length.
    shape: Option<(usize, usize, usize)>,
    /// Shards by index: data (unpadded `[len][packet]`), then repairs.
    data: Vec<Option<Vec<u8>>>,
    repair: Vec<Option<Vec<u8>>>,
    have_data: usize,
    have_repair: usize,
    bytes: usize,
    /// Every data packet is in (received or rebuilt): only a tombstone is kept, so late
    /// copies are recognised.
    done: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Decoder {
    groups: VecDeque<Group>,
    bytes: usize,
    codecs: Codecs,
    pub counters: FecCounters,
    /// Data packets received a second time (a duplicate, or one already rebuilt): not delivered.
    pub duplicates: u64,
}

impl Decoder {
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// Groups held now (for tests and status).
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// Shard bytes held now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// A data packet of `group` arrived. Returns whether to deliver it (false: already
    /// delivered, or it contradicts its group). Packets it makes recoverable go to `recovered`.
    pub fn on_data(
        &mut self,
        now: Instant,
        group: u16,
        index: u8,
        packet: &[u8],
        recovered: &mut Vec<Vec<u8>>,
    ) -> bool {
        let index = usize::from(index);
        if index >= MAX_DATA {
            self.counters.inconsistent += 1;
            return false;
        }
        let gi = self.group(now, group);
        let g = &mut self.groups[gi];
        if g.data[index].is_some() || (g.done && g.shape.is_some_and(|(k, _, _)| index < k)) {
            self.duplicates += 1;
            return false;
        }
        if g.done {
            // A group rebuilt or complete, and an index beyond its count: contradicts it.
            self.counters.inconsistent += 1;
            return false;
        }
        if let Some((k, _, len)) = g.shape {
            if index >= k || LEN_PREFIX + packet.len() > len {
                self.counters.inconsistent += 1;
                return false;
            }
        }
        let mut shard = Vec::with_capacity(LEN_PREFIX + packet.len());
        shard.extend_from_slice(&(packet.len() as u16).to_be_bytes());
        shard.extend_from_slice(packet);
        g.bytes += shard.len();
        self.bytes += shard.len();
        g.data[index] = Some(shard);
        g.have_data += 1;
        self.try_recover(gi, recovered);
        self.trim();
        true
    }

    /// A repair packet of `group` arrived; packets it makes recoverable go to `recovered`.
    pub fn on_repair(&mut self, now: Instant, r: &Repair<'_>, recovered: &mut Vec<Vec<u8>>) {
        let (group, shard) = (r.group, r.shard);
        let (index, k, m) = (usize::from(r.index), usize::from(r.k), usize::from(r.m));
        if k == 0 || k > MAX_DATA || m == 0 || m > MAX_REPAIR || index >= m || shard.len() <= 2 {
            self.counters.inconsistent += 1;
            return;
        }
        self.counters.repair_received += 1;
        let gi = self.group(now, group);
        let g = &mut self.groups[gi];
        if g.done {
            return;
        }
        match g.shape {
            None => {
                // The first repair fixes the shape; data already in must fit it.
                let fits = g
                    .data
                    .iter()
                    .enumerate()
                    .all(|(i, d)| d.as_ref().is_none_or(|d| i < k && d.len() <= shard.len()));
                if !fits {
                    self.counters.inconsistent += 1;
                    self.finish(gi);
                    return;
                }
                g.shape = Some((k, m, shard.len()));
            }
            Some(shape) if shape != (k, m, shard.len()) => {
                self.counters.inconsistent += 1;
                return;
            }
            Some(_) => {}
        }
        if g.repair[index].is_some() {
            return; // a duplicate repair
        }
        g.bytes += shard.len();
        self.bytes += shard.len();
        g.repair[index] = Some(shard.to_vec());
        g.have_repair += 1;
        self.try_recover(gi, recovered);
        self.trim();
    }

    /// Forget groups past `MAX_AGE` (counting what they left unrecovered). The shell calls
    /// this now and then; `on_data`/`on_repair` do it too.
    pub fn expire(&mut self, now: Instant) {
        while self
            .groups
            .front()
            .is_some_and(|g| now.saturating_duration_since(g.first) >= MAX_AGE)
        {
            self.pop_oldest();
        }
    }

    /// The index of `id`'s group, created if new. The newest groups are at the back, where a
    /// packet's group nearly always is.
    fn group(&mut self, now: Instant, id: u16) -> usize {
        self.expire(now);
        if let Some(i) = self.groups.iter().rposition(|g| g.id == id) {
            return i;
        }
        if self.groups.len() >= MAX_GROUPS {
            self.pop_oldest();
        }
        self.groups.push_back(Group {
            id,
            first: now,
            shape: None,
            data: vec![None; MAX_DATA],
            repair: vec![None; MAX_REPAIR],
            have_data: 0,
            have_repair: 0,
            bytes: 0,
            done: false,
        });
        self.groups.len() - 1
    }

    /// Keep the shard bytes within `MAX_BYTES` (oldest groups first, never the newest).
    fn trim(&mut self) {
        while self.bytes > MAX_BYTES && self.groups.len() > 1 {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some(g) = self.groups.pop_front() {
            self.bytes -= g.bytes;
            if let (false, Some((k, _, _))) = (g.done, g.shape) {
                if g.have_data < k {
                    self.counters.unrecoverable_groups += 1;
                    self.counters.unrecovered_packets += (k - g.have_data) as u64;
                }
            }
        }
    }

    /// Mark group `gi` done and let its shards go.
    fn finish(&mut self, gi: usize) {
        let g = &mut self.groups[gi];
        g.done = true;
        g.data.iter_mut().for_each(|d| *d = None);
        g.repair.iter_mut().for_each(|d| *d = None);
        self.bytes -= g.bytes;
        g.bytes = 0;
    }

    fn try_recover(&mut self, gi: usize, recovered: &mut Vec<Vec<u8>>) {
        let g = &mut self.groups[gi];
        let Some((k, m, len)) = g.shape else {
            return;
        };
        if g.have_data >= k {
            self.finish(gi);
            return;
        }
        if g.have_data + g.have_repair < k {
            return;
        }
        let Some(rs) = self.codecs.get(k as u8, m as u8) else {
            return;
        };
        let mut shards: Vec<(Vec<u8>, bool)> = Vec::with_capacity(k + m);
        for d in &g.data[..k] {
            shards.push(match d {
                Some(d) => {
                    let mut s = d.clone();
                    s.resize(len, 0);
                    (s, true)
                }
                None => (vec![0; len], false),
            });
        }
        for r in &g.repair[..m] {
            shards.push(match r {
                Some(r) => (r.clone(), true),
                None => (vec![0; len], false),
            });
        }
        if rs.reconstruct_data(&mut shards).is_err() {
            self.counters.inconsistent += 1;
            self.finish(gi);
            return;
        }
        for (i, (shard, _)) in shards.iter().enumerate().take(k) {
            if g.data[i].is_some() {
                continue;
            }
            let n = usize::from(u16::from_be_bytes([shard[0], shard[1]]));
            if n == 0 || LEN_PREFIX + n > len {
                // Repairs that do not fit their data (forged, or a peer's bug).
                self.counters.inconsistent += 1;
                continue;
            }
            recovered.push(shard[LEN_PREFIX..LEN_PREFIX + n].to_vec());
            self.counters.recovered += 1;
        }
        g.have_data = k;
        self.finish(gi);
    }
}
