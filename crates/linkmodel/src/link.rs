//! One direction of an emulated link, sans-IO: packets go in with `push(now, ..)`, come out of
//! `poll(now, ..)` when their time has come, and `next_deadline()` says when to call again.
//!
//! Stages, in order: state (down/blackhole) -> MTU -> loss (Bernoulli, Gilbert-Elliott, a
//! recorded loss trace) -> duplication -> per-flow cap (a shaper per 5-tuple, bounded in time)
//! -> the link's capacity (a rate, a rate per wall-clock slot, or recorded delivery
//! opportunities; one FIFO, drop-tail bounded in time or bytes, optional CoDel) -> propagation
//! delay (fixed or recorded) with jitter (order kept unless asked) and optional reordering.
//!
//! Departure and arrival times are computed exactly when a packet enters a stage, so a late
//! `poll` delays delivery only by its own lateness, never the link's model. The inner stages move
//! lazily (on `push` and `poll`, in time order), so `next_deadline()` is the next time a packet
//! may *leave* the link: a shell wakes up for deliveries, not for every departure from the rate
//! limiter (at 300 Mbit/s that would be every 40 us).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::rng::Rng;
use super::spec::{JitterDist, LinkSpec, LinkState, QueueLimit};
use super::trace::{CapacityTrace, StepTrace, OPPORTUNITY_BYTES};

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
    /// How late `poll` released packets after their model time, summed (ns) and at most (ns):
    /// the shell's contribution to the delay (wake-up latency and batching).
    pub late_ns_total: u64,
    pub late_ns_max: u64,
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

/// Where a capacity trace's FIFO stands: the opportunity the last packet left in (index within
/// the period that starts at `cycle_at`) and the bytes it has left.
#[derive(Debug, Clone, Copy)]
struct Opportunity {
    cycle_at: Instant,
    i: usize,
    left: u64,
}

impl Opportunity {
    fn at(&self, trace: &CapacityTrace) -> Instant {
        self.cycle_at + trace.time_of(self.i)
    }

    fn next(self, trace: &CapacityTrace) -> Opportunity {
        let (cycle_at, i) = if self.i + 1 >= trace.len() {
            (self.cycle_at + trace.period, 0)
        } else {
            (self.cycle_at, self.i + 1)
        };
        Opportunity {
            cycle_at,
            i,
            left: OPPORTUNITY_BYTES,
        }
    }
}

pub struct Link<P> {
    spec: LinkSpec,
    seed: u64,
    rng: Rng,
    /// Time zero of the recordings and slots (`set_epoch`): the start of a wall-clock minute
    /// in the lab; the first packet's time when nobody set it.
    epoch: Option<Instant>,
    /// A capacity trace's position.
    opportunity: Option<Opportunity>,
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

/// `t` on a recording's clock: since `epoch`, less `trace_at`, within its `period` (a
/// recording repeats).
fn trace_time(epoch: Instant, trace_at: Duration, t: Instant, period: Duration) -> Duration {
    let since = match t.checked_duration_since(epoch) {
        Some(d) => d.as_nanos() as i128,
        None => -(epoch.duration_since(t).as_nanos() as i128),
    } - trace_at.as_nanos() as i128;
    let period = period.as_nanos().max(1) as i128;
    Duration::from_nanos(since.rem_euclid(period) as u64)
}

fn tx_time(len: usize, bps: u64) -> Duration {
    Duration::from_nanos((len as u64 * 8).saturating_mul(1_000_000_000) / bps.max(1))
}

impl<P: Clone> Link<P> {
    pub fn new(spec: LinkSpec, seed: u64) -> Link<P> {
        Link {
            spec,
            seed,
            rng: Rng::new(seed),
            epoch: None,
            opportunity: None,
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
        if spec.capacity_trace != self.spec.capacity_trace || spec.trace_at != self.spec.trace_at {
            self.opportunity = None;
        }
        self.spec = spec;
    }

    /// Time zero of the recordings (`trace_at` counts from it) and of the rate slots. The lab
    /// sets the start of the wall clock's minute, so a link replays Starlink's slots when the
    /// real ones change; the simulator leaves it at the first packet.
    pub fn set_epoch(&mut self, epoch: Instant) {
        self.epoch = Some(epoch);
        self.opportunity = None;
    }

    fn epoch(&mut self, now: Instant) -> Instant {
        *self.epoch.get_or_insert(now)
    }

    /// A step trace's value at `t` (`which` picks the trace out of the spec).
    fn step_value(
        &mut self,
        t: Instant,
        which: fn(&LinkSpec) -> Option<&StepTrace>,
    ) -> Option<u64> {
        let epoch = self.epoch(t);
        let trace = which(&self.spec)?;
        let period = match self.spec.trace_repeat {
            Some(r) => r.min(trace.period()),
            None => trace.period(),
        };
        Some(trace.at(trace_time(epoch, self.spec.trace_at, t, period)))
    }

    /// A packet of `len` bytes (IP length) enters the link; `flow` is its 5-tuple hash.
    pub fn push(&mut self, now: Instant, payload: P, len: usize, flow: u64) {
        // The queue as it is at `now` (departures due by then have left it).
        self.advance(now);
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
        if self.lost(now) {
            self.stats.dropped_loss += 1;
            return;
        }
        if self.rng.chance(self.spec.dup) {
            self.stats.duplicated += 1;
            self.admit(now, payload.clone(), len, flow);
        }
        self.admit(now, payload, len, flow);
    }

    fn lost(&mut self, now: Instant) -> bool {
        if self.step_value(now, |s| s.loss_trace.as_ref()) == Some(1) {
            return true;
        }
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
        let shaped = self.spec.rate_bps.is_some()
            || self.spec.rate_slots.is_some()
            || self.spec.capacity_trace.is_some();
        if !shaped {
            return self.propagate(t, payload, len);
        }
        let start = self.link_free.map_or(t, |f| f.max(t));
        let full = match self.spec.queue {
            QueueLimit::Time(limit) => start.saturating_duration_since(t) > limit,
            QueueLimit::Bytes(limit) => self.queued_bytes + len as u64 > limit,
        };
        if full {
            self.stats.dropped_queue += 1;
            return;
        }
        let epoch = self.epoch(t);
        let depart = if let Some(rate) = self.spec.rate_bps {
            start + tx_time(len, rate)
        } else if let Some(slots) = &self.spec.rate_slots {
            // The slot the transmission starts in sets its rate.
            let slot = slots.slot(start.saturating_duration_since(epoch));
            start + tx_time(len, slots.rate(slot, self.seed))
        } else {
            self.take_opportunities(t, len as u64, epoch)
        };
        self.link_free = Some(depart);
        self.queued_bytes += len as u64;
        self.queue.push_back(Queued {
            enqueued: t,
            depart,
            len,
            payload,
        });
    }

    /// A packet of `bytes` entering at `t` leaves at the delivery opportunity that carries its
    /// last byte (Mahimahi's queue: each opportunity carries 1500 bytes; what one packet
    /// leaves of it carries the next if that one is already waiting; an opportunity nobody
    /// waits for is lost).
    fn take_opportunities(&mut self, t: Instant, bytes: u64, epoch: Instant) -> Instant {
        let trace = self.spec.capacity_trace.as_ref().expect("a capacity trace");
        let busy = self.link_free.is_some_and(|f| t <= f);
        let mut o = match self.opportunity {
            Some(o) if busy && o.left > 0 => o,
            Some(o) if busy => o.next(trace),
            _ => {
                let within = trace_time(epoch, self.spec.trace_at, t, trace.period);
                let first = Opportunity {
                    cycle_at: t - within,
                    i: trace.first_at_or_after(within),
                    left: OPPORTUNITY_BYTES,
                };
                if first.i >= trace.len() {
                    Opportunity {
                        cycle_at: first.cycle_at + trace.period,
                        i: 0,
                        ..first
                    }
                } else {
                    first
                }
            }
        };
        let mut need = bytes;
        loop {
            let take = need.min(o.left);
            need -= take;
            o.left -= take;
            if need == 0 {
                break;
            }
            o = o.next(trace);
        }
        self.opportunity = Some(o);
        o.at(trace)
    }

    /// Propagation delay from time `t` (when the last bit left).
    fn propagate(&mut self, t: Instant, payload: P, len: usize) {
        let mut arrival = t + self.delay_sample(t);
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

    /// The propagation delay of a packet whose last bit left at `t`.
    fn delay_sample(&mut self, t: Instant) -> Duration {
        let recorded = self.step_value(t, |s| s.delay_trace.as_ref()).unwrap_or(0);
        let base = self.spec.delay + Duration::from_nanos(recorded);
        let d = base.as_secs_f64();
        let j = self.spec.jitter.as_secs_f64();
        if j == 0.0 {
            return base;
        }
        let offset = match self.spec.jitter_dist {
            JitterDist::Uniform => (self.rng.unit() * 2.0 - 1.0) * j,
            JitterDist::Normal => self.rng.normal() * j,
            // Heavy tail to the late side, mean offset 0.
            JitterDist::Pareto => (self.rng.pareto_mean1(3.0) - 1.0) * j,
        };
        Duration::from_secs_f64((d + offset).max(0.0))
    }

    /// Move the inner stages forward to `now`, in time order: a shaped packet enters the FIFO
    /// at its time, the FIFO's front leaves at its departure (CoDel decides then, seeing the
    /// queue as it was at that moment). Nothing leaves the link here.
    fn advance(&mut self, now: Instant) {
        loop {
            let shaped = self.flow_wait.peek().map(|t| t.0.at).filter(|t| *t <= now);
            let departs = self.queue.front().map(|q| q.depart).filter(|t| *t <= now);
            match (shaped, departs) {
                // At equal times the departure goes first: it frees its place in the queue.
                (Some(s), Some(d)) if d <= s => self.depart_front(),
                (Some(_), _) => {
                    let Reverse(t) = self.flow_wait.pop().expect("peeked");
                    self.enqueue(t.at, t.payload, t.len);
                }
                (None, Some(_)) => self.depart_front(),
                (None, None) => break,
            }
        }
    }

    fn depart_front(&mut self) {
        let q = self.queue.pop_front().expect("caller saw a front");
        self.queued_bytes -= q.len as u64;
        if self.spec.codel {
            let sojourn = q.depart.saturating_duration_since(q.enqueued);
            if self
                .codel
                .should_drop(q.depart, sojourn, self.queue.is_empty())
            {
                self.stats.dropped_codel += 1;
                return;
            }
        }
        self.propagate(q.depart, q.payload, q.len);
    }

    /// Move time forward to `now`; packets that have arrived are appended to `out`.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<P>) {
        self.advance(now);
        while self.in_flight.peek().is_some_and(|t| t.0.at <= now) {
            let Reverse(t) = self.in_flight.pop().expect("peeked");
            self.stats.out_packets += 1;
            self.stats.out_bytes += t.len as u64;
            let late = now.saturating_duration_since(t.at).as_nanos() as u64;
            self.stats.late_ns_total += late;
            self.stats.late_ns_max = self.stats.late_ns_max.max(late);
            out.push(t.payload);
        }
    }

    /// The earliest time a packet may leave the link (`poll` has something to deliver then,
    /// or, rarely, only inner stages to move: a CoDel drop, or jitter that came out longer
    /// than its lower bound). A packet still in the shaper or the FIFO leaves no earlier than
    /// its stage time plus the shortest propagation delay.
    pub fn next_deadline(&self) -> Option<Instant> {
        let min = self.min_delay();
        [
            self.in_flight.peek().map(|t| t.0.at),
            self.queue.front().map(|q| q.depart + min),
            self.flow_wait.peek().map(|t| t.0.at + min),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// No packet pushed at `t` leaves before `t + min_delay()`: the shortest propagation delay
    /// the spec can give (a shell may read its input this late without changing the model).
    pub fn min_delay(&self) -> Duration {
        // Float rounding in `delay_sample` stays far within this margin.
        const MARGIN: Duration = Duration::from_micros(1);
        let recorded = self.spec.delay_trace.as_ref().map_or(0, StepTrace::min);
        let d = self.spec.delay + Duration::from_nanos(recorded);
        let j = self.spec.jitter;
        if self.spec.reorder > 0.0 {
            return Duration::ZERO;
        }
        let min = match self.spec.jitter_dist {
            _ if j.is_zero() => return d,
            JitterDist::Uniform => d.saturating_sub(j),
            JitterDist::Normal => Duration::ZERO,
            // pareto_mean1(3) >= 2/3, so the offset is at least -j/3.
            JitterDist::Pareto => d.saturating_sub(j / 3),
        };
        min.saturating_sub(MARGIN)
    }

    /// Packets waiting to be sent (shapers and queue; not those on the wire).
    pub fn queued(&self) -> usize {
        self.flow_wait.len() + self.queue.len()
    }

    /// Packets inside the link (shapers, queue, in flight).
    pub fn backlog(&self) -> usize {
        self.flow_wait.len() + self.queue.len() + self.in_flight.len()
    }
}
