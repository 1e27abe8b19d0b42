//! The stripe sender's record of its data packets in flight, and the congestion controller it
//! drives: a packet is acknowledged when a feedback (`feedback.rs`) reports its counter,
//! declared lost when it is still missing a time threshold after it was sent while later ones
//! arrived (QUIC's rule, RFC 9002 section 6.1.2, but later (`TIME_THRESHOLD`) and without the
//! packet threshold: the pipes of a path may sit behind different per-session shapers and
//! reorder a lot), or when nothing at all
//! came back for `PERSISTENT_PTOS` probe timeouts (the path stopped carrying: the controller
//! starts over). Nothing is retransmitted; the record exists for the controller and for the
//! loss figure in status.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::feedback::{self, Feedback};
use crate::cc::Controller;

/// Packets tracked at most (about 1.5 s at 1 Gbit/s): older ones are declared lost to make room.
const MAX_TRACKED: usize = 1 << 17;
/// A packet is lost when still unacknowledged this long after it was sent, in RTTs, plus
/// `REORDER_SLACK`, while a later one was acknowledged. Later than QUIC's 9/8 RTT: nothing is
/// retransmitted here, so a late verdict only holds window a little longer, while an early one
/// is wrong. The receiver reads each pipe's socket in its own task, a batch at a time, so on a
/// busy receiver a pipe's packets are acknowledged after later ones from other pipes: with
/// 9/8 RTT and no slack, scenario 06 (two paths, 540 Mbit/s) declared 4-7% of packets lost that
/// all arrived (the emulator dropped none).
const TIME_THRESHOLD: f64 = 5.0 / 4.0;
const REORDER_SLACK: Duration = Duration::from_millis(5);
/// Probe timeouts without any acknowledgement after which what is in flight is declared lost
/// as persistent congestion.
const PERSISTENT_PTOS: u32 = 3;
/// The RTT assumed before the first sample (RFC 9002's initial RTT).
const INITIAL_RTT: Duration = Duration::from_millis(333);

#[derive(Debug, Clone, Copy)]
struct Sent {
    counter: u64,
    at: Instant,
    bytes: u32,
    app_limited: bool,
    done: bool,
    /// The caller's tag (the stripe pipe it left on), for `lost_by_tag`.
    tag: u8,
}

/// RTT estimate (RFC 9002 section 5).
#[derive(Debug, Clone, Copy, Default)]
struct Rtt {
    smoothed: Option<Duration>,
    var: Duration,
    min: Option<Duration>,
    latest: Duration,
}

impl Rtt {
    fn sample(&mut self, raw: Duration, ack_delay: Duration) {
        let min = *self.min.get_or_insert(raw);
        self.min = Some(min.min(raw));
        // The receiver's wait is not the path's, unless that would go below the minimum.
        let adjusted = match raw.checked_sub(ack_delay) {
            Some(a) if a >= min => a,
            _ => raw,
        };
        self.latest = adjusted;
        match self.smoothed {
            None => {
                self.smoothed = Some(adjusted);
                self.var = adjusted / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(adjusted);
                self.var = (self.var * 3 + diff) / 4;
                self.smoothed = Some((s * 7 + adjusted) / 8);
            }
        }
    }

    fn smoothed(&self) -> Duration {
        self.smoothed.unwrap_or(INITIAL_RTT)
    }

    /// The probe timeout: how long without feedback means something is wrong.
    fn pto(&self) -> Duration {
        self.smoothed() + (4 * self.var).max(Duration::from_millis(1)) + feedback::MAX_DELAY
    }
}

/// Totals for status and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlightCounts {
    pub sent: u64,
    pub acked: u64,
    pub lost: u64,
}

#[derive(Debug)]
pub struct Flight {
    sent: VecDeque<Sent>,
    in_flight: u64,
    largest_acked: Option<u64>,
    rtt: Rtt,
    cc: Box<dyn Controller>,
    /// The last acknowledgement of anything (or the first send after a quiet spell).
    last_progress: Option<Instant>,
    counts: FlightCounts,
    /// Packets lost, and bytes in flight, by tag.
    lost_by_tag: Vec<u64>,
    in_flight_by_tag: Vec<u64>,
}

impl Flight {
    pub fn new(cc: Box<dyn Controller>) -> Flight {
        Flight {
            sent: VecDeque::new(),
            in_flight: 0,
            largest_acked: None,
            rtt: Rtt::default(),
            cc,
            last_progress: None,
            counts: FlightCounts::default(),
            lost_by_tag: Vec::new(),
            in_flight_by_tag: Vec::new(),
        }
    }

    /// A data packet with counter `counter` left (counters only grow), tagged `tag` (the pipe).
    /// `app_limited`: nothing else was waiting to be sent.
    pub fn on_sent(
        &mut self,
        now: Instant,
        counter: u64,
        bytes: usize,
        app_limited: bool,
        tag: u8,
    ) {
        if self.sent.len() >= MAX_TRACKED {
            let lost = self.declare_lost(|_| true, 1);
            self.report_loss(now, lost, false);
        }
        if self.in_flight == 0 {
            // Quiet until now: the probe timeout runs from here.
            self.last_progress = Some(now);
        }
        self.sent.push_back(Sent {
            counter,
            at: now,
            bytes: bytes as u32,
            app_limited,
            done: false,
            tag,
        });
        self.in_flight += bytes as u64;
        *tagged(&mut self.in_flight_by_tag, tag) += bytes as u64;
        self.counts.sent += 1;
        self.cc.on_sent(now, bytes as u64);
    }

    /// A feedback arrived: acknowledge what it reports, then declare lost what is overdue.
    pub fn on_feedback(&mut self, now: Instant, fb: &Feedback) {
        let mut newly = false;
        // Oldest first: the controller's delivery-rate records are taken in send order (an
        // acknowledgement lets go of the records before its packet).
        let ranges: Vec<(u64, u64)> = fb.arrived().collect();
        for &(low, high) in ranges.iter().rev() {
            let start = self.sent.partition_point(|s| s.counter < low);
            for i in start..self.sent.len() {
                let s = &mut self.sent[i];
                if s.counter > high {
                    break;
                }
                if s.done {
                    continue;
                }
                s.done = true;
                let s = *s;
                self.in_flight -= u64::from(s.bytes);
                *tagged(&mut self.in_flight_by_tag, s.tag) -= u64::from(s.bytes);
                self.counts.acked += 1;
                newly = true;
                if s.counter == fb.largest {
                    self.rtt
                        .sample(now.saturating_duration_since(s.at), fb.delay);
                }
                self.cc.on_ack(now, s.at, u64::from(s.bytes), s.app_limited);
            }
        }
        // What is resolved at the front is let go, so the next feedback's walk starts at the
        // oldest packet still in flight.
        while self.sent.front().is_some_and(|s| s.done) {
            self.sent.pop_front();
        }
        if newly {
            self.last_progress = Some(now);
            self.largest_acked = self.largest_acked.max(Some(fb.largest));
        }
        if let Some(largest) = self.largest_acked {
            let threshold = self
                .rtt
                .smoothed()
                .max(self.rtt.latest)
                .mul_f64(TIME_THRESHOLD)
                + REORDER_SLACK;
            let lost = self.declare_lost(
                |s| s.counter < largest && now.saturating_duration_since(s.at) >= threshold,
                usize::MAX,
            );
            self.report_loss(now, lost, false);
        }
        self.cc.on_end_acks(now, self.in_flight);
    }

    /// Call when `next_timeout` is reached: with no acknowledgement for `PERSISTENT_PTOS` probe
    /// timeouts, everything in flight is lost (the controller starts over).
    pub fn on_timeout(&mut self, now: Instant) {
        if self.next_timeout().is_none_or(|t| t > now) {
            return;
        }
        let lost = self.declare_lost(|_| true, usize::MAX);
        self.report_loss(now, lost, true);
        self.last_progress = Some(now);
    }

    /// The packets sent with tag `tag` (a pipe) from `since` on went to an address that no
    /// longer reaches the peer (a NAT rebinding moved the pipe, and the sender sends them again
    /// to the new one): lost now, not a time threshold after a later acknowledgement, so the
    /// window they hold is free for what is sent again.
    pub fn on_moved(&mut self, now: Instant, tag: u8, since: Instant) {
        let lost = self.declare_lost_all(|s| s.tag == tag && s.at >= since);
        self.report_loss(now, lost, false);
    }

    /// When `on_timeout` has something to do.
    pub fn next_timeout(&self) -> Option<Instant> {
        if self.in_flight == 0 {
            return None;
        }
        Some(self.last_progress? + self.rtt.pto() * PERSISTENT_PTOS)
    }

    /// Mark the unresolved packets from the oldest on that `lost` says are lost, stopping at
    /// the first it keeps (they are in send order) or after `max`; the bytes lost and the send
    /// time of the latest. Resolved packets at the front are let go.
    fn declare_lost(&mut self, lost: impl Fn(&Sent) -> bool, max: usize) -> Option<(u64, Instant)> {
        self.mark_lost(lost, max, true)
    }

    /// `declare_lost` of every unresolved packet `lost` says is lost, not only the oldest run.
    fn declare_lost_all(&mut self, lost: impl Fn(&Sent) -> bool) -> Option<(u64, Instant)> {
        self.mark_lost(lost, usize::MAX, false)
    }

    fn mark_lost(
        &mut self,
        lost: impl Fn(&Sent) -> bool,
        max: usize,
        stop_at_kept: bool,
    ) -> Option<(u64, Instant)> {
        let (mut bytes, mut latest, mut n) = (0u64, None, 0);
        for s in self.sent.iter_mut() {
            if s.done {
                continue;
            }
            if n == max {
                break;
            }
            if !lost(s) {
                match stop_at_kept {
                    true => break,
                    false => continue,
                }
            }
            s.done = true;
            n += 1;
            bytes += u64::from(s.bytes);
            latest = Some(s.at);
            *tagged(&mut self.lost_by_tag, s.tag) += 1;
            *tagged(&mut self.in_flight_by_tag, s.tag) -= u64::from(s.bytes);
        }
        while self.sent.front().is_some_and(|s| s.done) {
            self.sent.pop_front();
        }
        self.in_flight -= bytes;
        self.counts.lost += n as u64;
        latest.map(|at| (bytes, at))
    }

    fn report_loss(&mut self, now: Instant, lost: Option<(u64, Instant)>, persistent: bool) {
        if let Some((bytes, latest)) = lost {
            self.cc.on_loss(now, latest, persistent, bytes);
        }
    }

    /// Bytes that may be sent now.
    pub fn room(&self) -> u64 {
        self.cc.window().saturating_sub(self.in_flight)
    }

    pub fn window(&self) -> u64 {
        self.cc.window()
    }

    /// What the backlog in front of the path is sized by (`cc::Controller::backlog_window`).
    pub fn backlog_window(&self) -> u64 {
        self.cc.backlog_window()
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// The rate to pace at (bytes/s): QUIC's 1.25 windows per smoothed RTT (as quinn paces a
    /// datagram-mode QUIC path), or the controller's own rate when that is higher. Not the
    /// controller's rate alone: it is absent in BBR's Startup (unpaced, a window left in one
    /// burst and overflowed scenario 06b's per-session shapers), and on a path that carries
    /// only the inner flows' ACKs, whose feedback waits in the other direction's queues, BBR
    /// read that delay as its own standing queue and drained itself down to 1.6 Mbit/s (the
    /// ACKs then queued and the download over that path halved).
    pub fn pacing_rate(&self) -> Option<u64> {
        let rtt = self.rtt.smoothed().as_secs_f64().max(1e-4);
        let by_window = (1.25 * self.cc.window() as f64 / rtt) as u64;
        Some(
            self.cc
                .pacing_rate()
                .map_or(by_window, |r| r.max(by_window)),
        )
    }

    /// The smoothed RTT, once measured.
    pub fn rtt(&self) -> Option<Duration> {
        self.rtt.smoothed
    }

    pub fn counts(&self) -> FlightCounts {
        self.counts
    }

    /// Packets lost among those tagged `tag`.
    pub fn lost_by_tag(&self, tag: u8) -> u64 {
        self.lost_by_tag.get(usize::from(tag)).copied().unwrap_or(0)
    }

    /// Bytes in flight among those tagged `tag`.
    pub fn in_flight_by_tag(&self, tag: u8) -> u64 {
        self.in_flight_by_tag
            .get(usize::from(tag))
            .copied()
            .unwrap_or(0)
    }
}

/// The counter of `tag`, grown as needed.
fn tagged(v: &mut Vec<u64>, tag: u8) -> &mut u64 {
    let t = usize::from(tag);
    if v.len() <= t {
        v.resize(t + 1, 0);
    }
    &mut v[t]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cc::Bbr;
    use crate::stripe::ReplayWindow;

    fn feedback(seen: &[u64], delay: Duration) -> Feedback {
        let mut w = ReplayWindow::default();
        for &n in seen {
            w.mark(n);
        }
        Feedback::from_window(&w, delay).unwrap()
    }

    #[test]
    fn acks_losses_and_rtt() {
        let t0 = Instant::now();
        let mut f = Flight::new(Box::new(Bbr::new(1400)));
        let ms = Duration::from_millis;
        for c in 0..10 {
            f.on_sent(t0 + ms(c), c, 1000, false, 0);
        }
        assert_eq!(f.in_flight(), 10_000);
        // 0..=9 but 3 and 4 arrive, 100 ms after 9 left; the feedback waited 2 ms.
        let seen = [0, 1, 2, 5, 6, 7, 8, 9];
        f.on_feedback(t0 + ms(111), &feedback(&seen, ms(2)));
        assert_eq!(f.counts().acked, 8);
        assert_eq!(f.in_flight(), 2000);
        // The first sample is taken whole (RFC 9002: the delay is subtracted only above the
        // minimum RTT, and the first sample is the minimum).
        assert_eq!(f.rtt(), Some(ms(102)));
        // 3 and 4 are not overdue yet (sent 3 and 4 ms in; 5/4 x 102 ms + 5 ms = 132.5 ms).
        assert_eq!(f.counts().lost, 0);
        // Reordered: 3 arrives late and is acknowledged; 4 stays missing and is lost once
        // 132.5 ms old.
        let late = [0, 1, 2, 3, 5, 6, 7, 8, 9];
        f.on_feedback(t0 + ms(112), &feedback(&late, ms(0)));
        assert_eq!((f.counts().acked, f.counts().lost), (9, 0));
        f.on_feedback(t0 + ms(130), &feedback(&late, ms(0)));
        assert_eq!((f.counts().acked, f.counts().lost), (9, 0));
        f.on_feedback(t0 + ms(137), &feedback(&late, ms(0)));
        assert_eq!((f.counts().acked, f.counts().lost), (9, 1));
        assert_eq!(f.in_flight(), 0);
        // Everything resolved is let go.
        assert!(f.sent.is_empty());
        // A repeated feedback changes nothing.
        f.on_feedback(t0 + ms(51), &feedback(&seen, ms(0)));
        assert_eq!((f.counts().acked, f.counts().lost), (9, 1));
    }

    /// A pipe that moved loses what it sent from the given moment on, at once; the other
    /// pipes' packets, and its own from before, stay in flight.
    #[test]
    fn a_moved_pipe_loses_what_it_sent_since() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut f = Flight::new(Box::new(Bbr::new(1400)));
        for c in 0..10 {
            f.on_sent(t0 + ms(c), c, 1000, false, (c % 2) as u8);
        }
        f.on_moved(t0 + ms(20), 0, t0 + ms(4));
        // Pipe 0 sent 0, 2, 4, 6, 8: 4, 6 and 8 are lost.
        assert_eq!((f.lost_by_tag(0), f.lost_by_tag(1)), (3, 0));
        assert_eq!((f.in_flight_by_tag(0), f.in_flight_by_tag(1)), (2000, 5000));
        assert_eq!((f.in_flight(), f.counts().lost), (7000, 3));
        // Acknowledging the rest resolves everything.
        f.on_feedback(t0 + ms(30), &feedback(&[0, 1, 2, 3, 5, 7, 9], ms(0)));
        assert_eq!((f.in_flight(), f.counts().acked), (0, 7));
        assert!(f.sent.is_empty());
    }

    #[test]
    fn silence_is_persistent_loss_and_memory_is_bounded() {
        let t0 = Instant::now();
        let mut f = Flight::new(Box::new(Bbr::new(1400)));
        f.on_sent(t0, 0, 1200, false, 0);
        let due = f.next_timeout().unwrap();
        assert!(due > t0 && due <= t0 + Duration::from_secs(2), "{due:?}");
        f.on_timeout(due - Duration::from_millis(1));
        assert_eq!(f.counts().lost, 0);
        f.on_timeout(due);
        assert_eq!((f.counts().lost, f.in_flight()), (1, 0));
        assert_eq!(f.next_timeout(), None);
        for c in 1..=(MAX_TRACKED as u64 + 10) {
            f.on_sent(t0, c, 100, false, 0);
        }
        assert_eq!(f.sent.len(), MAX_TRACKED);
        assert_eq!(f.counts().lost, 11);
    }

    #[test]
    fn the_controller_opens_its_window_as_acks_come_back() {
        let t0 = Instant::now();
        let mut f = Flight::new(Box::new(Bbr::new(1400)));
        let initial = f.window();
        let mut now = t0;
        let mut counter = 0u64;
        let mut seen = Vec::new();
        // 20 ms round trips, sending what the window allows (up to what one feedback covers).
        for _ in 0..20 {
            let mut sent = Vec::new();
            while f.room() >= 1400 && sent.len() < 1000 {
                f.on_sent(now, counter, 1400, false, 0);
                sent.push(counter);
                counter += 1;
            }
            now += Duration::from_millis(20);
            seen.extend(sent);
            f.on_feedback(now, &feedback(&seen, Duration::ZERO));
        }
        assert!(f.window() > 4 * initial, "{} vs {initial}", f.window());
        assert_eq!(f.counts().lost, 0);
    }
}
