//! The two estimates a model-based controller keeps: the path's bottleneck bandwidth (the largest
//! delivery rate seen over the last few round trips) and its propagation delay (the smallest RTT
//! seen over the last few seconds).

use std::time::{Duration, Instant};

/// The maximum of samples over the last `len` periods (round trips for BBRv1, probing cycles
/// for BBRv3).
#[derive(Debug, Clone)]
pub struct MaxBwFilter {
    /// (period, best sample in that period), newest last; at most `len` entries.
    rounds: Vec<(u64, u64)>,
    len: u64,
}

/// BBRv1's bandwidth window: long enough to ride out a probing cycle's low phases.
const ROUNDS: u64 = 10;

impl Default for MaxBwFilter {
    fn default() -> Self {
        MaxBwFilter::new(ROUNDS)
    }
}

impl MaxBwFilter {
    pub fn new(len: u64) -> MaxBwFilter {
        MaxBwFilter {
            rounds: Vec::with_capacity(len as usize + 1),
            len,
        }
    }

    pub fn update(&mut self, round: u64, sample: u64) {
        match self.rounds.last_mut() {
            Some((r, best)) if *r == round => *best = (*best).max(sample),
            _ => self.rounds.push((round, sample)),
        }
        let len = self.len;
        self.rounds.retain(|(r, _)| r + len > round);
    }

    pub fn get(&self) -> u64 {
        self.rounds.iter().map(|(_, b)| *b).max().unwrap_or(0)
    }
}

/// Acknowledgements whose RTT samples `AckRtts` takes the median of.
const ACK_RTTS: usize = 16;

/// Samples of one acknowledgement `AckRtts` keeps for its median (the rest of a larger ACK are
/// left out: packets acknowledged together were sent within a short time of each other).
const ACK_SAMPLES: usize = 32;

/// A sample this far below the recent ACKs' median is an outlier (`AckRtts`).
const OUTLIER_BELOW: f64 = 0.75;

/// The median RTT sample of each of the last `ACK_RTTS` acknowledgements, which says whether a
/// sample is the path's delay or an outlier. On a link that reorders, a packet that overtakes
/// the others, or an ACK that does, comes back in a fraction of the round trip (the lab's
/// `reorder=2%` on a 60 ms path: samples of 4 ms), and a minimum taken from one of them cut the
/// window to a few packets: Drain never ended and a 50 Mbit/s path carried 0.1-1.5 Mbit/s. A
/// sample more than a quarter below the recent ACKs' median is not taken for the minimum (a
/// shorter route moves the median within 8 ACKs). Each ACK stands for the median of its own
/// samples, not the smallest: an ACK that covers a few dozen packets on that link nearly
/// always holds one that overtook the rest, so the ACKs' smallest samples were mostly the
/// outliers' (a median of 31 ms on the 60 ms path), and the minimum sank to 20-30 ms within
/// seconds, a window of one true round trip at the estimated rate, and the rate estimate
/// could only fall (an upload ran down from 45 to 5 Mbit/s in 10 s). Judged against the minimum
/// instead, samples a little below it lowered it step by step to the outliers' (7.6 / 4.0
/// Mbit/s on that link); and the minimum must still follow every other sample as before: fed
/// only once per ACK from the group it lost 10-70% of the rate on lossy paths (the matrix's 10%
/// and 30% rows: 41-46 and 11-26 against 50 and 39-42 Mbit/s).
#[derive(Debug, Clone, Default)]
pub struct AckRtts {
    ring: [Duration; ACK_RTTS],
    len: usize,
    next: usize,
    /// The median of the ring, kept at each `end_ack` (once per ACK) rather than sorted again
    /// for every packet `outlier` judges.
    median: Option<Duration>,
    /// The samples of the ACK being taken (`sample`), up to `ACK_SAMPLES`.
    current: [Duration; ACK_SAMPLES],
    current_len: usize,
}

/// The lower middle of `xs` (not empty), sorting it.
fn lower_median(xs: &mut [Duration]) -> Duration {
    xs.sort_unstable();
    xs[(xs.len() - 1) / 2]
}

impl AckRtts {
    /// One packet's sample, of the acknowledgement being taken.
    pub fn sample(&mut self, rtt: Duration) {
        if self.current_len < ACK_SAMPLES {
            self.current[self.current_len] = rtt;
            self.current_len += 1;
        }
    }

    /// The acknowledgement's samples are all in: its median joins the ring.
    pub fn end_ack(&mut self) {
        if self.current_len == 0 {
            return;
        }
        let n = std::mem::take(&mut self.current_len);
        let median = lower_median(&mut self.current[..n]);
        self.add(median);
    }

    /// Take one acknowledgement's sample.
    fn add(&mut self, sample: Duration) {
        self.ring[self.next] = sample;
        self.next = (self.next + 1) % ACK_RTTS;
        self.len = (self.len + 1).min(ACK_RTTS);
        let mut sorted = self.ring;
        self.median = Some(lower_median(&mut sorted[..self.len]));
    }

    /// Whether `sample` is an outlier for a path whose minimum RTT is `min` (none yet: the
    /// first samples are what there is): more than a quarter below the recent ACKs' median.
    pub fn outlier(&self, sample: Duration, min: Option<Duration>) -> bool {
        min.is_some()
            && self
                .median
                .is_some_and(|m| sample < m.mul_f64(OUTLIER_BELOW))
    }
}

/// The minimum RTT sample. It expires after its window (`MIN_RTT_WINDOW`) without a new minimum, and the
/// controller then probes for it (`ProbeRtt`: a nearly empty pipe) and sets what it measured
/// there (`restart`). An expired estimate is not simply replaced by the next sample: under load
/// that sample carries the queue, and a minimum RTT inflated by it inflates the window, which
/// queues more (scenario 10: the window doubled 10 s into an upload, and the RTT with it).
#[derive(Debug, Clone)]
pub struct MinRttFilter {
    min: Option<(Duration, Instant)>,
    window: Duration,
}

/// BBRv1's: the minimum expires after 10 s.
pub const MIN_RTT_WINDOW: Duration = Duration::from_secs(10);

impl Default for MinRttFilter {
    fn default() -> Self {
        MinRttFilter::new(MIN_RTT_WINDOW)
    }
}

impl MinRttFilter {
    pub fn new(window: Duration) -> MinRttFilter {
        MinRttFilter { min: None, window }
    }

    /// Take a sample; returns whether it set a new minimum.
    pub fn update(&mut self, now: Instant, sample: Duration) -> bool {
        let take = self.min.is_none_or(|(m, _)| sample <= m);
        if take {
            self.min = Some((sample, now));
        }
        take
    }

    pub fn get(&self) -> Option<Duration> {
        self.min.map(|(m, _)| m)
    }

    /// The estimate is older than the window: time to measure it again.
    pub fn expired(&self, now: Instant) -> bool {
        self.min
            .is_some_and(|(_, at)| now.saturating_duration_since(at) > self.window)
    }

    /// A sample close enough to the minimum (`sample <= min + slack`) confirms it: its age
    /// starts again, so a path whose queue stays short needs no ProbeRtt (which costs about a
    /// percent of the rate each time: scenario 06 144.5-145.1 Mbit/s without it, 143.3-143.8
    /// with one every 10 s).
    pub fn confirm(&mut self, now: Instant, sample: Duration, slack: Duration) {
        if let Some((m, at)) = &mut self.min {
            if sample <= *m + slack {
                *at = now;
            }
        }
    }

    /// A ProbeRtt ended having seen `probed` at least (its smallest sample; `None`: none):
    /// that is the estimate from `now`, larger than the old one if the path's delay grew.
    pub fn restart(&mut self, now: Instant, probed: Option<Duration>) {
        if let Some(p) = probed.or(self.get()) {
            self.min = Some((p, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_is_the_max_of_the_last_ten_rounds() {
        let mut f = MaxBwFilter::default();
        f.update(0, 100);
        f.update(0, 50);
        f.update(3, 80);
        assert_eq!(f.get(), 100);
        f.update(9, 10);
        assert_eq!(
            f.get(),
            100,
            "round 0 is still within ten rounds of round 9"
        );
        f.update(10, 10);
        assert_eq!(f.get(), 80, "round 0 aged out");
        f.update(20, 5);
        assert_eq!(f.get(), 5);
    }

    /// A sample far below the recent ACKs is an outlier until half of them are as low; a
    /// sample a little below is not.
    #[test]
    fn ack_rtts_take_no_single_samples_word() {
        let ms = Duration::from_millis;
        let mut a = AckRtts::default();
        assert!(!a.outlier(ms(4), None), "no minimum yet");
        assert!(!a.outlier(ms(4), Some(ms(60))), "no ACKs yet");
        let ack = |a: &mut AckRtts, samples: &[u64]| {
            for &s in samples {
                a.sample(ms(s));
            }
            a.end_ack();
        };
        for _ in 0..16 {
            ack(&mut a, &[60]);
        }
        assert!(a.outlier(ms(4), Some(ms(60))));
        assert!(a.outlier(ms(30), Some(ms(60))));
        assert!(!a.outlier(ms(50), Some(ms(60))), "within a quarter");
        // ACKs that each hold one packet that overtook the rest stand for the rest.
        for _ in 0..16 {
            ack(&mut a, &[61, 62, 4, 60, 63, 31, 60]);
        }
        assert!(a.outlier(ms(31), Some(ms(60))));
        for _ in 0..7 {
            ack(&mut a, &[20]);
        }
        assert!(a.outlier(ms(20), Some(ms(60))), "7 of 16 low");
        ack(&mut a, &[20, 21, 19]);
        assert!(!a.outlier(ms(20), Some(ms(60))), "8 of 16: a shorter route");
        // An ACK with no samples adds nothing.
        a.end_ack();
        assert!(!a.outlier(ms(20), Some(ms(60))));
    }

    #[test]
    fn min_rtt_expires_and_only_a_probe_sets_a_larger_one() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut f = MinRttFilter::default();
        assert!(f.update(t0, ms(30)));
        assert!(!f.update(t0 + ms(100), ms(40)));
        assert_eq!(f.get(), Some(ms(30)));
        assert!(!f.expired(t0 + MIN_RTT_WINDOW));
        assert!(f.expired(t0 + MIN_RTT_WINDOW + ms(1)));
        // A queued sample after expiry does not become the minimum.
        assert!(!f.update(t0 + MIN_RTT_WINDOW + ms(1), ms(60)));
        assert_eq!(f.get(), Some(ms(30)));
        // The probe measured 40 ms at best: the path's delay grew.
        f.restart(t0 + MIN_RTT_WINDOW + ms(300), Some(ms(40)));
        assert_eq!(f.get(), Some(ms(40)));
        assert!(!f.expired(t0 + MIN_RTT_WINDOW + ms(301)));
        // A probe that saw nothing keeps the estimate, fresh.
        f.restart(t0 + 2 * MIN_RTT_WINDOW + ms(400), None);
        assert_eq!(f.get(), Some(ms(40)));
        // A sample within the slack keeps it fresh; one beyond does not.
        let t1 = t0 + 3 * MIN_RTT_WINDOW;
        f.confirm(t1, ms(43), ms(4));
        assert!(!f.expired(t1 + MIN_RTT_WINDOW));
        f.confirm(t1 + ms(500), ms(50), ms(4));
        assert!(f.expired(t1 + MIN_RTT_WINDOW + ms(1)));
    }
}
