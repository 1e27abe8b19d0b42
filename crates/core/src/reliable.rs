//! Reliable mode's rules (one ordered stream per path). A stream retransmits what the link
//! loses, so what it holds can only grow when the path is slower than what is offered, and
//! everything in it is delivered, however late. Two rules keep that from hurting:
//!
//! - **The backlog is bounded in time**: a stream may hold its congestion window (the
//!   controller's backlog window: the window but for its momentary dips,
//!   `cc::Controller::backlog_window`) plus `BACKLOG_TIME` of sending at the window's rate,
//!   plus a round trip or two of it on a lossy path (where retransmissions hold the window),
//!   and a packet waits at most `queue_wait`
//!   (three round trips) in the send queue in front of it, where the pacer holds it and sparse
//!   flows pass bulk. Beyond that the tunnel refuses packets
//!   (counted `queue_full`), which is the loss signal inner TCP needs; without the bound a
//!   32 MiB buffer filled under loss (measured: client RSS 8.9 -> 26.8 MiB, seconds of delay).
//! - **A path that goes down hands its recent packets to a live path**: packets sent in the
//!   last silence bound plus a round trip may never have arrived; they are sent again on
//!   another path at once, and the dead path's connection is closed so its stream does not
//!   deliver them seconds later when the path recovers (scenario 03: 22 pings > 1 s late).
//!   Some of them may have arrived: those reach the peer twice, which inner TCP ignores (and
//!   ping reports as DUP); a late second copy after a failover is worse than an early one.

use std::time::{Duration, Instant};

/// Queueing a path's stream may add beyond its congestion window.
pub const BACKLOG_TIME: Duration = Duration::from_millis(25);
/// How long a packet may wait in a path's send queue before the stream (`queue_wait`), at
/// least; older ones are dropped (`queue_full`) instead of delaying everything behind them.
pub const HANDOFF_TIME: Duration = Duration::from_millis(20);
/// ... and at most.
pub const MAX_QUEUE_WAIT: Duration = Duration::from_millis(200);
/// Round trips of the path a packet may wait in its send queue.
const QUEUE_WAIT_RTTS: u32 = 3;

/// How long a packet may wait in the send queue of a path with this smoothed RTT: three round
/// trips, within `HANDOFF_TIME..=MAX_QUEUE_WAIT`. The queue is where the tunnel's pacer holds
/// what the path cannot take yet, so it is the bottleneck buffer of the inner flows, and a
/// loss-based inner TCP needs about a round trip of buffer to keep the link busy; a pacer that
/// dropped after a fixed 20 ms took 02 at 10% loss down to 8-20 Mbit/s (inner slow starts cut
/// short), three round trips gave 34-39. Sparse flows pass the queue (`sendq.rs`), so what
/// waits here delays only bulk.
pub fn queue_wait(srtt: Duration) -> Duration {
    (srtt * QUEUE_WAIT_RTTS).clamp(HANDOFF_TIME, MAX_QUEUE_WAIT)
}
/// Bounds of a stream's send window (bytes written and not yet acknowledged).
pub const MIN_WINDOW: u64 = 256 * 1024;
pub const MAX_WINDOW: u64 = 32 << 20;

/// Round trips of extra backlog per unit of loss rate, and the most: a lost packet holds the
/// stream's window for a round trip or two until its retransmission is acknowledged, and on a
/// lossy path that happens all the time, so the window must hold what is sent meanwhile or the
/// sender stalls. At 10% loss two round trips more (with none, scenario 02 at 10% loss: inner
/// cubic 41 -> 28 Mbit/s, 2194 packets refused); on a clean path none, so a bulk flow cannot
/// queue more than `BACKLOG_TIME` in front of everything else (scenario 10: ping RTT under an
/// upload 205 -> 65 ms).
const RTTS_PER_LOSS: f64 = 20.0;
const MAX_LOSS_RTTS: f64 = 2.0;

/// The send window of a path's stream: its congestion window, plus `BACKLOG_TIME` and the
/// retransmission allowance for a path losing `loss` (0..1) at the rate that window allows
/// per round trip.
pub fn stream_window(cwnd: u64, rtt: Duration, loss: f64) -> u64 {
    let rtt = rtt.max(Duration::from_millis(1)).as_secs_f64();
    let loss_rtts = (loss.max(0.0) * RTTS_PER_LOSS).min(MAX_LOSS_RTTS);
    let w = cwnd as f64 * (1.0 + BACKLOG_TIME.as_secs_f64() / rtt + loss_rtts);
    (w as u64).clamp(MIN_WINDOW, MAX_WINDOW)
}

/// Packets sent on a path since this moment may not have reached the peer when the path was
/// declared down at `now`: the silence that decided it, plus a round trip.
pub fn unconfirmed_since(now: Instant, down_after: Duration, srtt: Option<Duration>) -> Instant {
    let back = down_after + srtt.unwrap_or(Duration::from_millis(100));
    now.checked_sub(back).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_wait_is_three_round_trips_within_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(queue_wait(ms(30)), ms(90));
        assert_eq!(queue_wait(ms(1)), HANDOFF_TIME);
        assert_eq!(queue_wait(ms(600)), MAX_QUEUE_WAIT);
    }

    #[test]
    fn window_is_cwnd_plus_a_bounded_queue() {
        // 60 Mbit/s x 30 ms: a 225 KB window, plus 25 ms of 60 Mbit/s (187.5 KB).
        let w = stream_window(225_000, Duration::from_millis(30), 0.0);
        assert!((412_490..=412_500).contains(&w), "{w}");
        // Lossy: a round trip more per 5% loss, two at most.
        let lossy = stream_window(225_000, Duration::from_millis(30), 0.05);
        assert!((637_490..=637_500).contains(&lossy), "{lossy}");
        assert_eq!(
            stream_window(225_000, Duration::from_millis(30), 0.3),
            stream_window(225_000, Duration::from_millis(30), 0.1)
        );
        // Tiny windows get the floor; huge ones the cap; a zero RTT does not divide by zero.
        assert_eq!(
            stream_window(10_000, Duration::from_millis(30), 0.0),
            MIN_WINDOW
        );
        assert_eq!(
            stream_window(100 << 20, Duration::from_millis(10), 0.0),
            MAX_WINDOW
        );
        assert_eq!(stream_window(2_000_000, Duration::ZERO, 0.0), MAX_WINDOW);
    }

    #[test]
    fn unconfirmed_reaches_back_a_silence_and_a_round_trip() {
        let now = Instant::now() + Duration::from_secs(10);
        let since = unconfirmed_since(
            now,
            Duration::from_millis(350),
            Some(Duration::from_millis(30)),
        );
        assert_eq!(now - since, Duration::from_millis(380));
    }
}
