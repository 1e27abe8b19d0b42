//! Timing helpers for the emulator's I/O shell (`bridge`), kept pure so they can be tested.
//!
//! A userspace emulator adds its own scheduling latency to every emulated delay twice: once when
//! a packet arrives (the thread wakes up some time after the kernel queued the frame) and once
//! when it is due (the timer fires late). On an idle VM both can reach milliseconds, because a
//! halted vCPU has to be scheduled again by the host. The first is removed by taking the arrival
//! time from the kernel's receive timestamp (`arrival_age`); the second by waking up early and
//! spinning for a window that follows the lateness actually observed (`WakeTuner`).
//!
//! The spin applies to long sleeps only. Under load the waits are short, the lateness comes from
//! other emulator threads and the traffic's endpoints sharing the CPUs, and spinning would take
//! the CPU from them: a spin before every deadline cost 1.6 cores on a 300 Mbit/s link. A busy
//! link is served in rounds instead (`plan`): at most one per link slack, each releasing every
//! packet due and reading every frame that arrived, so the CPU follows the packet rate.

use std::time::{Duration, Instant};

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

/// What a direction thread does between two rounds (a round reads the input that has arrived
/// and releases the packets that are due). Three phases, each possibly empty:
///
/// 1. until `deaf_until`, sleep without reading input. Frames wait in the socket with their
///    kernel stamps, so the model still sees their true arrival times; this is safe while no
///    frame could be due before it is read (the link's shortest delay), and it is what lets a
///    busy link take many frames per wake-up instead of waking up for each one;
/// 2. until `listen_until`, wait for input (or a control event); `None`: no deadline;
/// 3. until `spin_until`, spin: the last stretch before a deadline after a long sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub deaf_until: Instant,
    pub listen_until: Option<Instant>,
    pub spin_until: Option<Instant>,
}

/// Input is never left unread longer than this (beyond a link's slack), however long the
/// link's delay: the socket's buffer must hold what arrives meanwhile.
pub const MAX_DEAF: Duration = Duration::from_millis(2);

/// What a thread knows of one of its links after a round.
#[derive(Debug, Clone, Copy)]
pub struct LinkTimes {
    /// The link's next delivery.
    pub deadline: Option<Instant>,
    /// Its shortest delay: a frame read this late is still on time.
    pub min_delay: Duration,
    /// How late it may release packets while busy (`LinkSpec::slack`).
    pub slack: Duration,
    /// The last round that released a packet of this link.
    pub last_release: Option<Instant>,
}

impl LinkTimes {
    /// A busy link releases at most once per slack; after a quiet spell, at once.
    fn next_release(&self, now: Instant) -> Instant {
        self.last_release.map_or(now, |r| (r + self.slack).max(now))
    }
}

/// The plan after a round that ended at `now`. A link releases packets at most once per slack:
/// while it is busy the packets due meanwhile leave together, at most that late, and the frames
/// that arrived are read at the same wake-up. A delivery after a quiet spell (a ping, a sparse
/// link) keeps its exact time.
pub fn plan(now: Instant, links: &[LinkTimes], tuner: &WakeTuner) -> Plan {
    // Input may wait until the latest time at which reading it changes nothing: a frame that
    // arrives now is due no earlier than its delay from now, and would leave at the link's next
    // release round anyway.
    let read_by = links
        .iter()
        .map(|l| (now + l.min_delay.min(MAX_DEAF)).max(l.next_release(now)))
        .min()
        .unwrap_or(now + MAX_DEAF);
    let due = links
        .iter()
        .filter_map(|l| l.deadline.map(|d| d.max(l.next_release(now))))
        .min();
    let Some(due) = due else {
        return Plan {
            deaf_until: read_by,
            listen_until: None,
            spin_until: None,
        };
    };
    let spin = tuner.spin(due.saturating_duration_since(now));
    let wake = due - spin;
    Plan {
        deaf_until: wake.min(read_by),
        listen_until: Some(wake),
        spin_until: (!spin.is_zero()).then_some(due),
    }
}

/// The busy-wait window before a deadline that follows a long sleep, adapted to how late such
/// sleeps actually wake up: it holds the worst recent lateness and forgets it slowly, so a noisy
/// host gets a longer spin and a quiet one returns to the minimum.
#[derive(Debug, Clone, Default)]
pub struct WakeTuner {
    late: Duration,
}

impl WakeTuner {
    /// Spin at least this long before a deadline after a long sleep.
    pub const MIN_SPIN: Duration = Duration::from_micros(60);
    /// Spin at most this long: beyond it the CPU cost of spinning is out of proportion
    /// (lateness above it comes from the host descheduling us, which spinning cannot prevent).
    pub const MAX_SPIN: Duration = Duration::from_millis(1);
    /// Margin over the lateness held.
    const MARGIN: Duration = Duration::from_micros(20);
    /// A sleep this long lets an idle vCPU halt, which is what makes wake-ups late by
    /// hundreds of microseconds. Shorter waits do not spin at all: they happen when the link is
    /// busy, where a spin per packet would cost a core (it did: 1.6 cores at 300 Mbit/s).
    pub const LONG_SLEEP: Duration = Duration::from_millis(2);

    /// How long before a deadline `wait` from now to stop sleeping and start spinning.
    pub fn spin(&self, wait: Duration) -> Duration {
        if wait <= Self::MIN_SPIN {
            // A sleep would wake up about this late anyway (two packets due close together,
            // e.g. both directions of a path at once).
            return wait;
        }
        if wait < Self::LONG_SLEEP {
            return Duration::ZERO;
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

/// The monotonic time at which the wall clock's current minute began (given `now` and the wall
/// clock read at the same moment): the epoch of recorded links and rate slots, so a replayed
/// Starlink slot changes when the real ones do (12, 27, 42 and 57 s past each minute) and the
/// tunnel's own reckoning of them, from the wall clock, agrees with the lab's.
pub fn minute_start(now: Instant, wall: std::time::SystemTime) -> Instant {
    let since_unix = wall
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let into_minute = Duration::from_nanos((since_unix.as_nanos() % 60_000_000_000) as u64);
    now.checked_sub(into_minute).unwrap_or(now)
}

/// The monotonic time of wall-clock time `at`, given `now` and the wall clock read with it.
pub fn instant_of(at: std::time::SystemTime, now: Instant, wall: std::time::SystemTime) -> Instant {
    match at.duration_since(wall) {
        Ok(ahead) => now + ahead,
        Err(behind) => now.checked_sub(behind.duration()).unwrap_or(now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_minute_starts_on_the_wall_clocks_minute() {
        let now = Instant::now();
        let wall = std::time::UNIX_EPOCH + Duration::from_millis(1_000 * 3600 + 27_250);
        assert_eq!(now - minute_start(now, wall), Duration::from_millis(27_250));
        let later = wall + Duration::from_millis(2_500);
        assert_eq!(
            instant_of(later, now, wall) - now,
            Duration::from_millis(2_500)
        );
        let earlier = wall - Duration::from_millis(500);
        assert_eq!(
            now - instant_of(earlier, now, wall),
            Duration::from_millis(500)
        );
    }

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
    fn short_waits_neither_spin_nor_teach_the_tuner() {
        let short = Duration::from_micros(500);
        let mut t = WakeTuner::default();
        t.observe(short, Duration::from_millis(3));
        assert_eq!(t.spin(Duration::from_millis(20)), WakeTuner::MIN_SPIN);
        t.observe(Duration::from_millis(20), Duration::from_micros(400));
        assert_eq!(t.spin(short), Duration::ZERO);
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// A link that released a packet `released_ago` before `now` (None: quiet for long).
    fn link(
        now: Instant,
        deadline: Option<Instant>,
        min_delay: u64,
        slack: u64,
        released_ago: Option<u64>,
    ) -> LinkTimes {
        LinkTimes {
            deadline,
            min_delay: us(min_delay),
            slack: us(slack),
            last_release: released_ago.map(|a| now - us(a)),
        }
    }

    #[test]
    fn busy_link_batches_deliveries_and_reads_input_at_the_same_rounds() {
        let now = Instant::now();
        let t = WakeTuner::default();
        // Released this round; the next delivery in 40 us (300 Mbit/s), 5 ms delay, slack
        // 500 us: the next round in 500 us, deaf until then.
        let p = plan(
            now,
            &[link(now, Some(now + us(40)), 5000, 500, Some(0))],
            &t,
        );
        assert_eq!(p.deaf_until, now + us(500));
        assert_eq!(p.listen_until, Some(now + us(500)));
        assert_eq!(p.spin_until, None);
        // Released 300 us ago: the next round 200 us from now.
        let p = plan(
            now,
            &[link(now, Some(now + us(40)), 5000, 500, Some(300))],
            &t,
        );
        assert_eq!(p.listen_until, Some(now + us(200)));
        // Slack 0: every deadline on time.
        let p = plan(now, &[link(now, Some(now + us(100)), 5000, 0, Some(0))], &t);
        assert_eq!(p.listen_until, Some(now + us(100)));
    }

    #[test]
    fn a_packet_after_a_quiet_spell_keeps_its_time() {
        let now = Instant::now();
        let t = WakeTuner::default();
        // A link without delay: a lone packet just read is due now, and input is listened for
        // at once (its next frame may be due as soon as it arrives).
        let p = plan(now, &[link(now, Some(now), 0, 500, None)], &t);
        assert_eq!((p.deaf_until, p.listen_until), (now, Some(now)));
        let p = plan(now, &[link(now, None, 0, 500, Some(10_000))], &t);
        assert_eq!((p.deaf_until, p.listen_until), (now, None));
        // The same link busy (released this round): input waits for the next round.
        let p = plan(now, &[link(now, None, 0, 500, Some(0))], &t);
        assert_eq!(p.deaf_until, now + us(500));
    }

    #[test]
    fn sparse_link_wakes_at_each_deadline_without_spinning() {
        let now = Instant::now();
        let t = WakeTuner::default();
        // 10 Mbit/s: the next delivery in 1.2 ms; deaf until then (delay 5 ms), no spin.
        let p = plan(
            now,
            &[link(now, Some(now + us(1200)), 5000, 500, Some(0))],
            &t,
        );
        assert_eq!(
            (p.deaf_until, p.listen_until),
            (now + us(1200), Some(now + us(1200)))
        );
        assert_eq!(p.spin_until, None);
        // The same with a 700 us delay: input is read (listened for) after 700 us.
        let p = plan(
            now,
            &[link(now, Some(now + us(1200)), 700, 500, Some(0))],
            &t,
        );
        assert_eq!(p.deaf_until, now + us(700));
        assert_eq!(p.listen_until, Some(now + us(1200)));
    }

    #[test]
    fn both_directions_of_a_path_share_the_rounds() {
        let now = Instant::now();
        let t = WakeTuner::default();
        // Upload busy (due in 40 us), download quiet (due in 3 ms): the earlier one decides.
        let up = link(now, Some(now + us(40)), 5000, 500, Some(0));
        let down = link(now, Some(now + us(3000)), 5000, 500, None);
        assert_eq!(plan(now, &[up, down], &t).listen_until, Some(now + us(500)));
        // A download packet due in 100 us after a quiet spell leaves on time, busy upload or not.
        let down = link(now, Some(now + us(100)), 5000, 500, None);
        assert_eq!(plan(now, &[up, down], &t).listen_until, Some(now + us(100)));
        // Due in 30 us: closer than a sleep could wake up, so spin for it.
        let down = link(now, Some(now + us(30)), 5000, 500, None);
        let p = plan(now, &[up, down], &t);
        assert_eq!(
            (p.listen_until, p.spin_until),
            (Some(now), Some(now + us(30)))
        );
    }

    #[test]
    fn long_sleep_listens_then_spins_to_the_deadline() {
        let now = Instant::now();
        let mut t = WakeTuner::default();
        t.observe(Duration::from_millis(20), us(300));
        let p = plan(
            now,
            &[link(now, Some(now + us(20_000)), 20_000, 500, Some(0))],
            &t,
        );
        assert_eq!(p.deaf_until, now + MAX_DEAF);
        assert_eq!(p.listen_until, Some(now + us(20_000 - 320)));
        assert_eq!(p.spin_until, Some(now + us(20_000)));
    }
}
