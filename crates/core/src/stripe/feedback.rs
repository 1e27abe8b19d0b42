//! Stripe feedback: the receiver tells the sender which of its counters arrived, as a QUIC ACK
//! frame would, so that the sender's congestion controller (`flight.rs`) sees deliveries, round
//! trips and losses. Stripe packets are never retransmitted (the FEC layer above repairs loss);
//! feedback exists for the controller alone.
//!
//! Payload of a type-5 packet:
//! ```text
//! | largest (u64 BE) | delay µs (u32 BE) | n (u8) | n runs (u16 BE each) |
//! ```
//! `largest` is the highest counter received, `delay` how long ago it arrived. The runs go
//! downward from `largest`: arrived, missing, arrived, ... (the first run includes `largest`,
//! so it is at least 1). They cover at most `SPAN` counters and `MAX_RUNS` runs; a counter below
//! them is not reported (the sender's loss timer decides it). Every feedback repeats the whole
//! picture, so a lost feedback costs nothing but time.

use std::time::{Duration, Instant};

use super::{Kind, ReplayWindow};

/// Counters a feedback covers below its largest at most (within the replay window).
pub const SPAN: u64 = 2048;
/// Runs a feedback carries at most (the packet stays under 150 bytes).
pub const MAX_RUNS: usize = 64;
/// Packets after which feedback goes out at once: QUIC's two. The sender's window is a few
/// minimum RTTs of its rate, and the minimum RTT is measured on packets whose feedback left at
/// once, so feedback must not wait long behind it: with one per 8 packets a path of 0.3 ms RTT
/// sat at a 4-packet window and moved 10 Mbit/s of 40 (the window ran out before the 8th).
pub const EVERY: u32 = 2;
/// The longest an arrived packet waits for its feedback (the sender's RTT samples include it,
/// less the `delay` the feedback reports).
pub const MAX_DELAY: Duration = Duration::from_millis(5);
const FIXED: usize = 8 + 4 + 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Feedback {
    pub largest: u64,
    pub delay: Duration,
    /// Run lengths downward from `largest`: arrived, missing, arrived, ...
    pub runs: Vec<u16>,
}

impl Feedback {
    /// The picture of `window` (the receiver's record of authenticated counters); `None` before
    /// anything arrived.
    pub fn from_window(w: &ReplayWindow, delay: Duration) -> Option<Feedback> {
        let largest = w.largest()?;
        let lowest = largest.saturating_sub(SPAN - 1);
        let mut runs = Vec::new();
        let (mut state, mut len) = (true, 0u16);
        let mut n = largest;
        loop {
            if w.seen(n) == state {
                len += 1;
            } else {
                runs.push(len);
                if runs.len() == MAX_RUNS {
                    break;
                }
                state = !state;
                len = 1;
            }
            if n == lowest {
                // A trailing "missing" run says nothing the sender does not infer.
                if state {
                    runs.push(len);
                }
                break;
            }
            n -= 1;
        }
        Some(Feedback {
            largest,
            delay,
            runs,
        })
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.largest.to_be_bytes());
        let us = u32::try_from(self.delay.as_micros()).unwrap_or(u32::MAX);
        out.extend_from_slice(&us.to_be_bytes());
        let n = self.runs.len().min(MAX_RUNS);
        out.push(n as u8);
        for r in &self.runs[..n] {
            out.extend_from_slice(&r.to_be_bytes());
        }
    }

    /// `None` for a malformed payload (wrong length, too many runs, an empty run, or runs
    /// reaching below counter 0).
    pub fn decode(b: &[u8]) -> Option<Feedback> {
        if b.len() < FIXED {
            return None;
        }
        let largest = u64::from_be_bytes(b[..8].try_into().ok()?);
        let delay = Duration::from_micros(u32::from_be_bytes(b[8..12].try_into().ok()?).into());
        let n = usize::from(b[12]);
        if n == 0 || n > MAX_RUNS || b.len() != FIXED + 2 * n {
            return None;
        }
        let runs: Vec<u16> = b[FIXED..]
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect();
        let span: u64 = runs.iter().map(|&r| u64::from(r)).sum();
        // `largest` is the peer's word: u64::MAX must not overflow the check.
        if runs.contains(&0) || span > SPAN || span > largest.saturating_add(1) {
            return None;
        }
        Some(Feedback {
            largest,
            delay,
            runs,
        })
    }

    /// The counters reported as arrived, as inclusive ranges `(low, high)`, highest first.
    pub fn arrived(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut top = self.largest;
        self.runs.iter().enumerate().filter_map(move |(i, &r)| {
            let r = u64::from(r);
            // r >= 1 and the runs reach no lower than counter 0 (`decode`), so this neither
            // underflows nor, at top = u64::MAX, overflows as `top + 1 - r` would.
            let range = (top - (r - 1), top);
            top = top.saturating_sub(r);
            (i % 2 == 0).then_some(range)
        })
    }
}

/// The receiver's side: when feedback is due.
#[derive(Debug, Default)]
pub struct Acks {
    /// Packets received that want feedback, since the last one sent.
    pending: u32,
    first_pending: Option<Instant>,
    /// When the highest counter so far arrived.
    largest: Option<(u64, Instant)>,
}

impl Acks {
    /// An authenticated packet `counter` of `kind` arrived at `now`.
    pub fn on_packet(&mut self, now: Instant, counter: u64, kind: Kind) {
        if self.largest.is_none_or(|(l, _)| counter > l) {
            self.largest = Some((counter, now));
        }
        // Feedback about feedback would never end.
        if kind != Kind::Feedback {
            self.pending += 1;
            self.first_pending.get_or_insert(now);
        }
    }

    /// When feedback should go out (`now` or earlier: at once), if anything waits for it.
    pub fn due(&self) -> Option<Instant> {
        let first = self.first_pending?;
        Some(match self.pending >= EVERY {
            true => first,
            false => first + MAX_DELAY,
        })
    }

    /// The feedback to send now from the receiver's `window`, if one is due.
    pub fn take(&mut self, now: Instant, window: &ReplayWindow) -> Option<Feedback> {
        if self.due()? > now {
            return None;
        }
        self.pending = 0;
        self.first_pending = None;
        let delay = self
            .largest
            .map_or(Duration::ZERO, |(_, at)| now.saturating_duration_since(at));
        Feedback::from_window(window, delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(seen: &[u64]) -> ReplayWindow {
        let mut w = ReplayWindow::default();
        for &n in seen {
            w.mark(n);
        }
        w
    }

    #[test]
    fn runs_describe_the_window_and_round_trip() {
        let w = window(&[0, 1, 2, 5, 6, 9]);
        let fb = Feedback::from_window(&w, Duration::from_micros(1500)).unwrap();
        assert_eq!(fb.largest, 9);
        // 9 | 8 7 missing | 6 5 | 4 3 missing | 2 1 0
        assert_eq!(fb.runs, vec![1, 2, 2, 2, 3]);
        assert_eq!(
            fb.arrived().collect::<Vec<_>>(),
            vec![(9, 9), (5, 6), (0, 2)]
        );
        let mut b = Vec::new();
        fb.encode(&mut b);
        assert_eq!(b.len(), 13 + 10);
        assert_eq!(Feedback::decode(&b), Some(fb));
    }

    #[test]
    fn span_and_run_limits_hold() {
        // Every other counter of 10000: the runs stop at MAX_RUNS.
        let seen: Vec<u64> = (0..10_000).filter(|n| n % 2 == 0).collect();
        let fb = Feedback::from_window(&window(&seen), Duration::ZERO).unwrap();
        assert_eq!(fb.runs.len(), MAX_RUNS);
        // Everything seen: one run of SPAN.
        let all: Vec<u64> = (0..5000).collect();
        let fb = Feedback::from_window(&window(&all), Duration::ZERO).unwrap();
        assert_eq!(fb.runs, vec![SPAN as u16]);
        let mut b = Vec::new();
        fb.encode(&mut b);
        assert_eq!(Feedback::decode(&b), Some(fb));
        assert_eq!(
            Feedback::from_window(&ReplayWindow::default(), Duration::ZERO),
            None
        );
    }

    #[test]
    fn malformed_feedback_is_refused() {
        let fb = Feedback {
            largest: 3,
            delay: Duration::ZERO,
            runs: vec![1, 1, 2],
        };
        let mut b = Vec::new();
        fb.encode(&mut b);
        assert!(Feedback::decode(&b).is_some());
        for n in 0..b.len() {
            assert_eq!(Feedback::decode(&b[..n]), None, "truncated to {n}");
        }
        // Runs below counter 0, an empty run, a wrong count.
        let mut below = b.clone();
        below[FIXED + 5] = 9;
        assert_eq!(Feedback::decode(&below), None);
        let mut empty = b.clone();
        empty[FIXED + 1] = 0;
        assert_eq!(Feedback::decode(&empty), None);
        let mut count = b.clone();
        count[12] = 2;
        assert_eq!(Feedback::decode(&count), None);
    }

    #[test]
    fn feedback_is_due_after_enough_packets_or_the_delay() {
        let t0 = Instant::now();
        let mut a = Acks::default();
        let mut w = ReplayWindow::default();
        assert_eq!(a.due(), None);
        a.on_packet(t0, 0, Kind::Data);
        w.mark(0);
        assert_eq!(a.due(), Some(t0 + MAX_DELAY));
        assert_eq!(a.take(t0, &w), None);
        for n in 1..EVERY as u64 {
            a.on_packet(t0, n, Kind::Data);
            w.mark(n);
        }
        let fb = a.take(t0 + Duration::from_millis(1), &w).unwrap();
        assert_eq!(
            (fb.largest, fb.delay),
            (EVERY as u64 - 1, Duration::from_millis(1))
        );
        // Feedback alone does not ask for feedback.
        a.on_packet(t0, 8, Kind::Feedback);
        assert_eq!(a.due(), None);
    }
}
