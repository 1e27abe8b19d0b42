//! A path's recent loss rate, from the transport's cumulative sent / lost packet counters (the
//! QUIC engine's loss detection). FEC's `auto` sizes its repair by it, and reliable mode sizes
//! its stream's backlog by it (a lossy path's stream waits on retransmissions).

use std::time::{Duration, Instant};

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
