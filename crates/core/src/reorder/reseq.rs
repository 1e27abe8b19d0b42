//! Per-packet bonding's two halves: the sender numbers each flow's packets (`Sequencer`), the
//! receiver puts them back in order (`Resequencer`) before they reach the TUN device.
//!
//! Why: a single TCP flow gets the sum of the links only if its packets go over all of them,
//! and links with different RTTs then deliver them out of order; Linux TCP takes reordering
//! beyond a few packets for loss and halves its window (seed 000: per-packet round robin over
//! two Starlink links collapsed to 78 Mbit/s). Put back in order, the flow sees one link with
//! the sum of the rates and the slower link's delay.
//!
//! Flows are identified by a 16-bit slot (the sender's flow hash folded; two flows sharing a
//! slot are simply ordered together) carried in the packet header with a 32-bit sequence number
//! per slot (docs/PROTOCOL.md, `BOND_DATA`).
//!
//! How the receiver decides a missing packet is lost rather than late: a path usually delivers
//! in the order it was given packets (one QUIC connection, a FIFO route), so once every path
//! that is up has delivered a later packet of the flow, the missing one is not coming:
//! the gap is skipped at once. Not on a path that has just shown otherwise (a packet of a flow
//! below one it delivered before: its link reorders, `REORDERED_FOR`): while one does, gaps
//! wait. Otherwise a gap is skipped after `max_wait` (the shell sets it from
//! the paths' delay difference and jitter, stretched while packets keep arriving after their
//! gap was given up: `Stretch`). A packet that arrives after its gap was skipped is
//! delivered anyway (counted `late`); one already delivered is dropped (`duplicates`: the
//! `redundant` scheduler sends some packets twice). Memory is bounded: `MAX_HELD` packets in
//! all, `MAX_HELD_PER_FLOW` per flow, `MAX_FLOWS` flows (idle ones forgotten first); beyond a
//! bound the oldest gap is skipped rather than anything dropped.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Slots the sender folds flow hashes into.
pub const SLOTS: usize = 4096;
const _: () = assert!(SLOTS <= START as usize);
/// Packets held across all flows, and per flow. A flow's bound is what its faster paths deliver
/// while a slower path's packet is on its way: 4096 packets is ~150 ms at 300 Mbit/s (at 1024,
/// one flow over 200 + 100 Mbit/s with 10 / 50 ms RTT overran it). ~6 MB per flow, ~12 MB per
/// tunnel at most.
pub const MAX_HELD: usize = 8192;
pub const MAX_HELD_PER_FLOW: usize = 4096;
/// Sequence numbers below the next expected one whose delivery is remembered (duplicates).
const WINDOW: u64 = 1024;
/// A packet this far ahead of the next expected one means the flow went on without us (an
/// outage, a restarted peer): start afresh from it. Far beyond what bonding puts between two
/// paths: a faster path runs ahead of a slower one by its rate times the delay difference,
/// 1,000-2,000 packets at 200 + 100 Mbit/s and 10 / 50 ms RTT. At `WINDOW` this fired in normal
/// operation there, and every packet still on the slower path then arrived late (23-35k per
/// 8 s flow, reordered for inner TCP).
const FAR_AHEAD: u64 = 1 << 15;
/// Flows the receiver keeps state for, and how long an idle one is kept.
const MAX_FLOWS: usize = 4096;
const FLOW_IDLE: Duration = Duration::from_secs(30);
/// Paths a flow's per-path progress is tracked for (more are treated as one).
const TRACKED_PATHS: usize = 8;
/// After a path delivers a flow's packets out of their order, this long that "every path has
/// passed it" does not mean a gap is lost (its missing packet may still be on that path).
/// Without it, per-packet bonding over links that reorder (1 ms of jitter that reorders, in the
/// simulator) gave up gaps whose packets then came late, reordered for the inner flow.
const REORDERED_FOR: Duration = Duration::from_secs(10);
/// Bounds of the wait for a missing packet.
pub const MIN_WAIT: Duration = Duration::from_millis(5);
pub const MAX_WAIT: Duration = Duration::from_millis(250);

/// How far the wait the shell sets (`set_max_wait`, from the paths' RTTs) is stretched for this
/// bond, the way TCP's RACK widens its reordering window after a spurious retransmission: a
/// quarter of it more for each give-up that turned out early (a packet of the gap arrived
/// after it), up to `MAX_STRETCH` quarters; a quarter less after `RELAX_AFTER` give-ups in a
/// row that no late packet followed. Why: a path's packets can trail by more than its RTTs
/// show when they wait in the sender's own queue (paced at the controller's rate, its wait is
/// invisible in the RTT), and a wait that is too short costs a flow a spurious loss per gap;
/// one that is too long costs only a true loss (on a path that has not yet passed it) a
/// little more time, bounded by `MAX_WAIT`.
#[derive(Debug, Default, Clone, Copy)]
struct Stretch {
    /// Quarters of the base wait added.
    quarters: u32,
    /// Give-ups since the wait last grew or shrank that no late packet followed (so far).
    clean: u32,
    /// When the last give-up happened: one early give-up (however many of its packets arrive
    /// late) stretches the wait once.
    last_give_up: Option<Instant>,
    /// The give-up that already stretched the wait.
    stretched_for: Option<Instant>,
}

const MAX_STRETCH: u32 = 8;
const RELAX_AFTER: u32 = 16;

impl Stretch {
    fn wait(&self, base: Duration) -> Duration {
        (base + base * self.quarters / 4).min(MAX_WAIT)
    }
    fn on_give_up(&mut self, now: Instant) {
        self.last_give_up = Some(now);
        self.clean += 1;
        if self.clean >= RELAX_AFTER {
            self.quarters = self.quarters.saturating_sub(1);
            self.clean = 0;
        }
    }
    /// A packet arrived after its gap was given up.
    fn on_late(&mut self) {
        if self.last_give_up.is_some() && self.stretched_for != self.last_give_up {
            self.stretched_for = self.last_give_up;
            self.quarters = (self.quarters + 1).min(MAX_STRETCH);
            self.clean = 0;
        }
    }
}

/// The sender's half: the next sequence number of each slot, and when the slot was last used.
///
/// The receiver keeps no state for a flow it has not seen (or has forgotten after
/// `FLOW_IDLE`), so it must know which packet starts it: the first packet of a flow, or of one
/// idle for `RESTART_IDLE` (less than the receiver's `FLOW_IDLE`), carries `START` in its slot
/// field. Packets of a flow the receiver does not know that arrive before the start are held
/// until it comes (or is given up like any gap).
#[derive(Debug, Default)]
pub struct Sequencer {
    slots: Vec<(u32, Option<Instant>)>,
}

/// The slot field's flag for a flow's (re)start; slots are below it.
pub const START: u16 = 0x8000;
/// Idle time after which a flow's next packet is marked as a (re)start.
const RESTART_IDLE: Duration = Duration::from_secs(1);

impl Sequencer {
    /// The slot of a flow with this hash (unparsable packets: slot 0).
    pub fn slot(flow_hash: Option<u64>) -> u16 {
        flow_hash.map_or(0, |h| ((h ^ (h >> 32)) as usize % SLOTS) as u16)
    }

    /// Number a packet of `slot` sent at `now`: the slot field for the header (with `START`
    /// when the flow (re)starts) and the sequence number.
    pub fn next(&mut self, slot: u16, now: Instant) -> (u16, u32) {
        if self.slots.is_empty() {
            self.slots = vec![(0, None); SLOTS];
        }
        let (next, last) = &mut self.slots[usize::from(slot) % SLOTS];
        let start = last.is_none_or(|l| now.saturating_duration_since(l) >= RESTART_IDLE);
        *last = Some(now);
        let seq = *next;
        *next = seq.wrapping_add(1);
        (if start { slot | START } else { slot }, seq)
    }
}

/// What became of a received packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Hand it on now (in order, or late after its gap was skipped); then take `ready`.
    Deliver,
    /// Kept until the packets before it arrive or are given up.
    Held,
    /// Delivered before: drop it.
    Duplicate,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReseqCounters {
    /// Packets that arrived ahead of a missing one and were held.
    pub held: u64,
    /// Missing packets given up: every path had passed them, or the wait ran out.
    pub skipped: u64,
    /// ... of those, given up because the wait ran out (or a memory bound was reached).
    pub timeouts: u64,
    /// Packets that arrived after they had been given up (delivered out of order).
    pub late: u64,
    /// Packets delivered before (dropped).
    pub duplicates: u64,
}

#[derive(Debug)]
struct Flow {
    /// The sequence number expected next, extended to 64 bits.
    next: u64,
    /// Delivered flags of the `WINDOW` numbers below `next`, by `seq % WINDOW`.
    delivered: [u64; (WINDOW / 64) as usize],
    /// The flow's start is known (`next` is real); until then everything is held.
    anchored: bool,
    /// Packets ahead of `next`, with when and on which path they arrived.
    held: BTreeMap<u64, (Instant, usize, Vec<u8>)>,
    /// Per path: the highest number it delivered of this flow.
    high: [Option<u64>; TRACKED_PATHS],
    last_seen: Instant,
}

impl Flow {
    fn new(seq: u32, now: Instant, anchored: bool) -> Flow {
        Flow {
            // Offset so that numbers a little below the first stay positive.
            next: u64::from(seq) + (1 << 32),
            anchored,
            delivered: [0; (WINDOW / 64) as usize],
            held: BTreeMap::new(),
            high: [None; TRACKED_PATHS],
            last_seen: now,
        }
    }

    fn extend(&self, seq: u32) -> u64 {
        let d = i64::from(seq.wrapping_sub(self.next as u32) as i32);
        (self.next as i64 + d) as u64
    }

    fn bit(&self, ext: u64) -> bool {
        let i = ext % WINDOW;
        self.delivered[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    fn set_bit(&mut self, ext: u64, on: bool) {
        let i = ext % WINDOW;
        let w = &mut self.delivered[(i / 64) as usize];
        if on {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }

    /// `next` was delivered (or given up): move on past it.
    fn advance(&mut self, delivered: bool) {
        let n = self.next;
        self.set_bit(n, delivered);
        self.next += 1;
    }

    /// Give up every number from `next` to `target` (exclusive); returns how many. In one step,
    /// not one per number: the numbers come from the peer, and a gap of 2^31 stepped through
    /// one at a time held the receiver's thread for seconds (found by fuzzing).
    fn skip_to(&mut self, target: u64) -> u64 {
        let n = target.saturating_sub(self.next);
        // Only the last `WINDOW` numbers have a place in the record of what was delivered.
        for ext in target - n.min(WINDOW)..target {
            self.set_bit(ext, false);
        }
        self.next += n;
        n
    }

    /// Hand on the held packets that are next in order, up to the first gap; returns how many.
    /// A held packet below `next` (the peer's numbers can put one there: a flow's start moved
    /// back, a far jump) is late by now: it goes on too, so nothing stays held behind `next`
    /// for ever (and no loop waits on it).
    fn release_in_order(&mut self, ready: &mut VecDeque<(usize, Vec<u8>)>) -> usize {
        let mut n = 0;
        while let Some(e) = self.held.first_entry() {
            let key = *e.key();
            if key > self.next {
                break;
            }
            let (_, path, pkt) = e.remove();
            ready.push_back((path, pkt));
            if key == self.next {
                self.advance(true);
            }
            n += 1;
        }
        n
    }

    /// Every path in `active` has delivered a later packet of this flow. A path that is up
    /// but has carried none of this flow's packets yet may be about to deliver the missing one
    /// (the scheduler just spilled the flow onto it), so it holds the gap open.
    fn gap_passed(&self, active: &[bool; TRACKED_PATHS]) -> bool {
        active.iter().any(|a| *a)
            && active
                .iter()
                .zip(&self.high)
                .all(|(a, h)| !a || h.is_some_and(|h| h > self.next))
    }

    /// When the oldest held packet stops waiting.
    fn deadline(&self, max_wait: Duration) -> Option<Instant> {
        self.held.values().next().map(|(at, _, _)| *at + max_wait)
    }
}

#[derive(Debug)]
pub struct Resequencer {
    flows: HashMap<u16, Flow>,
    held: usize,
    /// The wait the shell set (`set_max_wait`), before `stretch` (`max_wait()`: both).
    base_wait: Duration,
    stretch: Stretch,
    /// Released packets with the path they arrived on, in order.
    ready: VecDeque<(usize, Vec<u8>)>,
    /// The paths the peer may be sending on (up), by index (`set_active`).
    active: [bool; TRACKED_PATHS],
    /// When each path last delivered a flow's packet below one it had delivered before.
    reordered_at: [Option<Instant>; TRACKED_PATHS],
    /// Every numbered packet is a copy of a small real-time one (`bond::copies`; the policies
    /// that do not spread a flow): the first copy is handed on as it comes, out of order or
    /// not, and the second dropped. Held in order instead, a copy lost on one path kept the
    /// packets behind it waiting for the other path's copy, which a link in a capacity dip
    /// (LTE stops for up to a second) delivers late or never: one loss made several late.
    copies_only: bool,
    pub counters: ReseqCounters,
}

impl Default for Resequencer {
    fn default() -> Self {
        Resequencer {
            flows: HashMap::new(),
            held: 0,
            base_wait: Duration::from_millis(50),
            stretch: Stretch::default(),
            ready: VecDeque::new(),
            active: [true; TRACKED_PATHS],
            reordered_at: [None; TRACKED_PATHS],
            copies_only: false,
            counters: ReseqCounters::default(),
        }
    }
}

impl Resequencer {
    /// A resequencer whose packets are all copies (`copies_only`: `true`), or one that puts
    /// per-packet bonded flows back in order.
    pub fn copies_only(copies_only: bool) -> Resequencer {
        Resequencer {
            copies_only,
            ..Resequencer::default()
        }
    }

    /// The paths (by index) the peer may send on: those that are up. A missing packet is
    /// given up at once when every one of them has delivered a later packet of its flow.
    pub fn set_active(&mut self, up: impl Iterator<Item = usize>) {
        self.active = [false; TRACKED_PATHS];
        for i in up {
            self.active[i.min(TRACKED_PATHS - 1)] = true;
        }
    }

    /// How long a missing packet is waited for (clamped to `MIN_WAIT..=MAX_WAIT`), before the
    /// resequencer's own stretch (`Stretch`).
    pub fn set_max_wait(&mut self, d: Duration) {
        self.base_wait = d.clamp(MIN_WAIT, MAX_WAIT);
    }
    /// The wait in force: the base stretched.
    pub fn max_wait(&self) -> Duration {
        self.stretch.wait(self.base_wait)
    }
    /// Packets held now.
    pub fn holding(&self) -> usize {
        self.held
    }

    /// Packet `seq` of flow `slot` (the header's slot field: `START` marks a flow's first
    /// packet) arrived on path `path` (an index). `Deliver`: hand it on, then whatever `ready`
    /// yields (released behind it, in order).
    pub fn on_packet(
        &mut self,
        now: Instant,
        path: usize,
        slot: u16,
        seq: u32,
        pkt: &[u8],
    ) -> Verdict {
        let (start, slot) = (slot & START != 0, slot & !START);
        if !self.flows.contains_key(&slot) && self.flows.len() >= MAX_FLOWS {
            self.evict_idlest();
        }
        let flow = self
            .flows
            .entry(slot)
            .or_insert_with(|| Flow::new(seq, now, start));
        if now.saturating_duration_since(flow.last_seen) > FLOW_IDLE && flow.held.is_empty() {
            *flow = Flow::new(seq, now, start);
        }
        flow.last_seen = now;
        let ext = flow.extend(seq);
        if self.copies_only {
            return if ext >= flow.next {
                // The newest number yet: on at once, whatever is missing before it.
                flow.skip_to(ext);
                flow.advance(true);
                Verdict::Deliver
            } else if ext + WINDOW >= flow.next && flow.bit(ext) {
                self.counters.duplicates += 1;
                Verdict::Duplicate
            } else {
                if ext + WINDOW >= flow.next {
                    flow.set_bit(ext, true);
                }
                Verdict::Deliver
            };
        }
        if !flow.anchored && start {
            // The start of a flow whose later packets came first (held for it); any held
            // below it belong to an earlier run of the slot and go on now.
            let newer = flow.held.split_off(&ext);
            let older = std::mem::replace(&mut flow.held, newer);
            self.held -= older.len();
            self.counters.late += older.len() as u64;
            self.ready
                .extend(older.into_values().map(|(_, path, p)| (path, p)));
            flow.next = ext;
            flow.anchored = true;
        } else if !flow.anchored && ext < flow.next {
            // Not anchored yet: nothing was delivered, so `next` may move back.
            flow.next = ext;
        }
        let p = path.min(TRACKED_PATHS - 1);
        match flow.high[p] {
            Some(h) if ext < h => self.reordered_at[p] = Some(now),
            Some(h) if ext == h => {}
            _ => flow.high[p] = Some(ext),
        }
        let verdict = if ext < flow.next {
            if ext + WINDOW >= flow.next && flow.bit(ext) {
                self.counters.duplicates += 1;
                Verdict::Duplicate
            } else {
                if ext + WINDOW >= flow.next {
                    flow.set_bit(ext, true);
                }
                self.counters.late += 1;
                self.stretch.on_late();
                Verdict::Deliver
            }
        } else if ext == flow.next && flow.anchored {
            flow.advance(true);
            Verdict::Deliver
        } else if flow.held.contains_key(&ext) {
            self.counters.duplicates += 1;
            Verdict::Duplicate
        } else if ext - flow.next >= FAR_AHEAD {
            // Far ahead (a long outage): start afresh from here, handing on what was held and
            // giving up the rest of the numbers in between.
            let held = std::mem::take(&mut flow.held);
            self.held -= held.len();
            self.counters.skipped += ext - flow.next - held.len() as u64;
            self.ready
                .extend(held.into_values().map(|(_, path, p)| (path, p)));
            let high = flow.high;
            *flow = Flow::new(seq, now, true);
            flow.high = high;
            flow.advance(true);
            Verdict::Deliver
        } else {
            flow.held.insert(ext, (now, path, pkt.to_vec()));
            self.held += 1;
            self.counters.held += 1;
            Verdict::Held
        };
        self.release(now, slot);
        self.enforce_bounds(slot);
        verdict
    }

    /// The paths whose progress says which gaps are lost: the active ones, unless one of them
    /// reorders (then none: gaps wait for their deadline).
    fn trusted(&self, now: Instant) -> [bool; TRACKED_PATHS] {
        let reorders = (self.active.iter().zip(&self.reordered_at)).any(|(a, at)| {
            *a && at.is_some_and(|t| now.saturating_duration_since(t) < REORDERED_FOR)
        });
        if reorders {
            [false; TRACKED_PATHS]
        } else {
            self.active
        }
    }

    /// Release what `slot` can hand on now: in-order packets behind `next`, and gaps every path
    /// has passed.
    fn release(&mut self, now: Instant, slot: u16) {
        let active = self.trusted(now);
        let Some(flow) = self.flows.get_mut(&slot) else {
            return;
        };
        if !flow.anchored {
            // Its start is lost if every path that is up has delivered a packet of it since.
            let passed = active.iter().any(|a| *a)
                && active
                    .iter()
                    .zip(&flow.high)
                    .all(|(a, h)| !a || h.is_some());
            if !passed {
                return;
            }
            flow.anchored = true;
            self.counters.skipped += 1;
        }
        loop {
            self.held -= flow.release_in_order(&mut self.ready);
            if flow.held.is_empty() || !flow.gap_passed(&active) {
                return;
            }
            // Every active path has passed the numbers below the lowest of their highest
            // (and the gap ends at the first held packet): give those up at once.
            let passed = (active.iter().zip(&flow.high))
                .filter(|(a, _)| **a)
                .filter_map(|(_, h)| *h)
                .min()
                .unwrap_or(flow.next + 1);
            // `first` > `next` here (`release_in_order` took everything up to `next`) and
            // `passed` > `next` (`gap_passed`), so this moves on.
            let first = flow.held.keys().next().copied().unwrap_or(passed);
            self.counters.skipped += flow.skip_to(passed.min(first));
        }
    }

    /// Skip the oldest gap of `slot`, or of any flow, while a memory bound is exceeded.
    fn enforce_bounds(&mut self, slot: u16) {
        while self
            .flows
            .get(&slot)
            .is_some_and(|f| f.held.len() > MAX_HELD_PER_FLOW)
        {
            self.skip_gap(slot);
        }
        while self.held > MAX_HELD {
            let oldest = self
                .flows
                .iter()
                .filter_map(|(s, f)| f.held.values().next().map(|(at, _, _)| (*at, *s)))
                .min();
            match oldest {
                Some((_, s)) => self.skip_gap(s),
                None => break,
            }
        }
    }

    /// Give up the missing packets in front of `slot`'s first held one and release from there.
    fn skip_gap(&mut self, slot: u16) {
        let Some(flow) = self.flows.get_mut(&slot) else {
            return;
        };
        let Some(first) = flow.held.keys().next().copied() else {
            return;
        };
        self.counters.timeouts += 1;
        flow.anchored = true;
        self.counters.skipped += flow.skip_to(first);
        // The first held is now in order; what follows it too, up to the next gap.
        self.held -= flow.release_in_order(&mut self.ready);
    }

    fn evict_idlest(&mut self) {
        if let Some(slot) = self
            .flows
            .iter()
            .min_by_key(|(_, f)| f.last_seen)
            .map(|(s, _)| *s)
        {
            if let Some(f) = self.flows.remove(&slot) {
                self.held -= f.held.len();
                self.ready
                    .extend(f.held.into_values().map(|(_, path, p)| (path, p)));
            }
        }
    }

    /// Packets released, in order, with the path each arrived on, to hand on after the one
    /// `on_packet` returned `Deliver` for (or after `poll`).
    pub fn ready(&mut self) -> Option<(usize, Vec<u8>)> {
        self.ready.pop_front()
    }

    /// Give up gaps that waited `max_wait`, and forget idle flows; then take `ready`.
    pub fn poll(&mut self, now: Instant) {
        let wait = self.max_wait();
        let due: Vec<u16> = self
            .flows
            .iter()
            .filter(|(_, f)| f.deadline(wait).is_some_and(|d| d <= now))
            .map(|(s, _)| *s)
            .collect();
        for slot in due {
            while self.flows[&slot]
                .deadline(self.max_wait())
                .is_some_and(|d| d <= now)
            {
                self.skip_gap(slot);
                self.stretch.on_give_up(now);
            }
        }
        self.flows.retain(|_, f| {
            !f.held.is_empty() || now.saturating_duration_since(f.last_seen) <= FLOW_IDLE
        });
    }

    /// When `poll` next has a gap to give up.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.flows
            .values()
            .filter_map(|f| f.deadline(self.max_wait()))
            .min()
    }
}

/// The wait for a missing packet on paths with these smoothed RTTs and RTT variations: what
/// the later of two paths' packets can trail the earlier by (half the RTT difference, one way),
/// four variations of jitter, and a quarter of the slowest RTT for the error in the sender's
/// estimate of when a packet leaves its queue (its rates are windows per RTT, not measured
/// departures: with a fixed 5 ms floor instead, one flow over 10 and 40 ms paths saw ~1% of
/// its packets given up and arrive late), within `MIN_WAIT..=MAX_WAIT`.
pub fn wait_for(paths: impl Iterator<Item = (Duration, Duration)>) -> Duration {
    let (mut lo, mut hi, mut var) = (Duration::MAX, Duration::ZERO, Duration::ZERO);
    for (srtt, rttvar) in paths {
        lo = lo.min(srtt);
        hi = hi.max(srtt);
        var = var.max(rttvar);
    }
    if hi < lo {
        return MIN_WAIT;
    }
    ((hi - lo) / 2 + var * 4 + hi / 4).clamp(MIN_WAIT, MAX_WAIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    /// `feed` marks these as flows' first packets (`start` marks any).
    const FIRST: u32 = 10;

    /// Feed one packet; returns what was handed on (the packet itself if `Deliver`, then the
    /// released ones), as their first byte.
    fn feed(r: &mut Resequencer, now: Instant, path: usize, seq: u32) -> Vec<u32> {
        feed_as(r, now, path, seq, seq == FIRST)
    }

    /// `feed` a flow's first packet.
    fn start(r: &mut Resequencer, now: Instant, path: usize, seq: u32) -> Vec<u32> {
        feed_as(r, now, path, seq, true)
    }

    fn feed_as(r: &mut Resequencer, now: Instant, path: usize, seq: u32, first: bool) -> Vec<u32> {
        let pkt = seq.to_be_bytes();
        let mut out = Vec::new();
        let slot = if first { 7 | START } else { 7 };
        if r.on_packet(now, path, slot, seq, &pkt) == Verdict::Deliver {
            out.push(seq);
        }
        while let Some((_, p)) = r.ready() {
            out.push(u32::from_be_bytes(p[..4].try_into().unwrap()));
        }
        out
    }

    /// A resequencer whose peer sends on paths 0 and 1.
    fn both_paths_active(_: Instant) -> Resequencer {
        let mut r = Resequencer::default();
        r.set_active(0..2);
        r
    }

    /// Copies only (the policies that number copies, not flows): the first copy of each
    /// number goes on as it comes, ahead of a missing one or behind it, and the second is
    /// dropped; nothing is held.
    #[test]
    fn copies_go_on_at_once_and_their_second_is_dropped() {
        let t = Instant::now();
        let mut r = Resequencer::copies_only(true);
        assert_eq!(start(&mut r, t, 0, FIRST), vec![FIRST]);
        // 11 lost on path 0: 12 goes on at once, 11's copy from path 1 after it.
        assert_eq!(feed(&mut r, t + MS, 0, 12), vec![12]);
        assert_eq!(feed(&mut r, t + 2 * MS, 1, 10), Vec::<u32>::new());
        assert_eq!(feed(&mut r, t + 3 * MS, 1, 11), vec![11]);
        assert_eq!(feed(&mut r, t + 4 * MS, 1, 12), Vec::<u32>::new());
        assert_eq!(r.holding(), 0);
        assert_eq!(r.counters.duplicates, 2);
        // Far ahead (a long pause in copies): on at once too, and its copy dropped.
        assert_eq!(feed(&mut r, t + 5 * MS, 0, 50_000), vec![50_000]);
        assert_eq!(feed(&mut r, t + 6 * MS, 1, 50_000), Vec::<u32>::new());
        assert_eq!(r.next_deadline(), None);
    }

    #[test]
    fn a_path_that_never_carried_the_flow_holds_its_gap_open() {
        let t = Instant::now();
        let mut r = both_paths_active(t);
        start(&mut r, t, 0, 0);
        // 1 may be on path 1, which is up: 2 waits (for the timeout at worst).
        assert_eq!(feed(&mut r, t, 0, 2), vec![]);
        assert_eq!(feed(&mut r, t + MS, 1, 1), vec![1, 2]);
        // With only path 0 in use, a gap it passed is a loss: no wait.
        let mut solo = Resequencer::default();
        solo.set_active(0..1);
        start(&mut solo, t, 0, 0);
        assert_eq!(feed(&mut solo, t, 0, 2), vec![2]);
        assert_eq!(solo.counters.skipped, 1);
    }

    #[test]
    fn reorders_across_paths_and_skips_a_gap_both_paths_passed() {
        let t = Instant::now();
        let mut r = both_paths_active(t);
        assert_eq!(feed(&mut r, t, 0, 10), vec![10]);
        // 11 travels on the slow path 1; 12 and 13 on path 0 arrive first.
        assert_eq!(feed(&mut r, t, 0, 12), vec![]);
        assert_eq!(feed(&mut r, t, 0, 13), vec![]);
        assert_eq!(feed(&mut r, t + MS, 1, 11), vec![11, 12, 13]);
        // 14 is lost on path 0: 15 on path 0 is held until path 1 passes 14 too.
        assert_eq!(feed(&mut r, t + MS, 0, 15), vec![]);
        assert_eq!(feed(&mut r, t + 2 * MS, 1, 16), vec![15, 16]);
        assert_eq!(r.counters.skipped, 1);
        assert_eq!(r.counters.timeouts, 0);
        // 14 turns up after all: late but delivered; a second copy is a duplicate.
        assert_eq!(feed(&mut r, t + 3 * MS, 1, 14), vec![14]);
        assert_eq!(feed(&mut r, t + 3 * MS, 0, 14), vec![]);
        assert_eq!(feed(&mut r, t + 3 * MS, 0, 16), vec![]);
        assert_eq!((r.counters.late, r.counters.duplicates), (1, 2));
        assert_eq!(r.holding(), 0);
    }

    #[test]
    fn a_gap_no_path_passes_is_given_up_after_the_wait() {
        let t = Instant::now();
        let mut r = both_paths_active(t);
        r.set_max_wait(20 * MS);
        start(&mut r, t, 0, 0);
        feed(&mut r, t, 1, 1);
        // 2 is missing; 3 arrives on path 0 while path 1 has not passed 2.
        assert_eq!(feed(&mut r, t + MS, 0, 3), vec![]);
        assert_eq!(r.next_deadline(), Some(t + 21 * MS));
        r.poll(t + 20 * MS);
        assert!(r.ready().is_none());
        r.poll(t + 21 * MS);
        assert_eq!(r.ready(), Some((0, 3u32.to_be_bytes().to_vec())));
        assert_eq!((r.counters.skipped, r.counters.timeouts), (1, 1));
        assert_eq!(r.next_deadline(), None);
    }

    /// Path 1's packet trails path 0's next one by 30 ms while the RTTs say 20: the first two
    /// gaps are given up and their packets arrive late, each stretching the wait a quarter,
    /// and from 30 ms on none is; then 16 true losses (the packet never comes) take a quarter
    /// back.
    #[test]
    fn the_wait_stretches_while_given_up_packets_arrive_late_and_relaxes_after() {
        let t0 = Instant::now();
        let mut r = both_paths_active(t0);
        r.set_max_wait(20 * MS);
        start(&mut r, t0, 0, 0);
        let mut seq = 1;
        let mut late = Vec::new();
        let mut round = |r: &mut Resequencer, n: u32, arrives: bool| {
            let t = t0 + n * 100 * MS;
            let before = r.counters.late;
            feed(r, t, 0, seq + 1);
            for ms in 1..30 {
                r.poll(t + ms * MS);
                while r.ready().is_some() {}
            }
            if arrives {
                feed(r, t + 30 * MS, 1, seq);
            } else {
                r.poll(t + 90 * MS);
                while r.ready().is_some() {}
            }
            seq += 2;
            r.counters.late - before
        };
        for n in 1..=5 {
            late.push(round(&mut r, n, true));
        }
        assert_eq!(late, vec![1, 1, 0, 0, 0]);
        assert_eq!(r.max_wait(), 30 * MS);
        // The base follows the RTTs; the stretch stays on top of it.
        r.set_max_wait(40 * MS);
        assert_eq!(r.max_wait(), 60 * MS);
        r.set_max_wait(20 * MS);
        for n in 6..6 + RELAX_AFTER {
            assert_eq!(round(&mut r, n, false), 0);
        }
        assert_eq!(r.max_wait(), 25 * MS);
        // Never beyond MAX_WAIT, however late packets keep coming.
        r.set_max_wait(MAX_WAIT);
        assert_eq!(r.max_wait(), MAX_WAIT);
    }

    /// The faster path runs 3000 packets ahead of the slower one (200 + 100 Mbit/s, 10 / 50 ms
    /// RTT do that): all held, and the slower path's packets put back in order, none late.
    #[test]
    fn a_faster_path_far_ahead_is_held_not_taken_for_an_outage() {
        let t = Instant::now();
        let mut r = both_paths_active(t);
        r.set_max_wait(MAX_WAIT);
        start(&mut r, t, 0, 0);
        let mut out = Vec::new();
        for seq in 2..3002 {
            out.extend(feed(&mut r, t + MS, 0, seq));
        }
        assert!(out.is_empty());
        assert_eq!(r.holding(), 3000);
        assert_eq!(
            feed(&mut r, t + 2 * MS, 1, 1),
            (1..3002).collect::<Vec<u32>>()
        );
        assert_eq!((r.counters.late, r.counters.skipped), (0, 0));
    }

    /// The peer picks the numbers: a flow started at 1 whose next packet claims to be ~1.26
    /// billion behind moves an unanchored flow's start back that far; the gap to the held
    /// packet is then given up in one step (stepped through, it took seconds).
    #[test]
    fn a_gap_of_billions_is_given_up_at_once() {
        let t0 = Instant::now();
        let mut r = both_paths_active(t0);
        let mut got = feed(&mut r, t0, 0, 1);
        got.extend(feed(&mut r, t0, 1, 0xb4ad_5601));
        let started = std::time::Instant::now();
        r.poll(t0 + MAX_WAIT * 2);
        while r.ready().is_some() {}
        assert!(
            started.elapsed() < Duration::from_millis(100),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(r.holding(), 0);
    }

    #[test]
    fn sequence_numbers_wrap() {
        let t = Instant::now();
        let mut r = both_paths_active(t);
        assert_eq!(start(&mut r, t, 0, u32::MAX - 1), vec![u32::MAX - 1]);
        assert_eq!(feed(&mut r, t, 0, 0), vec![]);
        assert_eq!(feed(&mut r, t, 1, u32::MAX), vec![u32::MAX, 0]);
        assert_eq!(feed(&mut r, t, 1, 1), vec![1]);
    }

    #[test]
    fn memory_is_bounded_and_nothing_is_dropped() {
        let t = Instant::now();
        let mut r = Resequencer::default();
        r.set_max_wait(MAX_WAIT);
        let (mut fed, mut out) = (0, 0);
        let mut take = |r: &mut Resequencer, v: Verdict| {
            out += usize::from(v == Verdict::Deliver);
            while r.ready().is_some() {
                out += 1;
            }
        };
        // Flows 0..12 each miss packet 2 on path 1, which is up (so the gap stays open); path 0
        // brings 997 packets behind it per flow: ~12,000 in all, beyond `MAX_HELD`, so the
        // bound has to act (each flow alone stays under `MAX_HELD_PER_FLOW`).
        let mut most = 0;
        for slot in 0..12u16 {
            for seq in 0..1000u32 {
                if seq != 2 {
                    let v = r.on_packet(t, 0, slot, seq, b"y");
                    fed += 1;
                    take(&mut r, v);
                }
                let v = r.on_packet(t, 1, 100 + slot, seq, b"z");
                fed += 1;
                take(&mut r, v);
                assert!(r.holding() <= MAX_HELD);
                most = most.max(r.holding());
            }
        }
        assert!(most > MAX_HELD - 1000, "the bound was reached: {most}");
        assert_eq!(out + r.holding(), fed, "nothing dropped");
        assert!(r.holding() > 0);
        assert!(r.counters.timeouts > 0);
    }

    #[test]
    fn wait_covers_half_the_rtt_difference_and_jitter() {
        let w = wait_for([(10 * MS, MS), (30 * MS, 2 * MS)].into_iter());
        assert_eq!(w, 10 * MS + 8 * MS + 7500 * Duration::from_micros(1));
        assert_eq!(wait_for(std::iter::empty()), MIN_WAIT);
        assert_eq!(
            wait_for([(10 * MS, Duration::ZERO), (900 * MS, Duration::ZERO)].into_iter()),
            MAX_WAIT
        );
    }

    #[test]
    fn the_sequencer_numbers_each_slot_and_marks_starts() {
        let t = Instant::now();
        let mut s = Sequencer::default();
        let (a, b) = (Sequencer::slot(Some(1)), Sequencer::slot(Some(2)));
        assert_ne!(a, b);
        assert_eq!(Sequencer::slot(None), 0);
        assert_eq!(s.next(a, t), (a | START, 0));
        assert_eq!(s.next(b, t), (b | START, 0));
        assert_eq!(s.next(a, t + MS), (a, 1));
        // Idle for a second: a starts again (its numbers go on).
        assert_eq!(s.next(a, t + Duration::from_secs(2)), (a | START, 2));
    }

    #[test]
    fn packets_ahead_of_an_unknown_flows_start_wait_for_it() {
        let t = Instant::now();
        let mut r = both_paths_active(t);
        // 11 and 12 (path 0) overtake the start, 10 (path 1).
        assert_eq!(feed(&mut r, t, 0, 11), vec![]);
        assert_eq!(feed(&mut r, t, 0, 12), vec![]);
        assert_eq!(feed(&mut r, t + MS, 1, 10), vec![10, 11, 12]);
        assert_eq!(r.counters.late, 0);
        // A start lost on path 1: once path 1 delivers a later packet, the flow goes on.
        let mut r = both_paths_active(t);
        assert_eq!(feed(&mut r, t, 0, 12), vec![]);
        assert_eq!(feed(&mut r, t, 1, 11), vec![11, 12]);
        // ... or after the wait, when path 1 stays silent.
        let mut r = both_paths_active(t);
        r.set_max_wait(20 * MS);
        assert_eq!(feed(&mut r, t, 0, 12), vec![]);
        r.poll(t + 20 * MS);
        assert_eq!(
            r.ready().map(|(_, p)| p),
            Some(12u32.to_be_bytes().to_vec())
        );
    }
}
