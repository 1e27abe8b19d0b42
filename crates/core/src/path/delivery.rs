//! The delivery watch: a path is judged by what it delivers, not only by whether its probes
//! come back. Probes are small single packets; a path can answer every one of them while the
//! data it carries is lost whole (a NAT on the client host that corrupts the checksum of every
//! UDP GSO segment, a middlebox that drops bursts or large packets only, a transport wedged on a
//! stale peer address). Its probes would then keep it `up` while the tunnel is silent for good.
//!
//! So each probe reply carries the answering side's counts for the path: inner packets it sent
//! and inner packets that arrived (wrapping u32s, `wire::encode_probe_reply`). The prober sees
//! both directions of the path: its own sends against what the peer says arrived, and what the
//! peer says it sent against its own arrivals. A direction *stalls* when the receiver's count
//! has not moved for `stall_after` while the sender handed the path at least
//! `MIN_UNDELIVERED` packets that had `grace` to arrive (its queue, the way across, the
//! receiver's reordering and playout). Arrivals reset it once they are at least a
//! `TRICKLE`th of what the sender handed the path meanwhile: loss, however heavy (up to 97%),
//! is not a stall, while a path that delivers next to nothing is one even if a few of its
//! packets pass (a sparse flow's single datagrams, or its packets on a reliable path's sparse
//! stream, while the data in GSO batches vanishes).
//!
//! The bounds follow the path's RTT, so a long path (a geostationary satellite, a bloated LTE
//! queue) is not judged before its data could have arrived, and never below 2 s: a reliable
//! stream's head-of-line wait for a retransmission on a lossy path delivers nothing for a while
//! too, and must not be mistaken for a dead path.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The counts a probe reply carries: inner packets the answering side sent on the path, and
/// inner packets (and FEC repairs) that arrived on it. Both wrap at 2^32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    pub sent: u32,
    pub arrived: u32,
}

/// Which way a path stopped delivering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// What this side sends does not arrive.
    Out,
    /// What the peer sends does not arrive.
    In,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Out => "out",
            Direction::In => "in",
        }
    }
}

/// Packets handed to the path, with time to arrive, none of which arrived: at least this many,
/// and as many as make the chance that random loss took them all at most `FALSE_STALL`. A
/// wedged path offers little: the inner TCP it carries backs off to a retransmitted SYN or
/// segment every few seconds, so the bound must be a handful, not a burst.
pub const MIN_UNDELIVERED: u32 = 3;
const FALSE_STALL: f64 = 1e-4;
/// The shortest time a receiver's count must stand still.
pub const STALL_MIN: Duration = Duration::from_secs(2);
/// The least time a packet is given to arrive.
const GRACE_MIN: Duration = Duration::from_millis(500);
/// Sender counts remembered (a probe's each: 6.4 s at the fast interval).
const SAMPLES: usize = 64;
/// Arrivals count as delivery once they are at least this fraction (1/n) of what the sender
/// handed the path since the receiver last moved.
pub const TRICKLE: u32 = 32;

/// Arrivals that count as the receiver moving when the sender handed the path `handed` packets.
fn enough(handed: u32) -> u32 {
    match handed < 1 << 31 {
        true => (handed / TRICKLE).max(1),
        // The counts wrapped or came out of order: any arrival counts.
        false => 1,
    }
}

/// How long a packet is given to arrive, and how long a receiver may stand still, on a path of
/// this RTT.
pub fn bounds(srtt: Option<Duration>, rttvar: Duration) -> (Duration, Duration) {
    let rtt = srtt.unwrap_or_default();
    let grace = GRACE_MIN.max(rtt * 2 + rttvar * 4);
    (grace, STALL_MIN.max(grace * 2))
}

/// Packets that must all have vanished at this loss rate (the path's probes') before it is a
/// stall: 3 on a clean path, 4 at 10%, 8 at 30%, 14 at 50%.
pub fn min_undelivered(loss: f64) -> u32 {
    if loss <= 0.0 {
        return MIN_UNDELIVERED;
    }
    let n = (FALSE_STALL.ln() / loss.min(0.9).ln()).ceil();
    (n as u32).max(MIN_UNDELIVERED)
}

/// One direction: the receiver's count, when it last moved, and the sender's counts over time.
#[derive(Debug, Clone, Default)]
struct Flow {
    /// The receiver's count and when it was first seen at that value.
    rx: Option<(u32, Instant)>,
    /// The sender's count when the receiver's last moved.
    base: u32,
    /// The sender's counts, each with the moment it was taken, oldest first.
    samples: VecDeque<(Instant, u32)>,
}

impl Flow {
    /// The sender's count was `sender` at `sender_at`; the receiver's is `receiver`, seen at
    /// `now`. True when the direction has stalled.
    fn observe(
        &mut self,
        now: Instant,
        sender_at: Instant,
        sender: u32,
        receiver: u32,
        (grace, stall_after): (Duration, Duration),
        least: u32,
    ) -> bool {
        if self.samples.len() == SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((sender_at, sender));
        let since = match self.rx {
            Some((r, since))
                if receiver.wrapping_sub(r) < enough(sender.wrapping_sub(self.base)) =>
            {
                since
            }
            _ => {
                self.rx = Some((receiver, now));
                self.base = sender;
                return false;
            }
        };
        if now.saturating_duration_since(since) < stall_after {
            return false;
        }
        // What the sender had handed the path `grace` ago, and since the receiver last moved.
        let due = self
            .samples
            .iter()
            .rev()
            .find(|(t, _)| *t + grace <= now && *t >= since)
            .map(|&(_, s)| s.wrapping_sub(self.base));
        due.is_some_and(|n| (least..1 << 31).contains(&n))
    }
}

/// A path's delivery watch, for the side that probes (`health.rs`).
#[derive(Debug, Clone, Default)]
pub struct DeliveryWatch {
    out: Flow,
    inn: Flow,
    /// Our sent count when each probe left, by sequence number.
    sent_at_probe: VecDeque<(u32, u32)>,
}

impl DeliveryWatch {
    /// Probe `seq` leaves now; this side had sent `sent` inner packets on the path.
    pub fn on_probe_sent(&mut self, seq: u32, sent: u32) {
        if self.sent_at_probe.len() == SAMPLES {
            self.sent_at_probe.pop_front();
        }
        self.sent_at_probe.push_back((seq, sent));
    }

    /// The reply to probe `seq`, sent at `sent_at`, arrived now with the peer's `counts`;
    /// `arrived` is what arrived here from the peer so far; `loss`: the share of the path's
    /// probes lost lately. The direction that stalled, if one did.
    #[allow(clippy::too_many_arguments)]
    pub fn on_reply(
        &mut self,
        seq: u32,
        sent_at: Instant,
        now: Instant,
        peer: Counts,
        arrived: u32,
        srtt: Option<Duration>,
        rttvar: Duration,
        loss: f64,
    ) -> Option<Direction> {
        let bounds = bounds(srtt, rttvar);
        let least = min_undelivered(loss);
        let ours = self
            .sent_at_probe
            .iter()
            .find(|(s, _)| *s == seq)
            .map(|&(_, n)| n);
        let out = ours.is_some_and(|ours| {
            self.out
                .observe(now, sent_at, ours, peer.arrived, bounds, least)
        });
        // The peer's count as it answered: about half a round trip ago.
        let answered = now - now.saturating_duration_since(sent_at) / 2;
        let inn = self
            .inn
            .observe(now, answered, peer.sent, arrived, bounds, least);
        match (out, inn) {
            (true, _) => Some(Direction::Out),
            (false, true) => Some(Direction::In),
            _ => None,
        }
    }
}

/// The share of its packets a connection must keep losing, while the path's probes pass, for the
/// path to count as one whose data vanishes (`LossWatch`).
pub const DATA_LOST: f64 = 0.3;
/// Packets the connection must have sent in the window for its loss to be judged.
const DATA_MIN: u64 = 64;
/// The probes' loss at most: a path that loses its probes too is judged by them.
const PROBES_CLEAN: f64 = 0.05;
/// One sample of the counters per this much time.
const LOSS_STEP: Duration = Duration::from_millis(100);

/// The second half of the watch, on the transport's own counts: a connection that keeps losing
/// a large share of its packets while the path's probes all pass is a path whose data vanishes,
/// even where the inner counts say otherwise. On a reliable stream every inner packet arrives in
/// the end (QUIC sends lost data again, and a retransmission that goes alone passes where a GSO
/// batch is corrupted), and inner TCP backed off to one segment per timeout hands the path so
/// little that a trickle of arrivals keeps `Flow::observe` reset: a path that carried 0 Mbit/s
/// for 27 s on a loaded host, never judged. Random loss is not this: it takes the probes too.
///
/// The verdict: over every sliding `stall_after` for half a `stall_after` more, at least
/// `DATA_MIN` packets sent and `DATA_LOST` of them lost (spurious losses not counted), the
/// probes' loss at most `PROBES_CLEAN`. A congestion controller's overshoot (a start-up into a
/// shallow buffer) loses that much for a round or two, not for seconds.
#[derive(Debug, Clone, Default)]
pub struct LossWatch {
    /// (when, sent, lost), oldest first, one per `LOSS_STEP`.
    samples: VecDeque<(Instant, u64, u64)>,
    /// Since when every window has lost `DATA_LOST`.
    losing_since: Option<Instant>,
}

impl LossWatch {
    /// The connection's cumulative `sent` and `lost` packets now, the probes' loss lately. True
    /// when the path's data vanishes.
    pub fn observe(
        &mut self,
        now: Instant,
        sent: u64,
        lost: u64,
        probe_loss: f64,
        stall_after: Duration,
    ) -> bool {
        if let Some(&(at, s, l)) = self.samples.back() {
            if sent < s || lost < l {
                // A new connection: its counts start again.
                *self = LossWatch::default();
            } else if now.saturating_duration_since(at) < LOSS_STEP {
                return self.verdict(now, stall_after);
            }
        }
        self.samples.push_back((now, sent, lost));
        // The newest sample at least `stall_after` old starts the window; older ones go.
        while self.samples.len() > 1 && self.samples[1].0 + stall_after <= now {
            self.samples.pop_front();
        }
        let &(at, s0, l0) = self.samples.front().expect("just pushed");
        let losing = at + stall_after <= now && {
            let (ds, dl) = (sent - s0, lost - l0);
            ds >= DATA_MIN && dl as f64 >= DATA_LOST * ds as f64 && probe_loss <= PROBES_CLEAN
        };
        match losing {
            true => {
                self.losing_since.get_or_insert(now);
            }
            false => self.losing_since = None,
        }
        self.verdict(now, stall_after)
    }

    fn verdict(&self, now: Instant, stall_after: Duration) -> bool {
        self.losing_since
            .is_some_and(|t| now.saturating_duration_since(t) >= stall_after / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RTT: Duration = Duration::from_millis(30);

    /// A probe every 100 ms for `secs`; each interval this side sends `out` packets and the
    /// peer `inn`; `delivered(t)` says whether what is sent at `t` arrives. The first stall.
    fn run(
        secs: f64,
        out: u32,
        inn: u32,
        delivered: impl Fn(Duration) -> bool,
    ) -> Option<(Duration, Direction)> {
        let t0 = Instant::now();
        let mut w = DeliveryWatch::default();
        let (mut sent, mut peer_sent, mut peer_arrived, mut arrived) = (0u32, 0u32, 0u32, 0u32);
        let steps = (secs * 10.0) as u32;
        for k in 0..steps {
            let at = Duration::from_millis(100 * u64::from(k));
            w.on_probe_sent(k, sent);
            sent += out;
            peer_sent += inn;
            if delivered(at) {
                peer_arrived += out;
                arrived += inn;
            }
            let counts = Counts {
                sent: peer_sent,
                arrived: peer_arrived,
            };
            if let Some(d) = w.on_reply(
                k,
                t0 + at,
                t0 + at + RTT,
                counts,
                arrived,
                Some(RTT),
                RTT / 4,
                0.0,
            ) {
                return Some((at, d));
            }
        }
        None
    }

    #[test]
    fn a_path_that_delivers_nothing_stalls_after_the_bound() {
        let (at, d) = run(10.0, 50, 0, |t| t < Duration::from_secs(3)).expect("stalls");
        assert_eq!(d, Direction::Out);
        // Delivery stopped after the interval at 2.9 s: the receiver stood still from then on,
        // and 2 s later the path is judged.
        assert!(
            at >= Duration::from_millis(4900) && at <= Duration::from_millis(5500),
            "{at:?}"
        );
    }

    /// A path whose bulk vanishes while a trickle of its packets passes (under 1/32 of them)
    /// stalls as one that delivers nothing.
    #[test]
    fn a_trickle_is_no_delivery() {
        let (at, d) = run(10.0, 400, 0, |t| t < Duration::from_secs(3)).expect("stalls");
        assert_eq!(d, Direction::Out);
        // Now 1 of every 400 arrives in every interval after 3 s.
        let t0 = Instant::now();
        let mut w = DeliveryWatch::default();
        let (mut sent, mut arrived) = (0u32, 0u32);
        let mut stalled = None;
        for k in 0..100u32 {
            let at = Duration::from_millis(100 * u64::from(k));
            w.on_probe_sent(k, sent);
            sent += 400;
            arrived += if at < Duration::from_secs(3) { 400 } else { 1 };
            let peer = Counts { sent: 0, arrived };
            if let Some(d) = w.on_reply(k, t0 + at, t0 + at + RTT, peer, 0, Some(RTT), RTT / 4, 0.0)
            {
                stalled = Some((at, d));
                break;
            }
        }
        assert_eq!(stalled, Some((at, Direction::Out)));
    }

    #[test]
    fn the_way_back_is_judged_too() {
        let (_, d) = run(10.0, 0, 50, |t| t < Duration::from_secs(3)).expect("stalls");
        assert_eq!(d, Direction::In);
    }

    #[test]
    fn heavy_loss_and_idle_paths_do_not_stall() {
        // Something of every second interval arrives (or of every 1.5 s): loss, not a stall.
        assert_eq!(run(10.0, 50, 50, |t| t.as_millis() / 100 % 2 == 0), None);
        assert_eq!(run(10.0, 50, 50, |t| t.as_millis() / 100 % 15 == 0), None);
        // Nothing sent, nothing arrives.
        assert_eq!(run(10.0, 0, 0, |_| false), None);
        // Nothing arrives, but not for as long as the bound.
        assert_eq!(run(1.5, 10, 0, |_| false), None);
    }

    #[test]
    fn a_head_of_line_wait_shorter_than_the_bound_is_not_a_stall() {
        // 1.5 s with nothing delivered (a reliable stream's retransmission waits), then all.
        let gap = |t: Duration| !(Duration::from_secs(2)..Duration::from_millis(3500)).contains(&t);
        assert_eq!(run(10.0, 50, 50, gap), None);
    }

    #[test]
    fn the_packets_that_must_vanish_follow_the_loss() {
        assert_eq!(min_undelivered(0.0), 3);
        assert_eq!(min_undelivered(0.01), 3);
        assert_eq!(min_undelivered(0.1), 4);
        assert_eq!(min_undelivered(0.3), 8);
        assert_eq!(min_undelivered(0.5), 14);
        assert_eq!(min_undelivered(1.0), 88);
    }

    #[test]
    fn a_long_path_gets_longer_bounds() {
        let (grace, stall) = bounds(Some(Duration::from_millis(600)), Duration::from_millis(50));
        assert_eq!(grace, Duration::from_millis(1400));
        assert_eq!(stall, Duration::from_millis(2800));
        assert_eq!(bounds(Some(RTT), RTT / 4), (GRACE_MIN, STALL_MIN));
    }

    /// Every 100 ms the connection sends `rate(t)` packets and loses `lost(t)` of each 100;
    /// the probes lose `probe_loss`. When the loss watch fired, if it did.
    fn losing(
        secs: f64,
        rate: u64,
        lost: impl Fn(Duration) -> u64,
        probe_loss: f64,
    ) -> Option<Duration> {
        let t0 = Instant::now();
        let mut w = LossWatch::default();
        let (mut sent, mut gone) = (0u64, 0u64);
        for k in 0..(secs * 10.0) as u64 {
            let at = Duration::from_millis(100 * k);
            sent += rate;
            gone += rate * lost(at) / 100;
            if w.observe(t0 + at, sent, gone, probe_loss, STALL_MIN) {
                return Some(at);
            }
        }
        None
    }

    #[test]
    fn data_that_vanishes_while_probes_pass_is_found_in_three_seconds() {
        // A GSO batch corrupted, a retransmission alone passing: half of ~90 packets/s lost.
        let at = losing(20.0, 9, |_| 50, 0.0).expect("found");
        assert!(at <= Duration::from_millis(3100), "{at:?}");
    }

    #[test]
    fn loss_the_probes_share_or_a_short_overshoot_is_not_vanishing() {
        // Random loss takes the probes too.
        assert_eq!(losing(20.0, 100, |_| 50, 0.5), None);
        // A start-up's overshoot into a shallow buffer: 65% lost for 1.5 s, then little.
        let overshoot = |t: Duration| {
            if t < Duration::from_millis(1500) {
                65
            } else {
                2
            }
        };
        assert_eq!(losing(20.0, 400, overshoot, 0.0), None);
        // Heavy but partial loss that the probes happen to miss: below `DATA_LOST`.
        assert_eq!(losing(20.0, 400, |_| 20, 0.0), None);
        // Too few packets to judge.
        assert_eq!(losing(20.0, 3, |_| 100, 0.0), None);
    }

    #[test]
    fn a_new_connection_starts_the_loss_watch_again() {
        let t0 = Instant::now();
        let mut w = LossWatch::default();
        for k in 0..25u64 {
            assert!(!w.observe(
                t0 + Duration::from_millis(100 * k),
                10 * k,
                5 * k,
                0.0,
                STALL_MIN
            ));
        }
        // The counts restart: no window yet on the new connection.
        let t = t0 + Duration::from_millis(2600);
        assert!(!w.observe(t, 10, 5, 0.0, STALL_MIN));
        assert!(!w.observe(t + Duration::from_millis(1500), 200, 100, 0.0, STALL_MIN));
    }
}
