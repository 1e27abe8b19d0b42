//! Loss detection that learns a path's reordering (mpquic's change to quinn-proto, see
//! `vendor/README.md` at the root of the mpquic repository).
//!
//! RFC 9002 declares a packet lost when one sent `packet_threshold` (3) packets after it is
//! acknowledged, or when it is older than 9/8 of the RTT while a later one was acknowledged. On
//! a link that reorders (LTE carrier aggregation, Wi-Fi, per-packet load balancing) or whose
//! delay varies by more than an eighth of the RTT (jitter), both take packets that are merely
//! late for lost. Measured on a 50 Mbit/s path of 30 ms one way with 15 ms of jitter that
//! reorders: 45% of the packets sent were declared lost, almost none really were, and since a
//! congestion controller's delivery rate counts only what is acknowledged (a packet declared
//! lost is forgotten, its late acknowledgement ignored), the rate estimate fell round after
//! round until the path carried 2 Mbit/s.
//!
//! As TCP's RACK (RFC 8985, with DSACK) does, the detector learns from its mistakes: a packet
//! declared lost and acknowledged afterwards was late, not lost, and its acknowledgement says by
//! how much, in packets (how many later ones were acknowledged first) and in time (how long it
//! took). Both thresholds widen at once to cover it with a margin, up to bounds (`MAX_PACKETS`,
//! and a round trip of extra delay, RACK's bound). Widening costs only time to detect real
//! losses, so it is undone when the link's reordering shrinks and losses show up real: the
//! detector also measures the reordering it tolerates without mistakes (packets acknowledged
//! after a later one: how deep, and how long after they were sent), and at the end of each
//! epoch (`DECAY_TIME`, or a few round trips on a long path) without a spurious loss, once at
//! least `DECAY_AFTER` declared losses were never acknowledged, each threshold falls to a
//! quarter, or to what the epoch's own reordering needs, whichever is more. A link that keeps
//! reordering keeps its thresholds (every epoch shows the depth again); a link that stops
//! unlearns in a few seconds (one that reordered by 300 packets and then loses in bursts is back
//! to the RFC's in 4 epochs; by halves, 7 epochs cost its first upload 2 s at a fraction of the
//! link); a path that never reorders keeps the RFC's thresholds exactly.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use crate::{Duration, Instant};

/// Packets declared lost that are remembered until confirmed (never acknowledged) or found
/// spurious. More than one window's worth is never needed: the oldest beyond it are forgotten.
const MAX_SUSPECTS: usize = 4096;
/// The largest packet threshold learned. A reordering deeper than this (in packets) is covered
/// by the time threshold alone.
const MAX_PACKETS: u64 = 4096;
/// Declared losses confirmed real since the last spurious one (or the last shrinking) for the
/// learned thresholds to shrink at an epoch's end (RACK keeps its reordering window for 16
/// recoveries).
const DECAY_AFTER: u32 = 16;
/// The shortest epoch; on a long path it lasts `DECAY_RTTS` round trips (a reordering seen once
/// a round trip must show in every epoch).
const DECAY_TIME: Duration = Duration::from_secs(1);
const DECAY_RTTS: u32 = 4;
/// What an epoch that shows no reordering divides the learned thresholds by.
const DECAY_FACTOR: u32 = 4;

/// What the detector has learned about its path's reordering, and its counters.
#[derive(Debug, Clone, Default)]
pub(super) struct Reordering {
    /// Packets declared lost and neither acknowledged nor confirmed yet: number -> time sent.
    suspects: BTreeMap<u64, Instant>,
    /// The packet threshold learned (0: none; the configured one applies when larger).
    packets: u64,
    /// Delay tolerated beyond the RFC's time threshold.
    extra: Duration,
    /// Losses confirmed real since the last spurious one or the last shrinking, and when this
    /// epoch began: at the last spurious loss or the last epoch's end.
    confirmed_since_spurious: u32,
    learned_at: Option<Instant>,
    /// The reordering this epoch showed without mistakes: the deepest (in packets) and the
    /// latest (beyond the RFC's time threshold) packet acknowledged after a later one.
    epoch_depth: u64,
    epoch_late: Duration,
    /// Packets acknowledged after a later packet was (the link reordered them, or delayed them
    /// by more than the gap to the next): counted, and the deepest, in packets.
    pub(super) reordered: u64,
    pub(super) deepest: u64,
    /// Packets declared lost that were acknowledged afterwards.
    pub(super) spurious: u64,
}

/// The least margin below the largest acknowledged packet that packet numbers are encoded
/// against (`Reordering::pn_margin`): two bytes at least, so a link's first reordering, before
/// any is learned, can overtake a packet by up to 128 packets without its number decoding wrong
/// (one byte a packet, at rates where one byte would do).
const MIN_PN_MARGIN: u64 = 128;

impl Reordering {
    /// How far below the largest acknowledged packet numbers are encoded against: twice the
    /// deepest reordering seen, so a packet overtaken by that many still decodes.
    pub(super) fn pn_margin(&self) -> u64 {
        self.deepest.saturating_mul(2).max(MIN_PN_MARGIN)
    }

    /// The packet threshold in force, with `configured` the transport's.
    pub(super) fn packet_threshold(&self, configured: u64) -> u64 {
        configured.max(self.packets)
    }

    /// The time after which a packet is lost, with `base` the RFC's for the current RTT.
    pub(super) fn loss_delay(&self, base: Duration) -> Duration {
        base + self.extra
    }

    /// The delay tolerated beyond the RFC's time threshold now.
    pub(super) fn extra_delay(&self) -> Duration {
        self.extra
    }

    /// A packet sent at `sent` newly acknowledged at `now` while `largest_acked` (before this
    /// acknowledgement) was already: it was overtaken, by that many packets, and it came back
    /// this late beyond `base_delay` (the RFC's time threshold now).
    pub(super) fn on_acked(
        &mut self,
        packet: u64,
        largest_acked: Option<u64>,
        sent: Instant,
        now: Instant,
        base_delay: Duration,
    ) {
        if let Some(largest) = largest_acked.filter(|&l| l > packet) {
            let depth = largest - packet;
            self.reordered += 1;
            self.deepest = self.deepest.max(depth);
            self.epoch_depth = self.epoch_depth.max(depth);
            let late = now.saturating_duration_since(sent).saturating_sub(base_delay);
            self.epoch_late = self.epoch_late.max(late);
        }
    }

    /// A packet sent at `sent` was declared lost.
    pub(super) fn on_lost(&mut self, packet: u64, sent: Instant) {
        self.suspects.insert(packet, sent);
        while self.suspects.len() > MAX_SUSPECTS {
            self.suspects.pop_first();
        }
    }

    /// An acknowledgement of `range` arrived at `now`, with `largest_acked` the largest packet
    /// acknowledged so far. `base_delay`: the RFC's time threshold now; `max_extra`: the most
    /// delay the detector may add (a round trip). Returns how many of the range's packets had
    /// been declared lost.
    pub(super) fn on_ack_range(
        &mut self,
        range: RangeInclusive<u64>,
        largest_acked: u64,
        now: Instant,
        base_delay: Duration,
        max_extra: Duration,
    ) -> u64 {
        let found: Vec<(u64, Instant)> = self
            .suspects
            .range(range)
            .map(|(&pn, &sent)| (pn, sent))
            .collect();
        for &(pn, sent) in &found {
            self.suspects.remove(&pn);
            self.spurious += 1;
            // A new epoch: what it shows is measured against the thresholds widened now.
            self.confirmed_since_spurious = 0;
            self.new_epoch(now);
            let depth = largest_acked.saturating_sub(pn);
            self.reordered += 1;
            self.deepest = self.deepest.max(depth);
            self.packets = self.packets.max(packets_for(depth));
            let late = now.saturating_duration_since(sent).saturating_sub(base_delay);
            self.extra = self.extra.max(extra_for(late).min(max_extra));
        }
        found.len() as u64
    }

    /// Packets declared lost and sent before `confirmed_before` that are still unacknowledged
    /// at `now` are taken for real losses; an epoch with enough of them and no spurious one
    /// shrinks what was learned, to what the epoch's reordering needs at least. `rtt`: the
    /// path's smoothed round trip.
    pub(super) fn confirm(&mut self, now: Instant, confirmed_before: Instant, rtt: Duration) {
        while let Some((_, &sent)) = self.suspects.first_key_value() {
            if sent >= confirmed_before {
                break;
            }
            self.suspects.pop_first();
            self.confirmed_since_spurious = self.confirmed_since_spurious.saturating_add(1);
        }
        let epoch = DECAY_TIME.max(rtt * DECAY_RTTS);
        let started = *self.learned_at.get_or_insert(now);
        if now.saturating_duration_since(started) < epoch {
            return;
        }
        if self.confirmed_since_spurious >= DECAY_AFTER {
            let packets = self.packets / u64::from(DECAY_FACTOR);
            self.packets = packets.max(packets_for(self.epoch_depth).min(self.packets));
            let extra = self.extra / DECAY_FACTOR;
            self.extra = extra.max(extra_for(self.epoch_late).min(self.extra));
            self.confirmed_since_spurious = 0;
        }
        self.new_epoch(now);
    }

    /// An epoch begins at `now`: what the next one shows is measured afresh.
    fn new_epoch(&mut self, now: Instant) {
        self.learned_at = Some(now);
        self.epoch_depth = 0;
        self.epoch_late = Duration::ZERO;
    }
}

/// The packet threshold that covers a packet overtaken by `depth`: a quarter more than what was
/// seen (the next late packet is seldom exactly as late), and 0 for none.
fn packets_for(depth: u64) -> u64 {
    if depth == 0 {
        return 0;
    }
    (depth + 1 + depth / 4).min(MAX_PACKETS)
}

/// The extra delay that covers a packet `late` beyond the RFC's time threshold, with the same
/// margin.
fn extra_for(late: Duration) -> Duration {
    late.mul_f32(1.25)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A packet overtaken by as many packets as the deepest reordering seen (or, before any is
    /// seen, by up to 128) still decodes at the receiver, which decodes against the largest
    /// number it has received; encoded against the largest acknowledged alone, as the RFC's
    /// minimum, a packet 130 behind decodes wrong.
    #[test]
    fn packet_numbers_decode_past_the_reordering_seen() {
        use crate::packet::PacketNumber;
        let decodes = |r: &Reordering, overtaken: u64| {
            (1000..3000u64).all(|pn| {
                // Acknowledged up to 10 packets back: the sender alone would choose one byte.
                let base = (pn - 10).saturating_sub(r.pn_margin());
                PacketNumber::new(pn, base).expand(pn + overtaken + 1) == pn
            })
        };
        let mut r = Reordering::default();
        assert!(decodes(&r, 127));
        assert!(PacketNumber::new(2000, 1990).expand(2000 + 131) != 2000);
        let t0 = Instant::now();
        r.on_acked(1000, Some(1600), t0, t0, Duration::ZERO);
        assert_eq!(r.deepest, 600);
        assert!(decodes(&r, 600));
    }

    /// A late packet widens both thresholds to cover it; an epoch of real losses shrinks them
    /// back to a quarter, not sooner than an epoch after the last spurious loss.
    #[test]
    fn learns_from_spurious_losses_and_unlearns_from_real_ones() {
        let t0 = Instant::now();
        let rtt = ms(60);
        let mut r = Reordering::default();
        assert_eq!(r.packet_threshold(3), 3);
        assert_eq!(r.loss_delay(ms(67)), ms(67));

        // Packet 10 declared lost; acknowledged 90 ms after it was sent, when 70 was the
        // largest acknowledged: 60 packets deep, 23 ms beyond a 67 ms threshold.
        r.on_lost(10, t0);
        let found = r.on_ack_range(10..=10, 70, t0 + ms(90), ms(67), ms(60));
        assert_eq!(found, 1);
        assert_eq!(r.spurious, 1);
        assert_eq!(r.deepest, 60);
        assert_eq!(r.packet_threshold(3), 60 + 1 + 15);
        assert!(r.loss_delay(ms(67)) >= ms(90), "{:?}", r.loss_delay(ms(67)));

        // The extra delay is bounded (a round trip).
        r.on_lost(11, t0);
        let spurious_at = t0 + ms(900);
        r.on_ack_range(11..=11, 70, spurious_at, ms(67), ms(60));
        assert_eq!(r.extra_delay(), ms(60));

        // Sixteen real losses quarter both, once an epoch has passed without a spurious one.
        for pn in 100..116 {
            r.on_lost(pn, t0);
        }
        r.confirm(spurious_at + ms(500), t0 + ms(1), rtt);
        assert_eq!(r.extra_delay(), ms(60), "too soon");
        let later = spurious_at + DECAY_TIME;
        r.confirm(later, t0 + ms(1), rtt);
        assert_eq!(r.packet_threshold(3), 19);
        assert_eq!(r.extra_delay(), ms(15));
        // ... and no fewer losses, nor sooner again.
        for pn in 200..215 {
            r.on_lost(pn, t0 + ms(2));
        }
        r.confirm(later + DECAY_TIME, t0 + ms(3), rtt);
        assert_eq!(r.extra_delay(), ms(15));
        r.on_lost(300, t0 + ms(2));
        r.confirm(later + DECAY_TIME + ms(10), t0 + ms(3), rtt);
        assert_eq!(r.extra_delay(), ms(15), "within the epoch");
        r.confirm(later + DECAY_TIME * 2, t0 + ms(3), rtt);
        assert_eq!(r.extra_delay(), ms(15) / 4);
    }

    /// A link that keeps reordering keeps what was learned, however many real losses it also
    /// has; one that stops unlearns by quarters, an epoch each, back to the RFC's.
    #[test]
    fn keeps_what_the_link_still_shows_and_unlearns_what_it_stopped() {
        let t0 = Instant::now();
        let rtt = ms(60);
        let base = ms(67);
        let mut r = Reordering::default();
        // 300 packets deep, 50 ms late.
        r.on_lost(1000, t0);
        r.on_ack_range(1000..=1000, 1300, t0 + ms(117), base, rtt);
        let (packets, extra) = (r.packet_threshold(3), r.extra_delay());
        assert_eq!(packets, 376);
        assert!(extra >= ms(60), "{extra:?}");

        let mut now = t0 + ms(117);
        let mut pn = 2000;
        let mut epoch = |r: &mut Reordering, now: &mut Instant, depth: Option<u64>| {
            // Sixteen real losses and, when the link still reorders, one packet overtaken by
            // `depth` and 50 ms late, in each epoch.
            for _ in 0..16 {
                r.on_lost(pn, *now);
                pn += 1;
            }
            if let Some(depth) = depth {
                r.on_acked(pn - depth, Some(pn), *now - ms(117), *now, base);
            }
            *now += DECAY_TIME;
            r.confirm(*now, *now - ms(1), rtt);
        };
        for _ in 0..20 {
            epoch(&mut r, &mut now, Some(300));
        }
        assert_eq!(r.packet_threshold(3), packets);
        assert_eq!(r.extra_delay(), extra);

        // The link stops reordering: four epochs back to the RFC's packet threshold, the
        // extra delay within a millisecond of none.
        for _ in 0..4 {
            epoch(&mut r, &mut now, None);
        }
        assert!(r.packet_threshold(3) <= 3, "{}", r.packet_threshold(3));
        assert!(r.extra_delay() < ms(1), "{:?}", r.extra_delay());

        // A shallower reordering stops the fall where it needs: 20 packets deep.
        let mut r2 = Reordering::default();
        r2.on_lost(1000, t0);
        r2.on_ack_range(1000..=1000, 1300, t0 + ms(117), base, rtt);
        let mut now = t0 + ms(117);
        for _ in 0..10 {
            epoch(&mut r2, &mut now, Some(20));
        }
        assert_eq!(r2.packet_threshold(3), 26);
    }

    /// On a long path an epoch lasts several round trips: a reordering seen once a round trip
    /// is seen in every epoch.
    #[test]
    fn an_epoch_lasts_round_trips_on_a_long_path() {
        let t0 = Instant::now();
        let rtt = ms(600);
        let mut r = Reordering::default();
        r.on_lost(10, t0);
        r.on_ack_range(10..=10, 110, t0 + ms(700), ms(675), rtt);
        let packets = r.packet_threshold(3);
        for pn in 100..116 {
            r.on_lost(pn, t0);
        }
        r.confirm(t0 + ms(700) + DECAY_TIME, t0 + ms(1), rtt);
        r.confirm(t0 + ms(700) + rtt * 3, t0 + ms(1), rtt);
        assert_eq!(r.packet_threshold(3), packets, "within 4 round trips");
        r.confirm(t0 + ms(700) + rtt * 4, t0 + ms(1), rtt);
        assert_eq!(r.packet_threshold(3), packets / 4);
    }

    /// Packets acknowledged after a later one count as reordered, and how deep.
    #[test]
    fn counts_overtaken_packets() {
        let mut r = Reordering::default();
        let t0 = Instant::now();
        r.on_acked(5, None, t0, t0, ms(10));
        r.on_acked(6, Some(5), t0, t0, ms(10));
        assert_eq!(r.reordered, 0);
        r.on_acked(3, Some(6), t0, t0, ms(10));
        assert_eq!((r.reordered, r.deepest), (1, 3));
    }

    /// A spurious loss found while older suspects wait resets the run of real ones, and the
    /// suspects are bounded.
    #[test]
    fn suspects_are_bounded() {
        let t0 = Instant::now();
        let mut r = Reordering::default();
        for pn in 0..(MAX_SUSPECTS as u64 + 10) {
            r.on_lost(pn, t0);
        }
        assert_eq!(r.suspects.len(), MAX_SUSPECTS);
        assert_eq!(r.on_ack_range(0..=9, 100, t0, ms(10), ms(10)), 0);
    }
}
