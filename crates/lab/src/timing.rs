//! Timing helpers for the emulator's I/O shell (`bridge`), kept pure so they can be tested.
//!
//! A userspace emulator adds its own scheduling latency to every emulated delay twice: once when
//! a packet arrives (the thread wakes up some time after the kernel queued the frame) and once
//! when it is due (the timer fires late). On an idle VM both can reach milliseconds, because a
//! halted vCPU has to be scheduled again by the host. The first is removed by taking the arrival
//! time from the kernel's receive timestamp (`arrival_age`); the second by waking up early and
//! spinning for a window that follows the lateness actually observed (`WakeTuner`).
//!
//! The adaptive spin applies to long sleeps only. Under load the waits are short, the lateness
//! comes from other emulator threads and the traffic's endpoints sharing the CPUs, and spinning
//! longer would take the CPU from them: it halved the emulator's ceiling (4.2 -> 1.9 Gbit/s,
//! `bench/emulator.py`) when it applied to every wait.

use std::time::Duration;

/// Stamps older than this are not trusted (a stalled thread, or a clock we do not know); the
/// frame then counts as arriving now, as it did before stamps were used.
const MAX_AGE: Duration = Duration::from_secs(1);

/// How long ago a frame arrived, from its kernel receive stamp (nanoseconds). The stamp is
/// normally CLOCK_REALTIME, but a frame that still carries its sender's delivery time (TCP's
/// pacing stamps survive a veth crossing) is in CLOCK_MONOTONIC; the two clocks are decades
/// apart, so at most one of them gives a plausible age. `None`: no usable stamp. The monotonic
/// clock is read only when the realtime one does not fit (the usual case needs one clock read).
pub fn arrival_age(
    stamp_ns: u64,
    realtime_now_ns: u64,
    monotonic_now_ns: impl FnOnce() -> u64,
) -> Option<Duration> {
    let age = |now: u64| {
        now.checked_sub(stamp_ns)
            .map(Duration::from_nanos)
            .filter(|age| *age <= MAX_AGE)
    };
    age(realtime_now_ns).or_else(|| age(monotonic_now_ns()))
}

/// The busy-wait window before a deadline, adapted to how late long sleeps actually wake up: it
/// holds the worst recent lateness and forgets it slowly, so a noisy host gets a longer spin and
/// a quiet one returns to the minimum.
#[derive(Debug, Clone, Default)]
pub struct WakeTuner {
    late: Duration,
}

impl WakeTuner {
    /// Spin at least this long (a quiet machine wakes up within tens of microseconds).
    pub const MIN_SPIN: Duration = Duration::from_micros(60);
    /// Spin at most this long: beyond it the CPU cost of spinning before every deadline is out
    /// of proportion (lateness above it comes from the host descheduling us, which spinning
    /// cannot prevent).
    pub const MAX_SPIN: Duration = Duration::from_millis(1);
    /// Margin over the lateness held.
    const MARGIN: Duration = Duration::from_micros(20);
    /// A sleep this long lets an idle vCPU halt, which is what makes wake-ups late by
    /// hundreds of microseconds; shorter waits always get the minimum spin.
    pub const LONG_SLEEP: Duration = Duration::from_millis(2);

    /// How long before a deadline `wait` from now to stop sleeping and start spinning.
    pub fn spin(&self, wait: Duration) -> Duration {
        if wait < Self::LONG_SLEEP {
            return Self::MIN_SPIN;
        }
        (self.late + Self::MARGIN).clamp(Self::MIN_SPIN, Self::MAX_SPIN)
    }

    /// A timed sleep of `slept` woke up `late` after it was due.
    pub fn observe(&mut self, slept: Duration, late: Duration) {
        if slept < Self::LONG_SLEEP - Self::MAX_SPIN {
            return;
        }
        // Decay by 1/64 per wake-up: after a noisy spell, ~200 quiet wake-ups (a few seconds
        // of traffic) bring the spin back to the minimum.
        self.late = late.max(self.late - self.late / 64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clocks as they read on a machine up for 7 hours in 2026.
    const REAL: u64 = 56 * 365 * 24 * 3600 * 1_000_000_000;
    const MONO: u64 = 7 * 3600 * 1_000_000_000;
    fn mono() -> u64 {
        MONO
    }

    #[test]
    fn realtime_stamp_gives_its_age() {
        assert_eq!(
            arrival_age(REAL - 300_000, REAL, mono),
            Some(Duration::from_micros(300))
        );
    }

    #[test]
    fn monotonic_stamp_gives_its_age() {
        assert_eq!(
            arrival_age(MONO - 2_000, REAL, mono),
            Some(Duration::from_micros(2))
        );
    }

    #[test]
    fn implausible_stamps_are_not_used() {
        assert_eq!(arrival_age(0, REAL, mono), None); // no stamp
        assert_eq!(arrival_age(REAL + 5_000, REAL, mono), None); // future
        assert_eq!(arrival_age(REAL - 2 * 1_000_000_000, REAL, mono), None); // 2 s old
    }

    #[test]
    fn spin_follows_lateness_of_long_sleeps_and_decays() {
        let long = Duration::from_millis(20);
        let mut t = WakeTuner::default();
        assert_eq!(t.spin(long), WakeTuner::MIN_SPIN);
        t.observe(long, Duration::from_micros(400));
        assert_eq!(t.spin(long), Duration::from_micros(420));
        t.observe(long, Duration::from_millis(5));
        assert_eq!(t.spin(long), WakeTuner::MAX_SPIN);
        for _ in 0..400 {
            t.observe(long, Duration::from_micros(10));
        }
        assert_eq!(t.spin(long), WakeTuner::MIN_SPIN);
    }

    #[test]
    fn short_waits_neither_spin_longer_nor_teach_the_tuner() {
        let short = Duration::from_micros(500);
        let mut t = WakeTuner::default();
        t.observe(short, Duration::from_millis(3));
        assert_eq!(t.spin(Duration::from_millis(20)), WakeTuner::MIN_SPIN);
        t.observe(Duration::from_millis(20), Duration::from_micros(400));
        assert_eq!(t.spin(short), WakeTuner::MIN_SPIN);
    }
}
