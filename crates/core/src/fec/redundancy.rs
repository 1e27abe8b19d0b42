//! How many repair packets a group needs, from the loss measured on its path.
//!
//! Loss is modelled as independent per packet (the binomial case; bursts do worse, and the
//! bursty figures are in docs/BENCHMARKS.md). A data packet of a group of `k` with `m` repairs
//! stays lost when it is lost itself and at least `m` of the other `k + m - 1` shards are lost
//! too. `auto` picks the smallest `m` that keeps that probability under `RESIDUAL_TARGET` at
//! the measured loss with a margin, because the estimate lags a rising loss rate. The loss
//! itself comes from `crate::path::loss::LossEstimate`.

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
}
