//! One direction of an emulated link, sans-IO: packets go in with `push(now, ..)`, come out of
//! `poll(now, ..)` when their time has come, and `next_deadline()` says when to call again.
//!
//! Stages, in order: state (down/blackhole) -> MTU -> loss (Bernoulli or Gilbert-Elliott) ->
//! duplication -> per-flow cap (a shaper per 5-tuple, bounded in time) -> the link's rate (one
//! FIFO, drop-tail bounded in time or bytes, optional CoDel) -> propagation delay with jitter
//! (order kept unless asked) and optional reordering.
//!
//! Departure and arrival times are computed exactly when a packet enters a stage, so a late
//! `poll` delays delivery only by its own lateness, never the link's model.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::rng::Rng;
use super::spec::{JitterDist, LinkSpec, LinkState, QueueLimit};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LinkStats {
    pub in_packets: u64,
    pub in_bytes: u64,
    pub out_packets: u64,
    pub out_bytes: u64,
    pub dropped_state: u64,
    pub dropped_mtu: u64,
    pub dropped_loss: u64,
    pub dropped_flow_cap: u64,
    pub dropped_queue: u64,
    pub dropped_codel: u64,
    pub duplicated: u64,
    pub reordered: u64,
}

/// An entry of a time-ordered heap; `seq` keeps equal times in arrival order.
struct Timed<P> {
    at: Instant,
    seq: u64,
    len: usize,
    payload: P,
}
impl<P> PartialEq for Timed<P> {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl<P> Eq for Timed<P> {}
impl<P> PartialOrd for Timed<P> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<P> Ord for Timed<P> {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

struct Queued<P> {
    enqueued: Instant,
    depart: Instant,
    len: usize,
    payload: P,
}

/// CoDel (RFC 8289) with the standard 5 ms target and 100 ms interval.
#[derive(Default)]
struct Codel {
    first_above: Option<Instant>,
    dropping: bool,
    drop_next: Option<Instant>,
    count: u32,
}
const CODEL_TARGET: Duration = Duration::from_millis(5);
const CODEL_INTERVAL: Duration = Duration::from_millis(100);

impl Codel {
    fn control(&self, t: Instant) -> Instant {
        t + CODEL_INTERVAL.div_f64(f64::from(self.count.max(1)).sqrt())
    }

    /// Whether the packet leaving at `now` after `sojourn` in the queue is dropped.
    fn should_drop(&mut self, now: Instant, sojourn: Duration, queue_empty: bool) -> bool {
        let ok_to_drop = if sojourn < CODEL_TARGET || queue_empty {
            self.first_above = None;
            false
        } else {
            match self.first_above {
                None => {
                    self.first_above = Some(now + CODEL_INTERVAL);
                    false
                }
                Some(t) => now >= t,
            }
        };
        if self.dropping {
            if !ok_to_drop {
                self.dropping = false;
                return false;
            }
            if self.drop_next.is_some_and(|t| now >= t) {
                self.count += 1;
                self.drop_next = Some(self.control(self.drop_next.unwrap_or(now)));
                return true;
            }
            false
        } else if ok_to_drop {
            self.dropping = true;
            self.count = if self.count > 2 { self.count - 2 } else { 1 };
            self.drop_next = Some(self.control(now));
            true
        } else {
            false
        }
    }
}

pub struct Link<P> {
    spec: LinkSpec,
    rng: Rng,
    ge_bad: bool,
    seq: u64,
    /// Per-flow cap: when each flow's shaper is next free.
    flow_free: HashMap<u64, Instant>,
    flow_wait: BinaryHeap<Reverse<Timed<P>>>,
    /// The link's FIFO, in departure order.
    link_free: Option<Instant>,
    queue: VecDeque<Queued<P>>,
    queued_bytes: u64,
    codel: Codel,
    /// Propagation: packets ordered by arrival time.
    in_flight: BinaryHeap<Reverse<Timed<P>>>,
    last_arrival: Option<Instant>,
    pub stats: LinkStats,
}

fn tx_time(len: usize, bps: u64) -> Duration {
    Duration::from_nanos((len as u64 * 8).saturating_mul(1_000_000_000) / bps.max(1))
}

impl<P: Clone> Link<P> {
    pub fn new(spec: LinkSpec, seed: u64) -> Link<P> {
        Link {
            spec,
            rng: Rng::new(seed),
            ge_bad: false,
            seq: 0,
            flow_free: HashMap::new(),
            flow_wait: BinaryHeap::new(),
            link_free: None,
            queue: VecDeque::new(),
            queued_bytes: 0,
            codel: Codel::default(),
            in_flight: BinaryHeap::new(),
            last_arrival: None,
            stats: LinkStats::default(),
        }
    }

    pub fn spec(&self) -> &LinkSpec {
        &self.spec
    }

    /// Change the link live. Packets already in flight keep the timing they were given.
    pub fn set_spec(&mut self, spec: LinkSpec) {
        if spec.flow_rate_bps != self.spec.flow_rate_bps {
            self.flow_free.clear();
        }
        self.spec = spec;
    }

    /// A packet of `len` bytes (IP length) enters the link; `flow` is its 5-tuple hash.
    pub fn push(&mut self, now: Instant, payload: P, len: usize, flow: u64) {
        self.stats.in_packets += 1;
        self.stats.in_bytes += len as u64;
        if self.spec.state != LinkState::Up {
            self.stats.dropped_state += 1;
            return;
        }
        if self.spec.mtu.is_some_and(|m| len > m as usize) {
            self.stats.dropped_mtu += 1;
            return;
        }
        if self.lost() {
            self.stats.dropped_loss += 1;
            return;
        }
        if self.rng.chance(self.spec.dup) {
            self.stats.duplicated += 1;
            self.admit(now, payload.clone(), len, flow);
        }
        self.admit(now, payload, len, flow);
    }

    fn lost(&mut self) -> bool {
        if let Some(ge) = self.spec.ge {
            // Transition first, then lose with the state's probability.
            self.ge_bad = if self.ge_bad {
                !self.rng.chance(ge.r)
            } else {
                self.rng.chance(ge.p)
            };
            let p = if self.ge_bad {
                ge.loss_bad
            } else {
                ge.loss_good
            };
            if self.rng.chance(p) {
                return true;
            }
        }
        self.rng.chance(self.spec.loss)
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Per-flow cap, then the link queue.
    fn admit(&mut self, now: Instant, payload: P, len: usize, flow: u64) {
        let Some(rate) = self.spec.flow_rate_bps else {
            return self.enqueue(now, payload, len);
        };
        let free = self.flow_free.get(&flow).copied().unwrap_or(now).max(now);
        if free.saturating_duration_since(now) > self.spec.flow_queue {
            self.stats.dropped_flow_cap += 1;
            return;
        }
        self.flow_free.insert(flow, free + tx_time(len, rate));
        if self.flow_free.len() > 65_536 {
            self.flow_free.retain(|_, t| *t > now);
        }
        let seq = self.next_seq();
        self.flow_wait.push(Reverse(Timed {
            at: free,
            seq,
            len,
            payload,
        }));
    }

    /// The link's FIFO at time `t` (drop-tail).
    fn enqueue(&mut self, t: Instant, payload: P, len: usize) {
        let Some(rate) = self.spec.rate_bps else {
            return self.propagate(t, payload, len);
        };
        let start = self.link_free.map_or(t, |f| f.max(t));
        let full = match self.spec.queue {
            QueueLimit::Time(limit) => start.saturating_duration_since(t) > limit,
            QueueLimit::Bytes(limit) => self.queued_bytes + len as u64 > limit,
        };
        if full {
            self.stats.dropped_queue += 1;
            return;
        }
        let depart = start + tx_time(len, rate);
        self.link_free = Some(depart);
        self.queued_bytes += len as u64;
        self.queue.push_back(Queued {
            enqueued: t,
            depart,
            len,
            payload,
        });
    }

    /// Propagation delay from time `t` (when the last bit left).
    fn propagate(&mut self, t: Instant, payload: P, len: usize) {
        let mut arrival = t + self.delay_sample();
        if self.rng.chance(self.spec.reorder) {
            // Skips the delay: overtakes what is in flight.
            arrival = t;
            self.stats.reordered += 1;
        } else if self.spec.keep_order {
            if let Some(last) = self.last_arrival {
                arrival = arrival.max(last);
            }
            self.last_arrival = Some(arrival);
        }
        let seq = self.next_seq();
        self.in_flight.push(Reverse(Timed {
            at: arrival,
            seq,
            len,
            payload,
        }));
    }

    fn delay_sample(&mut self) -> Duration {
        let d = self.spec.delay.as_secs_f64();
        let j = self.spec.jitter.as_secs_f64();
        if j == 0.0 {
            return self.spec.delay;
        }
        let offset = match self.spec.jitter_dist {
            JitterDist::Uniform => (self.rng.unit() * 2.0 - 1.0) * j,
            JitterDist::Normal => self.rng.normal() * j,
            // Heavy tail to the late side, mean offset 0.
            JitterDist::Pareto => (self.rng.pareto_mean1(3.0) - 1.0) * j,
        };
        Duration::from_secs_f64((d + offset).max(0.0))
    }

    /// Move time forward to `now`; packets that have arrived are appended to `out`.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<P>) {
        while self.flow_wait.peek().is_some_and(|t| t.0.at <= now) {
            let Reverse(t) = self.flow_wait.pop().expect("peeked");
            self.enqueue(t.at, t.payload, t.len);
        }
        while self.queue.front().is_some_and(|q| q.depart <= now) {
            let q = self.queue.pop_front().expect("peeked");
            self.queued_bytes -= q.len as u64;
            if self.spec.codel {
                let sojourn = q.depart.saturating_duration_since(q.enqueued);
                if self
                    .codel
                    .should_drop(q.depart, sojourn, self.queue.is_empty())
                {
                    self.stats.dropped_codel += 1;
                    continue;
                }
            }
            self.propagate(q.depart, q.payload, q.len);
        }
        while self.in_flight.peek().is_some_and(|t| t.0.at <= now) {
            let Reverse(t) = self.in_flight.pop().expect("peeked");
            self.stats.out_packets += 1;
            self.stats.out_bytes += t.len as u64;
            out.push(t.payload);
        }
    }

    /// When `poll` next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        [
            self.flow_wait.peek().map(|t| t.0.at),
            self.queue.front().map(|q| q.depart),
            self.in_flight.peek().map(|t| t.0.at),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Packets inside the link (shapers, queue, in flight).
    pub fn backlog(&self) -> usize {
        self.flow_wait.len() + self.queue.len() + self.in_flight.len()
    }
}
