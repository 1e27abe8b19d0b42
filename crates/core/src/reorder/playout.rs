//! The receiving side of a path's stream holds packets so that they leave a steady delay
//! after they were sent, instead of in bursts whenever a retransmission fills the stream's
//! oldest gap.
//!
//! Why: on a lossy path a reliable stream delivers nothing behind a lost packet until its
//! retransmission arrives, a round trip or more later (several at 30% loss, where a
//! retransmission is lost again often). Inner TCP then sees its RTT swing between the path's
//! and several times that. Inner BBR keeps two BDPs of its *minimum* RTT in flight, which
//! covers an RTT of at most twice the minimum: beyond that its delivery rate falls, and its
//! bandwidth estimate with it, round after round (scenario 02, 60 Mbit/s with 30% loss: 5-7
//! Mbit/s). Held to a steady delay, the same flow got 26-37 Mbit/s, and 48 instead of 28-44
//! at 10% loss; inner cubic was unchanged within noise.
//!
//! When: only while the stream makes packets wait for retransmissions. Each packet comes with
//! its head-of-line wait, measured by the stream's reassembly (`reassembly.rs`); the playout
//! acts in a second where at least a quarter of the packets waited (the `QUANTILE` of the
//! waits is `MIN_WAIT` or more). Queueing is not such a wait: a clean or merely busy path, and
//! a quiet one beside someone else's upload, get no added latency (a ping beside bulk was held
//! to the queue's swings when the delay's spread alone decided: a 40-45 ms plateau).
//!
//! How much: each packet carries its send time (the sender's clock, microseconds, wrapping).
//! The receiver's arrival time minus that is the one-way delay plus an unknown constant; its
//! minimum over the last 10-20 s (`BASE_WINDOW`) is the path's base, and what a packet has
//! above it is its *excess* (queueing and head-of-line waiting both: inner TCP is best served
//! by a steady RTT, and on a lossy path its own queue's swings add to the waits). The delay is
//! the `QUANTILE` of the second's excess, and a packet is released once its excess reaches it.
//! Holding a packet to the quantile costs it latency only where it was faster than that.
//! Packets leave in order, and none is held more than `MAX_DELAY`.
//!
//! How long: while the path loses, and for `HOLD` after its last lossy second, for the flows
//! that are bulk (`BULK_BYTES` carried), once the path has lost for `LOSSY_FOR` without a clean
//! second between. A link that turns lossy now and then (a radio link
//! between good and bad cells, Starlink's slots) would otherwise swing inner TCP's RTT between
//! the clean path's and the lossy one's, and a loss-based inner TCP is sized by the RTT it had:
//! its window from a clean phase fills about half the path once the waits add a hundred
//! milliseconds, and cubic takes longer than a phase to grow it (one cubic upload over a link
//! switching every 8 s between clean and 8% loss: lossy phases at 24-31 of 46 Mbit/s). Held to
//! the lossy delay through the clean phases, its window stays the size the lossy phases need.
//! Short flows (a page's objects) and everything that is not TCP are not held once the loss
//! has stopped: what they lose to a hold is latency, and they gain nothing from a steady RTT.
//! Nor is anything held on after a loss that lasted a second or two: that is an inner TCP's
//! start-up overflowing the bottleneck's queue, not a lossy link, and a flow held to its delay
//! for 20 s ran at its window over an RTT 2.5 times the path's (an upload beside a call over
//! 20 Mbit/s, 40 ms: 7-15 instead of 18 Mbit/s).

use std::time::{Duration, Instant};

use crate::sendq::FLOW_FORGET;

/// The share of packets whose excess the delay covers; a quarter or more of them waiting for
/// retransmissions is what turns it on.
pub const QUANTILE: f64 = 0.75;
/// How often the delay is set anew, from at least `MIN_SAMPLES` packets (at most `MAX_SAMPLES`
/// are kept; a busier second ends its window early).
pub const WINDOW: Duration = Duration::from_secs(1);
const MIN_SAMPLES: usize = 50;
const MAX_SAMPLES: usize = 8192;
/// The most a packet is held for.
pub const MAX_DELAY: Duration = Duration::from_millis(250);
/// The base one-way delay is the smallest seen over the last one to two of these windows, so a
/// route that grew longer is followed within 20 s.
pub const BASE_WINDOW: Duration = Duration::from_secs(10);
/// Head-of-line waits shorter than this are the reader's own scheduling, not retransmissions.
pub const MIN_WAIT: Duration = Duration::from_millis(1);
/// How long after its last lossy second a path still holds its bulk flows to the delay.
pub const HOLD: Duration = Duration::from_secs(20);
/// How long a path loses, without a clean window between, before bulk flows are held for
/// `HOLD` (windows, not packets: a window ends early on a fast path).
pub const LOSSY_FOR: Duration = Duration::from_secs(3);
/// A flow that brought this much since it was first seen is bulk (a page's objects do not).
pub const BULK_BYTES: u64 = 1 << 20;
/// Flows share slots by hash: a slot counts for the last flow seen in it, so a collision can
/// make a bulk flow look short (not held, as before the loss), never a short flow bulk (a
/// page's objects after a download were held when they counted on in its slots: 6 objects
/// at a time over Starlink, p95 1.3x). A flow silent for `sendq::FLOW_FORGET` is forgotten.
const FLOW_BUCKETS: usize = 256;

/// Bytes a flow (its full hash) brought since it was first seen, and when it was last seen.
#[derive(Debug, Clone, Copy, Default)]
struct FlowBytes {
    flow: u64,
    bytes: u64,
    last: Option<Instant>,
}

#[derive(Debug)]
pub struct Playout {
    /// The receiver's clock origin (the first packet's arrival).
    epoch: Option<Instant>,
    /// Smallest relative one-way delay (µs, wrapping) of the previous and the current base
    /// window, and when the current one began.
    base_prev: Option<u32>,
    base_cur: Option<u32>,
    base_since: Option<Instant>,
    samples: Vec<u32>,
    /// How many of the same packets waited `MIN_WAIT` or more for retransmissions.
    waited: usize,
    /// The current window's first packet, and the last packet's arrival.
    window_since: Option<Instant>,
    last_sample: Option<Instant>,
    /// The delay set by the last second, while the path loses (none once it does not).
    losing: Duration,
    /// The last lossy second's delay, and when it was set: bulk flows keep it for `HOLD`.
    lossy_delay: Duration,
    lossy_at: Option<Instant>,
    /// When the lossy windows in a row up to now began.
    lossy_since: Option<Instant>,
    /// `delay` or, after the loss, the held one, as of the last packet (status).
    shown: Duration,
    last_release: Option<Instant>,
    flows: Vec<FlowBytes>,
}

impl Default for Playout {
    fn default() -> Self {
        Playout {
            epoch: None,
            base_prev: None,
            base_cur: None,
            base_since: None,
            samples: Vec::with_capacity(MAX_SAMPLES),
            waited: 0,
            window_since: None,
            last_sample: None,
            losing: Duration::ZERO,
            lossy_delay: Duration::ZERO,
            lossy_at: None,
            lossy_since: None,
            shown: Duration::ZERO,
            last_release: None,
            flows: vec![FlowBytes::default(); FLOW_BUCKETS],
        }
    }
}

/// `a - b` for wrapping microsecond clocks that are within 35 minutes of each other.
fn diff(a: u32, b: u32) -> i64 {
    i64::from(a.wrapping_sub(b) as i32)
}

impl Playout {
    /// The delay packets are held to now (0: none): while the path loses, every packet's;
    /// for `HOLD` after, bulk flows' (status shows this one).
    pub fn delay(&self) -> Duration {
        self.shown
    }

    /// The delay bulk flows are still held to at `now`, the path having stopped losing.
    fn held_delay(&self, now: Instant) -> Duration {
        match self.lossy_at {
            Some(at) if now.saturating_duration_since(at) < HOLD => self.lossy_delay,
            _ => Duration::ZERO,
        }
    }

    /// Count `len` bytes of `flow` (its hash) at `now`: is it bulk (`BULK_BYTES`)?
    pub fn on_flow(&mut self, now: Instant, flow: u64, len: usize) -> bool {
        let f = &mut self.flows[(flow % FLOW_BUCKETS as u64) as usize];
        if f.flow != flow
            || f.last
                .is_none_or(|t| now.saturating_duration_since(t) >= FLOW_FORGET)
        {
            *f = FlowBytes {
                flow,
                ..FlowBytes::default()
            };
        }
        f.last = Some(now);
        f.bytes += len as u64;
        f.bytes >= BULK_BYTES
    }

    /// A packet sent at `sent_us` (the sender's clock) is ready at `now`, after waiting
    /// `waited` for the stream's bytes ahead of it, and is of a bulk flow or not (`on_flow`):
    /// when to hand it on (`now` or later; never before the previous held packet's release).
    pub fn on_packet(
        &mut self,
        now: Instant,
        sent_us: u32,
        waited: Duration,
        bulk: bool,
    ) -> Instant {
        let epoch = *self.epoch.get_or_insert(now);
        let now_us = now.saturating_duration_since(epoch).as_micros() as u32;
        let rel = now_us.wrapping_sub(sent_us);
        let base = self.update_base(now, rel);
        let excess = Duration::from_micros(diff(rel, base).max(0) as u64);
        self.sample(now, excess, waited);
        self.shown = self.losing.max(self.held_delay(now));
        let delay = if bulk { self.shown } else { self.losing };
        if delay.is_zero() {
            // Not held: it may leave beside held packets of other flows (the caller keeps a
            // flow's own packets in order).
            return now;
        }
        let release = now + delay.saturating_sub(excess);
        let release = self.last_release.map_or(release, |l| release.max(l));
        self.last_release = Some(release);
        release
    }

    /// The base (smallest relative delay over the last one to two base windows), after `rel`.
    fn update_base(&mut self, now: Instant, rel: u32) -> u32 {
        let since = *self.base_since.get_or_insert(now);
        if now.saturating_duration_since(since) >= BASE_WINDOW {
            self.base_prev = self.base_cur.take();
            self.base_since = Some(now);
        }
        let cur = self.base_cur.map_or(rel, |m| min_wrapping(m, rel));
        self.base_cur = Some(cur);
        self.base_prev.map_or(cur, |p| min_wrapping(p, cur))
    }

    fn sample(&mut self, now: Instant, excess: Duration, waited: Duration) {
        // A window does not span a quiet stretch: the burst after it would count the quiet
        // time as lossy (`LOSSY_FOR`), and a start-up's loss be held on for `HOLD`.
        if self
            .last_sample
            .is_some_and(|t| now.saturating_duration_since(t) >= WINDOW)
        {
            self.samples.clear();
            self.waited = 0;
            self.window_since = None;
        }
        self.last_sample = Some(now);
        self.samples
            .push(excess.as_micros().min(u128::from(u32::MAX)) as u32);
        self.waited += usize::from(waited >= MIN_WAIT);
        let since = *self.window_since.get_or_insert(now);
        let full = self.samples.len() >= MAX_SAMPLES;
        if !full
            && (now.saturating_duration_since(since) < WINDOW || self.samples.len() < MIN_SAMPLES)
        {
            return;
        }
        let at = ((self.samples.len() - 1) as f64 * QUANTILE) as usize;
        // The `QUANTILE` of the waits is `MIN_WAIT` or more: at most `at` packets waited less.
        let waiting = self.samples.len() - self.waited <= at;
        let q = Duration::from_micros(u64::from(*self.samples.select_nth_unstable(at).1));
        self.losing = if waiting {
            q.min(MAX_DELAY)
        } else {
            Duration::ZERO
        };
        self.lossy_since = match waiting {
            true => Some(self.lossy_since.unwrap_or(since)),
            false => None,
        };
        if self
            .lossy_since
            .is_some_and(|t| now.saturating_duration_since(t) >= LOSSY_FOR)
        {
            self.lossy_delay = self.losing;
            self.lossy_at = Some(now);
        }
        self.samples.clear();
        self.waited = 0;
        // The next window begins with its first packet.
        self.window_since = None;
    }
}

/// The smaller of two wrapping clock values.
fn min_wrapping(a: u32, b: u32) -> u32 {
    if diff(a, b) <= 0 {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Packet `i`'s one-way delay: `base` ms, and every `every`th packet `extra` ms more (a
    /// retransmission).
    fn stalls(i: usize, base: u32, every: usize, extra: u32) -> Duration {
        MS * base
            + if i.is_multiple_of(every) {
                MS * extra
            } else {
                Duration::ZERO
            }
    }

    /// Packets every `gap` from `t0` for `secs`, each arriving `owd(i)` after it left and
    /// ready once the one ahead of it is (a stream delivers in order; each packet its own
    /// chunk), with the sender's clock offset by `offset` µs and its wait as `Reassembly`
    /// measures it (a late packet that the next one passed waited as long as that one);
    /// returns (ready, release) per packet.
    fn feed(
        p: &mut Playout,
        t0: Instant,
        secs: u64,
        gap: Duration,
        offset: u32,
        owd: impl Fn(usize) -> Duration,
    ) -> Vec<(Instant, Instant)> {
        let n = (Duration::from_secs(secs).as_micros() / gap.as_micros()) as usize;
        let sent = |i: usize| t0 + gap * i as u32;
        let arrival = |i: usize| sent(i) + owd(i);
        let mut out: Vec<(Instant, Instant)> = Vec::new();
        for i in 0..n {
            let ready = out.last().map_or(arrival(i), |&(r, _)| arrival(i).max(r));
            let next = if i + 1 < n { arrival(i + 1) } else { ready };
            let waited = ready - arrival(i).min(next);
            let sent_us = offset.wrapping_add((sent(i) - t0).as_micros() as u32);
            out.push((ready, p.on_packet(ready, sent_us, waited, true)));
        }
        out
    }

    #[test]
    fn a_clean_or_queueing_path_gets_no_delay() {
        let t0 = Instant::now();
        let mut p = Playout::default();
        // 15 ms one way and a bottleneck queue (someone else's upload) swinging between 0 and
        // 50 ms three times a second: the delay spreads by more than the RTT, but the arrivals
        // stay in order and nothing waits.
        let out = feed(&mut p, t0, 5, MS, 7, |i| {
            let phase = (i % 330) as u32;
            15 * MS + MS * phase.min(330 - phase) * 50 / 165
        });
        assert_eq!(p.delay(), Duration::ZERO);
        assert!(out.iter().all(|(a, r)| a == r));
    }

    #[test]
    fn rare_waits_add_no_delay() {
        let t0 = Instant::now();
        let mut p = Playout::default();
        // One loss in 500 packets: 40 of them wait, fewer than a quarter.
        let out = feed(&mut p, t0, 5, MS, 0, |i| stalls(i, 15, 500, 40));
        assert_eq!(p.delay(), Duration::ZERO);
        assert!(out.iter().all(|(a, r)| a == r));
    }

    #[test]
    fn head_of_line_stalls_are_smoothed_to_a_steady_delay() {
        let t0 = Instant::now();
        let mut p = Playout::default();
        // Every 50th packet waits 40 ms for its retransmission, and those behind it with it.
        let owd = |i: usize| stalls(i, 15, 50, 40);
        let out = feed(&mut p, t0, 5, MS, u32::MAX - 2_000_000, owd);
        let d = p.delay();
        assert!(
            d >= 25 * MS && d <= 31 * MS,
            "the 75th percentile of the excess: {d:?}"
        );
        // After the first window a packet leaves 15 ms + the delay after it was sent at the
        // earliest (it arrived 15 to 55 ms after): inner TCP sees its RTT vary by 40 ms less
        // the delay (which each window sets anew, within a millisecond or two here).
        for (i, (a, r)) in out.iter().enumerate().skip(1500) {
            let held = *r - (t0 + MS * i as u32);
            assert!(
                held + 2 * MS >= 15 * MS + d && held <= 55 * MS,
                "packet {i}: {held:?}"
            );
            assert!(r >= a);
        }
        assert!(out.windows(2).all(|w| w[0].1 <= w[1].1));
    }

    /// A packet of `flow` every ms from `from` for `n` ms, sent at `t` and arriving 15 ms later
    /// over a clean path; the last one's (ready, release).
    fn clean(
        p: &mut Playout,
        t0: Instant,
        from: Duration,
        n: u32,
        flow: u64,
    ) -> (Instant, Instant) {
        let mut out = (t0, t0);
        for k in 0..n {
            let t = from + k * MS;
            let ready = t0 + t + 15 * MS;
            let bulk = p.on_flow(ready, flow, 1400);
            out = (
                ready,
                p.on_packet(ready, t.as_micros() as u32, Duration::ZERO, bulk),
            );
        }
        out
    }

    #[test]
    fn after_the_loss_only_bulk_flows_are_held_and_only_for_a_while() {
        let t0 = Instant::now();
        let mut p = Playout::default();
        // Four lossy seconds (every 50th packet's retransmission 40 ms late), then clean.
        let end = 4000 * MS;
        feed(&mut p, t0, 4, MS, 0, |i| stalls(i, 15, 50, 40));
        let lossy = p.delay();
        assert!(lossy >= 25 * MS, "{lossy:?}");
        // A bulk flow (its first MiB) and a short one, clean from now on. Past the first clean
        // second's window, which sets the delay of the loss to none:
        let (bulk, short) = (7, 8);
        clean(&mut p, t0, end, 1500, bulk);
        let (ready, release) = clean(&mut p, t0, end + 1500 * MS, 1, bulk);
        assert!(
            release >= ready + lossy - 2 * MS,
            "bulk still held: {:?}",
            release - ready
        );
        // Status shows the held delay (the last lossy window's, which ends a little after the
        // loss: within a millisecond or two of the one before).
        assert!(p.delay().abs_diff(lossy) <= 2 * MS, "{:?}", p.delay());
        let (ready, release) = clean(&mut p, t0, end + 1501 * MS, 1, short);
        assert_eq!(release, ready, "a short flow is not held");
        let other = bulk + FLOW_BUCKETS as u64;
        let (ready, release) = clean(&mut p, t0, end + 1502 * MS, 1, other);
        assert_eq!(release, ready, "nor one that shares the bulk flow's slot");
        clean(&mut p, t0, end + 1503 * MS, 800, bulk);
        // `HOLD` after the last lossy second, the bulk flow too. It carries on all the while
        // (a flow silent for 10 s is forgotten).
        let (mut t, later) = (end + 2303 * MS, end + HOLD + 1500 * MS);
        let mut last_held = None;
        while t < later {
            let (ready, release) = clean(&mut p, t0, t, 1, bulk);
            if release > ready {
                last_held = Some(t);
            }
            t += MS;
        }
        let last_held = last_held.expect("held after the loss");
        assert!(last_held > end + HOLD - 1500 * MS, "{last_held:?}");
        let (ready, release) = clean(&mut p, t0, later, 1, bulk);
        assert_eq!(release, ready, "held past HOLD");
        assert_eq!(p.delay(), Duration::ZERO);
    }

    #[test]
    fn a_loss_of_a_second_or_two_is_not_held_after() {
        let t0 = Instant::now();
        let mut p = Playout::default();
        // An inner TCP's start-up overflowing the bottleneck: two lossy seconds, then clean.
        feed(&mut p, t0, 2, MS, 0, |i| stalls(i, 15, 50, 40));
        assert!(p.delay() >= 25 * MS, "held while it loses");
        let bulk = 7;
        clean(&mut p, t0, 2000 * MS, 1500, bulk);
        let (ready, release) = clean(&mut p, t0, 3500 * MS, 1, bulk);
        assert_eq!(
            release, ready,
            "the bulk flow is handed on once the loss stopped"
        );
        assert_eq!(p.delay(), Duration::ZERO);
    }

    #[test]
    fn a_quiet_stretch_is_not_lossy_time() {
        let t0 = Instant::now();
        let mut p = Playout::default();
        // One packet, a quiet minute, then a lossy second (a start-up's overflow) and clean.
        feed(&mut p, t0, 1, 1000 * MS, 0, |_| 15 * MS);
        let t1 = 60_000 * MS;
        let at = t1.as_micros() as u32;
        feed(&mut p, t0 + t1, 1, MS, at, |i| stalls(i, 15, 50, 40));
        let bulk = 7;
        clean(&mut p, t0, t1 + 1000 * MS, 100, bulk);
        assert!(p.delay() >= 25 * MS, "held while it loses");
        clean(&mut p, t0, t1 + 1100 * MS, 1500, bulk);
        let (ready, release) = clean(&mut p, t0, t1 + 2600 * MS, 1, bulk);
        assert_eq!(release, ready, "held after a second's loss");
    }

    #[test]
    fn the_delay_is_capped_and_follows_a_longer_route() {
        let t0 = Instant::now();
        let mut p = Playout::default();
        let out = feed(&mut p, t0, 3, MS, 0, |i| stalls(i, 15, 1000, 900));
        assert_eq!(p.delay(), MAX_DELAY);
        assert!(out.iter().all(|(a, r)| *r <= *a + MAX_DELAY));
        // The route grows 100 ms longer, with a stall every 50 packets: within two base
        // windows it is the new base, and the delay covers the stalls, not the longer route.
        let t1 = t0 + Duration::from_secs(3);
        feed(&mut p, t1, 25, MS, 3_000_000, |i| stalls(i, 115, 50, 40));
        let d = p.delay();
        assert!(d >= 24 * MS && d <= 31 * MS, "{d:?}");
    }
}
