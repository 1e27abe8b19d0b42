//! Links that reconfigure on a known schedule, and what the tunnel does about it.
//!
//! A Starlink dish is handed from one satellite to the next every 15 s, at 12, 27, 42 and 57 s
//! past each minute of UTC, on every dish at once. Around each such boundary the link loses a
//! burst of packets and its delay jumps (the recording in the lab: one way 31 -> 12 ms, loss
//! bursts of 50-200 ms). A path configured as Starlink (`link: starlink`) therefore expects a
//! change at each boundary of the wall clock, and the bond sends a copy of each small packet that
//! is not TCP (a call, a game, DNS, a ping) on another path for `BEFORE` before to `AFTER` after
//! it (`near_boundary`, `bond::copies`): a call rides through the burst instead of losing it. TCP
//! is left alone: it recovers for itself, and a copy of a bulk flow would cost a second link's
//! capacity.
//!
//! The core has no wall clock (it runs on an injected `Instant`): the shell gives it where the
//! wall clock stood at some instant (`WallClock`), again now and then, as the two clocks drift.
//!
//! A path whose `link` is not configured is recognised as Starlink by how it changes at the
//! boundaries (`detect`), and treated as one from then on (`Path::link`).

pub mod detect;

use std::time::{Duration, Instant};

use crate::path::{PathId, PathSet};

/// What kind of link a path runs over, as far as the tunnel treats it differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkKind {
    /// Nothing known.
    #[default]
    Other,
    /// A Starlink dish: reconfigures at `PHASE` past every `PERIOD` of UTC.
    Starlink,
}

impl LinkKind {
    pub const NAMES: &'static [&'static str] = &["starlink", "other"];

    pub fn parse(s: &str) -> Option<LinkKind> {
        match s {
            "starlink" => Some(LinkKind::Starlink),
            "other" => Some(LinkKind::Other),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LinkKind::Starlink => "starlink",
            LinkKind::Other => "other",
        }
    }

    /// In a probe (`wire::PROBE_VIEW_LEN`).
    pub fn to_wire(self) -> u8 {
        match self {
            LinkKind::Other => 0,
            LinkKind::Starlink => 1,
        }
    }

    /// From a probe: a kind this build does not know is `Other` (nothing known).
    pub fn from_wire(b: u8) -> LinkKind {
        match b {
            1 => LinkKind::Starlink,
            _ => LinkKind::Other,
        }
    }

    /// Its name where something is known (the hello's `link`, status), `None` for `Other`.
    pub fn known(self) -> Option<&'static str> {
        (self != LinkKind::Other).then(|| self.as_str())
    }
}

/// Starlink's reconfiguration period, and where its boundaries fall within it (12 s past the
/// minute, then every 15 s: 12, 27, 42, 57).
pub const PERIOD: Duration = Duration::from_secs(15);
pub const PHASE: Duration = Duration::from_secs(12);
/// The copies start this long before a boundary (the two clocks, the dish's and ours, are each
/// off by some milliseconds under NTP) and go on this long after it (the recorded loss bursts
/// last up to 200 ms; the delay settles by then).
pub const BEFORE: Duration = Duration::from_millis(100);
pub const AFTER: Duration = Duration::from_millis(300);
/// Packets up to this long (IP header included) are copied: calls (RTP 60-250 bytes), games,
/// DNS, pings. They cost the other link a few kilobytes per boundary; a video's full-size
/// packets would cost it more than the burst they cover, and need the room for the bond's
/// header (`wire::BOND_HEADER`) that a link MTU-sized packet does not have.
pub const COPY_MAX_LEN: usize = 512;

/// Where the wall clock (UTC, since the Unix epoch) stood at an instant of the core's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WallClock {
    at: Instant,
    since_epoch: Duration,
}

impl WallClock {
    pub fn new(at: Instant, since_epoch: Duration) -> Self {
        WallClock { at, since_epoch }
    }

    /// Whole seconds since the epoch at the instant it was read.
    pub fn unix_secs(&self) -> i64 {
        self.since_epoch.as_secs() as i64
    }

    /// The wall clock at `now`.
    fn at(&self, now: Instant) -> Duration {
        match now.checked_duration_since(self.at) {
            Some(d) => self.since_epoch + d,
            None => self.since_epoch.saturating_sub(self.at - now),
        }
    }

    /// Whether `now` is within `BEFORE` before to `AFTER` after a Starlink boundary.
    pub fn near_boundary(&self, now: Instant) -> bool {
        self.spans_boundary(now, now)
    }

    /// Whether any instant from `from` to `to` is near a boundary (`near_boundary`): a probe
    /// in flight over that span may have met the reconfiguration.
    pub fn spans_boundary(&self, from: Instant, to: Instant) -> bool {
        let (from, to) = (from.min(to), from.max(to));
        let into = self.past_window_start(from);
        into < WINDOW.as_nanos() || into + (to - from).as_nanos() >= PERIOD.as_nanos()
    }

    /// When the window around a boundary that `now` is in ends (`None`: `now` is in none).
    pub fn window_end(&self, now: Instant) -> Option<Instant> {
        let into = self.past_window_start(now);
        let left = WINDOW.as_nanos().checked_sub(into).filter(|&n| n > 0)?;
        Some(now + Duration::from_nanos(left as u64))
    }

    /// How long ago the last window around a boundary ended (`None`: `now` is in one).
    pub fn since_window_end(&self, now: Instant) -> Option<Duration> {
        let into = self.past_window_start(now);
        let past = into.checked_sub(WINDOW.as_nanos())?;
        Some(Duration::from_nanos(past as u64))
    }

    /// How far `t` is past the start of the last window (`BEFORE` before a boundary), in ns.
    fn past_window_start(&self, t: Instant) -> u128 {
        let period = PERIOD.as_nanos();
        (self.at(t).as_nanos() + period + BEFORE.as_nanos() - PHASE.as_nanos()) % period
    }
}

/// The window around each boundary, `BEFORE` it to `AFTER` it.
const WINDOW: Duration = BEFORE.saturating_add(AFTER);

/// Until when path `id`, a link that reconfigures, is in the window around a boundary (`None`:
/// it is not, or not such a link). A silence there is the reconfiguration's loss burst (up to
/// 200 ms in the recordings): the ACK watch judges it once the window has passed, and then
/// only what came after it (`judged_silence`). Judged at once, a 150 ms burst on a 20 ms path
/// took the path down 86 ms into it, and its connection was closed and dialled again (a QUIC
/// connection's congestion state lost every 15 s); a real outage that begins at a boundary
/// is found a bound after the window's end instead, at most `AFTER` later than elsewhere.
pub fn excused_until(paths: &PathSet, id: PathId, now: Instant) -> Option<Instant> {
    paths.reconfig_clock(id)?.window_end(now)
}

/// The part of a silence of `silent_for` on path `id` that the ACK watch judges: on a link
/// that reconfigures, what came after the last window. Judged whole at the window's end, a
/// 150 ms burst under a bulk download took the path down anyway: the sender's window was all
/// in the burst, so nothing new went out until its probe timeout, and the first new ACK
/// came 300 ms or more after the boundary, past the window. An outage that begins at a
/// boundary is then found a bound after the window, instead of a bound after it began.
pub fn judged_silence(paths: &PathSet, id: PathId, now: Instant, silent_for: Duration) -> Duration {
    match paths
        .reconfig_clock(id)
        .and_then(|c| c.since_window_end(now))
    {
        Some(since) => silent_for.min(since),
        None => silent_for,
    }
}

/// Whether path `id`, a link that reconfigures, is near a boundary now (`WallClock::near_boundary`):
/// the bond copies its small packets to another path then (`bond::copies`).
pub fn near_boundary(paths: &PathSet, id: PathId, now: Instant) -> bool {
    paths
        .reconfig_clock(id)
        .is_some_and(|c| c.near_boundary(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wall clock that reads `secs` past the epoch at `t0`.
    fn clock_at(t0: Instant, secs: f64) -> WallClock {
        WallClock::new(t0, Duration::from_secs_f64(secs))
    }

    #[test]
    fn boundaries_fall_at_12_27_42_57_past_the_minute() {
        let t0 = Instant::now();
        let near = |s: f64| clock_at(t0, 1_800_000_000.0 + s).near_boundary(t0);
        // 1_800_000_000 is a whole minute (divisible by 60).
        assert_eq!(1_800_000_000u64 % 60, 0);
        for b in [12.0, 27.0, 42.0, 57.0, 72.0] {
            assert!(near(b), "at {b}");
            assert!(near(b - 0.099), "just before {b}");
            assert!(near(b + 0.299), "just after {b}");
            assert!(!near(b - 0.101), "before {b}");
            assert!(!near(b + 0.301), "after {b}");
            assert!(!near(b + 7.0), "between {b} and the next");
        }
    }

    #[test]
    fn the_clock_runs_with_the_instant_both_ways() {
        let t0 = Instant::now() + Duration::from_secs(100);
        let c = clock_at(t0, 1_800_000_010.0);
        assert!(!c.near_boundary(t0));
        assert!(c.near_boundary(t0 + Duration::from_secs(2)));
        assert!(c.near_boundary(t0 - Duration::from_millis(13_100)));
        assert!(!c.near_boundary(t0 - Duration::from_secs(5)));
    }

    #[test]
    fn a_span_meets_a_boundary_when_any_of_it_is_near_one() {
        let t0 = Instant::now();
        // 1_800_000_000 s is a whole minute: a boundary at t0 + 12 s.
        let c = clock_at(t0, 1_800_000_000.0);
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        assert!(!c.spans_boundary(at(5.0), at(11.8)));
        assert!(c.spans_boundary(at(5.0), at(11.95)), "ends in the window");
        assert!(
            c.spans_boundary(at(11.0), at(13.0)),
            "spans the whole window"
        );
        assert!(c.spans_boundary(at(12.25), at(12.5)), "starts in it");
        assert!(
            !c.spans_boundary(at(12.35), at(26.85)),
            "between two windows"
        );
        assert!(c.spans_boundary(at(12.35), at(26.95)), "into the next");
        assert!(c.spans_boundary(at(13.0), at(11.0)), "either order");
    }

    #[test]
    fn a_window_ends_300_ms_after_its_boundary_and_says_since_when() {
        let t0 = Instant::now();
        let c = clock_at(t0, 1_800_000_000.0);
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        assert_eq!(c.window_end(at(11.0)), None);
        for s in [11.9, 12.0, 12.1, 12.299] {
            let end = c.window_end(at(s)).unwrap();
            let off = end.max(at(12.3)) - end.min(at(12.3));
            assert!(off < Duration::from_micros(1), "{s}: {off:?}");
        }
        assert_eq!(c.window_end(at(12.3)), None);
        assert!(c.window_end(at(26.95)).is_some());
        // And it ended as long ago as it says.
        assert_eq!(c.since_window_end(at(12.1)), None);
        let since = c.since_window_end(at(12.5)).unwrap();
        assert!(since.abs_diff(Duration::from_millis(200)) < Duration::from_micros(1));
        let since = c.since_window_end(at(20.0)).unwrap();
        assert!(since.abs_diff(Duration::from_millis(7700)) < Duration::from_micros(1));
    }

    #[test]
    fn link_kinds_parse_as_they_print() {
        for k in [LinkKind::Starlink, LinkKind::Other] {
            assert_eq!(LinkKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(LinkKind::parse("oneweb"), None);
    }
}
