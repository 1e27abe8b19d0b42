//! Failover from the data itself: a path that carries traffic and stops acknowledging it is
//! taken out of use within a few of its round trips, instead of after the probe silence bound
//! (`health.rs`: at least 350 ms, so that a quiet path costs few probes).
//!
//! Both sides watch their own sends. The tunnel core notes each send of inner packets on a
//! path (`on_sent`) and reads the count of packets its connection has had newly acknowledged
//! at each poll (`on_acks`; not of ACK frames received: a peer repeats its last ACK frame in
//! whatever it sends until it hears that the frame arrived, so a path dark from us to the peer
//! still brings ACK frames back, none new). Once a path has sent since
//! the last ACK progress and no ACK has come for `bound` (what a live path's next ACK can take:
//! two smoothed RTTs and four deviations, plus the peer's ACK delay, once for each ACK that
//! random loss may take in a row; 50 ms at least), it is silent. The core polls at a third of the bound while
//! a path waits, so a silence is seen within a third of a bound of its end. A quiet path sends
//! nothing and is judged by its probes alone, as before.

use std::time::{Duration, Instant};

/// The longest a QUIC peer delays an ACK (RFC 9000's default `max_ack_delay`, which quinn
/// uses): an ACK for a lone packet may come this much after a round trip.
pub const MAX_ACK_DELAY: Duration = Duration::from_millis(25);
/// The chance, per ACK, that random loss leaves a live path without ACKs for the bound (as
/// `health.rs` tolerates probe loss).
const FALSE_SILENCE: f64 = 1e-5;
/// Above this the loss is not random loss to ride out.
const TOLERATED_LOSS: f64 = 0.5;
/// The shortest bound, whatever the RTT: on a LAN-short path a peer that is not scheduled for
/// a few tens of milliseconds (a busy or oversubscribed host: this lab's hypervisor takes its
/// vCPUs away for that long at times) is not a dead path.
const MIN_BOUND: Duration = Duration::from_millis(50);

/// How long a live path may leave data unacknowledged: `rtt` (the larger of the probes' and
/// the connection's own estimate, which follows a growing queue within an ACK), `rttvar`, and
/// `loss` (the path's measured loss: each ACK may be lost, so as many ACK delays as losses in a
/// row happen by chance at most `FALSE_SILENCE`).
pub fn bound(rtt: Duration, rttvar: Duration, loss: f64) -> Duration {
    let p = loss.clamp(0.0, TOLERATED_LOSS);
    let in_a_row = if p > 0.0 {
        // (Less a hair: 1e-5 at 10% is exactly five, which floating point puts a hair above.)
        (FALSE_SILENCE.ln() / p.ln() - 1e-9).ceil().max(1.0)
    } else {
        1.0
    };
    (2 * rtt + 4 * rttvar + MAX_ACK_DELAY.mul_f64(in_a_row)).max(MIN_BOUND)
}

/// One path's watch over its connection's ACKs.
#[derive(Debug, Clone, Default)]
pub struct AckWatch {
    /// Packets newly acknowledged, as last read.
    acks: Option<u64>,
    /// When ACKs last progressed (as seen by a poll).
    progress_at: Option<Instant>,
    /// The first send since then.
    waiting_since: Option<Instant>,
    /// Times this watch took the path out of use.
    pub silences: u64,
}

impl AckWatch {
    /// Inner packets left on the path now. Returns true when the path starts waiting (the
    /// core's deadline moves earlier).
    pub fn on_sent(&mut self, now: Instant) -> bool {
        // Not waiting already, and a transport that counts ACKs (else every batch would wake
        // the core's timers for nothing: stripe paths).
        if self.waiting_since.is_some() || self.acks.is_none() {
            return false;
        }
        self.waiting_since = Some(now);
        true
    }

    /// The connection's count of packets newly acknowledged, read at `now`; `None` for a
    /// transport that has none (the watch then never judges).
    pub fn on_acks(&mut self, acks: Option<u64>, now: Instant) {
        let Some(acks) = acks else {
            *self = AckWatch {
                silences: self.silences,
                ..AckWatch::default()
            };
            return;
        };
        // A new connection's count starts again; either way, ACKs came.
        if self.acks != Some(acks) {
            self.acks = Some(acks);
            self.progress_at = Some(now);
            self.waiting_since = None;
        }
    }

    /// A connection watched by sampling rather than per send (`standby.rs`: its keep-alives
    /// count, not only the inner packets): its count of packets newly acknowledged, and whether
    /// it had ack-eliciting packets in flight, at `now`. A wait begins at the first sample
    /// that finds something in flight after the last ACK progress.
    pub fn on_sample(&mut self, acks: u64, in_flight: bool, now: Instant) {
        self.on_acks(Some(acks), now);
        if in_flight {
            self.on_sent(now);
        }
    }

    /// How long the path has left data unacknowledged (zero when it is not waiting, or when
    /// the watch has never seen an ACK count).
    pub fn silent_for(&self, now: Instant) -> Duration {
        match (self.acks, self.waiting_since) {
            (Some(_), Some(t)) => now.saturating_duration_since(t),
            _ => Duration::ZERO,
        }
    }

    /// When the core should look again, for a path with this `bound`: a third of it after
    /// the wait began, then every third (`None`: not waiting).
    pub fn deadline(&self, now: Instant, bound: Duration) -> Option<Instant> {
        let since = self.waiting_since.filter(|_| self.acks.is_some())?;
        let step = bound / 3;
        let waited = now.saturating_duration_since(since);
        let steps = (waited.as_nanos() / step.as_nanos().max(1)) as u32 + 1;
        Some(since + step * steps)
    }

    /// The path was taken out of use for its silence: it waits afresh once it sends again.
    pub fn silenced(&mut self) {
        self.silences += 1;
        self.waiting_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_bound_is_a_few_round_trips_and_grows_with_loss() {
        assert_eq!(bound(ms(10), ms(2), 0.0), ms(53));
        // 10% loss: five ACKs in a row lost happen once in 1e5.
        assert_eq!(bound(ms(10), ms(2), 0.1), ms(28 + 125));
        assert_eq!(bound(ms(10), ms(2), 0.3), ms(28 + 250));
        // Beyond half lost, no more tolerance.
        assert_eq!(bound(ms(10), ms(2), 0.9), bound(ms(10), ms(2), 0.5));
        // A LAN-short path still waits the floor.
        assert_eq!(bound(ms(1), Duration::ZERO, 0.0), MIN_BOUND);
    }

    #[test]
    fn a_path_that_acknowledges_never_goes_silent() {
        let t0 = Instant::now();
        let mut w = AckWatch::default();
        // Before the first count nothing waits.
        assert!(!w.on_sent(t0));
        w.on_acks(Some(0), t0);
        for i in 1..100u64 {
            let now = t0 + ms(10 * i);
            w.on_sent(now);
            w.on_acks(Some(i), now + ms(5));
            assert_eq!(w.silent_for(now + ms(5)), Duration::ZERO);
        }
    }

    #[test]
    fn sending_without_acks_is_silence_and_a_quiet_path_is_not() {
        let t0 = Instant::now();
        let mut w = AckWatch::default();
        w.on_acks(Some(7), t0);
        // Nothing sent: no silence, however long.
        assert_eq!(w.silent_for(t0 + ms(1000)), Duration::ZERO);
        assert_eq!(w.deadline(t0, ms(60)), None);
        assert!(w.on_sent(t0 + ms(10)));
        assert!(!w.on_sent(t0 + ms(20)));
        // Checked every third of the bound from the first send.
        assert_eq!(w.deadline(t0 + ms(10), ms(60)), Some(t0 + ms(30)));
        assert_eq!(w.deadline(t0 + ms(30), ms(60)), Some(t0 + ms(50)));
        w.on_acks(Some(7), t0 + ms(70));
        assert_eq!(w.silent_for(t0 + ms(70)), ms(60));
        // An ACK ends the wait.
        w.on_acks(Some(8), t0 + ms(71));
        assert_eq!(w.silent_for(t0 + ms(90)), Duration::ZERO);
        // A transport without ACK counts is never judged.
        w.on_sent(t0 + ms(100));
        w.on_acks(None, t0 + ms(100));
        w.on_sent(t0 + ms(101));
        assert_eq!(w.silent_for(t0 + ms(900)), Duration::ZERO);
    }

    #[test]
    fn sampled_a_wait_runs_from_the_first_sample_in_flight_after_progress() {
        let t0 = Instant::now();
        let mut w = AckWatch::default();
        w.on_sample(3, false, t0);
        assert_eq!(
            w.silent_for(t0 + ms(500)),
            Duration::ZERO,
            "idle, nothing in flight"
        );
        w.on_sample(3, true, t0 + ms(20));
        w.on_sample(3, true, t0 + ms(40));
        assert_eq!(w.silent_for(t0 + ms(40)), ms(20));
        // Progress with more in flight: the wait starts again from this sample.
        w.on_sample(4, true, t0 + ms(60));
        assert_eq!(w.silent_for(t0 + ms(260)), ms(200));
        w.on_sample(5, false, t0 + ms(280));
        assert_eq!(w.silent_for(t0 + ms(900)), Duration::ZERO);
    }
}
