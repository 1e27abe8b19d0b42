//! How many repair packets a group needs, from the loss measured on its path.
//!
//! Loss is modelled as independent per packet (the binomial case; bursts do worse, and the
//! bursty figures are in docs/BENCHMARKS.md). A data packet of a group of `k` with `m` repairs
//! stays lost when it is lost itself and at least `m` of the other `k + m - 1` shards are lost
//! too. `auto` picks the smallest `m` that keeps that probability under `RESIDUAL_TARGET` at
//! the measured loss with a margin, because the estimate lags a rising loss rate.

use std::time::{Duration, Instant};

use super::MAX_REPAIR;

/// Residual loss `auto` aims for: half the 0.1% that seed 002's FEC gate allows at 5% loss.
/// Each halving of it costs about one more repair per group at 5-10% loss.
pub const RESIDUAL_TARGET: f64 = 5e-4;
/// Below this measured loss a path gets no repair packets at all.
pub const OFF_BELOW: f64 = 0.002;
/// The estimate is scaled by this before choosing `m` (it trails a rising loss rate).
const MARGIN: f64 = 1.25;

/// Probability that a data packet of a (k, m) group is not recovered at loss `p`.
pub fn residual(k: usize, m: usize, p: f64) -> f64 {
    if p <= 0.0 {
        return 0.0;
    }
    let p = p.min(1.0);
    // P(at least m of the other n = k + m - 1 shards lost) = 1 - P(fewer than m lost).
    let n = k + m - 1;
    let mut below = 0.0;
    let mut term = (1.0 - p).powi(n as i32); // P(0 lost)
    for i in 0..m {
        below += term;
        // P(i + 1) from P(i): * (n - i) / (i + 1) * p / (1 - p)
        if p >= 1.0 {
            term = 0.0;
        } else {
            term *= (n - i) as f64 / (i + 1) as f64 * p / (1.0 - p);
        }
    }
    p * (1.0 - below).max(0.0)
}

/// The repair count `auto` gives a group of `k` at measured loss `loss`: 0 on a clean path,
/// otherwise the smallest that meets `RESIDUAL_TARGET`, at most `max(k, 3)` (and
/// `MAX_REPAIR`): beyond a copy per data packet, more repair costs more than it saves.
pub fn auto_parity(k: usize, loss: f64) -> usize {
    if loss < OFF_BELOW || k == 0 {
        return 0;
    }
    let p = (loss * MARGIN).min(0.9);
    let cap = k.clamp(3, MAX_REPAIR);
    (1..=cap)
        .find(|&m| residual(k, m, p) <= RESIDUAL_TARGET)
        .unwrap_or(cap)
}

/// Packets (or time) one loss sample spans before it moves the estimate.
const SAMPLE_PACKETS: u64 = 100;
const SAMPLE_TIME: Duration = Duration::from_secs(1);
/// Weight of a new sample above the estimate, and below it: quick to rise (every packet sent
/// while the estimate trails the loss is under-protected: a symmetric 0.3 left 0.15% of a
/// 20 Mbit/s UDP flow lost at 5% loss in scenario 08, nearly all in its first half second),
/// slow to fall (a lull between bursts is not the end of the loss).
const RISE_WEIGHT: f64 = 0.6;
const FALL_WEIGHT: f64 = 0.1;

/// The loss rate of a path, from the transport's cumulative sent/lost packet counters (the
/// QUIC engine's loss detection, which counts repair packets and probes too).
#[derive(Debug, Clone, Default)]
pub struct LossEstimate {
    estimate: f64,
    /// Counters at the start of the sample being gathered, and when it started.
    base: Option<(u64, u64, Instant)>,
    /// Packets the samples so far have covered.
    sampled: u64,
    /// The path's probe loss (round trip), used until the samples cover `TRUSTED_AFTER`.
    hint: f64,
}

/// Until its own samples have covered this many packets, the estimate is at least the
/// path's probe loss: a side that has sent little (a server before a download, a client
/// before an upload) would otherwise send its first packets unprotected on a lossy path.
const TRUSTED_AFTER: u64 = 1000;

impl LossEstimate {
    pub fn loss(&self) -> f64 {
        if self.sampled < TRUSTED_AFTER {
            self.estimate.max(self.hint)
        } else {
            self.estimate
        }
    }

    /// The path's probe loss (a round trip's, so both directions'): a prior for a side that
    /// has not measured its own direction yet.
    pub fn hint(&mut self, probe_loss: f64) {
        self.hint = probe_loss.clamp(0.0, 1.0);
    }

    /// The transport's counters now. A sample is taken once `SAMPLE_PACKETS` were sent since
    /// the last one, or `SAMPLE_TIME` passed with at least a tenth of that. Counters that went
    /// backwards (a new connection) start a new sample.
    pub fn on_counters(&mut self, now: Instant, sent: u64, lost: u64) {
        let Some((s0, l0, t0)) = self.base else {
            self.base = Some((sent, lost, now));
            return;
        };
        if sent < s0 || lost < l0 {
            self.base = Some((sent, lost, now));
            return;
        }
        let (ds, dl) = (sent - s0, lost - l0);
        let long_enough = now.saturating_duration_since(t0) >= SAMPLE_TIME;
        if ds >= SAMPLE_PACKETS || (long_enough && ds >= SAMPLE_PACKETS / 10) {
            let sample = (dl as f64 / ds as f64).min(1.0);
            let w = if sample > self.estimate {
                RISE_WEIGHT
            } else {
                FALL_WEIGHT
            };
            self.estimate += w * (sample - self.estimate);
            self.sampled += ds;
            self.base = Some((sent, lost, now));
        } else if long_enough && ds == 0 {
            // Nothing sent: nothing learnt; keep the estimate, restart the window.
            self.base = Some((sent, lost, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residual_matches_the_binomial() {
        // The figures: K=10/M=2 leaves ~0.5% at 5% loss and ~3% at 10%; K=10/M=4
        // ~0.3% at 10%.
        let r = residual(10, 2, 0.05);
        assert!((0.004..0.006).contains(&r), "{r}");
        let r = residual(10, 2, 0.10);
        assert!((0.025..0.035).contains(&r), "{r}");
        let r = residual(10, 4, 0.10);
        assert!((0.002..0.005).contains(&r), "{r}");
        assert_eq!(residual(10, 2, 0.0), 0.0);
        // A lone packet with m copies: lost only if all m + 1 are.
        assert!((residual(1, 2, 0.1) - 0.001).abs() < 1e-9);
    }

    #[test]
    fn auto_parity_follows_loss() {
        assert_eq!(auto_parity(10, 0.0), 0);
        assert_eq!(auto_parity(10, 0.001), 0);
        let at = |p| auto_parity(10, p);
        assert!(at(0.01) >= 1 && at(0.01) <= 3, "{}", at(0.01));
        assert!(at(0.05) > at(0.01));
        assert!(at(0.10) > at(0.05));
        for p in [0.01, 0.05, 0.10] {
            assert!(residual(10, at(p), p * MARGIN) <= RESIDUAL_TARGET, "{p}");
        }
        // Capped: at 60% loss no amount of repair meets the target.
        assert_eq!(auto_parity(10, 0.6), 10);
        assert_eq!(auto_parity(1, 0.6), 3);
    }

    #[test]
    fn probe_loss_is_a_prior_until_own_samples_count() {
        let t0 = Instant::now();
        let mut e = LossEstimate::default();
        e.hint(0.05);
        e.on_counters(t0, 0, 0);
        assert_eq!(e.loss(), 0.05);
        // Its own direction turns out clean: after enough packets the prior no longer counts.
        for i in 1..=12u64 {
            e.on_counters(t0 + Duration::from_millis(10 * i), i * 100, 0);
        }
        assert_eq!(e.loss(), 0.0);
    }

    #[test]
    fn estimate_follows_samples() {
        let t0 = Instant::now();
        let mut e = LossEstimate::default();
        e.on_counters(t0, 0, 0);
        // Loss appears: two samples take the estimate most of the way.
        e.on_counters(t0 + Duration::from_millis(50), 100, 10);
        e.on_counters(t0 + Duration::from_millis(100), 200, 20);
        assert!(e.loss() > 0.08, "{}", e.loss());
        for i in 1..=20u64 {
            e.on_counters(t0 + Duration::from_millis(100 * i), i * 200, i * 20);
        }
        assert!((e.loss() - 0.1).abs() < 0.01, "{}", e.loss());
        // A new connection's counters restart from zero: no negative sample.
        e.on_counters(t0 + Duration::from_secs(3), 5, 0);
        assert!((e.loss() - 0.1).abs() < 0.01);
        // Loss stops: the estimate decays, more slowly than it rose.
        e.on_counters(t0 + Duration::from_secs(4), 205, 0);
        assert!(e.loss() > 0.08, "{}", e.loss());
        for i in 2..=60u64 {
            e.on_counters(t0 + Duration::from_secs(3 + i), 5 + i * 200, 0);
        }
        assert!(e.loss() < 0.001, "{}", e.loss());
    }
}
