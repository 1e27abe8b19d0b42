//! Congestion controllers in virtual time: a sender paced and windowed the way the QUIC engine
//! (quinn) does it (pacing at 1.25 x window / smoothed RTT, packet-threshold loss detection), a
//! bottleneck from the lab's link model (rate, drop-tail queue, delay, random loss), and a
//! receiver that acknowledges every second packet or after 25 ms, as QUIC's default does, over a
//! clean return link. Seconds of traffic run in milliseconds, identically each time.
//!
//! A loss-based NewReno runs through the same harness beside our controller, so the lossy-link
//! tests can fail: it is what a controller that reads loss as congestion gets.
//!
//! The link model drops a lost packet before the bottleneck (as the lab's emulator does), so lost
//! packets do not take capacity and goodput can reach the full rate; the bound asserted is the
//! one a real radio link allows, (1 - p) of the rate.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use mpquic_core::cc::{Bbr, Controller};
use mpquic_linkmodel::{Link, LinkSpec};

const MSS: u64 = 1400;

#[derive(Clone, Debug)]
struct Pkt {
    seq: u64,
}

/// An ACK frame: the packets it acknowledges.
#[derive(Clone, Debug)]
struct Ack {
    seqs: Vec<u64>,
}

/// QUIC's default: an ACK after every second ack-eliciting packet, or after this delay.
const MAX_ACK_DELAY: Duration = Duration::from_millis(25);

/// Outcome of a run.
#[derive(Debug)]
struct Run {
    goodput_mbit: f64,
    rtt_min_ms: f64,
    rtt_median_ms: f64,
}

fn run(ctl: &mut dyn Controller, path: &str, secs: u64, seed: u64) -> Run {
    let t0 = Instant::now();
    let mut up: Link<Pkt> = Link::new(LinkSpec::parse(path).unwrap(), seed);
    let one_way = LinkSpec::parse(path).unwrap().delay;
    let mut down: Link<Ack> = Link::new(
        LinkSpec::parse(&format!("delay={}us", one_way.as_micros())).unwrap(),
        seed + 1,
    );
    let end = t0 + Duration::from_secs(secs);
    let mut now = t0;
    let mut next_seq = 0u64;
    // seq -> sent time, for packets in flight.
    let mut outstanding: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut in_flight = 0u64;
    let mut largest_acked: Option<u64> = None;
    let mut srtt: Option<Duration> = None;
    let (mut tokens, mut last_refill) = (10 * MSS, t0);
    let mut delivered = 0u64;
    let mut rtts: Vec<Duration> = Vec::new();
    let mut arrived = Vec::new();
    let mut acks: Vec<Ack> = Vec::new();
    // The receiver's unacknowledged packets and when the first of them arrived.
    let mut pending: (Vec<u64>, Option<Instant>) = (Vec::new(), None);
    while now < end {
        // Pacer: quinn's rule, refilled at 1.25 x window / smoothed RTT, a burst of 10 packets.
        if let Some(srtt) = srtt {
            let rate = 1.25 * ctl.window() as f64 / srtt.as_secs_f64();
            let add = rate * now.saturating_duration_since(last_refill).as_secs_f64();
            tokens = (tokens + add as u64).min(10 * MSS);
        } else {
            tokens = 10 * MSS;
        }
        last_refill = now;
        while in_flight + MSS <= ctl.window() && tokens >= MSS {
            outstanding.insert(next_seq, now);
            up.push(now, Pkt { seq: next_seq }, MSS as usize, 0);
            ctl.on_sent(now, MSS);
            next_seq += 1;
            in_flight += MSS;
            tokens -= MSS;
        }
        up.poll(now, &mut arrived);
        for p in arrived.drain(..) {
            delivered += MSS;
            pending.0.push(p.seq);
            pending.1.get_or_insert(now);
        }
        if pending.0.len() >= 2 || pending.1.is_some_and(|t| now >= t + MAX_ACK_DELAY) {
            let seqs = std::mem::take(&mut pending.0);
            pending.1 = None;
            down.push(now, Ack { seqs }, 60, 0);
        }
        down.poll(now, &mut acks);
        let mut acked_any = false;
        for seq in acks.drain(..).flat_map(|a| a.seqs) {
            let Some(sent) = outstanding.remove(&seq) else {
                continue;
            };
            let rtt = now.saturating_duration_since(sent);
            rtts.push(rtt);
            srtt = Some(srtt.map_or(rtt, |s| (s * 7 + rtt) / 8));
            in_flight -= MSS;
            largest_acked = Some(largest_acked.map_or(seq, |l| l.max(seq)));
            ctl.on_ack(now, sent, MSS, false);
            acked_any = true;
        }
        if acked_any {
            // Packet threshold 3 (RFC 9002): older packets still outstanding are lost.
            let largest = largest_acked.unwrap();
            let lost: Vec<(u64, Instant)> = outstanding
                .range(..largest.saturating_sub(2))
                .map(|(s, t)| (*s, *t))
                .collect();
            if let Some(&(_, last_sent)) = lost.last() {
                for (s, _) in &lost {
                    outstanding.remove(s);
                }
                let bytes = lost.len() as u64 * MSS;
                in_flight -= bytes;
                ctl.on_loss(now, last_sent, false, bytes);
            }
            ctl.on_end_acks(now, in_flight);
        }
        // Next event: a delivery, or the pacer's next packet when the window has room.
        let pace = srtt.map(|s| {
            let rate = 1.25 * ctl.window() as f64 / s.as_secs_f64();
            now + Duration::from_secs_f64((MSS.saturating_sub(tokens)) as f64 / rate)
        });
        let can_send = in_flight + MSS <= ctl.window();
        let ack_timer = pending.1.map(|t| t + MAX_ACK_DELAY);
        now = [
            up.next_deadline(),
            down.next_deadline(),
            pace.filter(|_| can_send),
            ack_timer,
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(now + Duration::from_millis(1))
        .max(now + Duration::from_micros(10));
    }
    rtts.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    Run {
        goodput_mbit: delivered as f64 * 8.0 / secs as f64 / 1e6,
        rtt_min_ms: ms(rtts[0]),
        rtt_median_ms: ms(rtts[rtts.len() / 2]),
    }
}

/// The loss-based reference: halve the window on a loss (once per window), grow by one packet
/// per window otherwise (slow start until the first loss).
#[derive(Debug)]
struct NewReno {
    window: u64,
    ssthresh: u64,
    recovery_start: Option<Instant>,
}

impl Controller for NewReno {
    fn on_sent(&mut self, _: Instant, _: u64) {}
    fn on_ack(&mut self, _: Instant, sent: Instant, bytes: u64, _: bool) {
        if self.recovery_start.is_some_and(|r| sent <= r) {
            return;
        }
        if self.window < self.ssthresh {
            self.window += bytes;
        } else {
            self.window += MSS * bytes / self.window;
        }
    }
    fn on_end_acks(&mut self, _: Instant, _: u64) {}
    fn on_loss(&mut self, now: Instant, sent: Instant, _: bool, _: u64) {
        if self.recovery_start.is_some_and(|r| sent <= r) {
            return;
        }
        self.recovery_start = Some(now);
        self.window = (self.window / 2).max(2 * MSS);
        self.ssthresh = self.window;
    }
    fn on_mtu(&mut self, _: u16) {}
    fn window(&self) -> u64 {
        self.window
    }
    fn initial_window(&self) -> u64 {
        10 * MSS
    }
    fn pacing_rate(&self) -> Option<u64> {
        None
    }
    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(NewReno { ..*self })
    }
}

fn newreno() -> NewReno {
    NewReno {
        window: 10 * MSS,
        ssthresh: u64::MAX,
        recovery_start: None,
    }
}

fn bbr() -> Bbr {
    Bbr::new(MSS as u16)
}

/// Random loss is not congestion: on lossy links of several rates and delays, the model-based
/// controller keeps at least 80% of what the loss leaves ((1 - p) of the rate), where a
/// loss-based one collapses.
#[test]
fn bbr_keeps_most_of_a_lossy_link() {
    for (path, loss) in [
        ("rate=60mbit,delay=15ms,loss=10%,queue=200ms", 0.10),
        ("rate=60mbit,delay=15ms,loss=30%,queue=200ms", 0.30),
        ("rate=20mbit,delay=50ms,loss=5%,queue=100ms", 0.05),
        ("rate=200mbit,delay=5ms,loss=10%,queue=50ms", 0.10),
    ] {
        let rate: f64 = LinkSpec::parse(path).unwrap().rate_bps.unwrap() as f64 / 1e6;
        let limit = rate * (1.0 - loss);
        let mut model = bbr();
        let b = run(&mut model, path, 20, 7);
        let r = run(&mut newreno(), path, 20, 7);
        // It measures the link's loss (and more where its window overflows the queue).
        assert!(
            model.loss() > loss - 0.03,
            "{path}: measured loss {}",
            model.loss()
        );
        println!(
            "{path}: bbr {:.1} Mbit/s (bound {limit:.1}), newreno {:.1}; bbr RTT min/median {:.1}/{:.1} ms",
            b.goodput_mbit,
            r.goodput_mbit,
            b.rtt_min_ms,
            b.rtt_median_ms
        );
        assert!(b.goodput_mbit >= 0.8 * limit, "{path}: bbr {b:?}");
        assert!(
            r.goodput_mbit < 0.5 * b.goodput_mbit,
            "{path}: newreno {r:?} is not the contrast"
        );
    }
}

/// On a clean bottleneck with a deep drop-tail queue, it fills the link without filling the
/// queue: at most about one BDP waits (RTT within 2.6x the path's: two BDPs in flight and the ACK
/// delay, plus the window's 2 ms allowance for ACK aggregation), where a loss-based controller
/// fills the whole queue.
#[test]
fn bbr_fills_a_clean_bottleneck_without_filling_its_queue() {
    for path in [
        "rate=50mbit,delay=10ms,queue=200ms",
        "rate=10mbit,delay=40ms,queue=300ms",
        "rate=300mbit,delay=5ms,queue=100ms",
    ] {
        let rate: f64 = LinkSpec::parse(path).unwrap().rate_bps.unwrap() as f64 / 1e6;
        let b = run(&mut bbr(), path, 20, 3);
        let r = run(&mut newreno(), path, 20, 3);
        println!(
            "{path}: bbr {:.1} Mbit/s, RTT min/median {:.1}/{:.1} ms; newreno {:.1} Mbit/s, RTT median {:.1} ms",
            b.goodput_mbit, b.rtt_min_ms, b.rtt_median_ms, r.goodput_mbit, r.rtt_median_ms
        );
        assert!(b.goodput_mbit >= 0.9 * rate, "{path}: {b:?}");
        assert!(
            b.rtt_median_ms <= 2.6 * b.rtt_min_ms + 2.0,
            "{path}: queue not bounded: {b:?}"
        );
        assert!(r.rtt_median_ms > b.rtt_median_ms, "{path}: newreno {r:?}");
    }
}
