//! When the client dials a path again: after a failed attempt, with exponential backoff; and
//! while a connection exists but the path has been unusable (down, or never answered) for
//! `REPLACE_AFTER`, or three of its round trips on a long path, in parallel with the old
//! connection (whichever recovers first wins). The latter is what brings a path back after a
//! server restart, whose QUIC state is gone.

use std::time::Duration;

/// Dial a replacement for a connection whose path has been unusable this long.
pub const REPLACE_AFTER: Duration = Duration::from_millis(1000);
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Whether to dial a replacement, given how long the path has been unusable (`None`: usable)
/// and its round trip as last known: a fresh connection of a 1 s path is not answered sooner
/// than its first probe's round trip, so a replacement dialed at `REPLACE_AFTER` replaced every
/// connection before it could come up.
pub fn should_replace(unusable_for: Option<Duration>, rtt: Option<Duration>) -> bool {
    let after = REPLACE_AFTER.max(3 * rtt.unwrap_or_default());
    unusable_for.is_some_and(|d| d >= after)
}

/// Waits between failed attempts: 200 ms doubling up to 2 s; reset by a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: BACKOFF_MIN }
    }
}

impl Backoff {
    /// The wait after a failed attempt.
    pub fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        wait
    }
    pub fn succeeded(&mut self) {
        self.next = BACKOFF_MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let mut b = Backoff::default();
        let ms: Vec<u128> = (0..6).map(|_| b.failed().as_millis()).collect();
        assert_eq!(ms, [200, 400, 800, 1600, 2000, 2000]);
        b.succeeded();
        assert_eq!(b.failed().as_millis(), 200);
    }

    #[test]
    fn replaces_only_after_a_long_unusable_spell() {
        assert!(!should_replace(None, None));
        assert!(!should_replace(Some(Duration::from_millis(999)), None));
        assert!(should_replace(Some(REPLACE_AFTER), None));
        let short = Some(Duration::from_millis(40));
        assert!(should_replace(Some(REPLACE_AFTER), short));
        let geo = Some(Duration::from_millis(600));
        assert!(!should_replace(Some(Duration::from_millis(1700)), geo));
        assert!(should_replace(Some(Duration::from_millis(1800)), geo));
    }
}
