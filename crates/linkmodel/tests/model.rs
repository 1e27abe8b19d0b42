//! The emulator's model in virtual time: each property the issue asks of the real emulator is
//! first checked here exactly (deterministic seeds), where no scheduler noise can hide a mistake.

use std::time::{Duration, Instant};

use mpquic_linkmodel::{Link, LinkSpec};

/// A packet's identity: (flow, sequence, send time offset in ns).
type Pkt = (u64, u64, u64);

struct Run {
    t0: Instant,
    link: Link<Pkt>,
    /// (arrival offset ns, packet)
    out: Vec<(u64, Pkt)>,
}

impl Run {
    fn new(spec: &str) -> Run {
        Run {
            t0: Instant::now(),
            link: Link::new(LinkSpec::parse(spec).unwrap(), 7),
            out: Vec::new(),
        }
    }

    fn advance_to(&mut self, t: Duration) {
        let now = self.t0 + t;
        let mut got = Vec::new();
        while let Some(d) = self.link.next_deadline().filter(|d| *d <= now) {
            got.clear();
            self.link.poll(d, &mut got);
            let at = d.duration_since(self.t0).as_nanos() as u64;
            self.out.extend(got.drain(..).map(|p| (at, p)));
        }
    }

    /// Offer `flows` flows, each at `mbit_per_flow` with `len`-byte packets, for `secs`.
    fn offer(&mut self, flows: u64, mbit_per_flow: f64, len: usize, secs: f64) {
        let gap = Duration::from_secs_f64(len as f64 * 8.0 / (mbit_per_flow * 1e6));
        let end = Duration::from_secs_f64(secs);
        let mut t = Duration::ZERO;
        let mut seq = 0;
        while t < end {
            self.advance_to(t);
            for f in 0..flows {
                self.link
                    .push(self.t0 + t, (f, seq, t.as_nanos() as u64), len, f);
            }
            seq += 1;
            t += gap;
        }
        self.advance_to(end + Duration::from_secs(2));
    }

    fn mbit(&self, flow: Option<u64>, secs: f64, len: usize) -> f64 {
        let n = self
            .out
            .iter()
            .filter(|(_, p)| flow.is_none_or(|f| p.0 == f))
            .count();
        n as f64 * len as f64 * 8.0 / secs / 1e6
    }
}

#[test]
fn constant_delay_is_exact_when_idle() {
    let mut r = Run::new("delay=20ms");
    r.offer(1, 1.0, 100, 1.0);
    assert!(!r.out.is_empty());
    for (at, p) in &r.out {
        assert_eq!(at - p.2, 20_000_000);
    }
}

#[test]
fn rate_limits_goodput_within_one_percent() {
    let mut r = Run::new("rate=100mbit,queue=50ms");
    r.offer(1, 150.0, 1500, 2.0);
    // Delivered over the 2 s of offer plus the queue drain (<= 50 ms).
    let mbit = r.mbit(None, 2.0, 1500);
    assert!((mbit - 100.0).abs() < 100.0 * 0.02 + 2.5, "{mbit}");
    assert!(r.link.stats.dropped_queue > 0);
    // Queueing delay is bounded by the queue limit (plus one packet's transmission).
    let worst = r.out.iter().map(|(at, p)| at - p.2).max().unwrap();
    assert!(worst <= 50_000_000 + 120_000 + 1, "{worst}");
}

#[test]
fn bernoulli_loss_measures_ten_percent_over_100k() {
    let mut r = Run::new("loss=10%");
    r.offer(1, 100.0, 125, 1.0); // 100k packets
    let sent = r.link.stats.in_packets as f64;
    let lost = r.link.stats.dropped_loss as f64 / sent;
    assert!((sent - 100_000.0).abs() < 2.0, "{sent}");
    assert!((lost - 0.10).abs() < 0.01, "{lost}");
}

#[test]
fn gilbert_elliott_gives_the_configured_mean_burst() {
    // r = 25%: mean burst 4 packets; p = 1%.
    let mut r = Run::new("ge=1%:25%");
    r.offer(1, 100.0, 125, 2.0);
    let delivered: std::collections::HashSet<u64> = r.out.iter().map(|(_, p)| p.1).collect();
    let sent = r.link.stats.in_packets;
    let (mut bursts, mut lost, mut run) = (0u64, 0u64, 0u64);
    for s in 0..sent {
        if delivered.contains(&s) {
            if run > 0 {
                bursts += 1;
            }
            run = 0;
        } else {
            lost += 1;
            run += 1;
        }
    }
    let mean = lost as f64 / bursts as f64;
    assert!((mean - 4.0).abs() < 0.3, "mean burst {mean}");
    // Stationary loss p/(p+r) = 1/26.
    let rate = lost as f64 / sent as f64;
    assert!((rate - 1.0 / 26.0).abs() < 0.005, "{rate}");
}

#[test]
fn per_flow_cap_shapes_each_flow() {
    let mut r = Run::new("rate=100mbit,flow_rate=20mbit");
    r.offer(4, 40.0, 1200, 2.0);
    let total = r.mbit(None, 2.0, 1200);
    assert!((total - 80.0).abs() < 3.0, "4 flows: {total}");
    for f in 0..4 {
        let m = r.mbit(Some(f), 2.0, 1200);
        assert!((m - 20.0).abs() < 1.0, "flow {f}: {m}");
    }
    let mut r = Run::new("rate=100mbit,flow_rate=20mbit");
    r.offer(1, 40.0, 1200, 2.0);
    let one = r.mbit(None, 2.0, 1200);
    assert!((one - 20.0).abs() < 1.0, "1 flow: {one}");
}

#[test]
fn jitter_keeps_order_unless_asked() {
    let mut r = Run::new("delay=20ms,jitter=5ms");
    r.offer(1, 10.0, 1000, 1.0);
    assert!(
        r.out.windows(2).all(|w| w[0].1 .1 < w[1].1 .1),
        "order kept"
    );
    let delays: Vec<u64> = r.out.iter().map(|(at, p)| at - p.2).collect();
    assert!(delays.iter().any(|d| *d > 22_000_000), "jitter present");
    let mut r = Run::new("delay=20ms,jitter=5ms,keep_order=false");
    r.offer(1, 10.0, 1000, 1.0);
    assert!(r.out.windows(2).any(|w| w[0].1 .1 > w[1].1 .1), "reordered");
}

#[test]
fn mtu_state_dup_and_reorder() {
    let mut r = Run::new("mtu=1000");
    r.offer(1, 1.0, 1200, 0.5);
    assert!(r.out.is_empty() && r.link.stats.dropped_mtu > 0);
    for s in ["state=down", "state=blackhole"] {
        let mut r = Run::new(s);
        r.offer(1, 1.0, 100, 0.5);
        assert!(r.out.is_empty() && r.link.stats.dropped_state > 0);
    }
    let mut r = Run::new("dup=50%");
    r.offer(1, 1.0, 100, 1.0);
    let ratio = r.out.len() as f64 / r.link.stats.in_packets as f64;
    assert!((ratio - 1.5).abs() < 0.15, "{ratio}");
    let mut r = Run::new("delay=10ms,reorder=20%");
    r.offer(1, 10.0, 1000, 1.0);
    assert!(r.link.stats.reordered > 0);
    assert!(r.out.windows(2).any(|w| w[0].1 .1 > w[1].1 .1));
}

#[test]
fn codel_keeps_the_standing_queue_short() {
    // Unresponsive overload: drop-tail fills the 200 ms queue; CoDel keeps sojourn far lower by
    // dropping at dequeue (the packets it lets through waited less on average).
    let mean_delay = |spec: &str| {
        let mut r = Run::new(spec);
        r.offer(1, 120.0, 1500, 3.0);
        let late: Vec<u64> = r
            .out
            .iter()
            .filter(|(_, p)| p.2 > 1_000_000_000)
            .map(|(at, p)| at - p.2)
            .collect();
        (
            late.iter().sum::<u64>() as f64 / late.len() as f64 / 1e6,
            r.link.stats.dropped_codel,
        )
    };
    let (tail, _) = mean_delay("rate=100mbit,queue=200ms");
    let (codel, drops) = mean_delay("rate=100mbit,queue=200ms,codel=on");
    assert!(tail > 150.0, "drop-tail standing queue {tail} ms");
    assert!(drops > 0);
    assert!(codel < tail, "codel {codel} ms vs drop-tail {tail} ms");
}

/// Every packet the link delivered, in order, with the stats, when the shell polls only every
/// `every` (a busy shell batching its wake-ups) instead of at each deadline; pushes are at the
/// same times either way.
fn delivered_polling_every(spec: &str, every: Option<Duration>) -> (Vec<Pkt>, u64, u64) {
    let mut r = Run::new(spec);
    let (gap, end) = (Duration::from_micros(70), Duration::from_secs(1));
    let mut t = Duration::ZERO;
    let mut next_poll = Duration::ZERO;
    let mut got = Vec::new();
    let mut seq = 0;
    while t < end {
        match every {
            None => r.advance_to(t),
            Some(e) if t >= next_poll => {
                r.link.poll(r.t0 + t, &mut got);
                next_poll += e;
            }
            Some(_) => {}
        }
        // Three flows, one of them bursty, 1200-byte packets: ~410 Mbit/s offered.
        for f in 0..3 {
            if f < 2 || seq % 4 == 0 {
                r.link.push(r.t0 + t, (f, seq, 0), 1200, f);
            }
        }
        seq += 1;
        t += gap;
    }
    r.advance_to(end + Duration::from_secs(2));
    r.link.poll(r.t0 + end + Duration::from_secs(2), &mut got);
    got.extend(r.out.into_iter().map(|(_, p)| p));
    let s = r.link.stats;
    (
        got,
        s.dropped_queue + s.dropped_codel + s.dropped_flow_cap,
        s.out_packets,
    )
}

#[test]
fn late_polls_change_no_decision_of_the_model() {
    for spec in [
        "rate=300mbit,delay=5ms,queue=20ms",
        "rate=300mbit,delay=5ms,queue=64kb,codel=on",
        "rate=300mbit,flow_rate=120mbit,flow_queue=5ms,delay=2ms,jitter=1ms",
        "rate=200mbit,delay=10ms,jitter=3ms,jitter_dist=pareto,keep_order=false",
    ] {
        let exact = delivered_polling_every(spec, None);
        assert!(exact.1 > 0, "{spec}: the case should drop something");
        for every in [250, 1000, 4000] {
            let lazy = delivered_polling_every(spec, Some(Duration::from_micros(every)));
            // The same packets in the same order, the same drops: only release times differ.
            let first_difference = exact.0.iter().zip(&lazy.0).position(|(a, b)| a != b);
            assert!(
                exact == lazy,
                "{spec}, polled every {every} us: {} vs {} delivered, {} vs {} dropped, \
                 first difference at {first_difference:?}",
                exact.2,
                lazy.2,
                exact.1,
                lazy.1
            );
        }
    }
}

#[test]
fn deadlines_are_deliveries_not_departures() {
    // A saturated 300 Mbit/s FIFO releases a packet every 40 us; its deliveries are what a shell
    // must wake up for, and (with a constant delay) each deadline delivers something.
    let mut r = Run::new("rate=300mbit,delay=5ms");
    let (mut polls, mut empty) = (0, 0);
    let mut got = Vec::new();
    let mut t = Duration::ZERO;
    while t < Duration::from_millis(500) {
        let now = r.t0 + t;
        while let Some(d) = r.link.next_deadline().filter(|d| *d <= now) {
            got.clear();
            r.link.poll(d, &mut got);
            polls += 1;
            empty += usize::from(got.is_empty());
        }
        r.link.push(now, (0, 0, 0), 1500, 0);
        t += Duration::from_micros(30);
    }
    assert!(polls > 10_000, "{polls}");
    assert_eq!(empty, 0, "{empty} of {polls} deadlines delivered nothing");
    assert_eq!(
        r.link.stats.late_ns_total, 0,
        "polled exactly at the deadlines"
    );
}

#[test]
fn lower_bound_of_delivery_holds_for_every_jitter() {
    // Polling only at deadlines never delivers a packet after its time (lateness stays 0), with
    // jitter of any distribution, reordering and a per-flow shaper in front.
    for spec in [
        "rate=100mbit,delay=20ms,jitter=5ms",
        "rate=100mbit,delay=20ms,jitter=5ms,jitter_dist=normal,keep_order=false",
        "rate=100mbit,delay=20ms,jitter=6ms,jitter_dist=pareto,keep_order=false",
        "delay=10ms,reorder=20%,flow_rate=30mbit",
    ] {
        let mut r = Run::new(spec);
        r.offer(3, 20.0, 1000, 1.0);
        assert!(r.out.len() > 1000, "{spec}");
        let s = r.link.stats;
        assert!(
            s.late_ns_max < 1_000,
            "{spec}: a packet left {} ns after its time",
            s.late_ns_max
        );
    }
}
