//! The queue in front of an ordered transport (reliable mode's stream, which delivers
//! everything it takes in order, so whatever it holds is delay for whatever comes next).
//! Packets wait here instead, while the pacer (`pacing.rs`) holds them back, and:
//!
//! - **sparse flows go first**: a packet of a flow that has nothing waiting in the bulk queue
//!   (a ping, a DNS query, an interactive session, TCP's first packets) joins the sparse queue,
//!   which is always served before bulk, as fq_codel's new-flow queue is; a flow with more
//!   than `SPARSE_PACKETS` waiting is bulk. A flow's packets never overtake each other: one
//!   goes to the sparse queue only while the flow has none in bulk, and sparse ones leave first.
//! - **it is bounded**: `limit` packets; a packet beyond is refused (the caller counts it),
//!   except a sparse flow's, which takes the place of the oldest bulk packet instead (fq_codel
//!   drops from the fattest flow too): a ping behind a saturating upload is not lost to the
//!   upload's backlog.
//!
//! A sender that hands packets to the queue's owner across threads keeps `WaitingFlows` beside
//! it, so the hand-over can let a sparse flow's packet past its own bounds too.
//! - **nothing waits longer than `max_wait`**: older packets are dropped when they reach the
//!   head (the inner flow's loss signal, rather than the delay of everything behind them). A
//!   sparse packet waits at most `SPARSE_MAX_WAIT` (or `max_wait` if longer): it is not part of
//!   the backlog the bound is for, and what holds it back is the pacer or the sender's own
//!   thread not running, where a drop helps nothing (a ping lost to a 20 ms stall of a busy
//!   host); the bound is there for a flood of new flows.
//! - **an ECN-capable flow is marked before it is dropped**: a bulk packet that has waited
//!   `mark_after` (`mark_after()`: a round trip of the path, at most half the drop bound) is
//!   offered to the caller's `mark` (`pop_marking`: the writer sets "congestion experienced"
//!   on a packet whose sender negotiated ECN, `packet::ecn`). Its sender slows down as for a
//!   loss, without the round trip of nothing delivered that a loss costs it; a flow that does
//!   not negotiate ECN meets the queue as before.
//!
//! Measured and not adopted (sixteen inner uploads over a replayed Starlink link, where each
//! flow stalls over 200 ms at every loss: its inner RTT is 130-240 ms under the load, and a
//! lost packet costs it a round trip):
//! - a bulk wait of `max_wait` over the square root of the bulk flows queued (buffer sizing
//!   for many flows): inner cubic's RTT 204-236 -> 127-136 ms and its long stalls 133-179 ->
//!   54-119 in 28 s, but inner BBR (which does not slow down for loss) retransmitted 7x more on
//!   a constant 50 Mbit/s link (3277 -> 23200 in 15 s) with 3x the long stalls (47 -> 134),
//!   and had as many over Starlink;
//! - one stale drop per flow per `max_wait`, the flow's later stale packets sent late (up to
//!   twice the bound): no fewer long stalls with either inner controller.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Packets a flow may have in the sparse queue; more and it is bulk.
pub const SPARSE_PACKETS: u32 = 2;

/// How long a sparse flow's packet may wait, at least (`SendQueue::pop_from`).
pub const SPARSE_MAX_WAIT: Duration = Duration::from_millis(200);

/// How long a bulk packet waits before it may be marked (`SendQueue::pop_marking`), on a path
/// with this smoothed RTT whose queue drops at `max_wait`: a round trip (the buffer one
/// loss-based flow needs to keep the path busy; `reliable::queue_wait` lets three wait), and
/// at most half the bound, so that a flow hears of the queue before it loses to it.
pub fn mark_after(srtt: Duration, max_wait: Duration) -> Duration {
    srtt.min(max_wait / 2)
}

/// Counters of `WaitingFlows`, shared by flows by their hash.
const FLOW_BUCKETS: usize = 256;

/// How many packets each flow has on their way through a sender (handed over to the task that
/// owns its `SendQueue`, and not yet sent or dropped), for the thread that hands them over:
/// before refusing a packet for a bound of its own it asks `is_sparse`, since the queue will
/// serve a sparse flow's packet first. The hand-over `add`s before it passes a packet on, the
/// owner `sub`s when the packet leaves its hands whichever way (a stream receiver counts the
/// packets its playout holds with it too). Flows share counters by hash: a
/// collision makes a sparse flow look busy (refused as before), never a busy one sparse.
pub struct WaitingFlows {
    counts: [AtomicU32; FLOW_BUCKETS],
}

impl Default for WaitingFlows {
    fn default() -> WaitingFlows {
        WaitingFlows {
            counts: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }
}

impl WaitingFlows {
    fn bucket(&self, flow: u64) -> &AtomicU32 {
        &self.counts[(flow % FLOW_BUCKETS as u64) as usize]
    }

    /// Whether a packet of `flow` would join the sparse queue now (`None`: no flow key, bulk).
    pub fn is_sparse(&self, flow: Option<u64>) -> bool {
        flow.is_some_and(|f| self.bucket(f).load(Ordering::Relaxed) < SPARSE_PACKETS)
    }

    /// Whether nothing of `flow` is on its way (`None`: no flow key, never).
    pub fn is_idle(&self, flow: Option<u64>) -> bool {
        flow.is_some_and(|f| self.bucket(f).load(Ordering::Relaxed) == 0)
    }

    pub fn add(&self, flow: Option<u64>) {
        if let Some(f) = flow {
            self.bucket(f).fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn sub(&self, flow: Option<u64>) {
        if let Some(f) = flow {
            self.bucket(f).fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Whether nothing is on its way.
    pub fn is_empty(&self) -> bool {
        self.counts.iter().all(|c| c.load(Ordering::Relaxed) == 0)
    }
}

/// How long a flow must have been seen, sparse throughout, before its packets take the sparse
/// stream (`SparseLane`).
pub const SPARSE_AGE: Duration = Duration::from_secs(1);
/// How long a flow may be silent before it is forgotten (and counts as new if it comes back).
pub const FLOW_FORGET: Duration = Duration::from_secs(10);

/// Flows `SparseLane` tracks at most; a flow beyond them is bulk until some are forgotten.
pub const LANE_FLOWS: usize = 4096;

/// What `SparseLane` knows of a flow.
#[derive(Clone, Copy)]
struct FlowTimes {
    first: Instant,
    last: Instant,
    /// A packet of it left through the bulk queue.
    bulk: bool,
}

/// Which of its lane's two ordered streams a packet goes on: the bulk stream, or the sparse
/// one the peer reads beside it, so that a ping or a voice packet never waits behind the bulk
/// stream's backlog or its retransmissions (head of line: after a NAT rebinding a server's
/// download retransmits a round trip of data lost to the old mapping, and a ping's reply on
/// the same stream waited behind it, two round trips in all).
///
/// A packet goes on the sparse stream when it left the send queue through its sparse queue and
/// its flow has been seen for `SPARSE_AGE` without ever leaving through the bulk queue (seen
/// on the path, its packets that went as datagrams included: the writer tells it those while
/// the path is on its stream). A flow
/// is on one stream for its life, so its packets never overtake each other across the two:
/// a TCP flow that paused and took the sparse stream overtook its own packets still waiting
/// for retransmissions in the bulk one, and packets that pass a path whose bulk does not
/// (a NAT that corrupts GSO batches) held off the delivery watch's verdict. And a flow's
/// first packets stay with its later ones: a TCP flow whose handshake and first packets took
/// the sparse stream on a lossy path measured its RTT without the bulk stream's waits, and
/// inner cubic ran at 0.79x (10% loss, 60 Mbit/s, 30 ms: 24.9 against 31.6 Mbit/s, 8 runs
/// each).
///
/// Flows are told apart by their whole key (forgotten after `FLOW_FORGET` of silence), not
/// by a slot of a 256-slot table: there, a call that shared a slot with any of 16 new TCP
/// flows (1 call in 16, on random ports) rode the bulk stream from then on and waited behind
/// its backlog whenever the path lost (the likely cause of a call's seconds 52-98% late
/// beside 16 starting uploads over Starlink, while pings on the same path passed). At most
/// `LANE_FLOWS` are tracked; one more is bulk until room is made.
#[derive(Default)]
pub struct SparseLane {
    flows: HashMap<u64, FlowTimes>,
    /// When silent flows were last forgotten.
    swept: Option<Instant>,
}

impl SparseLane {
    /// Whether the packet of `flow` that left the send queue now (through its sparse queue or
    /// not: `left_sparse`) goes on the sparse stream.
    pub fn on_stream_sparse(&mut self, now: Instant, flow: Option<u64>, left_sparse: bool) -> bool {
        let Some(f) = flow else {
            return false;
        };
        let forgotten = |t: &FlowTimes| now.saturating_duration_since(t.last) >= FLOW_FORGET;
        let fresh = FlowTimes {
            first: now,
            last: now,
            bulk: false,
        };
        let t = match self.flows.get_mut(&f) {
            Some(t) => {
                if forgotten(t) {
                    *t = fresh;
                }
                t
            }
            None => {
                // A new flow: silent ones are forgotten once per `FLOW_FORGET`, or once per
                // `SPARSE_AGE` while the table is full (not for each packet of a flow it has
                // no room for); a known flow's packet costs one lookup.
                let full = self.flows.len() >= LANE_FLOWS;
                let every = if full { SPARSE_AGE } else { FLOW_FORGET };
                if self
                    .swept
                    .is_none_or(|at| now.saturating_duration_since(at) >= every)
                {
                    self.flows.retain(|_, t| !forgotten(t));
                    self.swept = Some(now);
                }
                if self.flows.len() >= LANE_FLOWS {
                    return false;
                }
                self.flows.entry(f).or_insert(fresh)
            }
        };
        t.last = now;
        t.bulk |= !left_sparse;
        !t.bulk && now.saturating_duration_since(t.first) >= SPARSE_AGE
    }

    /// Whether a packet of `flow` that leaves through its sparse queue now would go on the
    /// sparse stream (`on_stream_sparse`, without recording it).
    pub fn takes_sparse(&self, now: Instant, flow: Option<u64>) -> bool {
        flow.and_then(|f| self.flows.get(&f)).is_some_and(|t| {
            !t.bulk
                && now.saturating_duration_since(t.last) < FLOW_FORGET
                && now.saturating_duration_since(t.first) >= SPARSE_AGE
        })
    }

    /// Flows tracked now.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }
}

struct Entry<T> {
    flow: Option<u64>,
    at: Instant,
    item: T,
}

pub struct SendQueue<T> {
    sparse: VecDeque<Entry<T>>,
    bulk: VecDeque<Entry<T>>,
    /// Packets waiting per flow, in each queue.
    in_sparse: HashMap<u64, u32>,
    in_bulk: HashMap<u64, u32>,
    limit: usize,
    max_wait: Duration,
    /// A bulk packet that waited longer may be marked (`pop_marking`); `max_wait / 2` until set.
    mark_after: Option<Duration>,
    /// Packets that left through the sparse queue.
    pub sparse_sent: u64,
}

impl<T> SendQueue<T> {
    pub fn new(limit: usize, max_wait: Duration) -> SendQueue<T> {
        SendQueue {
            sparse: VecDeque::new(),
            bulk: VecDeque::new(),
            in_sparse: HashMap::new(),
            in_bulk: HashMap::new(),
            limit,
            max_wait,
            mark_after: None,
            sparse_sent: 0,
        }
    }

    /// Change how long a packet may wait (follows the path's RTT).
    pub fn set_max_wait(&mut self, max_wait: Duration) {
        self.max_wait = max_wait;
    }

    /// Change how long a bulk packet waits before it may be marked (`mark_after()`).
    pub fn set_mark_after(&mut self, after: Duration) {
        self.mark_after = Some(after);
    }

    /// Change how many packets may wait (follows the path's rate). Packets already waiting
    /// beyond a lower limit stay; new ones are refused until the queue is below it.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    pub fn len(&self) -> usize {
        self.sparse.len() + self.bulk.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a sparse flow's packet waits (it leaves before anything bulk).
    pub fn has_sparse(&self) -> bool {
        !self.sparse.is_empty()
    }

    /// Queue `item` of `flow` (`None`: a packet without a flow key, treated as bulk). When the
    /// queue is full a bulk packet is refused (returned); a sparse flow's packet is queued in
    /// place of the oldest bulk one, which is returned instead (refused only when nothing bulk
    /// waits). Either way the caller counts what comes back as dropped.
    pub fn push(&mut self, now: Instant, flow: Option<u64>, item: T) -> Result<(), T> {
        let sparse = flow.is_some_and(|f| {
            !self.in_bulk.contains_key(&f)
                && self.in_sparse.get(&f).copied().unwrap_or(0) < SPARSE_PACKETS
        });
        let displaced = match self.len() >= self.limit {
            false => None,
            true if sparse => match self.bulk.pop_front() {
                Some(e) => {
                    self.forget(false, e.flow);
                    Some(e.item)
                }
                None => return Err(item),
            },
            true => return Err(item),
        };
        let (queue, counts) = if sparse {
            (&mut self.sparse, &mut self.in_sparse)
        } else {
            (&mut self.bulk, &mut self.in_bulk)
        };
        if let Some(f) = flow {
            *counts.entry(f).or_insert(0) += 1;
        }
        queue.push_back(Entry {
            flow,
            at: now,
            item,
        });
        displaced.map_or(Ok(()), Err)
    }

    /// A packet of `flow` left the sparse or the bulk queue.
    fn forget(&mut self, from_sparse: bool, flow: Option<u64>) {
        let counts = match from_sparse {
            true => &mut self.in_sparse,
            false => &mut self.in_bulk,
        };
        if let Some(f) = flow {
            if let Some(n) = counts.get_mut(&f) {
                *n -= 1;
                if *n == 0 {
                    counts.remove(&f);
                }
            }
        }
    }

    /// The next packet to send: sparse first. Packets that waited longer than `max_wait` (a
    /// sparse one: `SPARSE_MAX_WAIT`, if longer) go to `stale` instead.
    pub fn pop(&mut self, now: Instant, stale: &mut impl FnMut(T)) -> Option<T> {
        self.pop_from(now, stale).map(|(item, _)| item)
    }

    /// `pop`, saying whether the packet left through the sparse queue.
    pub fn pop_from(&mut self, now: Instant, stale: &mut impl FnMut(T)) -> Option<(T, bool)> {
        self.pop_marking(now, stale, &mut |_| {})
    }

    /// `pop_from`, offering `mark` each bulk packet that leaves after waiting longer than
    /// `mark_after` (it marks what it can, an ECN-capable packet, and counts what it marked).
    pub fn pop_marking(
        &mut self,
        now: Instant,
        stale: &mut impl FnMut(T),
        mark: &mut impl FnMut(&mut T),
    ) -> Option<(T, bool)> {
        loop {
            let from_sparse = !self.sparse.is_empty();
            let queue = match from_sparse {
                true => &mut self.sparse,
                false => &mut self.bulk,
            };
            let e = queue.pop_front()?;
            self.forget(from_sparse, e.flow);
            let max_wait = match from_sparse {
                true => self.max_wait.max(SPARSE_MAX_WAIT),
                false => self.max_wait,
            };
            let waited = now.saturating_duration_since(e.at);
            if waited > max_wait {
                stale(e.item);
                continue;
            }
            let mut item = e.item;
            if from_sparse {
                self.sparse_sent += 1;
            } else if waited > self.mark_after.unwrap_or(self.max_wait / 2) {
                mark(&mut item);
            }
            return Some((item, from_sparse));
        }
    }

    /// Everything still queued, oldest class first (the transport failed).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.in_sparse.clear();
        self.in_bulk.clear();
        self.sparse
            .drain(..)
            .chain(self.bulk.drain(..))
            .map(|e| e.item)
    }
}

/// One `SendQueue` per rank (a tunnel's lanes, its traffic classes), served in rank order:
/// strict priority, so a packet of a higher class never waits behind a lower class's backlog
/// in the sender's own queue (it may still share the path's bottleneck with it). Each rank's
/// queue has the same bounds; ranks are made as they are used.
pub struct RankedQueues<T> {
    queues: Vec<SendQueue<T>>,
    limit: usize,
    max_wait: Duration,
    mark_after: Option<Duration>,
}

impl<T> RankedQueues<T> {
    pub fn new(limit: usize, max_wait: Duration) -> RankedQueues<T> {
        RankedQueues {
            queues: Vec::new(),
            limit,
            max_wait,
            mark_after: None,
        }
    }

    /// `SendQueue::push` into `rank`'s queue (at most `wire::MAX_LANES` ranks: a higher rank
    /// joins the last).
    pub fn push(&mut self, rank: u8, now: Instant, flow: Option<u64>, item: T) -> Result<(), T> {
        let r = usize::from(rank).min(crate::wire::MAX_LANES - 1);
        while self.queues.len() <= r {
            let mut q = SendQueue::new(self.limit, self.max_wait);
            q.mark_after = self.mark_after;
            self.queues.push(q);
        }
        self.queues[r].push(now, flow, item)
    }

    /// The next packet: from the highest rank (lowest number) that has one.
    pub fn pop(&mut self, now: Instant, stale: &mut impl FnMut(T)) -> Option<T> {
        self.queues.iter_mut().find_map(|q| q.pop(now, stale))
    }

    /// `pop`, saying whether the packet left through its rank's sparse queue.
    pub fn pop_from(&mut self, now: Instant, stale: &mut impl FnMut(T)) -> Option<(T, bool)> {
        self.queues.iter_mut().find_map(|q| q.pop_from(now, stale))
    }

    /// `SendQueue::pop_marking` from the highest rank that has a packet.
    pub fn pop_marking(
        &mut self,
        now: Instant,
        stale: &mut impl FnMut(T),
        mark: &mut impl FnMut(&mut T),
    ) -> Option<(T, bool)> {
        self.queues
            .iter_mut()
            .find_map(|q| q.pop_marking(now, stale, mark))
    }

    pub fn set_max_wait(&mut self, max_wait: Duration) {
        self.max_wait = max_wait;
        self.queues
            .iter_mut()
            .for_each(|q| q.set_max_wait(max_wait));
    }

    pub fn set_mark_after(&mut self, after: Duration) {
        self.mark_after = Some(after);
        self.queues.iter_mut().for_each(|q| q.set_mark_after(after));
    }

    pub fn len(&self) -> usize {
        self.queues.iter().map(SendQueue::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.queues.iter().all(SendQueue::is_empty)
    }

    /// Whether a sparse flow's packet waits in any rank.
    pub fn has_sparse(&self) -> bool {
        self.queues.iter().any(SendQueue::has_sparse)
    }

    /// Everything still queued (the transport failed).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.queues.iter_mut().flat_map(SendQueue::drain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_served_in_order_each_with_its_own_bound() {
        let t0 = Instant::now();
        let mut q = RankedQueues::new(2, Duration::from_millis(100));
        // Bulk (rank 2) first, then a critical packet (rank 0).
        assert!(q.push(2, t0, Some(1), "bulk-1").is_ok());
        assert!(q.push(2, t0, Some(1), "bulk-2").is_ok());
        assert_eq!(q.push(2, t0, Some(1), "bulk-3"), Err("bulk-3"));
        assert!(q.push(0, t0, Some(2), "crit").is_ok());
        assert!(q.push(1, t0, Some(3), "default").is_ok());
        assert_eq!(q.len(), 4);
        let mut stale = Vec::new();
        let mut out = Vec::new();
        while let Some(p) = q.pop(t0, &mut |p| stale.push(p)) {
            out.push(p);
        }
        assert_eq!(out, ["crit", "default", "bulk-1", "bulk-2"]);
        assert!(q.is_empty() && stale.is_empty());
        // A rank beyond the lanes joins the last; the wait bound holds in every rank.
        assert!(q.push(200, t0, None, "far").is_ok());
        assert!(q
            .push(0, t0 + Duration::from_millis(150), None, "late")
            .is_ok());
        let later = t0 + Duration::from_millis(160);
        assert_eq!(q.pop(later, &mut |p| stale.push(p)), Some("late"));
        assert_eq!(q.pop(later, &mut |p| stale.push(p)), None);
        assert_eq!(stale, ["far"]);
    }

    const WAIT: Duration = Duration::from_millis(20);

    fn pop_all(q: &mut SendQueue<(u64, u32)>, now: Instant) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        while let Some(x) = q.pop(now, &mut |_| panic!("nothing is stale")) {
            out.push(x);
        }
        out
    }

    #[test]
    fn a_ping_passes_a_bulk_backlog() {
        let now = Instant::now();
        let mut q = SendQueue::new(512, WAIT);
        for i in 0..100 {
            q.push(now, Some(1), (1, i)).unwrap();
        }
        q.push(now, Some(2), (2, 0)).unwrap();
        let out = pop_all(&mut q, now);
        // The bulk flow's first two packets were sparse (nothing of it queued yet), then the
        // ping, then the rest of the bulk flow.
        assert_eq!(&out[..3], &[(1, 0), (1, 1), (2, 0)]);
        assert_eq!(out.len(), 101);
        assert_eq!(q.sparse_sent, 3);
    }

    #[test]
    fn a_flows_packets_stay_in_order_whatever_the_mix() {
        let now = Instant::now();
        let mut q = SendQueue::new(10_000, WAIT);
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = [0u32; 5];
        let mut out = Vec::new();
        for _ in 0..5000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let f = rng % 5;
            q.push(now, Some(f), (f, next[f as usize])).unwrap();
            next[f as usize] += 1;
            if rng.is_multiple_of(3) {
                out.extend(q.pop(now, &mut |_| panic!()));
            }
        }
        out.extend(pop_all(&mut q, now));
        let mut seen = [0u32; 5];
        for (f, i) in out {
            assert_eq!(i, seen[f as usize], "flow {f} reordered");
            seen[f as usize] += 1;
        }
        assert_eq!(seen, next);
    }

    /// A flow takes the sparse stream once it has been seen for `SPARSE_AGE`, sparse
    /// throughout; one that was ever bulk stays on the bulk stream until it is forgotten
    /// (`FLOW_FORGET` of silence); a packet without a flow key is bulk.
    #[test]
    fn only_a_flow_that_was_always_sparse_takes_the_sparse_stream() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut lane = SparseLane::default();
        // A ping every 100 ms: on the bulk stream for its first second, then sparse.
        for i in 0..10 {
            assert!(
                !lane.on_stream_sparse(t0 + ms(100 * i), Some(7), true),
                "{i}"
            );
        }
        // `takes_sparse` says so beforehand, without recording anything.
        assert!(!lane.takes_sparse(t0 + ms(999), Some(7)));
        assert!(lane.takes_sparse(t0 + ms(1000), Some(7)));
        assert!(lane.on_stream_sparse(t0 + ms(1000), Some(7), true));
        assert!(lane.on_stream_sparse(t0 + ms(5000), Some(7), true));
        assert!(!lane.on_stream_sparse(t0 + ms(1000), None, true));
        assert!(!lane.takes_sparse(t0 + ms(5000), None));
        assert!(!lane.takes_sparse(t0 + ms(5000), Some(8)));
        assert!(!lane.takes_sparse(t0 + ms(15_000), Some(7)));
        // Forgotten after 10 s of silence: a new flow again.
        assert!(!lane.on_stream_sparse(t0 + ms(15_000), Some(7), true));
        // A flow that was bulk once, then slows down or pauses: bulk for good.
        assert!(!lane.on_stream_sparse(t0, Some(1), false));
        assert!(!lane.takes_sparse(t0 + ms(2000), Some(1)));
        assert!(!lane.on_stream_sparse(t0 + ms(2000), Some(1), true));
        assert!(!lane.on_stream_sparse(t0 + ms(9000), Some(1), true));
        // ... until it was silent for `FLOW_FORGET`.
        assert!(!lane.on_stream_sparse(t0 + ms(19_000), Some(1), true));
        assert!(lane.on_stream_sparse(t0 + ms(20_000), Some(1), true));
    }

    /// A call beside 16 bulk flows keeps the sparse stream whatever their keys, even one equal
    /// to its own in its low bits; the table is bounded, a flow beyond it bulk, and room is
    /// made once flows have been silent for `FLOW_FORGET`.
    #[test]
    fn a_sparse_flow_is_not_taken_for_a_bulk_one() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut lane = SparseLane::default();
        let call = 0x1234_5678_9abc_de07_u64;
        for i in 0..=50 {
            let now = t0 + ms(20 * i);
            // Bulk flows, one of them sharing the call's low 16 bits.
            for b in 0..16u64 {
                lane.on_stream_sparse(now, Some((call & 0xffff) | ((b + 1) << 16)), false);
            }
            let sparse = lane.on_stream_sparse(now, Some(call), true);
            assert_eq!(sparse, now >= t0 + SPARSE_AGE, "{i}");
        }
        assert_eq!(lane.len(), 17);
        // Full: a new flow is bulk, the ones tracked keep their stream.
        let t1 = t0 + ms(2000);
        for k in 0..(LANE_FLOWS as u64 - 17) {
            lane.on_stream_sparse(t1, Some(1_000_000 + k), true);
        }
        assert_eq!(lane.len(), LANE_FLOWS);
        assert!(!lane.on_stream_sparse(t1 + ms(1000), Some(7), true));
        assert!(lane.on_stream_sparse(t1 + ms(1000), Some(call), true));
        // The others silent for `FLOW_FORGET`: forgotten, and the new flow is tracked.
        let t2 = t1 + FLOW_FORGET;
        assert!(!lane.on_stream_sparse(t2, Some(7), true));
        assert_eq!(lane.len(), 2);
        assert!(lane.on_stream_sparse(t2 + SPARSE_AGE, Some(7), true));
    }

    /// The limit follows the path: raised, more may wait; lowered below what waits, nothing
    /// waiting is dropped and new packets are refused until the queue is below it.
    #[test]
    fn the_limit_can_change() {
        let now = Instant::now();
        let mut q = SendQueue::new(2, WAIT);
        q.push(now, Some(1), (1, 0)).unwrap();
        q.push(now, Some(1), (1, 1)).unwrap();
        assert!(q.push(now, Some(1), (1, 2)).is_err());
        q.set_limit(4);
        q.push(now, Some(1), (1, 2)).unwrap();
        q.push(now, Some(1), (1, 3)).unwrap();
        q.set_limit(1);
        assert!(q.push(now, Some(1), (1, 4)).is_err());
        assert_eq!(q.len(), 4);
        assert_eq!(pop_all(&mut q, now).len(), 4);
        q.push(now, Some(2), (2, 0)).unwrap();
    }

    #[test]
    fn bounded_and_stale_packets_are_dropped() {
        let t0 = Instant::now();
        let mut q = SendQueue::new(3, WAIT);
        for i in 0..3 {
            q.push(t0, Some(1), (1, i)).unwrap();
        }
        // Full: a sparse flow's packet takes the oldest bulk packet's place (the third of
        // flow 1; its first two were sparse), a bulk one is refused.
        assert_eq!(q.push(t0, Some(2), (2, 0)), Err((1, 2)));
        assert_eq!(q.push(t0, Some(1), (1, 9)), Err((1, 9)));
        let mut stale = Vec::new();
        // Past the bulk bound, the sparse packets are still sent (a stalled sender loses none
        // of a ping), and a bulk one is stale; past `SPARSE_MAX_WAIT` they are stale too.
        let later = t0 + WAIT + Duration::from_millis(1);
        q.push(t0 + WAIT, None, (9, 9)).ok();
        assert_eq!(q.pop(later, &mut |x| stale.push(x)), Some((1, 0)));
        q.push(t0, None, (8, 8)).unwrap();
        assert_eq!(q.pop(later, &mut |x| stale.push(x)), Some((1, 1)));
        assert_eq!(stale, []);
        assert_eq!(
            q.pop(t0 + SPARSE_MAX_WAIT, &mut |x| stale.push(x)),
            Some((2, 0))
        );
        assert_eq!(q.pop(later, &mut |x| stale.push(x)), None);
        assert_eq!(stale, [(8, 8)]);
        q.push(t0, Some(3), (3, 0)).unwrap();
        let later = t0 + SPARSE_MAX_WAIT + Duration::from_millis(1);
        assert_eq!(q.pop(later, &mut |x| stale.push(x)), None);
        assert_eq!(stale, [(8, 8), (3, 0)]);
        // Counts are consistent after drops: the flow is sparse again.
        q.push(later, Some(1), (1, 3)).unwrap();
        assert_eq!(q.pop(later, &mut |_| {}), Some((1, 3)));
        assert!(q.is_empty());
    }

    /// Bulk packets that waited over `mark_after` (a round trip, here 10 ms) are offered for a
    /// mark, those that waited less and sparse ones are not; past the bound they are dropped.
    #[test]
    fn bulk_packets_that_waited_are_offered_for_a_mark() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut q = SendQueue::new(100, ms(30));
        q.set_mark_after(mark_after(ms(10), ms(30)));
        for i in 0..6 {
            q.push(t0 + ms(u64::from(i) * 5), Some(1), (1, i)).unwrap();
        }
        let mut offered = Vec::new();
        let mut stale = Vec::new();
        // At 17 ms: (1, 0) and (1, 1) are sparse; (1, 2) waited 7 ms, (1, 3) 2 ms: none is
        // offered. At 35 ms (1, 4) waited 15 ms (over 10): offered; (1, 5) waited 10: not.
        type Item = (u64, u32);
        let mut pop = |q: &mut SendQueue<Item>, at: Duration| {
            q.pop_marking(t0 + at, &mut |x| stale.push(x), &mut |x: &mut Item| {
                offered.push(*x)
            })
        };
        for _ in 0..4 {
            assert!(pop(&mut q, ms(17)).is_some());
        }
        assert!(pop(&mut q, ms(35)).is_some());
        assert!(pop(&mut q, ms(35)).is_some());
        assert_eq!(offered, [(1, 4)]);
        // Past the bound: dropped, not offered.
        q.push(t0, Some(1), (1, 9)).unwrap();
        q.push(t0, Some(1), (1, 9)).unwrap();
        q.push(t0, Some(1), (1, 9)).unwrap();
        let mut no_mark = |_: &mut Item| panic!("sparse or stale: not offered");
        let (item, _) = q
            .pop_marking(t0 + ms(31), &mut |x| stale.push(x), &mut no_mark)
            .unwrap();
        assert_eq!(item, (1, 9), "a sparse one still goes");
        assert!(q
            .pop_marking(t0 + ms(31), &mut |x| stale.push(x), &mut no_mark)
            .is_some());
        assert!(q
            .pop_marking(t0 + ms(31), &mut |x| stale.push(x), &mut no_mark)
            .is_none());
        assert_eq!(stale.len(), 1);
        // A round trip, at most half the bound.
        assert_eq!(mark_after(ms(10), ms(30)), ms(10));
        assert_eq!(mark_after(ms(100), ms(200)), ms(100));
        assert_eq!(mark_after(ms(150), ms(200)), ms(100));
    }

    /// A full queue of one bulk flow: a sparse packet displaces the bulk backlog's oldest, and
    /// a sparse packet finding nothing bulk to displace is refused.
    #[test]
    fn a_sparse_packet_is_not_lost_to_a_full_bulk_backlog() {
        let now = Instant::now();
        let mut q = SendQueue::new(4, WAIT);
        for i in 0..4 {
            q.push(now, Some(1), (1, i)).unwrap();
        }
        assert_eq!(q.push(now, Some(1), (1, 4)), Err((1, 4)));
        assert_eq!(q.push(now, Some(2), (2, 0)), Err((1, 2)));
        assert_eq!(pop_all(&mut q, now), [(1, 0), (1, 1), (2, 0), (1, 3)]);
        let mut q = SendQueue::new(2, WAIT);
        q.push(now, Some(1), (1, 0)).unwrap();
        q.push(now, Some(2), (2, 0)).unwrap();
        assert_eq!(q.push(now, Some(3), (3, 0)), Err((3, 0)));
    }

    /// `WaitingFlows`: a flow is sparse below `SPARSE_PACKETS` on their way, busy at it, and
    /// sparse again once they have left.
    #[test]
    fn waiting_flows_count_what_is_on_its_way() {
        let w = WaitingFlows::default();
        assert!(w.is_sparse(Some(1)) && !w.is_sparse(None) && w.is_empty());
        w.add(Some(1));
        assert!(w.is_sparse(Some(1)));
        w.add(Some(1));
        w.add(None);
        assert!(!w.is_sparse(Some(1)) && w.is_sparse(Some(2)));
        // A flow sharing flow 1's counter looks busy with it.
        assert!(!w.is_sparse(Some(1 + FLOW_BUCKETS as u64)));
        w.sub(Some(1));
        w.sub(None);
        w.sub(Some(1));
        assert!(w.is_sparse(Some(1)) && w.is_empty());
    }
}
