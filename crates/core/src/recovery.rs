//! Adaptive recovery of one path (`transport_mode: auto`): how the path carries inner packets
//! now, decided from the loss its connection measures and the traffic it carries.
//!
//! On its reliable stream, QUIC retransmits what is lost and the receiver releases packets in
//! order at a steady playout delay, so inner TCP sees delay instead of loss. That is worth it at
//! almost any loss: a TCP flow's rate is bounded by about 1.22·MSS / (RTT·√p) (Mathis et al.),
//! so 0.1% of loss passed through holds a cubic flow at a 30 ms RTT to ~15 Mbit/s, and the
//! matrix's 1% row gives datagram 0.07 of lossless against reliable's 0.99. Datagrams gain in
//! two places only: per-packet bonding spreads a flow over unlike paths at their full rate,
//! nothing held behind a lost packet on one of them (the bonding cell: datagram 0.96-0.98 of the
//! single-path sum, the stream 0.77-0.85), and at rates where the stream's own cost per byte
//! shows (one unshaped veth: 2.4 Gbit/s on the stream, 3.0 as datagrams). Elsewhere the stream
//! costs nothing on a clean path, and on a path that turns lossy it passes nothing on: a path on
//! datagrams learns of its first loss a round trip after it (QUIC declares it then), and what it
//! lost meanwhile reaches the inner flows (the matrix's handover cell, 60 Mbit/s on one path:
//! ~25 segments at each onset cut inner cubic's window, 23-29 Mbit/s in the lossy phases against
//! the stream's 29-37).
//!
//! So a path carries on its stream unless datagrams gain something there and it has just shown,
//! on enough traffic, that it is clean: in the last `WINDOW`, none lost, the loss estimate
//! (`loss.rs`) decayed below `LEAVE_LOSS`, at least `MIN_STREAM` on the stream, and either
//! `FAST_PACKETS` sent, or `BUSY_PACKETS` on a path bonded per packet with another that is up
//! (`bonded`). It goes back to the stream at the first loss (or an estimate of `ENTER_LOSS`),
//! when its traffic falls below `IDLE_PACKETS` per `WINDOW` (a path that has been quiet has no
//! evidence that it is still clean, and the flow that starts on it next would take its first
//! losses in slow start, the costliest place: the matrix's 1% row, loss appearing while the
//! path was quiet, 0.29x on datagrams against 0.99x on the stream), or, not bonded, below
//! `SLOW_PACKETS`. Each switch reorders the packets in flight across it once; the hysteresis
//! bounds how often. Pure TCP ACKs and control messages go as datagrams either way (the
//! transport decides those).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::path::loss::LossEstimate;

/// How a configuration says its paths carry inner packets (`transport_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportMode {
    /// `auto`: each path as this module decides. The default.
    Auto,
    /// `datagram`: QUIC DATAGRAM frames (unreliable, lowest latency).
    Datagram,
    /// `reliable`: one QUIC stream per path (retransmitted).
    Reliable,
}

impl TransportMode {
    /// The names a configuration may use.
    pub const NAMES: &'static [&'static str] = &["auto", "datagram", "reliable"];

    pub fn as_str(self) -> &'static str {
        match self {
            TransportMode::Auto => "auto",
            TransportMode::Datagram => "datagram",
            TransportMode::Reliable => "reliable",
        }
    }

    pub fn parse(s: &str) -> Option<TransportMode> {
        match s {
            "auto" => Some(TransportMode::Auto),
            "datagram" => Some(TransportMode::Datagram),
            "reliable" => Some(TransportMode::Reliable),
            _ => None,
        }
    }

    /// Whether a path's connection opens a stream for inner packets (the receiver reads both
    /// it and datagrams whatever the mode).
    pub fn has_stream(self) -> bool {
        self != TransportMode::Datagram
    }
}

/// How a path carries inner packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carry {
    /// As datagrams: unreliable, nothing held.
    Datagram,
    /// On the path's reliable stream: retransmitted, released in order.
    Stream,
}

impl Carry {
    pub fn as_str(self) -> &'static str {
        match self {
            Carry::Datagram => "datagram",
            Carry::Stream => "stream",
        }
    }
}

/// The span of recent traffic the decision looks at.
const WINDOW: Duration = Duration::from_secs(1);
/// Packets per `WINDOW`, none lost, before a bonded path carries datagrams (~11 Mbit/s of full
/// packets: below that, datagrams gain nothing worth a loss passed through) ...
const BUSY_PACKETS: u64 = 1000;
/// ... and below which it goes back to its stream (the gap is hysteresis).
const IDLE_PACKETS: u64 = 200;
/// Packets per `WINDOW` before a path that is not bonded carries datagrams (~600 Mbit/s of
/// full packets; the stream carried 2.4 Gbit/s on this project's 2-core lab machine, so below
/// this its cost per byte is far from the limit) ...
const FAST_PACKETS: u64 = 50_000;
/// ... and below which it goes back to its stream.
const SLOW_PACKETS: u64 = 25_000;
/// The loss estimate at which a path goes to its stream even without a loss in the window.
const ENTER_LOSS: f64 = 0.001;
/// ... and below which it may leave it: the estimate falls by a tenth per sample, so from 10%
/// this is ~65 samples (about 1.3 s at 60 Mbit/s) of no loss.
const LEAVE_LOSS: f64 = 0.0002;
/// The shortest stay on the stream.
const MIN_STREAM: Duration = Duration::from_secs(1);
/// Counter snapshots are kept at most this often (a shell may poll at every event), so the
/// window holds about 16 of them.
const SNAPSHOT_EVERY: Duration = Duration::from_millis(62);

/// Why a path is on its stream, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// It lost packets.
    Loss,
    /// Too little traffic to know it is clean.
    Quiet,
    /// Not bonded, at a rate the stream carries as well: datagrams gain nothing there.
    Single,
    /// It showed it is clean on enough traffic (to datagrams).
    Clean,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Loss => "loss",
            Why::Quiet => "quiet",
            Why::Single => "single",
            Why::Clean => "clean",
        }
    }
}

/// One path's recovery state. Kept across the path's reconnections (the loss is the path's).
#[derive(Debug, Clone)]
pub struct Recovery {
    loss: LossEstimate,
    carry: Carry,
    /// Why it carries as it does (the last change's reason).
    why: Why,
    since: Option<Instant>,
    /// (time, sent, lost) at recent polls, oldest first.
    recent: VecDeque<(Instant, u64, u64)>,
    /// Times the path went to its stream.
    pub to_stream: u64,
    /// Time spent on the stream before the current stay.
    stream_time: Duration,
}

impl Default for Recovery {
    fn default() -> Self {
        Recovery {
            loss: LossEstimate::default(),
            // No evidence yet that the path is clean.
            carry: Carry::Stream,
            why: Why::Quiet,
            since: None,
            recent: VecDeque::new(),
            to_stream: 0,
            stream_time: Duration::ZERO,
        }
    }
}

impl Recovery {
    pub fn carry(&self) -> Carry {
        self.carry
    }

    /// Why the path carries as it does now.
    pub fn why(&self) -> Why {
        self.why
    }

    /// The loss the decision follows (a fraction).
    pub fn loss(&self) -> f64 {
        self.loss.loss()
    }

    /// Time on the stream over the path's life, up to `now`.
    pub fn stream_time(&self, now: Instant) -> Duration {
        match (self.carry, self.since) {
            (Carry::Stream, Some(t)) => self.stream_time + now.saturating_duration_since(t),
            _ => self.stream_time,
        }
    }

    /// The connection's cumulative sent / lost packet counters now, the path's probe loss (a
    /// prior while the counters have said little), and whether it is `bonded`: one of the
    /// paths a per-packet policy spreads flows over, with another up. Returns the new carriage,
    /// and why, when it changed.
    pub fn on_counters(
        &mut self,
        now: Instant,
        sent: u64,
        lost: u64,
        probe_loss: f64,
        bonded: bool,
    ) -> Option<(Carry, Why)> {
        self.loss.hint(probe_loss);
        self.loss.on_counters(now, sent, lost);
        if self.since.is_none() {
            self.since = Some(now);
        }
        // A new connection's counters start again: the window starts with them.
        if self
            .recent
            .back()
            .is_some_and(|&(_, s, l)| sent < s || lost < l)
        {
            self.recent.clear();
        }
        let due = self
            .recent
            .back()
            .is_none_or(|&(t, _, _)| now.saturating_duration_since(t) >= SNAPSHOT_EVERY);
        if due {
            self.recent.push_back((now, sent, lost));
        }
        // The oldest snapshot still within the window is the window's start (the newest is
        // always kept).
        while self.recent.len() > 1
            && self
                .recent
                .front()
                .is_some_and(|&(t, _, _)| now.saturating_duration_since(t) > WINDOW)
        {
            self.recent.pop_front();
        }
        let (t0, s0, l0) = self.recent[0];
        let span = now.saturating_duration_since(t0);
        let full = span >= WINDOW / 2;
        // Packets sent per `WINDOW`, at the rate of the span the snapshots cover.
        let ds = ((sent - s0) as f64 * WINDOW.as_secs_f64() / span.as_secs_f64().max(1e-3)) as u64;
        let dl = lost - l0;
        let loss = self.loss.loss();
        let stayed = self
            .since
            .is_some_and(|t| now.saturating_duration_since(t) >= MIN_STREAM);
        let busy = match bonded {
            true => BUSY_PACKETS,
            false => FAST_PACKETS,
        };
        let change = match self.carry {
            Carry::Datagram if dl > 0 || loss >= ENTER_LOSS => Some((Carry::Stream, Why::Loss)),
            Carry::Datagram if full && ds < IDLE_PACKETS => Some((Carry::Stream, Why::Quiet)),
            Carry::Datagram if !bonded && full && ds < SLOW_PACKETS => {
                Some((Carry::Stream, Why::Single))
            }
            Carry::Stream if stayed && full && ds >= busy && dl == 0 && loss < LEAVE_LOSS => {
                Some((Carry::Datagram, Why::Clean))
            }
            _ => None,
        };
        let (next, why) = change?;
        self.why = why;
        if next == Carry::Stream {
            self.to_stream += 1;
        } else if let Some(t) = self.since {
            self.stream_time += now.saturating_duration_since(t);
        }
        self.carry = next;
        self.since = Some(now);
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `feed_as` for a path that is not bonded, nothing lost.
    fn feed_single(
        r: &mut Recovery,
        t: &mut Instant,
        c: &mut (u64, u64),
        n: usize,
        per: u64,
    ) -> Vec<(Carry, Why)> {
        feed_as(r, t, c, (n, per, 0), false)
    }

    #[test]
    fn a_single_path_takes_datagrams_only_at_a_high_rate() {
        let (mut r, mut t, mut c) = (Recovery::default(), Instant::now(), (0, 0));
        // 5000 packets/s, clean, for 4 s: bonded, datagrams; alone, the stream.
        assert!(feed_single(&mut r, &mut t, &mut c, 200, 100).is_empty());
        // 60 000 packets/s: datagrams.
        assert_eq!(
            feed_single(&mut r, &mut t, &mut c, 60, 1200),
            vec![(Carry::Datagram, Why::Clean)]
        );
        // 30 000 packets/s (between the bounds) keeps them; 10 000 does not.
        assert!(feed_single(&mut r, &mut t, &mut c, 100, 600).is_empty());
        assert_eq!(
            feed_single(&mut r, &mut t, &mut c, 60, 200),
            vec![(Carry::Stream, Why::Single)]
        );
    }

    /// `n` polls 20 ms apart, `per` packets sent and `lost_each` lost between polls, on a
    /// path `bonded` or not; returns the changes, with why.
    fn feed_as(
        r: &mut Recovery,
        t: &mut Instant,
        c: &mut (u64, u64),
        (n, per, lost_each): (usize, u64, u64),
        bonded: bool,
    ) -> Vec<(Carry, Why)> {
        let mut changes = Vec::new();
        for _ in 0..n {
            *t += Duration::from_millis(20);
            c.0 += per;
            c.1 += lost_each;
            changes.extend(r.on_counters(*t, c.0, c.1, 0.0, bonded));
        }
        changes
    }

    /// `feed_as` for a bonded path; returns the carriages changed to.
    fn feed(
        r: &mut Recovery,
        t: &mut Instant,
        c: &mut (u64, u64),
        n: usize,
        per: u64,
        lost_each: u64,
    ) -> Vec<Carry> {
        let changes = feed_as(r, t, c, (n, per, lost_each), true);
        changes.into_iter().map(|(c, _)| c).collect()
    }

    #[test]
    fn a_busy_clean_path_moves_to_datagrams_and_stays() {
        let (mut r, mut t, mut c) = (Recovery::default(), Instant::now(), (0, 0));
        assert_eq!(r.carry(), Carry::Stream, "no evidence yet");
        // 5000 packets/s, none lost: datagrams once the minimum stay is over.
        assert_eq!(
            feed(&mut r, &mut t, &mut c, 60, 100, 0),
            vec![Carry::Datagram]
        );
        assert!(feed(&mut r, &mut t, &mut c, 500, 100, 0).is_empty());
        assert_eq!(r.to_stream, 0);
    }

    #[test]
    fn loss_moves_a_path_to_its_stream_at_once_and_back_after_it_ends() {
        let (mut r, mut t, mut c) = (Recovery::default(), Instant::now(), (0, 0));
        feed(&mut r, &mut t, &mut c, 100, 100, 0);
        assert_eq!(r.carry(), Carry::Datagram);
        // 1% loss: the first poll that sees a loss moves it.
        assert_eq!(feed(&mut r, &mut t, &mut c, 1, 100, 1), vec![Carry::Stream]);
        // It stays there while the loss lasts.
        assert!(feed(&mut r, &mut t, &mut c, 200, 100, 10).is_empty());
        // Loss ends: back within a couple of seconds of clean traffic.
        assert_eq!(
            feed(&mut r, &mut t, &mut c, 150, 100, 0),
            vec![Carry::Datagram]
        );
        assert_eq!(r.to_stream, 1);
        assert!(r.stream_time(t) >= Duration::from_secs(4));
    }

    #[test]
    fn a_quiet_path_goes_back_to_its_stream() {
        let (mut r, mut t, mut c) = (Recovery::default(), Instant::now(), (0, 0));
        feed(&mut r, &mut t, &mut c, 100, 100, 0);
        assert_eq!(r.carry(), Carry::Datagram);
        // 1000 packets/s (between the bounds) keeps it; probes alone (50/s) do not.
        assert!(feed(&mut r, &mut t, &mut c, 200, 20, 0).is_empty());
        let changes = feed(&mut r, &mut t, &mut c, 100, 1, 0);
        assert_eq!(changes, vec![Carry::Stream]);
    }

    #[test]
    fn a_short_loss_holds_the_stream_at_least_its_minimum() {
        let (mut r, mut t, mut c) = (Recovery::default(), Instant::now(), (0, 0));
        feed(&mut r, &mut t, &mut c, 100, 100, 0);
        feed(&mut r, &mut t, &mut c, 1, 100, 1);
        assert_eq!(r.carry(), Carry::Stream);
        let entered = t;
        let mut left = None;
        for _ in 0..200 {
            if !feed(&mut r, &mut t, &mut c, 1, 100, 0).is_empty() {
                left = Some(t);
                break;
            }
        }
        assert!(left.expect("came back") - entered >= MIN_STREAM);
    }
}
