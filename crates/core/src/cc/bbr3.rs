//! BBRv3 (draft-ietf-ccwg-bbr, and Linux's tcp_bbr v3 where the draft leaves a choice), for
//! links shared with other traffic. Like `bbr` it models the path's bandwidth and minimum RTT,
//! but it also keeps the volume in flight within what the path carried without too much loss:
//!
//! - `inflight_hi`: an upper bound set where a bandwidth probe met more than 2% loss
//!   (`LOSS_THRESH`) and raised, exponentially per round, while probes meet none;
//! - `bw_lo` / `inflight_lo`: lower bounds cut to 0.7x (`BETA`) in every round with any loss
//!   outside a probe, dropped when the next probe starts;
//! - probes every 2-3 s, or sooner on a small BDP where a Reno flow would have grown as much
//!   (the "Reno coexistence" bound), so it shares a bottleneck with loss-based flows instead of
//!   pushing them out as BBRv1 does.
//!
//! The price is the one the product's default avoids: on a radio link losing packets at random,
//! every round has loss and the lower bounds hold the rate near what got through (`tests/cc.rs`
//! measures both). Hence `bbr` stays the default, and `bbr3` is the choice for a link where the
//! tunnel competes with other senders (a shared DSL line, an office uplink).
//!
//! Fitted to the QUIC engine as `bbr` is: quinn paces from the window (1.25 x window / smoothed
//! RTT) and takes no rate, so the window carries each phase, and the tunnel's own pacer
//! (reliable mode) takes `pacing_rate`. Deviations from the draft, each for the same reason
//! as in `bbr`: no packet conservation on loss (quinn reports losses once per detection pass;
//! the lower bounds take over a round later), the ACK-aggregation allowance is a fixed 2 ms of
//! the rate, Startup's window stops at 2.885 BDPs (a tunnel's inner flows may never fill it), and
//! a sample near the minimum RTT keeps it fresh (no ProbeRtt while the path shows no queue).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::delivery::{Delivery, Sample};
use super::filters::{MaxBwFilter, MinRttFilter};
use super::Controller;

const CWND_GAIN: f64 = 2.0;
const UP_CWND_GAIN: f64 = 2.25;
const STARTUP_CWND_GAIN: f64 = 2.885;
const UP_PACING_GAIN: f64 = 1.25;
const DOWN_PACING_GAIN: f64 = 0.9;
/// Pacing runs this much below the estimate, so the path's queue drains over time.
const PACING_MARGIN: f64 = 0.01;
/// Loss above this share of what was in flight is "too high": the volume is past what the path
/// carries (a queue overflowing, a policer).
const LOSS_THRESH: f64 = 0.02;
/// The multiplicative decrease of the bounds.
const BETA: f64 = 0.7;
/// Cruising leaves this share of `inflight_hi` free for other flows.
const HEADROOM: f64 = 0.15;
const FULL_BW_GROWTH: f64 = 1.25;
const FULL_BW_ROUNDS: u32 = 3;
/// Startup ends on loss when a round had this many loss events and too high a loss rate.
const STARTUP_FULL_LOSS_COUNT: u32 = 6;
/// The bandwidth estimate is the largest sample over the last two probing cycles.
const MAX_BW_CYCLES: u64 = 2;
/// Wall-clock time between bandwidth probes: this plus a random share of `PROBE_WAIT_RAND`.
const PROBE_WAIT: Duration = Duration::from_secs(2);
const PROBE_WAIT_RAND: Duration = Duration::from_secs(1);
/// Probe at least as often as a Reno flow grows by the BDP: every BDP-in-packets rounds, at
/// most this many.
const RENO_ROUNDS_MAX: u64 = 63;
const PROBE_RTT_INTERVAL: Duration = Duration::from_secs(5);
const PROBE_RTT_TIME: Duration = Duration::from_millis(200);
const PROBE_RTT_GAIN: f64 = 0.5;
const MIN_WINDOW_PACKETS: u64 = 4;
const INITIAL_WINDOW_PACKETS: u64 = 10;
/// As in `bbr`: acknowledgements come in bursts, and the window covers this long at the rate.
const ACK_AGGREGATION: Duration = Duration::from_millis(2);
/// Within this share of the minimum RTT (1 ms at least) a sample shows no queue.
const QUEUE_SLACK: f64 = 0.1;
const QUEUE_SLACK_MIN: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Startup,
    Drain,
    /// ProbeBw's phases: drain below the estimate, cruise with headroom, refill the pipe for a
    /// round, probe above it.
    Down,
    Cruise,
    Refill,
    Up,
    ProbeRtt,
}

/// Unset bounds.
const NONE: u64 = u64::MAX;

#[derive(Debug, Clone)]
pub struct Bbr3 {
    mss: u64,
    state: State,
    window: u64,
    in_flight: u64,
    delivery: Delivery,
    round_start: bool,
    max_bw: MaxBwFilter,
    cycle_count: u64,
    min_rtt: MinRttFilter,
    // The bounds (`NONE`: unset).
    inflight_hi: u64,
    bw_lo: u64,
    inflight_lo: u64,
    // The last round's delivery signals and loss.
    bw_latest: u64,
    inflight_latest: u64,
    loss_in_round: bool,
    loss_events_in_round: u32,
    // Startup.
    full_bw: u64,
    full_bw_rounds: u32,
    filled: bool,
    // ProbeBw.
    /// A probe just ended (Down began): the next round's acknowledgements are the last of the
    /// probe's packets (Linux's ACKS_PROBE_STOPPING; its other ack phases change nothing here).
    probe_stopping: bool,
    cycle_stamp: Option<Instant>,
    probe_wait: Duration,
    rounds_since_probe: u64,
    /// Acknowledgements of packets sent while probing may show the loss the probe caused.
    probe_samples: bool,
    prev_probe_too_high: bool,
    probe_up_rounds: u32,
    probe_up_cnt: u64,
    probe_up_acked: u64,
    cwnd_limited: bool,
    // ProbeRtt.
    probe_rtt_until: Option<Instant>,
    probe_rtt_min: Option<Duration>,
    probe_rtt_round_done: bool,
    acked: u64,
    rng: u64,
}

/// Seeds for the probe timers' randomness: distinct per controller, so two connections do not
/// probe in step.
static SEEDS: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);

impl Bbr3 {
    pub fn new(mtu: u16) -> Bbr3 {
        Bbr3::with_seed(
            mtu,
            SEEDS.fetch_add(0x6a09_e667_f3bc_c909, Ordering::Relaxed),
        )
    }

    /// With a given seed for the probe timers (virtual-time tests repeat exactly).
    pub fn with_seed(mtu: u16, seed: u64) -> Bbr3 {
        let mss = u64::from(mtu);
        Bbr3 {
            mss,
            state: State::Startup,
            window: INITIAL_WINDOW_PACKETS * mss,
            in_flight: 0,
            delivery: Delivery::default(),
            round_start: false,
            max_bw: MaxBwFilter::new(MAX_BW_CYCLES),
            cycle_count: 0,
            min_rtt: MinRttFilter::new(PROBE_RTT_INTERVAL),
            inflight_hi: NONE,
            bw_lo: NONE,
            inflight_lo: NONE,
            bw_latest: 0,
            inflight_latest: 0,
            loss_in_round: false,
            loss_events_in_round: 0,
            full_bw: 0,
            full_bw_rounds: 0,
            filled: false,
            probe_stopping: false,
            cycle_stamp: None,
            probe_wait: PROBE_WAIT,
            rounds_since_probe: 0,
            probe_samples: false,
            prev_probe_too_high: false,
            probe_up_rounds: 0,
            probe_up_cnt: NONE,
            probe_up_acked: 0,
            cwnd_limited: false,
            probe_rtt_until: None,
            probe_rtt_min: None,
            probe_rtt_round_done: false,
            acked: 0,
            rng: seed,
        }
    }

    /// The bandwidth the model uses: the estimate within the lower bound, bytes/s.
    pub fn bandwidth(&self) -> u64 {
        self.max_bw.get().min(self.bw_lo)
    }

    /// `gain` bandwidth-delay products, once both estimates exist.
    fn bdp(&self, gain: f64) -> Option<u64> {
        let bw = self.bandwidth();
        let rtt = self.min_rtt.get()?;
        (bw > 0).then_some((gain * bw as f64 * rtt.as_secs_f64()) as u64)
    }

    fn min_window(&self) -> u64 {
        MIN_WINDOW_PACKETS * self.mss
    }

    /// A uniform random number in [0, 1) (splitmix64).
    fn random(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as f64 / (u64::MAX as f64 + 1.0)
    }

    fn inflight_with_headroom(&self) -> u64 {
        if self.inflight_hi == NONE {
            return NONE;
        }
        let headroom = ((HEADROOM * self.inflight_hi as f64) as u64).max(self.mss);
        self.inflight_hi
            .saturating_sub(headroom)
            .max(self.min_window())
    }

    fn too_high(&self, s: &Sample) -> bool {
        s.lost > 0 && s.lost as f64 > LOSS_THRESH * s.in_flight as f64
    }

    fn probing(&self) -> bool {
        matches!(self.state, State::Startup | State::Refill | State::Up)
    }

    fn in_probe_bw(&self) -> bool {
        matches!(
            self.state,
            State::Down | State::Cruise | State::Refill | State::Up
        )
    }

    fn elapsed_in_phase(&self, now: Instant, d: Duration) -> bool {
        self.cycle_stamp
            .is_some_and(|s| now.saturating_duration_since(s) > d)
    }

    fn start_down(&mut self, now: Instant) {
        self.bw_latest = 0;
        self.inflight_latest = 0;
        self.loss_in_round = false;
        self.probe_up_cnt = NONE;
        self.rounds_since_probe = u64::from(self.random() < 0.5);
        self.probe_wait = PROBE_WAIT + PROBE_WAIT_RAND.mul_f64(self.random());
        self.cycle_stamp = Some(now);
        self.probe_stopping = true;
        self.state = State::Down;
    }

    fn start_refill(&mut self) {
        self.bw_lo = NONE;
        self.inflight_lo = NONE;
        self.probe_up_rounds = 0;
        self.probe_up_acked = 0;
        self.probe_stopping = false;
        self.state = State::Refill;
    }

    fn start_up(&mut self, now: Instant) {
        self.probe_stopping = false;
        self.cycle_stamp = Some(now);
        self.state = State::Up;
        self.raise_inflight_hi_slope();
    }

    /// While probing finds no loss, `inflight_hi` grows by 1, 2, 4, ... packets per round.
    fn raise_inflight_hi_slope(&mut self) {
        let growth = self.mss << self.probe_up_rounds;
        self.probe_up_rounds = (self.probe_up_rounds + 1).min(30);
        self.probe_up_cnt = (self.window / growth).max(1);
    }

    /// Time for the next bandwidth probe (from Down or Cruise): wall clock, or as soon as a
    /// Reno flow would have grown its window by the BDP.
    fn time_to_probe(&mut self, now: Instant) -> bool {
        let reno_rounds = self
            .bdp(1.0)
            .map_or(RENO_ROUNDS_MAX, |b| (b / self.mss).min(RENO_ROUNDS_MAX));
        if self.elapsed_in_phase(now, self.probe_wait) || self.rounds_since_probe >= reno_rounds {
            self.start_refill();
            return true;
        }
        false
    }

    /// A probe met too much loss: bound the volume where it was, and stop probing.
    fn inflight_too_high(&mut self, now: Instant, s: &Sample, app_limited: bool) {
        self.prev_probe_too_high = true;
        self.probe_samples = false;
        if !app_limited {
            let target = self.bdp(1.0).map_or(0, |b| (b as f64 * BETA) as u64);
            self.inflight_hi = s.in_flight.max(target);
        }
        if self.state == State::Up {
            self.start_down(now);
        }
    }

    /// The upper bound from this acknowledgement's loss (ProbeBw and the states around it).
    fn adapt_upper_bounds(&mut self, now: Instant, s: &Sample, app_limited: bool) {
        if self.probe_stopping && self.round_start {
            // The probe's acknowledgements are all in: its samples are the freshest chance of
            // the path's bandwidth, so the filter may now forget the older cycle.
            self.probe_samples = false;
            self.probe_stopping = false;
            if self.in_probe_bw() && !app_limited {
                self.cycle_count += 1;
            }
        }
        if self.too_high(s) {
            if self.probe_samples {
                self.inflight_too_high(now, s, app_limited);
            }
        } else if self.inflight_hi != NONE {
            if s.in_flight > self.inflight_hi {
                self.inflight_hi = s.in_flight;
            }
            if self.state == State::Up {
                self.probe_inflight_hi_upward(s);
            }
        }
    }

    fn probe_inflight_hi_upward(&mut self, s: &Sample) {
        if !self.cwnd_limited || self.window < self.inflight_hi {
            return;
        }
        self.probe_up_acked += s.delivered.min(self.mss);
        let per_packet = self.probe_up_cnt.saturating_mul(self.mss);
        if self.probe_up_acked >= per_packet {
            let delta = self.probe_up_acked / per_packet;
            self.probe_up_acked -= delta * per_packet;
            self.inflight_hi += delta * self.mss;
        }
        if self.round_start {
            self.raise_inflight_hi_slope();
        }
    }

    /// At each round's end, a round with loss outside a probe cuts the lower bounds.
    fn adapt_lower_bounds(&mut self) {
        if self.probing() || !self.loss_in_round {
            return;
        }
        if self.bw_lo == NONE {
            self.bw_lo = self.max_bw.get();
        }
        if self.inflight_lo == NONE {
            self.inflight_lo = self.window;
        }
        self.bw_lo = self.bw_latest.max((BETA * self.bw_lo as f64) as u64);
        self.inflight_lo = self
            .inflight_latest
            .max((BETA * self.inflight_lo as f64) as u64);
    }

    fn check_startup(&mut self, s: &Sample, app_limited: bool) {
        if self.filled {
            return;
        }
        if self.round_start && !app_limited {
            let bw = self.max_bw.get();
            if bw as f64 >= self.full_bw as f64 * FULL_BW_GROWTH {
                self.full_bw = bw;
                self.full_bw_rounds = 0;
            } else {
                self.full_bw_rounds += 1;
                self.filled = self.full_bw_rounds >= FULL_BW_ROUNDS;
            }
        }
        if self.round_start
            && self.loss_events_in_round >= STARTUP_FULL_LOSS_COUNT
            && self.too_high(s)
        {
            // Startup overflowed the path: what it delivered in the last round is the bound.
            self.filled = true;
            self.inflight_hi = self.bdp(1.0).unwrap_or(0).max(self.inflight_latest);
        }
        if self.filled && self.state == State::Startup {
            self.state = State::Drain;
        }
    }

    fn update_state(&mut self, now: Instant) {
        let bdp = self.bdp(1.0);
        let before = self.state;
        match self.state {
            State::Startup | State::ProbeRtt | State::Up | State::Refill => {}
            State::Drain => {
                if bdp.is_some_and(|b| self.in_flight <= b) {
                    self.start_down(now);
                }
            }
            State::Down => {
                if !self.time_to_probe(now)
                    && self.in_flight <= self.inflight_with_headroom()
                    && bdp.is_some_and(|b| self.in_flight <= b)
                {
                    self.state = State::Cruise;
                }
            }
            State::Cruise => {
                self.time_to_probe(now);
            }
        }
        if self.state != before {
            // A phase begun by this acknowledgement runs at least until the next.
            self.update_probe_rtt(now);
            return;
        }
        match self.state {
            State::Refill if self.round_start => {
                self.probe_samples = true;
                self.start_up(now);
            }
            State::Up => {
                let past = bdp.map_or(0, |b| (b as f64 * UP_PACING_GAIN) as u64);
                let min_rtt = self.min_rtt.get().unwrap_or_default();
                if (self.prev_probe_too_high && self.in_flight >= self.inflight_hi)
                    || (self.elapsed_in_phase(now, min_rtt) && self.in_flight > past)
                {
                    self.prev_probe_too_high = false;
                    self.start_down(now);
                }
            }
            _ => {}
        }
        self.update_probe_rtt(now);
    }

    fn probe_rtt_window(&self) -> u64 {
        self.bdp(PROBE_RTT_GAIN).unwrap_or(0).max(self.min_window())
    }

    fn update_probe_rtt(&mut self, now: Instant) {
        if self.state != State::ProbeRtt && self.min_rtt.expired(now) {
            self.state = State::ProbeRtt;
            self.probe_rtt_until = None;
            self.probe_rtt_min = None;
            self.probe_rtt_round_done = false;
            return;
        }
        if self.state != State::ProbeRtt {
            return;
        }
        if self.probe_rtt_until.is_none() && self.in_flight <= self.probe_rtt_window() {
            self.probe_rtt_until = Some(now + PROBE_RTT_TIME);
            self.probe_rtt_round_done = false;
        } else if self.probe_rtt_until.is_some() && self.round_start {
            self.probe_rtt_round_done = true;
        }
        if self.probe_rtt_round_done && self.probe_rtt_until.is_some_and(|t| now >= t) {
            self.probe_rtt_until = None;
            self.min_rtt.restart(now, self.probe_rtt_min.take());
            self.bw_lo = NONE;
            self.inflight_lo = NONE;
            if self.filled {
                self.start_down(now);
                self.state = State::Cruise;
            } else {
                self.state = State::Startup;
            }
        }
    }

    fn update_window(&mut self) {
        let acked = std::mem::take(&mut self.acked);
        let Some(bdp) = self.bdp(1.0) else {
            self.window += acked;
            return;
        };
        let quantum = 3 * self.mss;
        let aggregation = (self.bandwidth() as f64 * ACK_AGGREGATION.as_secs_f64()) as u64;
        let gain = match self.state {
            State::Startup => STARTUP_CWND_GAIN,
            State::Up => UP_CWND_GAIN,
            _ => CWND_GAIN,
        };
        let target = (gain * bdp as f64) as u64 + quantum + aggregation;
        let mut window = if self.filled {
            (self.window + acked).min(target)
        } else {
            (self.window + acked).min(target.max(self.window))
        };
        // The model's bounds: the loss-found ceiling while probing or draining, with headroom
        // for other flows while cruising; the lower bound from recent loss always.
        let cap = match self.state {
            State::Down | State::Refill | State::Up => self.inflight_hi,
            State::Cruise | State::ProbeRtt => self.inflight_with_headroom(),
            _ => NONE,
        };
        window = window.min(cap.min(self.inflight_lo).max(self.min_window()));
        if self.state == State::ProbeRtt {
            window = window.min(self.probe_rtt_window());
        }
        self.window = window.max(self.min_window());
    }
}

impl Controller for Bbr3 {
    fn on_sent(&mut self, now: Instant, bytes: u64) {
        self.in_flight += bytes;
        self.delivery.on_sent(now, bytes, self.in_flight);
        if self.in_flight + self.mss > self.window {
            self.cwnd_limited = true;
        }
    }

    fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool) {
        self.in_flight = self.in_flight.saturating_sub(bytes);
        self.acked += bytes;
        let rtt = now.saturating_duration_since(sent);
        self.min_rtt.update(now, rtt);
        if let Some(m) = self.min_rtt.get() {
            self.min_rtt
                .confirm(now, rtt, m.mul_f64(QUEUE_SLACK).max(QUEUE_SLACK_MIN));
        }
        if self.probe_rtt_until.is_some() {
            self.probe_rtt_min = Some(self.probe_rtt_min.map_or(rtt, |m| m.min(rtt)));
        }
        let Some(s) = self.delivery.on_ack(now, sent, bytes, self.min_rtt.get()) else {
            return;
        };
        if s.new_round {
            self.round_start = true;
            self.rounds_since_probe += 1;
            // The round that just ended: its loss cuts the lower bounds, then its signals
            // start over.
            self.adapt_lower_bounds();
            self.loss_in_round = false;
            self.bw_latest = 0;
            self.inflight_latest = 0;
        }
        if s.rate > 0 && (!app_limited || s.rate >= self.max_bw.get()) {
            self.max_bw.update(self.cycle_count, s.rate);
        }
        self.bw_latest = self.bw_latest.max(s.rate);
        self.inflight_latest = self.inflight_latest.max(s.delivered);
        self.check_startup(&s, app_limited);
        if s.new_round {
            self.loss_events_in_round = 0;
        }
        if self.filled {
            self.adapt_upper_bounds(now, &s, app_limited);
        }
    }

    fn on_end_acks(&mut self, now: Instant, in_flight: u64) {
        self.in_flight = in_flight;
        self.update_state(now);
        self.update_window();
        if self.round_start {
            self.cwnd_limited = false;
        }
        self.round_start = false;
    }

    fn on_loss(&mut self, _now: Instant, _sent: Instant, persistent: bool, lost_bytes: u64) {
        self.in_flight = self.in_flight.saturating_sub(lost_bytes);
        self.delivery.on_loss(lost_bytes);
        self.loss_in_round = true;
        self.loss_events_in_round = self.loss_events_in_round.saturating_add(1);
        if persistent {
            // The path carried nothing for a while: start over from a minimal window.
            *self = Bbr3 {
                min_rtt: self.min_rtt.clone(),
                ..Bbr3::with_seed(self.mss as u16, self.rng)
            };
            self.window = self.min_window();
        }
    }

    fn on_mtu(&mut self, mtu: u16) {
        self.mss = u64::from(mtu);
        self.window = self.window.max(self.min_window());
    }

    fn window(&self) -> u64 {
        self.window
    }

    fn initial_window(&self) -> u64 {
        INITIAL_WINDOW_PACKETS * self.mss
    }

    /// The rate the tunnel's own pacer (reliable mode) uses in ProbeBw: the phase's gain times
    /// the model's bandwidth, 1% under. None in Startup and Drain, as in `bbr`.
    fn pacing_rate(&self) -> Option<u64> {
        let gain = match self.state {
            State::Startup | State::Drain => return None,
            State::Down => DOWN_PACING_GAIN,
            State::Up => UP_PACING_GAIN,
            State::Cruise | State::Refill | State::ProbeRtt => 1.0,
        };
        let bw = self.bandwidth();
        (bw > 0).then_some((gain * (1.0 - PACING_MARGIN) * bw as f64) as u64)
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }
}
