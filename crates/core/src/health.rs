//! Active path health: every path is probed at a fixed interval, idle or busy, and judged only by
//! whether its own probes come back. There is no "master" path and no reliance on the QUIC engine's
//! idle timeout (a field peer took 34 s to forever to notice a black hole that way).
//!
//! One side probes (`HealthMode::Probe`, the client): a probe every `probe_interval`, answered at
//! once by the peer; the path is judged by whether replies come back, so a failure in either
//! direction takes it down there. Each probe carries the prober's view of the path (state, RTT,
//! loss), and the other side (`HealthMode::Follow`, the server) adopts it, so both ends agree on
//! the state without the follower sending probes of its own (half the packets, and none of the
//! QUIC ACKs they would elicit, on an idle tunnel). The follower still takes a path down by
//! itself when the probes stop arriving (client -> server black hole).

use std::time::{Duration, Instant};

/// Which side of a path probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HealthMode {
    /// Send probes, judge the path by their replies (the client).
    #[default]
    Probe,
    /// Send no probes; adopt the view carried by the peer's probes, and take the path down when
    /// they stop arriving (the server).
    Follow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    pub mode: HealthMode,
    /// Time between probes on a path.
    pub probe_interval: Duration,
    /// A path is declared down when no probe reply arrived for
    /// `max(down_after_min, 2*srtt + 4*rttvar)`, capped at `down_after_max`.
    pub down_after_min: Duration,
    pub down_after_max: Duration,
    /// Consecutive probe replies needed before a path that was down is used again.
    pub up_after: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            mode: HealthMode::Probe,
            probe_interval: Duration::from_millis(100),
            down_after_min: Duration::from_millis(350),
            down_after_max: Duration::from_millis(1500),
            up_after: 3,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    /// Connected, waiting for the first probe reply.
    Probing,
    Up,
    Down,
}

impl PathState {
    pub fn as_str(self) -> &'static str {
        match self {
            PathState::Probing => "probing",
            PathState::Up => "up",
            PathState::Down => "down",
        }
    }
}

/// The prober's view of a path, carried in each probe (docs/PROTOCOL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerView {
    pub state: PathState,
    pub srtt: Option<Duration>,
    pub rttvar: Duration,
    pub min_rtt: Option<Duration>,
    /// Share of recent probes unanswered, in 1/1000.
    pub loss_permille: u16,
}

/// Outstanding probes remembered for RTT measurement; older replies are ignored.
const PROBE_RING: usize = 64;
/// Probes whose fate decides the loss estimate.
const LOSS_WINDOW: usize = 50;
/// A follower whose path is down has no deadline of its own; it is woken by the next probe.
const NOTHING_DUE: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone)]
pub struct PathHealth {
    cfg: HealthConfig,
    state: PathState,
    since: Instant,
    next_seq: u32,
    next_probe_at: Instant,
    sent_at: [Option<(u32, Instant)>; PROBE_RING],
    last_reply_at: Option<Instant>,
    last_reply_seq: Option<u32>,
    consecutive: u32,
    srtt: Option<Duration>,
    rttvar: Duration,
    min_rtt: Option<Duration>,
    /// One bit per probe outcome (true = answered), oldest first.
    outcomes: std::collections::VecDeque<bool>,
    /// Follow mode: the loss the prober last reported.
    peer_loss: f64,
    pub probes_sent: u64,
    pub probes_answered: u64,
    pub transitions: u64,
}

impl PathHealth {
    pub fn new(cfg: HealthConfig, now: Instant) -> Self {
        PathHealth {
            cfg,
            state: PathState::Probing,
            since: now,
            next_seq: 0,
            next_probe_at: now,
            sent_at: [None; PROBE_RING],
            last_reply_at: None,
            last_reply_seq: None,
            consecutive: 0,
            srtt: None,
            rttvar: Duration::ZERO,
            min_rtt: None,
            outcomes: Default::default(),
            peer_loss: 0.0,
            probes_sent: 0,
            probes_answered: 0,
            transitions: 0,
        }
    }

    pub fn state(&self) -> PathState {
        self.state
    }
    pub fn since(&self) -> Instant {
        self.since
    }
    pub fn srtt(&self) -> Option<Duration> {
        self.srtt
    }
    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }
    /// Share of recent probes that were not answered, 0.0..=1.0 (a follower: as the prober
    /// last reported it).
    pub fn loss(&self) -> f64 {
        if self.cfg.mode == HealthMode::Follow {
            return self.peer_loss;
        }
        if self.outcomes.is_empty() {
            return 0.0;
        }
        let lost = self.outcomes.iter().filter(|ok| !**ok).count();
        lost as f64 / self.outcomes.len() as f64
    }

    /// How long silence must last before the path is declared down.
    pub fn down_after(&self) -> Duration {
        let adaptive = match self.srtt {
            Some(srtt) => 2 * srtt + 4 * self.rttvar,
            None => Duration::ZERO,
        };
        adaptive
            .max(self.cfg.down_after_min)
            .min(self.cfg.down_after_max)
    }

    /// When the shell must call `poll` again at the latest: the next probe, or the moment the
    /// silence since the last reply takes the path down, whichever comes first.
    pub fn next_deadline(&self) -> Instant {
        let follow = self.cfg.mode == HealthMode::Follow;
        if self.state == PathState::Down {
            // A follower has nothing to do until the peer's next probe arrives.
            return if follow {
                self.since + NOTHING_DUE
            } else {
                self.next_probe_at
            };
        }
        // `check_silence` needs the silence to exceed `down_after`: one nanosecond past it.
        let silent = self.silence_reference() + self.down_after() + Duration::from_nanos(1);
        if follow {
            silent
        } else {
            self.next_probe_at.min(silent)
        }
    }

    /// What this side knows of the path, for the peer (sent in each probe).
    pub fn view(&self) -> PeerView {
        PeerView {
            state: self.state,
            srtt: self.srtt,
            rttvar: self.rttvar,
            min_rtt: self.min_rtt,
            loss_permille: (self.loss() * 1000.0).round().clamp(0.0, 1000.0) as u16,
        }
    }

    /// Silence is measured from the last reply, or from the start of probing.
    fn silence_reference(&self) -> Instant {
        self.last_reply_at.unwrap_or(self.since).max(self.since)
    }

    /// Advance time. Returns a probe sequence number when a probe is due (never for a follower).
    pub fn poll(&mut self, now: Instant) -> Option<u32> {
        self.check_silence(now);
        self.expire_probes(now);
        if self.cfg.mode == HealthMode::Follow || now < self.next_probe_at {
            return None;
        }
        self.next_probe_at = now + self.cfg.probe_interval;
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.sent_at[seq as usize % PROBE_RING] = Some((seq, now));
        self.probes_sent += 1;
        Some(seq)
    }

    /// A reply to our probe `seq` arrived.
    pub fn on_reply(&mut self, seq: u32, now: Instant) {
        let slot = &mut self.sent_at[seq as usize % PROBE_RING];
        let Some((s, sent)) = *slot else { return };
        if s != seq {
            return; // stale or forged
        }
        *slot = None;
        self.probes_answered += 1;
        self.record_outcome(true);
        let sample = now.saturating_duration_since(sent);
        self.update_rtt(sample);
        self.heard(seq, now);
        self.up_if_proven(now);
    }

    /// Something answering for the path arrived: a reply to our probe `seq`, or (a follower)
    /// the peer's probe `seq`. Counts consecutive ones for `up_after`.
    fn heard(&mut self, seq: u32, now: Instant) {
        self.last_reply_at = Some(now);
        let contiguous = self.last_reply_seq.map(|l| l.wrapping_add(1) == seq);
        self.consecutive = if contiguous == Some(true) {
            self.consecutive + 1
        } else {
            1
        };
        self.last_reply_seq = Some(seq);
    }

    fn up_if_proven(&mut self, now: Instant) {
        match self.state {
            // A fresh connection has just proven the path with its handshake.
            PathState::Probing => self.set_state(PathState::Up, now),
            PathState::Down if self.consecutive >= self.cfg.up_after => {
                self.set_state(PathState::Up, now)
            }
            _ => {}
        }
    }

    /// The peer's probe `seq` arrived, with its view of the path (`None` from a peer that sends
    /// none). Only a follower learns from it; a prober judges by its own probes' replies.
    pub fn on_peer_probe(&mut self, seq: u32, view: Option<&PeerView>, now: Instant) {
        if self.cfg.mode != HealthMode::Follow {
            return;
        }
        self.probes_answered += 1;
        self.heard(seq, now);
        let Some(v) = view else {
            // No view: the probe's arrival is all there is, judged like a reply.
            self.up_if_proven(now);
            return;
        };
        self.srtt = v.srtt;
        self.rttvar = v.rttvar;
        self.min_rtt = v.min_rtt;
        self.peer_loss = f64::from(v.loss_permille.min(1000)) / 1000.0;
        // The prober decides: it sees both directions (a dead return path shows there only).
        if v.state != self.state {
            if v.state == PathState::Down {
                self.consecutive = 0;
            }
            self.set_state(v.state, now);
        }
    }

    fn check_silence(&mut self, now: Instant) {
        if self.state == PathState::Down {
            return;
        }
        if now.saturating_duration_since(self.silence_reference()) > self.down_after() {
            self.consecutive = 0;
            self.set_state(PathState::Down, now);
        }
    }

    /// A probe unanswered for as long as the silence that takes a path down counts as lost;
    /// a reply arriving later is ignored.
    fn expire_probes(&mut self, now: Instant) {
        let limit = self.down_after();
        let mut lost = 0;
        for slot in self.sent_at.iter_mut() {
            if slot.is_some_and(|(_, at)| now.saturating_duration_since(at) > limit) {
                *slot = None;
                lost += 1;
            }
        }
        for _ in 0..lost {
            self.record_outcome(false);
        }
    }

    fn set_state(&mut self, s: PathState, now: Instant) {
        if self.state != s {
            self.state = s;
            self.since = now;
            self.transitions += 1;
            // A prober tells the follower at once (the next probe carries the new view) rather
            // than up to a probe interval later.
            if self.cfg.mode == HealthMode::Probe {
                self.next_probe_at = self.next_probe_at.min(now);
            }
        }
    }

    fn record_outcome(&mut self, ok: bool) {
        if self.outcomes.len() == LOSS_WINDOW {
            self.outcomes.pop_front();
        }
        self.outcomes.push_back(ok);
    }

    /// RFC 6298 smoothing.
    fn update_rtt(&mut self, sample: Duration) {
        self.min_rtt = Some(self.min_rtt.map_or(sample, |m| m.min(sample)));
        match self.srtt {
            None => {
                self.srtt = Some(sample);
                self.rttvar = sample / 2;
            }
            Some(srtt) => {
                let diff = srtt.abs_diff(sample);
                self.rttvar = (3 * self.rttvar + diff) / 4;
                self.srtt = Some((7 * srtt + sample) / 8);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Drive a path for `dur` with replies after `rtt` when `answer` is true.
    fn run(
        h: &mut PathHealth,
        start: Instant,
        dur: Duration,
        rtt: Duration,
        answer: bool,
    ) -> Instant {
        let mut t = start;
        let mut pending: Vec<(Instant, u32)> = Vec::new();
        while t < start + dur {
            if let Some(seq) = h.poll(t) {
                if answer {
                    pending.push((t + rtt, seq));
                }
            }
            pending.retain(|(at, seq)| {
                if *at <= t {
                    h.on_reply(*seq, t);
                    false
                } else {
                    true
                }
            });
            t += ms(1);
        }
        t
    }

    #[test]
    fn comes_up_on_first_reply_and_measures_rtt() {
        let t0 = Instant::now();
        let mut h = PathHealth::new(HealthConfig::default(), t0);
        run(&mut h, t0, ms(500), ms(20), true);
        assert_eq!(h.state(), PathState::Up);
        assert_eq!(h.srtt(), Some(ms(20)));
        assert_eq!(h.min_rtt(), Some(ms(20)));
        assert_eq!(h.loss(), 0.0);
    }

    #[test]
    fn black_hole_goes_down_within_bound_and_recovers_after_up_after() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = PathHealth::new(cfg, t0);
        let t = run(&mut h, t0, ms(1000), ms(20), true);
        let t = run(&mut h, t, ms(200), ms(20), false);
        assert_eq!(h.state(), PathState::Up, "not down after only 200 ms");
        let t = run(&mut h, t, ms(300), ms(20), false);
        assert_eq!(h.state(), PathState::Down);
        let down_at = h.since();
        assert!(down_at <= t0 + ms(1000) + cfg.down_after_min + cfg.probe_interval);
        // Recovery needs `up_after` consecutive replies.
        let t = run(&mut h, t, ms(150), ms(20), true);
        assert_eq!(h.state(), PathState::Down);
        run(&mut h, t, ms(300), ms(20), true);
        assert_eq!(h.state(), PathState::Up);
        assert!(h.loss() > 0.0);
    }

    #[test]
    fn forged_or_stale_replies_are_ignored() {
        let t0 = Instant::now();
        let mut h = PathHealth::new(HealthConfig::default(), t0);
        h.on_reply(7, t0);
        h.on_reply(u32::MAX, t0);
        assert_eq!(h.state(), PathState::Probing);
        assert_eq!(h.probes_answered, 0);
    }

    #[test]
    fn a_follower_sends_nothing_adopts_the_view_and_goes_down_on_silence() {
        let t0 = Instant::now();
        let cfg = HealthConfig {
            mode: HealthMode::Follow,
            ..Default::default()
        };
        let mut f = PathHealth::new(cfg, t0);
        let mut prober = PathHealth::new(HealthConfig::default(), t0);
        let t = run(&mut prober, t0, ms(1000), ms(20), true);
        assert_eq!(f.poll(t0), None, "a follower never probes");
        let view = prober.view();
        f.on_peer_probe(0, Some(&view), t0 + ms(10));
        assert_eq!(f.state(), PathState::Up);
        assert_eq!(f.srtt(), Some(ms(20)));
        assert_eq!(f.min_rtt(), Some(ms(20)));
        // The prober saw its replies stop (a dead return path): the follower follows at once.
        let down = PeerView {
            state: PathState::Down,
            ..view
        };
        f.on_peer_probe(1, Some(&down), t0 + ms(110));
        assert_eq!(f.state(), PathState::Down);
        assert!(f.next_deadline() > t + ms(1000), "nothing due while down");
        f.on_peer_probe(2, Some(&view), t0 + ms(210));
        assert_eq!(f.state(), PathState::Up);
        // Probes stop arriving (client -> server black hole): down after the silence bound.
        let deadline = f.next_deadline();
        assert!(deadline <= t0 + ms(210) + f.down_after() + ms(1));
        f.poll(deadline - ms(1));
        assert_eq!(f.state(), PathState::Up);
        f.poll(deadline);
        assert_eq!(f.state(), PathState::Down);
        // A prober ignores the peer's probes: it judges by its own replies.
        let before = prober.state();
        prober.on_peer_probe(9, Some(&down), t);
        assert_eq!(prober.state(), before);
    }
}
