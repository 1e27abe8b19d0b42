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

/// A recording written where the spec can read it; removed when dropped.
struct TraceFile(std::path::PathBuf);

impl TraceFile {
    fn new(name: &str, lines: impl IntoIterator<Item = u64>) -> TraceFile {
        let path = std::env::temp_dir().join(format!("mpquic-model-{}-{name}", std::process::id()));
        let text: String = lines.into_iter().map(|x| format!("{x}\n")).collect();
        std::fs::write(&path, text).unwrap();
        TraceFile(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TraceFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A packet's delay is the recording's value for the step its last bit left in (plus `delay`),
/// and the recording starts `trace_at` after the epoch and repeats.
#[test]
fn delay_trace_is_replayed_step_by_step() {
    // 10 ms steps: 30, 12, 50, 20 ms (ns, as irtt records).
    let ms = [30u64, 12, 50, 20];
    let f = TraceFile::new("delay", ms.iter().map(|m| m * 1_000_000));
    let mut r = Run::new(&format!(
        "delay_trace={}:10ms:ns,delay=1ms,keep_order=false,trace_at=5ms",
        f.path()
    ));
    r.link.set_epoch(r.t0);
    r.offer(1, 0.8, 100, 0.2); // one packet a millisecond
    assert!(r.out.len() >= 190, "{}", r.out.len());
    for (at, p) in &r.out {
        let sent = Duration::from_nanos(p.2);
        // trace_at: the recording's step 0 starts 5 ms after the epoch (before that, its end).
        let step = ((sent.as_nanos() as i128 - 5_000_000).div_euclid(10_000_000)).rem_euclid(4);
        let want = (ms[step as usize] + 1) * 1_000_000;
        assert_eq!(at - p.2, want, "sent at {sent:?}");
    }
    // Keeping order, a packet after a drop waits for the one ahead (no overtaking).
    let mut r = Run::new(&format!("delay_trace={}:10ms", f.path()));
    r.link.set_epoch(r.t0);
    r.offer(1, 0.8, 100, 0.2);
    let arrivals: Vec<u64> = r.out.iter().map(|(at, _)| *at).collect();
    let seqs: Vec<u64> = r.out.iter().map(|(_, p)| p.1).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "in order");
    assert!(arrivals.windows(2).all(|w| w[0] <= w[1]));
    for (at, p) in &r.out {
        assert!(at - p.2 >= 12_000_000);
    }
    assert_eq!(r.link.min_delay(), Duration::from_millis(12));
    // Repeating after 30 ms of it: the fourth step never plays.
    let mut r = Run::new(&format!(
        "delay_trace={}:10ms,keep_order=false,trace_repeat=30ms",
        f.path()
    ));
    r.link.set_epoch(r.t0);
    r.offer(1, 0.8, 100, 0.2);
    for (at, p) in &r.out {
        let step = (p.2 / 10_000_000) % 3;
        assert_eq!(at - p.2, ms[step as usize] * 1_000_000);
    }
}

/// A step marked 1 drops everything that enters in it, and nothing else is lost.
#[test]
fn loss_trace_drops_exactly_its_steps() {
    let f = TraceFile::new("loss", [0, 0, 1, 0, 1, 1, 0, 0, 0, 0]);
    let mut r = Run::new(&format!("loss_trace={}:10ms,delay=5ms", f.path()));
    r.link.set_epoch(r.t0);
    r.offer(1, 0.8, 100, 1.0);
    let sent = 1000;
    let lost_steps = |t_ns: u64| matches!((t_ns / 10_000_000) % 10, 2 | 4 | 5);
    let delivered: std::collections::HashSet<u64> = r.out.iter().map(|(_, p)| p.2).collect();
    for i in 0..sent {
        let t = i * 1_000_000;
        assert_eq!(!delivered.contains(&t), lost_steps(t), "sent at {t} ns");
    }
    assert_eq!(r.link.stats.dropped_loss, 300);
}

/// Saturated, a capacity trace delivers what its opportunities allow, per 100 ms, exactly
/// (1500-byte packets: one per opportunity), and idle opportunities are not saved up.
#[test]
fn capacity_trace_delivers_its_opportunities() {
    // 1 s, bursty like LTE: 1..=4 opportunities in some milliseconds, none in others.
    let mut ms = Vec::new();
    for m in 1..=1000u64 {
        for _ in 0..(m * 7 % 5) {
            ms.push(m);
        }
    }
    ms.push(1000); // the period is the last time (Mahimahi's)
    let total = ms.len();
    let f = TraceFile::new("capacity", ms.iter().copied());
    let mut r = Run::new(&format!("capacity_trace={},queue=2s", f.path()));
    r.link.set_epoch(r.t0);
    r.offer(1, 100.0, 1500, 2.0);
    let per_window = |from: u64| ms.iter().filter(|&&m| m > from && m <= from + 100).count();
    for w in 0..10 {
        let (a, b) = (w * 100_000_000, (w + 1) * 100_000_000);
        let got = r
            .out
            .iter()
            .filter(|(at, _)| (a < *at) && (*at <= b))
            .count();
        assert_eq!(got, per_window(w * 100), "window {w}");
    }
    // Second period: the trace repeats.
    let second = r
        .out
        .iter()
        .filter(|(at, _)| (1_000_000_000 < *at) && (*at <= 2_000_000_000))
        .count();
    assert_eq!(second, total);
    // Idle: a packet waits for the next opportunity, however many passed unused.
    let mut r = Run::new(&format!("capacity_trace={},queue=2s", f.path()));
    r.link.set_epoch(r.t0);
    r.advance_to(Duration::from_micros(4_500));
    r.link.push(
        r.t0 + Duration::from_micros(4_500),
        (0, 0, 4_500_000),
        1500,
        0,
    );
    r.advance_to(Duration::from_millis(50));
    let next = ms.iter().find(|&&m| m * 1_000_000 >= 4_500_000).unwrap();
    assert_eq!(r.out[0].0, next * 1_000_000);
    // Small packets share an opportunity: ten of 150 bytes leave in the first one.
    let mut r = Run::new(&format!("capacity_trace={},queue=2s", f.path()));
    r.link.set_epoch(r.t0);
    for i in 0..10 {
        r.link.push(r.t0, (0, i, 0), 150, 0);
    }
    r.advance_to(Duration::from_millis(50));
    assert!(r.out.iter().all(|(at, _)| *at == ms[0] * 1_000_000));
}

/// Rate slots change the rate at each slot boundary of the epoch's clock.
#[test]
fn rate_slots_change_at_the_boundaries() {
    let mut r = Run::new("rate_slots=1s@500ms:10mbit/40mbit,queue=50ms");
    r.link.set_epoch(r.t0);
    r.offer(1, 60.0, 1500, 2.5);
    let mbit_in = |a: f64, b: f64| {
        let n = r
            .out
            .iter()
            .filter(|(at, _)| (*at as f64 / 1e9) > a && (*at as f64 / 1e9) <= b)
            .count();
        n as f64 * 1500.0 * 8.0 / (b - a) / 1e6
    };
    // Before 0.5 s: the slot before the first (the list's last, 40); then 10, then 40.
    let (x, y, z) = (mbit_in(0.1, 0.5), mbit_in(0.6, 1.5), mbit_in(1.6, 2.5));
    assert!((x - 40.0).abs() < 1.0, "{x}");
    assert!((y - 10.0).abs() < 0.5, "{y}");
    assert!((z - 40.0).abs() < 1.0, "{z}");
}

#[test]
fn trace_errors_name_the_file_and_line() {
    let f = TraceFile::new("bad", [1, 2]);
    std::fs::write(&f.0, "10\n20\nabc\n").unwrap();
    let e = LinkSpec::parse(&format!("delay_trace={}", f.path())).unwrap_err();
    assert!(e.contains(&format!("{}:3", f.path())), "{e}");
    let e = LinkSpec::parse("capacity_trace=/nonexistent/trace.up").unwrap_err();
    assert!(e.contains("cannot read"), "{e}");
    let g = TraceFile::new("cap", [1, 2, 3]);
    let e = LinkSpec::parse(&format!("rate=10mbit,capacity_trace={}", g.path())).unwrap_err();
    assert!(e.contains("each set the capacity"), "{e}");
    let e = LinkSpec::parse(&format!("loss_trace={}", g.path())).unwrap_err();
    assert!(e.contains("not 0 or 1"), "{e}");
    let mut s = LinkSpec::parse(&format!("capacity_trace={}", g.path())).unwrap();
    s.apply("capacity_trace=none,rate=5mbit").unwrap();
    assert!(s.capacity_trace.is_none());
}
