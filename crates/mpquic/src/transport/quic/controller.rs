//! Congestion controllers for quinn's connections: the engine's own or the core's
//! (`mpquic_core::cc`, driven through `Adapter`), each wrapped (`Tracked`) so that its window,
//! bytes in flight and pacing rate are published beside the connection (`WindowMeter`) for the
//! schedulers, and so that pipes can share one controller (`PipeGroup`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use mpquic_core::cc;
use quinn::congestion::{BbrConfig, CubicConfig, NewRenoConfig};

use crate::config::Congestion;

/// The controller factory of a connection with controller `cc`, tracked (`WindowMeter`).
pub fn tracked(cc: Congestion) -> Arc<dyn quinn::congestion::ControllerFactory + Send + Sync> {
    Arc::new(Tracked(factory(cc)))
}

/// A kind of controller: the QUIC engine's own, or one of the core's (`mpquic_core::cc`), which
/// `Adapter` drives and which may be told to yield (`WindowMeter::set_yielding`).
#[derive(Clone)]
enum Factory {
    Engine(Arc<dyn quinn::congestion::ControllerFactory + Send + Sync>),
    Ours(fn(u16) -> Box<dyn cc::Controller>),
}

impl Factory {
    /// A controller for a connection (or a pipe group) whose yield switch is `yielding`, which
    /// hears through `idle` that its sender's queue emptied (`WindowMeter::on_idle`), and which
    /// tells its backlog window (`cc::Controller::backlog_window`) through `backlog`
    /// (the engine's controllers do not: 0) and whether the path reorders through `reorders`.
    fn build(
        &self,
        now: std::time::Instant,
        mtu: u16,
        yielding: &Arc<AtomicBool>,
        idle: &Arc<AtomicBool>,
        backlog: &Arc<AtomicU64>,
        reorders: &Arc<AtomicBool>,
    ) -> Box<dyn quinn::congestion::Controller> {
        match self {
            Factory::Engine(f) => f.clone().build(now, mtu),
            Factory::Ours(make) => Box::new(Adapter {
                inner: make(mtu),
                heard_at: None,
                yielding: yielding.clone(),
                yields: false,
                idle: idle.clone(),
                backlog: backlog.clone(),
                reorders: reorders.clone(),
            }),
        }
    }
}

/// The configured controller, bare (`Tracked` wraps it for a connection).
fn factory(cc: Congestion) -> Factory {
    match cc {
        Congestion::Cubic => Factory::Engine(Arc::new(CubicConfig::default())),
        Congestion::Newreno => Factory::Engine(Arc::new(NewRenoConfig::default())),
        Congestion::QuinnBbr => Factory::Engine(Arc::new(BbrConfig::default())),
        Congestion::Bbr => Factory::Ours(|mtu| Box::new(cc::Bbr::new(mtu))),
        Congestion::Bbr3 => Factory::Ours(|mtu| Box::new(cc::Bbr3::new(mtu))),
    }
}

/// Any controller, with its window and the bytes in flight published beside it: the
/// per-packet schedulers need to know whether a path's window has room before every batch, and
/// quinn tells the bytes in flight only to its controller (`on_end_acks`). Read through the
/// connection's `WindowMeter` (`window_meter`), a pair of atomics: no lock on the connection and
/// no copy of the controller per batch (`congestion_state` clones it, our bbr's delivery records
/// with it). Through the meter a connection can also join a `PipeGroup`: from then on its
/// controller's events go to the group's one controller.
struct Tracked(Factory);

impl quinn::congestion::ControllerFactory for Tracked {
    fn build(
        self: Arc<Self>,
        now: std::time::Instant,
        current_mtu: u16,
    ) -> Box<dyn quinn::congestion::Controller> {
        let meter = Arc::new(WindowMeter::default());
        let inner = self.0.build(
            now,
            current_mtu,
            &meter.yielding,
            &meter.idle,
            &meter.backlog,
            &meter.reorders,
        );
        meter.window.store(inner.window(), Ordering::Relaxed);
        Box::new(TrackedController {
            inner,
            in_flight: 0,
            acked: 0,
            meter,
        })
    }
}

/// A connection's congestion window, bytes in flight and pacing rate, as its controller last
/// saw them, and the pipe group it has joined, if any.
#[derive(Default)]
pub struct WindowMeter {
    window: AtomicU64,
    in_flight: AtomicU64,
    /// Bits/s; 0: the controller gives none (quinn's own).
    pacing: AtomicU64,
    group: OnceLock<(Arc<PipeGroup>, usize)>,
    /// The controller yields (`set_yielding`); read by it at every ACK frame.
    yielding: Arc<AtomicBool>,
    /// The sender's queue emptied since the controller's last ACK frame (`on_idle`).
    idle: Arc<AtomicBool>,
    /// Packets the peer has newly acknowledged (`acked`).
    acked: AtomicU64,
    /// The controller's backlog window (`backlog_window`); 0: it gives none.
    backlog: Arc<AtomicU64>,
    /// The controller has seen the path reorder lately (`reorders`).
    reorders: Arc<AtomicBool>,
}

impl WindowMeter {
    /// (window, bytes in flight). In a pipe group: this connection's part of the group's
    /// window (what the others left free at its last event) and its own bytes in flight.
    pub fn read(&self) -> (u64, u64) {
        (
            self.window.load(Ordering::Relaxed),
            self.in_flight.load(Ordering::Relaxed),
        )
    }

    /// The window the backlog in front of the path is sized by
    /// (`cc::Controller::backlog_window`): the window, or more while the controller (one of
    /// ours, not in a pipe group) holds its window down for a moment (bbr's Drain, ProbeRtt).
    pub fn backlog_window(&self) -> u64 {
        let window = self.window.load(Ordering::Relaxed);
        window.max(self.backlog.load(Ordering::Relaxed))
    }

    /// The controller (one of ours) has lately seen packets acknowledged out of send order
    /// (`cc::Controller::reorders`): its rate may run high, and the sender does not save up
    /// for bursts at it (`Pacer::idle`). In a pipe group: the group's controller.
    pub fn reorders(&self) -> bool {
        self.reorders.load(Ordering::Relaxed)
    }

    /// The rate (bits/s) the controller paces at, when it gives one (ours do).
    pub fn pacing_rate(&self) -> Option<u64> {
        Some(self.pacing.load(Ordering::Relaxed)).filter(|r| *r > 0)
    }

    /// The connection carries traffic classes: its controller (one of ours) keeps the
    /// bottleneck's queue short for the higher classes (`cc::Controller::set_yielding`), from
    /// its next ACK frame on; in a pipe group, the group's controller.
    pub fn set_yielding(&self, yielding: bool) {
        self.yielding.store(yielding, Ordering::Relaxed);
        if let Some((g, _)) = self.group.get() {
            g.yielding.store(yielding, Ordering::Relaxed);
        }
    }

    /// The path's sender found nothing waiting to be sent: its traffic offers less than the
    /// controller lets out (`cc::Controller::on_idle`), heard at the next ACK frame. A member of
    /// a pipe group does not tell the group (the others may still have a backlog).
    pub fn on_idle(&self) {
        self.idle.store(true, Ordering::Relaxed);
    }

    /// Packets the peer has newly acknowledged so far: the proof that a path still delivers
    /// (`ackwatch.rs`). Not the ACK frames received: a peer keeps repeating an ACK frame for
    /// what it received until it hears that its ACK arrived, so over a path that has gone dark
    /// one way only (client to server) the client kept receiving ACK frames, each of which
    /// reset its watch: the path went down ~160 ms after the fault instead of ~60, after its
    /// hand-over window, and 6-7 pings of 10 ms were lost (the matrix's black-hole cell).
    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    fn publish(&self, window: u64, in_flight: u64, pacing: Option<u64>) {
        self.window.store(window, Ordering::Relaxed);
        self.in_flight.store(in_flight, Ordering::Relaxed);
        self.pacing.store(pacing.unwrap_or(0), Ordering::Relaxed);
    }
}

/// The meter of `conn`'s controller (one clone of the controller, once per connection).
pub fn window_meter(conn: &quinn::Connection) -> Option<Arc<WindowMeter>> {
    conn.congestion_state()
        .into_any()
        .downcast::<TrackedController>()
        .ok()
        .map(|t| t.meter.clone())
}

/// One congestion controller for the connections of a path's pipes (`pipes: N`, several UDP
/// 5-tuples over one link). They share the link's capacity, so one controller owns its window:
/// with a controller each, every pipe takes the link for its own and the losses they cause
/// each other slow them all (seed 000 section 13: four QUIC pipes got 33 Mbit/s where one got
/// 74). A member connection's controller forwards its events here, and tells its connection
/// the group's window less what the other members have in flight, so together they never
/// exceed it. A group lives as long as its members.
pub struct PipeGroup {
    state: Mutex<GroupState>,
    /// (window, bytes in flight) of the whole group.
    total: WindowMeter,
    /// The group's controller yields (`WindowMeter::set_yielding` of a member).
    yielding: Arc<AtomicBool>,
}

/// Two full-size packets: the least window a member has (`GroupState::window_for`).
const MEMBER_FLOOR: u64 = 2 * 1500;

struct GroupState {
    inner: Box<dyn quinn::congestion::Controller>,
    /// Bytes in flight per member, in joining order.
    in_flight: Vec<u64>,
}

impl GroupState {
    fn total(&self) -> u64 {
        self.in_flight.iter().sum()
    }

    /// Member `m`'s window: the group's, less what the others have in flight, but never below
    /// its fair share of the group's window (nor `MEMBER_FLOOR`). quinn re-checks a blocked
    /// connection's window only on that connection's own events (its ACKs, a new datagram),
    /// not when another member's ACK frees the group's window: without the fair share, members
    /// that got ahead kept the window (their ACKs come back, and they send again at once) and a
    /// squeezed one sent a couple of packets per round trip. Under our bbr, whose window has
    /// little slack, four pipes through 20 Mbit/s per-session caps then carried 17/33/17/33% of
    /// 49 Mbit/s. With the share, a member below it may always fill it; one above it only takes
    /// what is free, so the members settle at their shares. The group may exceed its window
    /// while they do (at most by what the members below their share add).
    fn window_for(&self, m: usize) -> u64 {
        let window = self.inner.window();
        let others = self.total() - self.in_flight[m];
        let share = window / self.in_flight.len() as u64;
        window.saturating_sub(others).max(share).max(MEMBER_FLOOR)
    }

    /// Member `m`'s part of the group's pacing rate: in proportion to its part of the window.
    fn pacing_for(&self, m: usize) -> Option<u64> {
        let (all, mine) = (self.inner.window().max(1), self.window_for(m));
        self.inner
            .metrics()
            .pacing_rate
            .map(|r| (u128::from(r) * u128::from(mine) / u128::from(all)) as u64)
    }
}

impl PipeGroup {
    /// A group with a fresh controller of kind `cc` for packets of `mtu` bytes.
    pub fn new(cc: Congestion, mtu: u16) -> Arc<PipeGroup> {
        let yielding = Arc::new(AtomicBool::new(false));
        // A member's window is its part of the group's, which a probe's dip moves with the
        // others' traffic: members size their backlog by their window alone.
        let backlog = Arc::new(AtomicU64::new(0));
        let idle = Arc::new(AtomicBool::new(false));
        let total = WindowMeter::default();
        let inner = factory(cc).build(
            std::time::Instant::now(),
            mtu,
            &yielding,
            &idle,
            &backlog,
            &total.reorders,
        );
        total.publish(inner.window(), 0, inner.metrics().pacing_rate);
        Arc::new(PipeGroup {
            state: Mutex::new(GroupState {
                inner,
                in_flight: Vec::new(),
            }),
            total,
            yielding,
        })
    }

    /// Make the connection behind `meter` a member; false when it already is one (of any
    /// group). Its packets in flight so far (the handshake's) are left out of the group's.
    pub fn join(self: &Arc<Self>, meter: &WindowMeter) -> bool {
        let mut st = self.lock();
        let m = st.in_flight.len();
        if meter.group.set((self.clone(), m)).is_err() {
            return false;
        }
        st.in_flight.push(0);
        let (window, pacing) = (st.window_for(m), st.pacing_for(m));
        drop(st);
        // Its own controller is no longer driven: what it told last would stand for good.
        meter.backlog.store(0, Ordering::Relaxed);
        meter.publish(window, 0, pacing);
        true
    }

    /// The group's (window, bytes in flight).
    pub fn read(&self) -> (u64, u64) {
        self.total.read()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `f` on the group's state for member `m`, then publish the figures.
    fn with<R>(&self, m: usize, meter: &WindowMeter, f: impl FnOnce(&mut GroupState) -> R) -> R {
        let mut st = self.lock();
        let r = f(&mut st);
        let (window, total, mine) = (st.window_for(m), st.total(), st.in_flight[m]);
        let (group_window, group_pacing) = (st.inner.window(), st.inner.metrics().pacing_rate);
        let pacing = st.pacing_for(m);
        drop(st);
        self.total.publish(group_window, total, group_pacing);
        meter.publish(window, mine, pacing);
        meter
            .reorders
            .store(self.total.reorders(), Ordering::Relaxed);
        r
    }
}

struct TrackedController {
    inner: Box<dyn quinn::congestion::Controller>,
    /// As of the last ACK batch, less what was declared lost, plus what was sent since.
    in_flight: u64,
    /// Packets newly acknowledged so far, published to the meter once per ACK frame.
    acked: u64,
    /// Shared with clones (quinn clones a controller for status): they are not driven.
    meter: Arc<WindowMeter>,
}

impl TrackedController {
    fn publish(&self) {
        let pacing = self.inner.metrics().pacing_rate;
        self.meter
            .publish(self.inner.window(), self.in_flight, pacing);
    }

    /// The group this connection has joined, and its member number.
    fn group(&self) -> Option<(&PipeGroup, usize)> {
        self.meter.group.get().map(|(g, m)| (&**g, *m))
    }
}

impl quinn::congestion::Controller for TrackedController {
    fn on_sent(&mut self, now: std::time::Instant, bytes: u64, last_packet_number: u64) {
        if let Some((g, m)) = self.group() {
            return g.with(m, &self.meter, |st| {
                st.in_flight[m] += bytes;
                st.inner.on_sent(now, bytes, last_packet_number)
            });
        }
        self.in_flight += bytes;
        self.inner.on_sent(now, bytes, last_packet_number);
        self.publish();
    }
    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.acked += 1;
        if let Some((g, m)) = self.group() {
            return g.with(m, &self.meter, |st| {
                st.inner.on_ack(now, sent, bytes, app_limited, rtt)
            });
        }
        self.inner.on_ack(now, sent, bytes, app_limited, rtt);
    }
    /// In a group the controller is told the group's bytes in flight. Packet numbers are each
    /// connection's own, so the largest acknowledged is passed as the member's: only quinn's
    /// bbr reads it (rounds), and a group under it counts rounds per member.
    fn on_end_acks(
        &mut self,
        now: std::time::Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.meter.acked.store(self.acked, Ordering::Relaxed);
        if let Some((g, m)) = self.group() {
            return g.with(m, &self.meter, |st| {
                st.in_flight[m] = in_flight;
                let total = st.total();
                st.inner
                    .on_end_acks(now, total, app_limited, largest_packet_num_acked)
            });
        }
        self.in_flight = in_flight;
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
        self.publish();
    }
    fn on_congestion_event(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        if let Some((g, m)) = self.group() {
            // One loss episode seen by several members reduces the window once: the
            // controllers ignore losses of packets sent before their recovery began.
            return g.with(m, &self.meter, |st| {
                st.in_flight[m] = st.in_flight[m].saturating_sub(lost_bytes);
                st.inner
                    .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes)
            });
        }
        self.in_flight = self.in_flight.saturating_sub(lost_bytes);
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
        self.publish();
    }
    fn on_mtu_update(&mut self, new_mtu: u16) {
        if let Some((g, m)) = self.group() {
            return g.with(m, &self.meter, |st| st.inner.on_mtu_update(new_mtu));
        }
        self.inner.on_mtu_update(new_mtu);
        self.publish();
    }
    fn window(&self) -> u64 {
        match self.group() {
            Some((g, m)) => g.lock().window_for(m),
            None => self.inner.window(),
        }
    }
    /// In a group: the group's figures, its pacing rate scaled to this member's part of the
    /// window (a reliable-mode stream writer paces each pipe by it).
    fn metrics(&self) -> quinn::congestion::ControllerMetrics {
        let Some((g, m)) = self.group() else {
            return self.inner.metrics();
        };
        let st = g.lock();
        let mut metrics = st.inner.metrics();
        metrics.congestion_window = st.window_for(m);
        metrics.pacing_rate = st.pacing_for(m);
        metrics
    }
    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        Box::new(TrackedController {
            inner: self.inner.clone_box(),
            in_flight: self.in_flight,
            acked: self.acked,
            meter: self.meter.clone(),
        })
    }
    fn initial_window(&self) -> u64 {
        match self.group() {
            Some((g, _)) => g.lock().inner.initial_window(),
            None => self.inner.initial_window(),
        }
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// Builds one of the core's controllers for a datagram size.
/// One of the core's controllers (`mpquic_core::cc`) in the QUIC engine: `Factory::build`
/// makes one per connection, and this forwards the engine's events to it.
struct Adapter {
    inner: Box<dyn cc::Controller>,
    /// When the ACK frame being processed was heard (`heard`): one clock read per frame, not
    /// per packet it acknowledges. quinn ends every frame's acknowledgements with `on_end_acks`,
    /// which clears it.
    heard_at: Option<std::time::Instant>,
    /// The connection's yield switch (`WindowMeter::set_yielding`), and what `inner` was last
    /// told.
    yielding: Arc<AtomicBool>,
    yields: bool,
    /// The connection's sender found its queue empty since the last ACK frame
    /// (`WindowMeter::on_idle`).
    idle: Arc<AtomicBool>,
    /// Where `inner`'s backlog window is told (`WindowMeter::backlog_window`), after every
    /// event that may change it.
    backlog: Arc<AtomicU64>,
    /// Where `inner` tells whether the path reorders (`WindowMeter::reorders`), after each ACK
    /// frame.
    reorders: Arc<AtomicBool>,
}

impl Adapter {
    fn tell_backlog(&self) {
        self.backlog
            .store(self.inner.backlog_window(), Ordering::Relaxed);
    }
}

/// When an acknowledgement (or a loss it shows) reaches the controller: the engine's `now`, or
/// the clock if that is later. quinn stamps a received datagram with a time its endpoint read
/// before it received it, and on a busy host (the 2-core lab: emulator, iperf3 and both ends
/// on two cores) that read can precede the datagram's arrival by milliseconds: RTT samples
/// came out up to 10 ms short on a 30 ms path (minimum RTT 19.9 ms). The minimum RTT is a
/// minimum, so one short sample stands for 10 s: every later sample then looked like a
/// standing queue, the loss the window makes room for was read as overflow, and the path's
/// estimate fell from 61 to 18 Mbit/s within 15 s at 30% loss. The clock read here is never
/// before the arrival, so samples err long, which the minimum filters out. Send times stay the
/// engine's: they name the packets (`Delivery` finds its records by them).
fn heard(now: std::time::Instant) -> std::time::Instant {
    now.max(std::time::Instant::now())
}

impl quinn::congestion::Controller for Adapter {
    fn on_sent(&mut self, now: std::time::Instant, bytes: u64, _last_packet_number: u64) {
        self.inner.on_sent(now, bytes);
    }

    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        _rtt: &quinn_proto::RttEstimator,
    ) {
        let at = *self.heard_at.get_or_insert_with(|| heard(now));
        self.inner.on_ack(at, sent, bytes, app_limited);
    }

    fn on_end_acks(
        &mut self,
        now: std::time::Instant,
        in_flight: u64,
        _app_limited: bool,
        _largest_packet_num_acked: Option<u64>,
    ) {
        let at = self.heard_at.take().unwrap_or_else(|| heard(now));
        let yielding = self.yielding.load(Ordering::Relaxed);
        if yielding != self.yields {
            self.yields = yielding;
            self.inner.set_yielding(yielding);
        }
        if self.idle.swap(false, Ordering::Relaxed) {
            self.inner.on_idle();
        }
        self.inner.on_end_acks(at, in_flight);
        self.tell_backlog();
        self.reorders
            .store(self.inner.reorders(), Ordering::Relaxed);
    }

    fn on_congestion_event(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.inner
            .on_loss(heard(now), sent, is_persistent_congestion, lost_bytes);
        self.tell_backlog();
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu(new_mtu);
        self.tell_backlog();
    }

    fn window(&self) -> u64 {
        self.inner.window()
    }

    fn metrics(&self) -> quinn::congestion::ControllerMetrics {
        let mut m = quinn::congestion::ControllerMetrics::default();
        m.congestion_window = self.inner.window();
        m.pacing_rate = self.inner.pacing_rate().map(|r| r * 8);
        m
    }

    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        // quinn clones a controller for status (`Connection::congestion_state`) and for a
        // migrated path: the state as it is.
        Box::new(Adapter {
            inner: self.inner.clone_box(),
            heard_at: None,
            yielding: self.yielding.clone(),
            yields: self.yields,
            idle: self.idle.clone(),
            backlog: self.backlog.clone(),
            reorders: self.reorders.clone(),
        })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quinn::congestion::{Controller, ControllerFactory};
    use std::time::{Duration, Instant};

    /// A tracked controller of kind `cc`, and its meter.
    fn tracked(cc: Congestion) -> (Box<dyn Controller>, Arc<WindowMeter>) {
        let c = Arc::new(Tracked(factory(cc))).build(Instant::now(), 1200);
        let meter = c
            .clone_box()
            .into_any()
            .downcast::<TrackedController>()
            .unwrap()
            .meter
            .clone();
        (c, meter)
    }

    /// A core controller that records when it hears of acknowledgements and losses.
    #[derive(Debug, Clone)]
    struct Recorder(Arc<Mutex<Vec<Instant>>>);

    impl cc::Controller for Recorder {
        fn on_sent(&mut self, _: Instant, _: u64) {}
        fn on_ack(&mut self, now: Instant, _: Instant, _: u64, _: bool) {
            self.0.lock().unwrap().push(now);
        }
        fn on_end_acks(&mut self, now: Instant, _: u64) {
            self.0.lock().unwrap().push(now);
        }
        fn on_loss(&mut self, now: Instant, _: Instant, _: bool, _: u64) {
            self.0.lock().unwrap().push(now);
        }
        fn on_mtu(&mut self, _: u16) {}
        fn window(&self) -> u64 {
            12_000
        }
        fn initial_window(&self) -> u64 {
            12_000
        }
        fn pacing_rate(&self) -> Option<u64> {
            None
        }
        fn clone_box(&self) -> Box<dyn cc::Controller> {
            Box::new(self.clone())
        }
        fn set_yielding(&mut self, yielding: bool) {
            // A far-future mark for each time it is told to yield.
            if yielding {
                let mark = Instant::now() + Duration::from_secs(3600);
                self.0.lock().unwrap().push(mark);
            }
        }
    }

    /// The transport's yield switch (`WindowMeter::set_yielding`, a path carrying traffic
    /// classes) reaches one of our controllers at its next ACK frame, once; a pipe group's
    /// controller too. The controller's backlog window comes back through the meter.
    #[test]
    fn the_yield_switch_reaches_the_controller() {
        let times = Arc::new(Mutex::new(Vec::new()));
        let meter = WindowMeter::default();
        let mut a = Adapter {
            inner: Box::new(Recorder(times.clone())),
            heard_at: None,
            yielding: meter.yielding.clone(),
            yields: false,
            idle: meter.idle.clone(),
            backlog: meter.backlog.clone(),
            reorders: meter.reorders.clone(),
        };
        let now = Instant::now();
        a.on_end_acks(now, 0, false, None);
        // The controller's backlog window reaches the meter the same way.
        assert_eq!(meter.backlog_window(), 12_000);
        meter.set_yielding(true);
        a.on_end_acks(now, 0, false, None);
        a.on_end_acks(now, 0, false, None);
        let far = now + Duration::from_secs(1800);
        let told = times.lock().unwrap().iter().filter(|t| **t > far).count();
        assert_eq!(told, 1);
        // A member of a pipe group switches the group's controller.
        let group = PipeGroup::new(Congestion::Bbr, 1200);
        let member = WindowMeter::default();
        assert!(group.join(&member));
        member.set_yielding(true);
        assert!(group.yielding.load(Ordering::Relaxed));
    }

    /// The engine's time for an acknowledgement or a loss can precede the datagram's arrival
    /// (`heard`): the controller hears of it no earlier than the clock's time when it is told,
    /// so its RTT samples are never short.
    #[test]
    fn controller_hears_acks_no_earlier_than_the_clock() {
        let times = Arc::new(Mutex::new(Vec::new()));
        let mut a = Adapter {
            inner: Box::new(Recorder(times.clone())),
            heard_at: None,
            yielding: Arc::default(),
            yields: false,
            idle: Arc::default(),
            backlog: Arc::default(),
            reorders: Arc::default(),
        };
        let sent = Instant::now();
        a.on_sent(sent, 1200, 1);
        std::thread::sleep(Duration::from_millis(5));
        let told = Instant::now();
        // Stamped 1 ms after the send: read before the datagram arrived.
        let stale = sent + Duration::from_millis(1);
        a.on_end_acks(stale, 0, false, Some(1));
        a.on_congestion_event(stale, sent, false, 1200);
        let times = times.lock().unwrap();
        assert_eq!(times.len(), 2);
        assert!(
            times.iter().all(|&t| t >= told),
            "{times:?} before {told:?}"
        );
        // A later engine time is kept as it is.
        drop(times);
        let later = Instant::now() + Duration::from_secs(1);
        assert_eq!(heard(later), later);
    }

    /// Pipes under one controller: each is allowed the group's window less what the others
    /// have in flight (never below its fair share), the group counts every member's bytes, and
    /// one loss episode seen by two members shrinks the window once.
    #[test]
    fn pipe_group_shares_one_window() {
        let group = PipeGroup::new(Congestion::Newreno, 1200);
        let t0 = Instant::now() + Duration::from_millis(1);
        let (mut a, ma) = tracked(Congestion::Newreno);
        let (mut b, mb) = tracked(Congestion::Newreno);
        assert!(group.join(&ma) && group.join(&mb));
        assert!(!group.join(&ma), "a member joins once");
        let w = group.read().0;
        assert_eq!(a.window(), w);
        a.on_sent(t0, 6000, 1);
        assert_eq!(group.read(), (w, 6000));
        assert_eq!(b.window(), w - 6000);
        b.on_sent(t0, w, 1);
        assert_eq!(
            mb.read(),
            (w - 6000, w),
            "b's meter: its part, its own bytes"
        );
        assert_eq!(a.window(), w / 2, "nothing free: its fair share");
        // a's packets acknowledged: a has none in flight, b's part grows back.
        a.on_end_acks(t0 + Duration::from_millis(10), 0, false, Some(1));
        assert_eq!(group.read().1, w);
        assert_eq!(b.window(), group.read().0);
        // A loss on b, then one on a of a packet sent before the first: one reduction.
        let now = t0 + Duration::from_millis(20);
        b.on_congestion_event(now, t0 + Duration::from_millis(1), false, 1200);
        let reduced = group.read().0;
        assert!(reduced < w, "{reduced} < {w}");
        a.on_congestion_event(
            now + Duration::from_millis(1),
            t0 + Duration::from_millis(2),
            false,
            1200,
        );
        assert_eq!(group.read().0, reduced);
        assert_eq!(group.read().1, w - 1200);
    }
}
