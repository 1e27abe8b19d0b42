//! Pacing in our own send path: a token bucket at the congestion controller's pacing rate.
//!
//! quinn paces at `1.25 * window / RTT` and ignores the rate a controller computes
//! (quinn-proto connection/pacing.rs), so a model-based controller whose window is two BDPs
//! (room for ACK aggregation) fills the bottleneck's queue with one BDP: under one upload, ping
//! through the tunnel measured 3x the idle RTT (scenario 10). Handing the engine no more than
//! the model's rate (BBR's pacing gain included: above the estimate while probing, below it
//! while draining) keeps in flight what the path carries, and the window is left as a cap.
//! What waits meanwhile waits in our queue (`sendq.rs`), where a sparse flow can pass bulk.

use std::time::{Duration, Instant};

/// Tokens the bucket holds at most: this long at the rate, and at least `MIN_BURST` bytes (a
/// few full packets, so slow rates are not paced one packet per timer wake-up).
const BURST_TIME: Duration = Duration::from_millis(2);
const MIN_BURST: f64 = 4.0 * 1500.0;
/// Paced this much below the controller's rate (BBRv3's pacing margin): a pacer at exactly the
/// bottleneck's rate never drains what probing queued, and the estimate itself is a maximum.
const MARGIN: f64 = 0.01;
/// What a QUIC packet adds to the stream bytes it carries (short header with its connection
/// id and packet number, STREAM frame header, AEAD tag), at most. The controller's rate counts
/// whole packets (UDP payload), so that is what the bucket must count too: paced by stream
/// bytes alone, a 50 Mbit/s path got 3% more than it carries and its queue grew by 3 ms a
/// second.
pub const QUIC_PACKET_OVERHEAD: usize = 48;

/// UDP payload bytes that `bytes` of stream data take in packets of `udp_payload` bytes.
pub fn on_the_wire(bytes: usize, udp_payload: u16) -> usize {
    let per_packet = usize::from(udp_payload)
        .saturating_sub(QUIC_PACKET_OVERHEAD)
        .max(1);
    bytes + bytes.div_ceil(per_packet) * QUIC_PACKET_OVERHEAD
}

/// IPv4 or IPv6 and UDP headers in front of a datagram's payload.
pub fn ip_udp_header(ipv6: bool) -> usize {
    match ipv6 {
        true => 40 + 8,
        false => 20 + 8,
    }
}

/// A path's `rate_limit` (bits/s of IP packets, as a link or a carrier's meter counts them) as
/// the UDP payload bytes/s the pacer counts, in packets of `udp_payload` bytes.
pub fn link_cap(bits_per_s: u64, udp_payload: u16, ipv6: bool) -> u64 {
    let payload = u64::from(udp_payload.max(1));
    bits_per_s / 8 * payload / (payload + ip_udp_header(ipv6) as u64)
}

/// The rate to pace at (bytes/s): the controller's, or a path's cap (`rate_limit`) when that is
/// lower or the controller gives none (an unpaced path with a cap is paced at the cap). A cap
/// is exact, not an estimate: it is raised by the pacer's `MARGIN`, which takes it off again
/// (paced 1% under, a 50 Mbit/s cap measured 0.96 of itself on the link).
pub fn capped(rate: Option<u64>, cap: Option<u64>) -> Option<u64> {
    let exact = |c: u64| (c as f64 / (1.0 - MARGIN)) as u64;
    match (rate, cap) {
        (Some(r), Some(c)) if exact(c) < r => Some(exact(c)),
        (Some(r), Some(_)) => Some(r),
        (r, c) => r.or(c.map(exact)),
    }
}

#[derive(Debug, Clone, Default)]
pub struct Pacer {
    /// Bytes per second; `None`: not paced (the controller gives no rate).
    rate: Option<f64>,
    tokens: f64,
    last: Option<Instant>,
    /// The sender has had nothing waiting since `last` (`idle`): tokens are saved up to this
    /// long at the rate rather than `BURST_TIME`.
    idle_burst: Option<Duration>,
}

impl Pacer {
    /// The controller's rate now (bytes/s), or `None`.
    pub fn set_rate(&mut self, bytes_per_s: Option<u64>) {
        self.rate = bytes_per_s
            .filter(|&r| r > 0)
            .map(|r| r as f64 * (1.0 - MARGIN));
    }

    fn burst(rate: f64) -> f64 {
        (rate * BURST_TIME.as_secs_f64()).max(MIN_BURST)
    }

    /// The sender has nothing waiting from `now` on (its queue is empty): until it sends
    /// again, the bucket saves up to `burst` at the rate (one round trip, from the writer).
    /// A sender whose traffic offers less than the rate sends in bursts that follow quiet
    /// spells (an inner TCP flow held by its application writes 128 KB at a time; ACKs that
    /// come back in clumps over a jittery link release clumps), and the path would take them
    /// at once: held to `BURST_TIME`, such a burst of a 15 Mbit/s upload left at the estimated
    /// rate and waited in the tunnel (one-way median 45-72 ms where the link's own was 42-45;
    /// 42.5-44.5 with the saved tokens, the window's room aside). A sender with a backlog
    /// never saves beyond `BURST_TIME`, so a flow that fills the path is paced as before.
    pub fn idle(&mut self, now: Instant, burst: Duration) {
        self.refill(now);
        self.idle_burst = Some(burst);
    }

    fn refill(&mut self, now: Instant) {
        let Some(rate) = self.rate else { return };
        let elapsed = self
            .last
            .map_or(Duration::MAX, |l| now.saturating_duration_since(l));
        let burst = Self::burst(rate).max(self.idle_burst.map_or(0.0, |b| rate * b.as_secs_f64()));
        // Tokens saved while idle are kept after the sender resumes (up to what was saved), so
        // the burst they were saved for can use them.
        let cap = burst.max(self.tokens);
        self.tokens = (self.tokens + rate * elapsed.as_secs_f64().min(1.0)).min(cap);
        self.last = Some(now);
    }

    /// Bytes that may be sent now (`usize::MAX` when not paced).
    pub fn budget(&mut self, now: Instant) -> usize {
        if self.rate.is_none() {
            return usize::MAX;
        }
        self.refill(now);
        self.tokens.max(0.0) as usize
    }

    /// When `bytes` may be sent (now, if already).
    pub fn ready_at(&mut self, now: Instant, bytes: usize) -> Instant {
        let Some(rate) = self.rate else { return now };
        self.refill(now);
        // More than a burst can never be saved up: wait for a full bucket at most.
        let need = (bytes as f64).min(Self::burst(rate)) - self.tokens;
        if need <= 0.0 {
            return now;
        }
        now + Duration::from_secs_f64(need / rate)
    }

    /// `bytes` were sent (the bucket may go below zero by one write's excess).
    pub fn spend(&mut self, bytes: usize) {
        if self.rate.is_some() {
            self.tokens -= bytes as f64;
        }
        self.idle_burst = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_bytes_count_each_packets_overhead() {
        assert_eq!(on_the_wire(0, 1472), 0);
        assert_eq!(on_the_wire(1, 1472), 49);
        assert_eq!(on_the_wire(1424, 1472), 1472);
        assert_eq!(on_the_wire(1425, 1472), 1425 + 96);
        assert_eq!(on_the_wire(10, 10), 10 + 10 * 48);
    }

    #[test]
    fn a_cap_lowers_the_rate_and_paces_an_unpaced_path() {
        assert_eq!(capped(Some(10_000), Some(4_000)), Some(4_040));
        assert_eq!(capped(Some(3_000), Some(4_000)), Some(3_000));
        assert_eq!(capped(None, Some(4_000)), Some(4_040));
        assert_eq!(capped(Some(10), None), Some(10));
        let mut p = Pacer::default();
        p.set_rate(capped(None, Some(4_000)));
        let paced = p.rate.expect("paced");
        assert!(
            (paced - 4_000.0).abs() < 1.0,
            "the cap, within a byte/s: {paced}"
        );
        assert_eq!(capped(None, None), None);
    }

    #[test]
    fn a_link_cap_leaves_room_for_the_headers() {
        // 8 Mbit/s of 1500-byte IPv4 packets: 1472 bytes of UDP payload each.
        assert_eq!(link_cap(8_000_000, 1472, false), 981_333);
        assert_eq!(link_cap(8_000_000, 1452, true), 968_000);
    }

    #[test]
    fn unpaced_without_a_rate() {
        let mut p = Pacer::default();
        let now = Instant::now();
        assert_eq!(p.budget(now), usize::MAX);
        assert_eq!(p.ready_at(now, 1_000_000), now);
    }

    #[test]
    fn holds_the_rate_over_time() {
        // 50 Mbit/s: 6.25 MB/s. Send 1500-byte packets as fast as the pacer allows for 1 s.
        let mut p = Pacer::default();
        p.set_rate(Some(6_250_000));
        let t0 = Instant::now();
        let mut now = t0;
        let mut sent = 0usize;
        while now < t0 + Duration::from_secs(1) {
            let at = p.ready_at(now, 1500);
            now = at.max(now);
            if p.budget(now) >= 1500 || at == now {
                p.spend(1500);
                sent += 1500;
            }
            now += Duration::from_micros(50);
        }
        let rate = sent as f64;
        assert!((6.0e6..=6.3e6).contains(&rate), "{rate}");
    }

    /// A sender whose queue emptied saves up to the burst it was given (one round trip at the
    /// rate), and keeps what it saved once it sends again; a sender with a backlog does not.
    #[test]
    fn an_idle_sender_saves_up_for_its_next_burst() {
        let mut p = Pacer::default();
        p.set_rate(Some(2_000_000));
        let t0 = Instant::now();
        p.idle(t0, Duration::from_millis(60));
        let t1 = t0 + Duration::from_secs(1);
        // (The pacer runs 1% under the rate, `MARGIN`.)
        assert_eq!(p.budget(t1), 118_800);
        p.spend(30_000);
        // Resumed: what is left of the saving stays, and grows no further.
        assert_eq!(p.budget(t1 + Duration::from_millis(10)), 88_800);
        p.spend(88_800);
        // Back to `BURST_TIME` (the floor, `MIN_BURST`, at this rate).
        assert_eq!(p.budget(t1 + Duration::from_secs(1)), 6_000);
    }

    #[test]
    fn a_burst_is_bounded_after_idle() {
        let mut p = Pacer::default();
        p.set_rate(Some(6_250_000));
        let t0 = Instant::now();
        p.budget(t0);
        // Idle for a second: no more than the burst is saved up.
        let b = p.budget(t0 + Duration::from_secs(1));
        assert_eq!(b, 12_375);
        p.spend(b);
        assert_eq!(p.budget(t0 + Duration::from_secs(1)), 0);
        let wait = p.ready_at(t0 + Duration::from_secs(1), 1500) - (t0 + Duration::from_secs(1));
        assert!(
            wait.abs_diff(Duration::from_micros(242)) < Duration::from_micros(2),
            "{wait:?}"
        );
    }
}
