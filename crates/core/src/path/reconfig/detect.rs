//! Recognising a link that reconfigures on Starlink's schedule from what its probes see, so
//! that a path nobody configured as Starlink (`link:` unset) still gets what `link: starlink`
//! does once its link has shown it.
//!
//! Starlink's reconfigurations fall at 12, 27, 42 and 57 s past each minute of UTC, on every
//! dish at once, and each changes the link: in the recording the lab replays, the least round
//! trip steps (61 -> 29 ms, 22 -> 27, 26 -> 31, 28 -> 47, 47 -> 24 ms) at five of its six, and
//! other dishes lose a burst of packets there. Neither is rare on other links (a route change,
//! a queue, random loss), but there they fall at any second, not at these. So the detector
//! asks the same question at each boundary and at points between them (every `STEP`: four
//! per slot), over the same spans: did a probe sent across the point go unanswered, or is the
//! least round trip of the probes after the point not that of the probes before it? The
//! points between the boundaries say how often the link changes anyway; a link is taken for
//! Starlink when most of its recent boundaries changed (`DETECT_SHARE`) and so many would
//! change at that rate by chance less than once in `DETECT_CHANCE` (a binomial tail), and
//! taken out again when that no longer holds at the looser `KEEP_SHARE` and `KEEP_CHANCE`
//! (one quiet boundary does not flip it).
//!
//! The recording itself, probed every 100 ms, changes at 5 of its 6 boundaries and at about one
//! of the 24 points between them (its delay wanders within a slot too): taken for Starlink at
//! its 4th-6th boundary. Only points where the tunnel carried traffic are judged (`MIN_SIDE`):
//! a link is recognised in its first minutes of traffic, and keeps its verdict through quiet
//! spells. A link that changes at random has the same rate at the boundaries as
//! between them; in a model of such links (each point changing independently at 5-60%), a
//! day of 5760 slots took one for Starlink 0-6 times, each for a few slots. Mistaken, it costs
//! little: copies of small packets for 400 ms per slot, a silence that begins at a boundary
//! judged at most 300 ms later, and the probes of those 400 ms not counted.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{WallClock, AFTER, BEFORE, PERIOD, PHASE};

/// One probe's fate, as the prober saw it: when it was sent, and its round trip (`None`: it
/// was not answered in time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeOutcome {
    pub sent: Instant,
    pub rtt: Option<Duration>,
}

/// Points examined: the boundaries and, between them, every `STEP` (3 s: the boundaries fall
/// on whole multiples of it, 12 s past the minute being one).
const STEP: Duration = Duration::from_secs(3);
const CHECKS_PER_PERIOD: u32 = (PERIOD.as_secs() / STEP.as_secs()) as u32;
/// The spans before and after a point whose least round trips are compared: long enough that
/// a queue comes and goes within them (the least of ~25 probes at the fast interval, ~5 at the
/// quiet one), short enough to fit between two points with the window around each.
const SPAN: Duration = Duration::from_millis(2500);
/// Probes answered on each side needed to judge a point: a second of the fast interval (a
/// tunnel carrying traffic). A quiet tunnel's (one every 500 ms, five per span, each 15 s on
/// the same phase) judged the recording's boundaries changed at half of them: its points are
/// not judged, and what the path showed while it carried traffic stands meanwhile.
const MIN_SIDE: usize = 10;
/// A change of the least round trip by this much, and by `STEP_SHARE` of it, and by more than
/// the least wanders within either span, is a step. (Without the last, 13% of the recording's
/// points between boundaries were steps, probed every 100 ms, against 83% of its boundaries;
/// with it, 3% and 83%.)
const STEP_MIN: Duration = Duration::from_millis(2);
const STEP_SHARE: f64 = 0.10;
/// A point is judged once the probes sent in its after-span have been answered or expired.
const SETTLE: Duration = Duration::from_secs(2);
/// Boundaries remembered (two minutes), and points between them (four minutes' worth: the
/// rate they give is what a chance at the boundaries is judged against, and a rate from too
/// few points underestimated is how a link that changes often would be mistaken).
const HISTORY: usize = 8;
const HISTORY_BETWEEN: usize = 2 * HISTORY * (CHECKS_PER_PERIOD as usize - 1);
/// Boundaries seen before anything is decided.
const MIN_BOUNDARIES: usize = 4;
/// Taken for Starlink: at least this share of the boundaries changed, and as many or more
/// would change by chance, at the rate between them, less often than this.
const DETECT_SHARE: f64 = 0.75;
const DETECT_CHANCE: f64 = 0.001;
/// Kept while at least this share of the boundaries change, and not by a chance this large.
const KEEP_SHARE: f64 = 0.5;
const KEEP_CHANCE: f64 = 0.05;
/// Probes remembered: a point's spans, and its judgement's delay, at most 10/s, bounded.
const SAMPLES_MAX: usize = 256;

/// The evidence so far: how many of the recent boundaries, and of the points between them,
/// showed a change (`changed` of `seen`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evidence {
    pub boundaries_changed: u32,
    pub boundaries_seen: u32,
    pub between_changed: u32,
    pub between_seen: u32,
}

#[derive(Debug, Clone, Default)]
pub struct Detector {
    samples: VecDeque<ProbeOutcome>,
    /// The last point judged.
    judged: Option<Instant>,
    boundaries: VecDeque<bool>,
    between: VecDeque<bool>,
    detected: bool,
    /// Times the link was taken for Starlink.
    pub detections: u64,
}

impl Detector {
    /// Whether the link has shown Starlink's reconfigurations.
    pub fn detected(&self) -> bool {
        self.detected
    }

    pub fn evidence(&self) -> Evidence {
        let count = |v: &VecDeque<bool>| v.iter().filter(|c| **c).count() as u32;
        Evidence {
            boundaries_changed: count(&self.boundaries),
            boundaries_seen: self.boundaries.len() as u32,
            between_changed: count(&self.between),
            between_seen: self.between.len() as u32,
        }
    }

    /// A probe's fate is known.
    pub fn observe(&mut self, outcome: ProbeOutcome) {
        if self.samples.len() == SAMPLES_MAX {
            self.samples.pop_front();
        }
        self.samples.push_back(outcome);
    }

    /// Judge the points whose probes are all in; returns true when the verdict changed.
    pub fn poll(&mut self, now: Instant, clock: &WallClock) -> bool {
        let Some(target) = now.checked_sub(AFTER + SPAN + SETTLE) else {
            return false;
        };
        let (mark, is_boundary) = last_mark(clock, target);
        if self.judged.is_some_and(|j| mark < j + STEP / 2) {
            return false;
        }
        self.judged = Some(mark);
        let oldest = mark.checked_sub(BEFORE + SPAN + Duration::from_secs(1));
        while self
            .samples
            .front()
            .is_some_and(|s| oldest.is_some_and(|o| s.sent < o))
        {
            self.samples.pop_front();
        }
        let Some(changed) = self.changed_at(mark) else {
            return false;
        };
        let (ring, cap) = match is_boundary {
            true => (&mut self.boundaries, HISTORY),
            false => (&mut self.between, HISTORY_BETWEEN),
        };
        if ring.len() == cap {
            ring.pop_front();
        }
        ring.push_back(changed);
        let before = self.detected;
        self.detected = self.verdict();
        if self.detected && !before {
            self.detections += 1;
        }
        self.detected != before
    }

    /// Whether the link changed at `t` (`None`: too few probes around it to say).
    fn changed_at(&self, t: Instant) -> Option<bool> {
        let base = (self.samples.iter().filter_map(|s| s.rtt).min()).unwrap_or_default();
        // A probe crosses the link about half a round trip after it is sent.
        let lo = t.checked_sub(BEFORE + base / 2)?;
        let hi = t + AFTER;
        let before = least(&self.samples, lo.checked_sub(SPAN)?, lo)?;
        let after = least(&self.samples, hi + Duration::from_nanos(1), hi + SPAN)?;
        let lost = (self.samples.iter()).any(|s| s.rtt.is_none() && s.sent >= lo && s.sent <= hi);
        let step = before.0.abs_diff(after.0);
        Some(
            lost || (step >= STEP_MIN
                && step.as_secs_f64() >= STEP_SHARE * before.0.min(after.0).as_secs_f64()
                && step > before.1.max(after.1)),
        )
    }

    fn verdict(&self) -> bool {
        let e = self.evidence();
        let n = e.boundaries_seen;
        if (n as usize) < MIN_BOUNDARIES {
            return false;
        }
        // The rate between the boundaries, one change and one calm point added (so that no
        // change seen yet is not taken for a rate of zero).
        let rate = f64::from(e.between_changed + 1) / f64::from(e.between_seen + 2);
        let share = f64::from(e.boundaries_changed) / f64::from(n);
        let chance = at_least(e.boundaries_changed, n, rate);
        match self.detected {
            false => share >= DETECT_SHARE && chance < DETECT_CHANCE,
            true => share >= KEEP_SHARE && chance < KEEP_CHANCE,
        }
    }
}

/// The chance of `k` or more of `n` independent points changing, each at `p` (binomial tail).
fn at_least(k: u32, n: u32, p: f64) -> f64 {
    let choose = |n: u32, k: u32| (0..k).fold(1.0, |c, i| c * f64::from(n - i) / f64::from(i + 1));
    (k..=n)
        .map(|i| choose(n, i) * p.powi(i as i32) * (1.0 - p).powi((n - i) as i32))
        .sum()
}

/// The least round trip of the probes answered that were sent from `from` to `to`, and how
/// far the least of their first half is from that of their second: what the least of so few
/// probes wanders by on this link anyway. `None` with fewer than `MIN_SIDE`.
fn least(
    samples: &VecDeque<ProbeOutcome>,
    from: Instant,
    to: Instant,
) -> Option<(Duration, Duration)> {
    let sent = samples.iter().filter(|s| s.sent >= from && s.sent < to);
    let rtts: Vec<Duration> = sent.filter_map(|s| s.rtt).collect();
    if rtts.len() < MIN_SIDE {
        return None;
    }
    let (a, b) = rtts.split_at(rtts.len() / 2);
    let (a, b) = (a.iter().min()?, b.iter().min()?);
    Some((*a.min(b), a.abs_diff(*b)))
}

/// The last point (a multiple of `STEP` past `PHASE` on the wall clock) at or before `t`, and
/// whether it is a boundary.
fn last_mark(clock: &WallClock, t: Instant) -> (Instant, bool) {
    let since_phase = clock.at(t).as_nanos() + PERIOD.as_nanos() - PHASE.as_nanos();
    let into = since_phase % STEP.as_nanos();
    let index = (since_phase / STEP.as_nanos()) % u128::from(CHECKS_PER_PERIOD);
    let mark = t
        .checked_sub(Duration::from_nanos(into as u64))
        .unwrap_or(t);
    (mark, index == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prober on a link over `secs` seconds: a probe every `interval`, its round trip
    /// `rtt(t)` (seconds since the start; `None`: lost). The wall clock reads a whole minute
    /// at the start, so the boundaries fall at 12, 27, 42, 57 s. Returns the detector and when
    /// it first took the link for Starlink (seconds), if it did.
    fn run(
        secs: f64,
        interval: f64,
        mut rtt: impl FnMut(f64) -> Option<f64>,
    ) -> (Detector, Option<f64>) {
        let t0 = Instant::now();
        let clock = WallClock::new(t0, Duration::from_secs(1_800_000_000));
        let mut d = Detector::default();
        let mut first = None;
        let mut pending: VecDeque<(f64, Option<f64>)> = VecDeque::new();
        let mut t = 0.0;
        while t < secs {
            pending.push_back((t, rtt(t)));
            // Known a round trip later, or (lost) a second later.
            while let Some(&(sent, r)) = pending.front() {
                if sent + r.unwrap_or(1.0) > t {
                    break;
                }
                pending.pop_front();
                d.observe(ProbeOutcome {
                    sent: t0 + Duration::from_secs_f64(sent),
                    rtt: r.map(Duration::from_secs_f64),
                });
            }
            if d.poll(t0 + Duration::from_secs_f64(t), &clock) && d.detected() {
                first.get_or_insert(t);
            }
            t += interval;
        }
        (d, first)
    }

    /// A simple deterministic noise in 0..1.
    fn noise(seed: &mut u64) -> f64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed % 10_000) as f64 / 10_000.0
    }

    #[test]
    fn a_link_whose_round_trip_steps_at_the_boundaries_is_taken_for_starlink() {
        // The recording's least round trips, one per slot, and queueing of up to 40 ms on top.
        let slots = [0.061, 0.029, 0.027, 0.031, 0.047, 0.024, 0.040];
        let mut seed = 7;
        let (d, first) = run(130.0, 0.1, |t| {
            let slot = ((t + 3.0) / 15.0) as usize % slots.len();
            Some(slots[slot] + 0.040 * noise(&mut seed))
        });
        let first = first.expect("detected");
        // Not before the fourth boundary (57 s, judged ~5 s later), by the eighth (117 s).
        assert!(
            (57.0..125.0).contains(&first),
            "{first}: {:?}",
            d.evidence()
        );
        assert!(d.detected());
        let e = d.evidence();
        assert!(e.boundaries_changed >= 6 && e.between_changed <= 4, "{e:?}");
    }

    #[test]
    fn a_loss_burst_at_each_boundary_is_taken_for_starlink_while_traffic_flows() {
        let burst_at_boundaries = |t: f64| ((t - 12.0).rem_euclid(15.0) > 0.15).then_some(0.040);
        let (_, first) = run(90.0, 0.1, burst_at_boundaries);
        assert!(first.is_some());
        // A quiet tunnel (a probe every 500 ms) is not judged: nothing is decided.
        let (d, first) = run(300.0, 0.5, burst_at_boundaries);
        assert_eq!((first, d.evidence()), (None, Evidence::default()));
    }

    #[test]
    fn changes_at_random_seconds_are_not_starlink_however_many() {
        // Steps and losses at seconds unrelated to the boundaries: every 4.3 s, or at random;
        // 5% loss at random; round trips that swing with a queue.
        let mut seed = 11;
        let (d, first) = run(300.0, 0.1, |t| {
            Some(if ((t / 4.3) as u64).is_multiple_of(2) {
                0.030
            } else {
                0.045
            })
        });
        assert_eq!(first, None, "{:?}", d.evidence());
        let (d, first) = run(300.0, 0.1, |_| (noise(&mut seed) > 0.05).then_some(0.030));
        assert_eq!(first, None, "{:?}", d.evidence());
        let (d, first) = run(300.0, 0.1, |_| Some(0.020 + 0.2 * noise(&mut seed)));
        assert_eq!(first, None, "{:?}", d.evidence());
        let (d, first) = run(300.0, 0.1, |_| Some(0.030));
        assert_eq!(first, None, "{:?}", d.evidence());
    }

    #[test]
    fn a_link_that_stops_reconfiguring_is_no_longer_taken_for_starlink() {
        let (d, first) = run(300.0, 0.1, |t| {
            let burst = t < 100.0 && (t - 12.0).rem_euclid(15.0) < 0.15;
            (!burst).then_some(0.030)
        });
        assert!(first.is_some());
        assert!(!d.detected(), "{:?}", d.evidence());
        assert_eq!(d.detections, 1);
    }

    #[test]
    fn the_chance_is_a_binomial_tail() {
        assert!((at_least(0, 8, 0.3) - 1.0).abs() < 1e-12);
        assert!((at_least(8, 8, 0.5) - 1.0 / 256.0).abs() < 1e-12);
        // 5 or more of 6 at 0.23: 6 * 0.23^5 * 0.77 + 0.23^6.
        let want = 6.0 * 0.23f64.powi(5) * 0.77 + 0.23f64.powi(6);
        assert!((at_least(5, 6, 0.23) - want).abs() < 1e-12);
    }

    #[test]
    fn the_points_fall_on_the_boundaries_and_between() {
        let t0 = Instant::now();
        let clock = WallClock::new(t0, Duration::from_secs(1_800_000_000));
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        for (t, mark, boundary) in [(12.5, 12.0, true), (16.0, 15.0, false), (26.9, 24.0, false)]
            .into_iter()
            .chain([
                (27.0, 27.0, true),
                (41.99, 39.0, false),
                (59.0, 57.0, true),
                (60.0, 60.0, false),
            ])
        {
            let (m, b) = last_mark(&clock, at(t));
            let off = m.max(at(mark)) - m.min(at(mark));
            assert!(
                off < Duration::from_micros(1) && b == boundary,
                "{t}: {off:?} {b}"
            );
        }
    }
}
