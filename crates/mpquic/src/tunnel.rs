//! One tunnel's I/O shell, shared by the client and by each client session on the server: the
//! sans-IO `TunnelCore` (mpquic-core `tunnel`: router, health, bonds, resequencers, per-path FEC
//! and packet-size watch, receive dispatch) plus the transport of each path (`transport.rs`;
//! the tunnel never sees QUIC). The shell holds the connections and the lock, hands the core
//! what arrives and the time, and carries out what it says: sends, TUN writes, wake-ups.
//!
//! A tunnel with traffic classes has one lane per class (`Lane`): the classes share the paths
//! (one connection, prober, health and congestion controller each), each lane has its own bond
//! and resequencer in the core, its rank in every path's send queue and its carriage.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use mpquic_core::classify::{FlowClasses, Prefix};
use mpquic_core::fec::FecMode;
use mpquic_core::path::budget::{iso_date, Budget, Standing, Usage};
use mpquic_core::path::pmtu::Resize;
use mpquic_core::recovery::Why;
use mpquic_core::tunnel::{Deliver, LinkStats, PathFec, Polled, Received, Routing, TunnelCore};
use mpquic_core::wire::{self, Datagram};
use mpquic_core::{
    DropReason, HealthMode, PacketInfo, PathId, PathSpec, PathState, Policy, Transition,
};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::config::{Congestion, TransportMode};
use crate::io::batch::{Facts, PacketBatch};
use crate::io::tun::Tun;
use crate::status::{ClassStatus, PathStatus, TunnelStatus};
use crate::transport::{LaneCarry, LaneSend, PathTransport, Sink};

pub use crate::transport::close;
pub use mpquic_core::tunnel::Sources;

/// How long a replaced connection stays open to drain what is already in flight on it.
const REPLACE_GRACE: Duration = Duration::from_millis(250);
/// A live transport carrying one path.
struct Link {
    transport: Arc<dyn PathTransport>,
    generation: u64,
}

struct State {
    core: TunnelCore,
    /// The live connection of each path, by `PathId::index()`.
    links: Vec<Option<Link>>,
    next_generation: u64,
}

impl State {
    fn link(&self, path: PathId) -> Option<&Link> {
        self.links.get(path.index()).and_then(Option::as_ref)
    }
}

/// A metered path's budget for status, at `wall` (seconds since the epoch).
fn budget_status(m: &mpquic_core::path::budget::Meter, wall: i64) -> crate::status::BudgetStatus {
    let (b, u) = (&m.budget, &m.usage);
    let end = b.period_end(u.since);
    let runs_out = b.runs_out(u, wall);
    crate::status::BudgetStatus {
        limit_bytes: b.limit,
        used_bytes: u.used,
        left_bytes: b.left(u),
        state: match m.standing() {
            Standing::Within => "within",
            Standing::Warn => "warn",
            Standing::Exhausted => "used up",
        }
        .into(),
        period_start: iso_date(u.since),
        period_end: iso_date(end),
        period_end_unix: end,
        runs_out: runs_out.map(iso_date),
        runs_out_unix: runs_out,
    }
}

/// What a connection tells the core about itself.
fn link_stats(t: &dyn PathTransport) -> LinkStats {
    let st = t.stats();
    LinkStats {
        sent_packets: st.sent_packets,
        lost_packets: st.lost_packets,
        udp_payload: st.udp_payload,
        link_payload: st.link_payload,
        max_datagram: st.max_datagram,
        acks: st.acks,
        rtt: st.rtt,
        wire_bytes: st.wire_bytes,
    }
}

/// One traffic class of a tunnel as its shell sees it: the lane of the same index in the core
/// (its bond and resequencer), its place in the paths' send queues and how its packets travel,
/// and where its peer's packets are written.
pub struct Lane {
    /// The class's name; `None`: the only lane of a tunnel without classes.
    name: Option<String>,
    mode: TransportMode,
    /// Rank (the lane's index: 0 is the highest priority) and carriage, for the transports.
    send: LaneSend,
    /// The class's own TUN device (`tun_name` of a client's class), else the tunnel's.
    tun: Arc<Tun>,
    /// The policy spreads a flow's packets (numbered for the peer's resequencer): routing
    /// needs each path's load first.
    per_packet: bool,
}

/// A traffic class of a new tunnel (`Carriage::lanes`).
pub struct LaneSpec {
    pub name: Option<String>,
    pub policy: Policy,
    pub mode: TransportMode,
    /// FEC protects its packets (in the tunnel's FEC mode).
    pub fec: bool,
    /// Its own TUN device (`None`: the tunnel's).
    pub tun: Option<Arc<Tun>>,
}

pub struct Tunnel {
    /// Client name on the server, instance name on the client.
    pub peer: String,
    /// The lanes, in priority order (one without classes).
    lanes: Vec<Lane>,
    /// Server: each packet delivered from the client marks its flow's answers with its lane
    /// (`classify::FlowClasses`); `None` on the client and for a session without classes.
    marks: Option<Mutex<FlowClasses>>,
    tun: Arc<Tun>,
    /// The connections' mode (`Carriage::connection_mode`).
    mode: TransportMode,
    /// The configured congestion controller (`congestion_algorithm`; a reload keeps it).
    congestion: Congestion,
    state: Mutex<State>,
    /// Wakes the timer task when the core's next deadline may have moved earlier (a path was
    /// connected, a state changed, a packet woke a quiet tunnel), so it can sleep until that
    /// deadline rather than tick.
    timers_changed: Notify,
    /// Server: a path of the client was closed with `close::LEAVING` (the process is stopping).
    peer_leaving: AtomicBool,
}

/// How a tunnel carries its packets: the client's choices, which the server learns from the
/// hello.
pub struct Carriage {
    /// The FEC mode of the paths' groups (for the lanes that use FEC).
    pub fec: FecMode,
    /// The lanes in priority order: one without classes, one per class with them.
    pub lanes: Vec<LaneSpec>,
    /// Server: remember each flow's class from what the client sends (a session with classes).
    pub marks: bool,
}

impl Carriage {
    /// The mode of the connections that carry every lane: `auto` when a class adapts to its
    /// paths' loss, else `reliable` when one uses the paths' streams, else `datagram`.
    pub fn connection_mode(modes: impl IntoIterator<Item = TransportMode>) -> TransportMode {
        let modes: Vec<TransportMode> = modes.into_iter().collect();
        [TransportMode::Auto, TransportMode::Reliable]
            .into_iter()
            .find(|m| modes.contains(m))
            .unwrap_or(TransportMode::Datagram)
    }
}

/// How a lane in `mode` travels on connections in `connection` mode (`LaneCarry`).
fn lane_carry(mode: TransportMode, connection: TransportMode) -> LaneCarry {
    match mode {
        m if m == connection => LaneCarry::Path,
        TransportMode::Datagram => LaneCarry::Datagram,
        TransportMode::Reliable => LaneCarry::Stream,
        // Only on `auto` connections (`connection_mode`), where it is the path's carriage.
        TransportMode::Auto => LaneCarry::Path,
    }
}

impl Tunnel {
    /// `expect_src`: on the server, the sources the client may use (packets from any other
    /// source are dropped); `None` on the client.
    pub fn new(
        peer: String,
        tun: Arc<Tun>,
        expect_src: Option<Sources>,
        health: HealthMode,
        congestion: Congestion,
        carriage: Carriage,
    ) -> Arc<Tunnel> {
        let Carriage {
            fec,
            lanes: specs,
            marks,
        } = carriage;
        assert!(!specs.is_empty(), "a tunnel has a lane at least");
        let mode = Carriage::connection_mode(specs.iter().map(|l| l.mode));
        let mut core = TunnelCore::new(specs[0].policy, health, fec, expect_src);
        core.set_lane_fec(0, specs[0].fec);
        for l in &specs[1..] {
            // The config allows no more classes than lanes (`MAX_CLASSES`), the server checks
            // a hello's list against the same bound.
            let _ = core.add_lane(l.policy, l.fec);
        }
        if mode == TransportMode::Auto {
            core = core.adaptive();
        }
        let lanes = specs
            .into_iter()
            .enumerate()
            .map(|(rank, l)| Lane {
                name: l.name,
                mode: l.mode,
                send: LaneSend {
                    rank: rank as u8,
                    carry: lane_carry(l.mode, mode),
                },
                tun: l.tun.unwrap_or_else(|| tun.clone()),
                per_packet: l.policy.per_packet(),
            })
            .collect();
        Arc::new(Tunnel {
            peer,
            lanes,
            marks: marks.then(|| Mutex::new(FlowClasses::default())),
            tun,
            mode,
            congestion,
            state: Mutex::new(State {
                core,
                links: Vec::new(),
                next_generation: 1,
            }),
            timers_changed: Notify::new(),
            peer_leaving: AtomicBool::new(false),
        })
    }

    /// Whether the peer said it is stopping (a path closed with `close::LEAVING`).
    pub fn peer_leaving(&self) -> bool {
        self.peer_leaving.load(Ordering::Relaxed)
    }

    /// The congestion controller of its connections as it runs: `bbr` yields with traffic
    /// classes (`PathTransport::set_yielding`).
    pub fn congestion(&self) -> String {
        match self.congestion {
            Congestion::Bbr if self.lanes.len() > 1 => "bbr (yielding)".into(),
            c => c.as_str().into(),
        }
    }

    /// The mode of the tunnel's connections (`Carriage::connection_mode`).
    pub fn mode(&self) -> TransportMode {
        self.mode
    }

    /// Server: the lane a flow's answers go in, from what the client sent on it (`None`: not
    /// seen, or a session without classes).
    pub fn lane_of(&self, flow_reply_hash: u64, now: Instant) -> Option<usize> {
        let marks = self.marks.as_ref()?;
        let rank = marks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .class_of(flow_reply_hash, now)?;
        Some(usize::from(rank)).filter(|&l| l < self.lanes.len())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug; keep serving rather than cascade.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of the path called `name`, created if new; its spec is refreshed. `None` when the
    /// tunnel already has `limit` paths (or no room at all) and this one is new.
    pub fn path(&self, spec: PathSpec, limit: usize) -> Option<PathId> {
        let mut s = self.lock();
        let id = s.core.path(spec, limit)?;
        if s.links.len() <= id.index() {
            s.links.resize_with(id.index() + 1, || None);
        }
        Some(id)
    }

    /// `path`'s role now: its configured one, or backup while its data budget is used up.
    pub fn role(&self, path: PathId) -> mpquic_core::Role {
        self.lock().core.router().paths().get(path).role()
    }

    /// Meter `path` against `budget` (`None`: not metered), counting on from `usage` (the
    /// state file's; `None`: nothing used yet).
    pub fn set_budget(&self, path: PathId, budget: Option<Budget>, usage: Option<Usage>) {
        self.lock()
            .core
            .set_budget(path, budget, usage, wall_clock());
        self.timers_changed.notify_one();
    }

    /// What each metered path has used in its period, by name (the state file's lines).
    pub fn budget_usage(&self) -> Vec<(String, Usage)> {
        let s = self.lock();
        let paths = s.core.router().paths();
        paths
            .ids()
            .filter_map(|id| Some((paths.get(id).spec.name.clone(), s.core.meter(id)?.usage)))
            .collect()
    }

    /// The first lane's policy (a tunnel without classes has only that one).
    pub fn policy(&self) -> Policy {
        self.lock().core.router().bond().policy()
    }

    /// The first lane schedules by `policy` from now on (a reload of a tunnel without classes;
    /// `Bond::set_policy` says which changes are possible).
    pub fn set_policy(&self, policy: Policy) -> Result<(), String> {
        let mut s = self.lock();
        let before = s.core.router().bond().policy();
        s.core.router_mut().set_policy(0, policy)?;
        drop(s);
        if before != policy {
            info!(tunnel = %self.peer, from = before.as_str(), to = policy.as_str(), "bonding policy changed");
        }
        Ok(())
    }

    /// The id of the path called `name`, if the tunnel has one.
    pub fn path_id(&self, name: &str) -> Option<PathId> {
        self.lock().core.router().paths().find(name)
    }

    pub fn path_name(&self, path: PathId) -> String {
        self.lock()
            .core
            .router()
            .paths()
            .get(path)
            .spec
            .name
            .clone()
    }

    /// Put a fresh transport on `path`, replacing any previous one (closed after a short
    /// drain), and start its receive side. Returns the link generation for `remove` (0, and the
    /// transport closed, when the path was retired meanwhile: no generation is 0).
    pub fn install(self: &Arc<Self>, path: PathId, transport: Arc<dyn PathTransport>) -> u64 {
        let now = Instant::now();
        let (generation, old) = {
            let mut s = self.lock();
            if s.core.router().paths().get(path).retired {
                // Removed by a reload while this connection was being made (a path task on
                // another thread): it is not wanted.
                drop(s);
                transport.close(close::REMOVED, "path removed from the configuration");
                return 0;
            }
            let generation = s.next_generation;
            s.next_generation += 1;
            let old = s.links[path.index()].replace(Link {
                transport: transport.clone(),
                generation,
            });
            s.core.connected(path, link_stats(&*transport), now);
            if let Some(c) = s.core.carry(path) {
                transport.set_carry(c);
            }
            transport.set_hand_over(s.core.router().can_hand_over(path));
            // Every class leaves through the path's one controller: it keeps the bottleneck's
            // queue short for the higher ones (scenario 17: critical ping p99 +3.7/+4.6 ms over
            // idle beside 8 bulk uploads yielding, +11.5/+12.8 not).
            if self.lanes.len() > 1 {
                transport.set_yielding();
            }
            (generation, old)
        };
        // A new path probes at once.
        self.timers_changed.notify_one();
        if let Some(old) = old {
            // Let the replaced connection drain: datagrams already queued or in flight on it
            // (either way) still arrive and are delivered by its reader; new packets use the
            // new connection. Closing at once would discard them.
            tokio::spawn(async move {
                tokio::time::sleep(REPLACE_GRACE).await;
                old.transport
                    .close(close::REPLACED, "replaced by a new connection");
            });
        }
        info!(tunnel = %self.peer, path = %self.path_name(path), remote = %transport.remote(), mode = self.mode.as_str(), "path connected");
        let sink = Arc::new(LinkSink {
            tunnel: self.clone(),
            path,
            generation,
            transport: Arc::downgrade(&transport),
        });
        transport.start(sink);
        generation
    }

    /// The connection with `generation` on `path` is gone (if it is still the current one).
    pub fn remove(&self, path: PathId, generation: u64) {
        let mut s = self.lock();
        if s.link(path).is_some_and(|l| l.generation == generation) {
            s.links[path.index()] = None;
            s.core.disconnected(path);
            let name = s.core.router().paths().get(path).spec.name.clone();
            drop(s);
            info!(tunnel = %self.peer, path = %name, "path disconnected");
        }
    }

    /// `path` was taken out of the configuration: close its connection (telling the peer,
    /// `close::REMOVED`) and keep it out of use until it is configured again (`path`). With
    /// `only`: if that generation is still the path's connection (the peer closed it).
    pub fn retire(&self, path: PathId, only: Option<u64>) {
        let link = {
            let mut s = self.lock();
            if only.is_some_and(|g| s.link(path).is_none_or(|l| l.generation != g)) {
                return;
            }
            s.core.router_mut().retire(path);
            s.links.get_mut(path.index()).and_then(Option::take)
        };
        if let Some(l) = link {
            l.transport
                .close(close::REMOVED, "path removed from the configuration");
        }
        info!(tunnel = %self.peer, path = %self.path_name(path), "path removed");
    }

    pub fn connected_paths(&self) -> usize {
        self.lock().links.iter().filter(|l| l.is_some()).count()
    }

    /// `path`'s RTT as its probes last measured it: its live connection's, or the one it had
    /// when its last connection went away.
    pub fn rtt(&self, path: PathId) -> Option<Duration> {
        self.lock().core.router().paths().get(path).srtt()
    }

    pub fn unusable_for(&self, path: PathId) -> Option<Duration> {
        self.lock().core.router().unusable_for(path, Instant::now())
    }

    /// Close every connection (shutdown, or the session was replaced).
    pub fn close_all(&self, code: u32, reason: &str) {
        let links: Vec<Link> = self
            .lock()
            .links
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        for l in links {
            l.transport.close(code, reason);
        }
    }

    /// Send the packets `which` of `batch` (already MSS-clamped, `infos` their parsed headers,
    /// indexed like the batch), all of `lane`, each on the path its lane's policy picks:
    /// `route_batch`, then `send_routed`. `scratch` is the caller's, kept from batch to batch
    /// so routing allocates nothing in the steady state.
    pub fn send_batch(
        &self,
        lane: usize,
        batch: &mut PacketBatch,
        which: &[usize],
        infos: &[Option<PacketInfo>],
        scratch: &mut Routed,
    ) {
        self.route_batch(lane, batch, which, infos, scratch);
        self.send_routed(batch, scratch);
    }

    /// The first half of `send_batch`: the core picks each packet's path and writes every
    /// header (the bond's numbering, FEC's), then the transports write their framing; the picks
    /// stay in `scratch`. One lock covers the decisions for the whole batch. Nothing is sent,
    /// so the batch stays writable: the server routes one batch for each of its client sessions
    /// before any is sent (a transport that takes packets shares the batch, and no header can
    /// be written after that; later sessions' packets went unnumbered and without FEC).
    pub fn route_batch(
        &self,
        lane: usize,
        batch: &mut PacketBatch,
        which: &[usize],
        infos: &[Option<PacketInfo>],
        scratch: &mut Routed,
    ) {
        let now = Instant::now();
        scratch.clear();
        let Some(l) = self.lanes.get(lane) else {
            self.drop_unsent(0, DropReason::Malformed, which.len() as u64);
            return;
        };
        // What the transports queue and carry by, from the headers parsed once.
        for &i in which {
            let facts = Facts::of(batch.packet(i), infos.get(i).and_then(Option::as_ref));
            batch.set_facts(i, facts);
        }
        scratch.lane = lane;
        if l.per_packet {
            self.refresh_loads(scratch);
        }
        {
            let mut s = self.lock();
            let State { core, links, .. } = &mut *s;
            for (path, load) in scratch.loads.drain(..) {
                core.router_mut().set_load(path, load);
            }
            let link = |id: PathId| links.get(id.index()).and_then(Option::as_ref);
            let routing = &mut scratch.routing;
            let connected = |id: PathId| link(id).is_some();
            core.route_batch(lane, which, infos, batch, connected, now, routing);
            // The transports of the paths used, while their links are at hand.
            let used = routing.paths().map(|(id, _)| id);
            for id in used.chain(routing.copies.iter().map(|c| c.path)) {
                if scratch.to.len() <= id.index() {
                    scratch.to.resize_with(id.index() + 1, || None);
                }
                scratch.to[id.index()] = link(id).map(|l| l.transport.clone());
            }
            self.wake_timers_if(routing.wake);
        }
        // Every transport writes its headers before any takes packets (then they are shared).
        for (id, share) in scratch.routing.paths() {
            if let Some(t) = scratch.transport(id) {
                t.prepare(batch, &share.picks);
            }
        }
    }

    /// The second half of `send_batch`: send what `route_batch` put in `scratch`, outside the
    /// tunnel's lock (grouped per path, so the receive side never waits behind the sends), and
    /// count what the transports refused.
    pub fn send_routed(&self, batch: &mut PacketBatch, scratch: &mut Routed) {
        let mut refused_copies: Vec<(PathId, usize, DropReason, bool)> = Vec::new();
        for c in &scratch.routing.copies {
            let Some(t) = scratch.transport(c.path) else {
                continue;
            };
            if let Err(reason) = t.send_control(&c.bytes) {
                refused_copies.push((c.path, c.bytes.len(), reason, c.repair));
            }
        }
        let mut refused = std::mem::take(&mut scratch.refused);
        let mut repairs_refused: Vec<(PathId, u64)> = Vec::new();
        let lane = &self.lanes[scratch.lane];
        for (path, share) in scratch.routing.paths() {
            if let Some(t) = scratch.transport(path) {
                t.send_batch(batch, &share.picks, lane.send, &mut |i, reason| {
                    refused.push((path, i, reason))
                });
                let n = send_repairs(&**t, &share.repairs);
                if n > 0 {
                    repairs_refused.push((path, n));
                }
            }
        }
        if !refused_copies.is_empty() || !refused.is_empty() || !repairs_refused.is_empty() {
            let mut too_big = Vec::new();
            let mut s = self.lock();
            for (path, len, reason, repair) in refused_copies {
                match repair {
                    true => s.core.repairs_refused(path, 1),
                    false => s.core.router_mut().drop_tx(path, len, reason),
                }
            }
            for &(path, i, reason) in refused.iter() {
                s.core
                    .router_mut()
                    .drop_tx(path, batch.packet(i).len(), reason);
                if reason == DropReason::Oversized {
                    let limit = scratch.transport(path).and_then(|t| t.stats().max_datagram);
                    if let Some(reply) = limit.and_then(|l| too_big_reply(batch, i, l)) {
                        s.core.too_big_sent(path);
                        too_big.push(reply);
                    }
                }
            }
            for (path, n) in repairs_refused {
                s.core.repairs_refused(path, n);
            }
            drop(s);
            // The TUN write forwards the message to the sender; outside the lock.
            for reply in too_big {
                let refused = lane.tun.send(&reply);
                self.count_refused(refused);
            }
        }
        refused.clear();
        scratch.refused = refused;
    }

    /// Each connected path's load as its transport sees it now (`PathLoad`) into
    /// `scratch.loads`, read outside the tunnel's lock (it takes the QUIC connection's).
    fn refresh_loads(&self, scratch: &mut Routed) {
        {
            let s = self.lock();
            let links = s.core.router().paths().ids();
            scratch
                .links
                .extend(links.filter_map(|id| s.link(id).map(|l| (id, l.transport.clone()))));
        }
        let loads = scratch.links.drain(..).map(|(id, t)| (id, t.load()));
        scratch.loads.extend(loads);
    }

    /// Connecting `path` with packets of `payload` failed (a larger size tried): the MTU watch
    /// takes it as too big for now, unless the path went down meanwhile. Returns whether it
    /// counted.
    pub fn resize_failed(&self, path: PathId, payload: u16) -> bool {
        let counted = self
            .lock()
            .core
            .resize_failed(path, payload, Instant::now());
        self.timers_changed.notify_one();
        counted
    }

    /// `path` could be connected only at the smallest packet size (`pmtu::PathMtu::on_fallback`);
    /// called before the new transport is installed.
    pub fn fell_back(&self, path: PathId) {
        self.lock().core.fell_back(path);
    }

    /// A CONNECT-IP client's first answer came from an mpquic server
    /// (`TunnelCore::peer_speaks_mpquic`).
    pub fn peer_speaks_mpquic(&self) {
        self.lock().core.peer_speaks_mpquic();
    }

    /// ... from a standard server (`TunnelCore::peer_speaks_ip_only`): whether a per-packet
    /// policy gave way to failover.
    pub fn peer_speaks_ip_only(&self) -> bool {
        self.lock().core.peer_speaks_ip_only()
    }

    /// Whether this side watches its paths' packet size (`pmtu.rs`: the client, when its
    /// server answers probes).
    pub fn watches_mtu(&self) -> bool {
        self.lock().core.watches_mtu()
    }

    /// A size change the MTU watch decided for `path` (client: reconnect it with packets of
    /// this UDP payload at most), once.
    pub fn take_resize(&self, path: PathId) -> Option<Resize> {
        self.lock().core.take_resize(path)
    }

    /// `n` packets of `lane` dropped before routing (counted on the lane, not on a path).
    pub fn drop_unsent(&self, lane: usize, reason: DropReason, n: u64) {
        if n > 0 {
            self.lock().core.router_mut().drop_unrouted(lane, reason, n);
        }
    }

    /// Write what this wake-up delivered to the TUN devices (`Sink::on_batch_end`): the
    /// tunnel's, and a class's own.
    pub fn flush_tun(&self) {
        let refused = self.tun.flush();
        self.count_refused(refused);
        for (i, l) in self.lanes.iter().enumerate() {
            let own = !Arc::ptr_eq(&l.tun, &self.tun);
            // A device shared by classes (not the tunnel's) is flushed once, by its first.
            let first = own && !self.lanes[..i].iter().any(|o| Arc::ptr_eq(&o.tun, &l.tun));
            if first {
                let refused = l.tun.flush();
                self.count_refused(refused);
            }
        }
    }

    /// Packets a TUN device refused, counted on the tunnel (its first lane): a coalesced write
    /// carries packets of several paths and lanes (and, on a server, of several clients'
    /// tunnels).
    fn count_refused(&self, refused: Option<crate::io::tun::Refused>) {
        if let Some((reason, n)) = self.refusal(refused) {
            self.lock().core.router_mut().drop_unrouted(0, reason, n);
        }
    }

    /// Why and how many packets the TUN device refused.
    fn refusal(&self, refused: Option<crate::io::tun::Refused>) -> Option<(DropReason, u64)> {
        let r = refused?;
        let reason = if r.error.raw_os_error() == Some(libc::EAGAIN) {
            DropReason::QueueFull
        } else {
            DropReason::TunRefused
        };
        debug!(tunnel = %self.peer, packets = r.packets, error = %r.error, "TUN write refused");
        Some((reason, r.packets))
    }

    /// A packet woke a quiet tunnel: its probes are due now, not when the timer task planned.
    fn wake_timers_if(&self, woken: bool) {
        if woken {
            self.timers_changed.notify_one();
        }
    }

    /// A datagram from `path`'s connection `transport` (probes are answered on it, while it
    /// lives).
    fn on_datagram(&self, path: PathId, transport: &Weak<dyn PathTransport>, d: &[u8]) {
        let mut rx = Rx {
            tunnel: self,
            reply_to: Some(transport),
        };
        let got = self
            .lock()
            .core
            .on_datagram(path, d, Instant::now(), &mut rx);
        self.after_receive(got);
    }

    /// A packet from `path`'s reliable stream (`None`: a frame that did not parse).
    fn on_stream_packet(&self, path: PathId, pkt: Option<&[u8]>) {
        let mut rx = Rx {
            tunnel: self,
            reply_to: None,
        };
        let got = self
            .lock()
            .core
            .on_stream_packet(path, pkt, Instant::now(), &mut rx);
        self.after_receive(got);
    }

    fn after_receive(&self, got: Received) {
        self.wake_timers_if(got.wake);
        if let Some(t) = got.transition {
            self.on_transition(&t);
        }
    }

    /// Advance the core's timers: send due probes, FEC repairs and MTU probes, deliver what the
    /// resequencer released, log transitions. Returns when the core next has work (`None`: no
    /// connected path, nothing to do until one is installed).
    fn tick(&self, polled: &mut Polled) -> Option<Instant> {
        let now = Instant::now();
        let mut rx = Rx {
            tunnel: self,
            reply_to: None,
        };
        let mut sends: Vec<(Arc<dyn PathTransport>, Vec<u8>)> = Vec::new();
        let mut repairs = Vec::new();
        let next = {
            let mut s = self.lock();
            let State { core, links, .. } = &mut *s;
            core.set_wall_clock(wall_clock());
            let link = |id: PathId| links.get(id.index()).and_then(Option::as_ref);
            let next = core.poll(
                now,
                |id| link(id).map(|l| link_stats(&*l.transport)),
                &mut rx,
                polled,
            );
            let to = |id: PathId| link(id).map(|l| l.transport.clone());
            for p in &polled.probes {
                if let Some(t) = to(p.path) {
                    sends.push((t, wire::encode_probe_view(p.seq, &p.view).to_vec()));
                }
            }
            // Refused when the datagram buffer is full: then an MTU probe is lost, as it should
            // be, and a health probe counts as unanswered, which is what a full buffer means.
            sends.extend(
                polled
                    .mtu_probes
                    .drain(..)
                    .filter_map(|(id, m)| Some((to(id)?, m))),
            );
            repairs.extend(
                polled
                    .repairs
                    .drain(..)
                    .filter_map(|(id, r)| Some((id, to(id)?, r))),
            );
            // Under the lock, so a connection installed meanwhile cannot miss the change.
            for &(id, c, _) in &polled.carry {
                if let Some(t) = to(id) {
                    t.set_carry(c);
                }
            }
            for id in core.router().paths().ids() {
                if let Some(l) = link(id) {
                    l.transport.set_hand_over(core.router().can_hand_over(id));
                }
            }
            next
        };
        if polled.delivered {
            self.flush_tun();
        }
        for (transport, msg) in sends {
            let _ = transport.send_control(&msg);
        }
        for (path, transport, r) in repairs {
            let n = send_repairs(&*transport, &r);
            if n > 0 {
                self.lock().core.repairs_refused(path, n);
            }
        }
        for &(path, v, was) in &polled.resized {
            let name = self.path_name(path);
            if v.recheck {
                info!(tunnel = %self.peer, path = %name, payload = v.payload,
                      "path MTU: trying larger packets");
            } else {
                warn!(tunnel = %self.peer, path = %name, was, payload = v.payload,
                      "path MTU fell (full-size packets lost, small ones answered): reconnecting with smaller packets");
            }
        }
        for &(path, _, why) in &polled.carry {
            let loss = self.lock().core.recovery(path).map_or(0.0, |r| r.loss());
            let name = self.path_name(path);
            // Debug for the quiet and slow cases: every lull in traffic does them.
            match why {
                Why::Loss => info!(tunnel = %self.peer, path = %name, loss_pct = loss * 100.0,
                    "path loses packets: inner packets on its stream (retransmitted, in order)"),
                Why::Quiet => debug!(tunnel = %self.peer, path = %name,
                    "path quiet: inner packets on its stream until traffic shows it clean"),
                Why::Single => debug!(tunnel = %self.peer, path = %name,
                    "path not bonded, at a rate its stream carries as well: inner packets on its stream"),
                Why::Clean => debug!(tunnel = %self.peer, path = %name,
                    "path clean under traffic: inner packets as datagrams"),
            }
        }
        for &(path, standing) in &polled.budgets {
            self.log_budget(path, standing);
        }
        for t in &polled.transitions {
            self.on_transition(t);
        }
        next
    }

    /// A metered path crossed its warning share, used its budget up, or started a new period.
    fn log_budget(&self, path: PathId, standing: Standing) {
        let name = self.path_name(path);
        let Some(m) = self.lock().core.meter(path).copied() else {
            return;
        };
        let (used, limit) = (m.usage.used, m.budget.limit);
        match standing {
            Standing::Within => {
                info!(tunnel = %self.peer, path = %name, limit, "data budget: a new period starts; the path carries as configured again")
            }
            Standing::Warn => {
                warn!(tunnel = %self.peer, path = %name, used, limit, left = m.budget.left(&m.usage),
                      "data budget: past its warning share")
            }
            Standing::Exhausted => {
                warn!(tunnel = %self.peer, path = %name, used, limit,
                      ends = %iso_date(m.budget.period_end(m.usage.since)),
                      "data budget used up: the path carries only as a backup until its period ends")
            }
        }
    }

    /// Serve the core's timers for the tunnel's life: sleep until its next deadline, or until a
    /// path is installed (which may bring the deadline forward). No fixed tick.
    pub async fn run_timers(&self) {
        let mut polled = Polled::default();
        loop {
            let next = self.tick(&mut polled);
            let changed = self.timers_changed.notified();
            match next {
                Some(at) => {
                    // At least a millisecond (the timer's resolution): a deadline that a core
                    // bug left in the past must not turn this loop into a spin.
                    let at = at.max(Instant::now() + Duration::from_millis(1));
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    /// A path changed state: log it, and hand a path that went down over to the live ones
    /// (`reliable.rs`): its connection closed so it delivers nothing late, and in reliable
    /// mode its recent packets sent again there.
    fn on_transition(&self, t: &Transition) {
        self.log_transition(t);
        if t.to != Some(PathState::Down) {
            return;
        }
        let now = Instant::now();
        let handover = {
            let s = self.lock();
            s.link(t.path).and_then(|l| {
                let since = s.core.router().hand_over_since(t.path, now)?;
                Some((l.transport.clone(), since))
            })
        };
        let Some((transport, since)) = handover else {
            return;
        };
        let packets = transport.abandon(since);
        self.lock()
            .core
            .router_mut()
            .handed_over(t.path, packets.len() as u64);
        info!(tunnel = %self.peer, path = %self.path_name(t.path), resent = packets.len(),
              "path down: connection closed, its recent packets sent again on the live paths");
        self.resend(&packets);
    }

    /// Send packets again (a dead path's, `on_transition`), routed like new ones, each in its
    /// lane (a batch per lane: a batch's headers are written before any of it is sent).
    fn resend(&self, packets: &[bytes::Bytes]) {
        // The frames as the dead path carried them: their lane's header and a per-packet
        // policy's numbering go (the packet is numbered again where it goes now; sent with it,
        // the receiver took the old header for the packet: `malformed` on the live path).
        let mut by_lane: Vec<Vec<&[u8]>> = vec![Vec::new(); self.lanes.len()];
        for frame in packets {
            let (lane, d) = match wire::decode(frame) {
                Some(Datagram::Classed { lane, inner }) => (usize::from(lane), wire::decode(inner)),
                d => (0, d),
            };
            match (by_lane.get_mut(lane), d) {
                (Some(l), Some(Datagram::Packet(p) | Datagram::Bonded { packet: p, .. })) => {
                    l.push(p)
                }
                _ => self.drop_unsent(0, DropReason::Malformed, 1),
            }
        }
        let mut batch = PacketBatch::new();
        let mut scratch = Routed::default();
        let mut infos = Vec::with_capacity(crate::io::batch::BATCH_PACKETS);
        for (lane, packets) in by_lane.iter().enumerate() {
            for chunk in packets.chunks(crate::io::batch::BATCH_PACKETS) {
                batch.clear();
                infos.clear();
                for p in chunk {
                    batch.slot(p.len())[..p.len()].copy_from_slice(p);
                    batch.commit(p.len());
                    infos.push(PacketInfo::parse(p));
                }
                let which: Vec<usize> = (0..batch.len()).collect();
                self.send_batch(lane, &mut batch, &which, &infos, &mut scratch);
            }
        }
    }

    fn log_transition(&self, t: &Transition) {
        let name = self.path_name(t.path);
        let to = t.to.map_or("disconnected", PathState::as_str);
        let from = t.from.map_or("disconnected", PathState::as_str);
        if t.to == Some(PathState::Down) {
            warn!(tunnel = %self.peer, path = %name, from, to, "path state");
        } else {
            info!(tunnel = %self.peer, path = %name, from, to, "path state");
        }
    }

    pub fn status(&self, address: Option<String>) -> TunnelStatus {
        let now = Instant::now();
        let wall = wall_clock();
        let s = self.lock();
        let router = s.core.router();
        let paths = router
            .paths()
            .iter()
            .map(|(id, p)| {
                let link = s.link(id);
                let mut ps = PathStatus {
                    name: p.spec.name.clone(),
                    // A removed path stays listed: its counters are part of the totals.
                    state: match p.retired {
                        true => "removed",
                        false => p.state().map_or("disconnected", PathState::as_str),
                    }
                    .into(),
                    priority: p.spec.priority,
                    weight: p.spec.weight,
                    role: p.role().as_str().into(),
                    rate_limit_mbit: p.spec.rate_limit.map(|r| r as f64 / 1e6),
                    budget: s.core.meter(id).map(|m| budget_status(m, wall)),
                    tx_bytes: p.counters.tx_bytes,
                    tx_packets: p.counters.tx_packets,
                    rx_bytes: p.counters.rx_bytes,
                    rx_packets: p.counters.rx_packets,
                    handed_over_packets: p.counters.handed_over,
                    flows: (router.lanes().iter())
                        .map(|l| l.bond().flows_on(id) as u64)
                        .sum(),
                    connects: p.connects,
                    drops: p
                        .drops
                        .iter()
                        .map(|(r, n)| (r.as_str().to_string(), n))
                        .collect(),
                    ..Default::default()
                };
                if let Some(h) = &p.health {
                    // Sampled while the path is connected (its probes keep the timers going).
                    ps.tx_mbit = p.throughput.tx_bps as f64 / 1e6;
                    ps.rx_mbit = p.throughput.rx_bps as f64 / 1e6;
                    ps.state_for_s = now.saturating_duration_since(h.since()).as_secs_f64();
                    ps.srtt_ms = h.srtt().map(ms);
                    ps.min_rtt_ms = h.min_rtt().map(ms);
                    ps.probe_loss_pct = h.loss() * 100.0;
                    ps.probe_interval_ms = Some(ms(h.probe_interval()));
                }
                if let (Some(f), true) = (s.core.fec(id), s.core.fec_mode() != FecMode::Off) {
                    fec_status(&mut ps, f);
                }
                ps.ack_silences = s.core.ack_watch(id).map_or(0, |w| w.silences);
                if let Some(r) = s.core.recovery(id) {
                    ps.carry = Some(r.carry().as_str().into());
                    ps.carry_why = Some(r.why().as_str().into());
                    ps.recovery_loss_pct = Some(r.loss() * 100.0);
                    ps.to_stream = r.to_stream;
                    ps.stream_s = r.stream_time(now).as_secs_f64();
                }
                if let Some(size) = s.core.size(id) {
                    ps.too_big_sent = size.too_big_sent;
                    if let Some(w) = &size.watch {
                        ps.udp_payload_max = Some(u64::from(w.ceiling()));
                        ps.mtu_changes = w.changes;
                    }
                }
                if let Some(l) = link {
                    let st = l.transport.stats();
                    ps.remote = l.transport.remote().to_string();
                    ps.quic_rtt_ms = st.rtt.map(ms);
                    ps.cwnd_bytes = st.cwnd;
                    ps.pacing_mbit = st.pacing_rate.map(|r| r as f64 / 1e6);
                    ps.playout_ms = st.playout.map(ms);
                    ps.quic_sent_packets = st.sent_packets;
                    ps.udp_payload = st.udp_payload.map(u64::from);
                    ps.quic_lost_packets = st.lost_packets;
                    ps.pipes = l.transport.pipes();
                    ps.transport = l.transport.kind().into();
                    if st.sent_packets > 0 {
                        ps.quic_loss_pct = st.lost_packets as f64 * 100.0 / st.sent_packets as f64;
                    }
                }
                ps
            })
            .collect();
        let drops_of = |l: &mpquic_core::bond::router::Lane| -> BTreeMap<String, u64> {
            (l.bond().drops.iter())
                .map(|(r, n)| (r.as_str().to_string(), n))
                .collect()
        };
        let classes = self
            .lanes
            .iter()
            .zip(router.lanes())
            .filter_map(|(l, core)| {
                Some(ClassStatus {
                    name: l.name.clone()?,
                    policy: core.bond().policy().as_str().into(),
                    mode: l.mode.as_str().into(),
                    fec: s.core.protects(l.send.rank.into()),
                    // The shell that classifies fills these in.
                    classified_packets: 0,
                    unmatched_packets: 0,
                    tx_packets: core.counters.tx_packets,
                    tx_bytes: core.counters.tx_bytes,
                    rx_packets: core.counters.rx_packets,
                    rx_bytes: core.counters.rx_bytes,
                    drops: drops_of(core),
                    reorder: reorder_status(core.reseq()),
                })
            })
            .collect();
        TunnelStatus {
            peer: self.peer.clone(),
            classes,
            address,
            // The shell knows it (a dual-stack tunnel).
            address6: None,
            congestion: self.congestion(),
            lans: (s.core.expect_src().into_iter())
                .flat_map(|e| &e.lans)
                .map(Prefix::to_string)
                .collect(),
            policy: router.bond().policy().as_str().into(),
            mode: self.mode.as_str().into(),
            // The shell knows it (what the other end speaks).
            protocol: String::new(),
            fec: s.core.fec_mode().to_string(),
            paths,
            // The lanes' together (each class's in `classes`).
            drops: merge(router.lanes().iter().map(drops_of)),
            reorder: merge(router.lanes().iter().map(|l| reorder_status(l.reseq()))),
        }
    }
}

/// Counters of several lanes as one: summed, but for the wait in force for a missing packet
/// (the same for every lane), of which the largest is kept.
fn merge(maps: impl Iterator<Item = BTreeMap<String, u64>>) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for m in maps {
        for (k, v) in m {
            let gauge = k == "wait_ms";
            let e = out.entry(k).or_insert(0);
            *e = if gauge { (*e).max(v) } else { *e + v };
        }
    }
    out
}

/// The resequencer's counters for status (`TunnelStatus::reorder`), with what it holds now
/// and the wait in force for a missing packet (gauges).
fn reorder_status(r: &mpquic_core::reorder::reseq::Resequencer) -> BTreeMap<String, u64> {
    let c = r.counters;
    [
        ("held", c.held),
        ("skipped", c.skipped),
        ("timeouts", c.timeouts),
        ("late", c.late),
        ("duplicates", c.duplicates),
        ("holding", r.holding() as u64),
        ("wait_ms", r.max_wait().as_millis() as u64),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A path's FEC figures (encoder: what we send; decoder: what we receive).
fn fec_status(ps: &mut PathStatus, f: &PathFec) {
    let (e, d) = (&f.enc.counters, &f.dec.counters);
    ps.fec_parity = Some(f.enc.parity() as f64);
    ps.fec_loss_pct = Some(f.enc.loss() * 100.0);
    ps.fec_overhead_pct = Some(e.overhead() * 100.0);
    ps.fec_protected_packets = e.protected_packets;
    ps.fec_repair_sent = e.repair_sent;
    ps.fec_repair_refused = e.repair_refused;
    ps.fec_repair_received = d.repair_received;
    ps.fec_recovered = d.recovered;
    ps.fec_unrecoverable_groups = d.unrecoverable_groups;
    ps.fec_unrecovered_packets = d.unrecovered_packets;
    ps.fec_duplicates = f.dec.duplicates;
    ps.fec_inconsistent = d.inconsistent;
}

/// ICMP "too big" for packet `i` of `batch`, which a transport refused: it carries datagrams of
/// `max_datagram` bytes, this packet's header included.
fn too_big_reply(batch: &PacketBatch, i: usize, max_datagram: usize) -> Option<Vec<u8>> {
    let mtu = max_datagram.checked_sub(batch.header_len(i))?;
    mpquic_core::packet::icmp::too_big(batch.packet(i), u16::try_from(mtu).ok()?)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A TUN batch's packets shared among tunnels and their lanes: a server's client sessions, a
/// client's (or a session's) traffic classes. Every share is routed and has its headers written
/// before any is sent (a transport that takes packets shares the batch, and no header can be
/// written after that), and the shares go out highest class first, so a critical packet
/// reaches its path's queue before the bulk read with it. Owned by a TUN reader and reused for
/// every batch.
#[derive(Default)]
pub struct Shares {
    groups: Vec<Share>,
}

struct Share {
    tunnel: Arc<Tunnel>,
    lane: usize,
    picks: Vec<usize>,
    routed: Routed,
}

impl Shares {
    /// Packet `i` of the batch goes through `tunnel`, in its lane `lane`.
    pub fn add(&mut self, tunnel: &Arc<Tunnel>, lane: usize, i: usize) {
        let same = |g: &&mut Share| g.lane == lane && Arc::ptr_eq(&g.tunnel, tunnel);
        match self.groups.iter_mut().find(same) {
            Some(g) => g.picks.push(i),
            None => self.groups.push(Share {
                tunnel: tunnel.clone(),
                lane,
                picks: vec![i],
                routed: Routed::default(),
            }),
        }
    }

    /// Route and send every share of `batch`, then start over for the next batch.
    pub fn send(&mut self, batch: &mut PacketBatch, infos: &[Option<PacketInfo>]) {
        self.groups.sort_by_key(|g| g.lane);
        for g in &mut self.groups {
            if !g.picks.is_empty() {
                (g.tunnel).route_batch(g.lane, batch, &g.picks, infos, &mut g.routed);
            }
        }
        for g in &mut self.groups {
            if !g.picks.is_empty() {
                g.tunnel.send_routed(batch, &mut g.routed);
            }
        }
        // Forget tunnels that took nothing this time (ended ones go with them).
        self.groups.retain(|g| !g.picks.is_empty());
        for g in &mut self.groups {
            g.picks.clear();
        }
    }
}

/// A batch's routing: the core's picks per path and the transports they go to. Owned by a
/// TUN reader and reused for every batch (`Tunnel::send_batch`).
#[derive(Default)]
pub struct Routed {
    routing: Routing,
    /// The lane the batch's packets are in.
    lane: usize,
    /// By `PathId::index()`: the transport of each path this batch uses.
    to: Vec<Option<Arc<dyn PathTransport>>>,
    /// Packets a transport refused: (path, packet, reason).
    refused: Vec<(PathId, usize, DropReason)>,
    /// Per-packet policies: the paths' loads read before routing, and the transports they are
    /// read from (kept from batch to batch: no allocation per batch).
    loads: Vec<(PathId, mpquic_core::PathLoad)>,
    links: Vec<(PathId, Arc<dyn PathTransport>)>,
}

/// Send FEC repair packets as datagrams; returns how many the transport refused (a full
/// buffer: repair never evicts data).
fn send_repairs(t: &dyn PathTransport, repairs: &[Vec<u8>]) -> u64 {
    repairs
        .iter()
        .filter(|r| t.send_control(r).is_err())
        .count() as u64
}

impl Routed {
    fn clear(&mut self) {
        self.to.iter_mut().for_each(|t| *t = None);
        self.refused.clear();
    }

    fn transport(&self, path: PathId) -> Option<&Arc<dyn PathTransport>> {
        self.to.get(path.index()).and_then(Option::as_ref)
    }
}

/// What the transport of one path (one connection generation) delivers to its tunnel.
struct LinkSink {
    tunnel: Arc<Tunnel>,
    path: PathId,
    generation: u64,
    /// Probes are answered on the transport they came on. Weak: the transport's tasks hold
    /// this sink, and a strong reference back would keep every replaced connection (its
    /// socket, queues and tasks) alive for good.
    transport: Weak<dyn PathTransport>,
}

impl Sink for LinkSink {
    fn on_datagram(&self, d: &[u8]) {
        self.tunnel.on_datagram(self.path, &self.transport, d);
    }

    fn on_batch_end(&self) {
        self.tunnel.flush_tun();
    }

    fn on_stream_packet(&self, pkt: Option<&[u8]>) {
        self.tunnel.on_stream_packet(self.path, pkt);
    }

    fn on_send_dropped(&self, reason: DropReason, packets: u64, bytes: u64) {
        self.tunnel
            .lock()
            .core
            .router_mut()
            .drop_tx_batch(self.path, packets, bytes, reason);
    }

    fn on_received_dropped(&self, reason: DropReason) {
        (self.tunnel.lock().core.router_mut()).drop_on(self.path, reason, 1);
    }

    fn on_closed(&self, peer_code: Option<u32>) {
        let prober = self.tunnel.watches_mtu();
        match peer_code {
            // The client took the path out of its configuration: so does the server's view
            // (the side that does not probe).
            Some(close::REMOVED) if !prober => self.tunnel.retire(self.path, Some(self.generation)),
            Some(close::LEAVING) => {
                self.tunnel.peer_leaving.store(true, Ordering::Relaxed);
                self.tunnel.remove(self.path, self.generation);
            }
            _ => self.tunnel.remove(self.path, self.generation),
        }
    }
}

/// The core's receive side as the shell carries it out: inner packets to the TUN device's
/// outbox (written at the end of the wake-up, `flush_tun`), replies on the connection the
/// datagram came on. Used under the tunnel's lock, so it never takes it.
struct Rx<'a> {
    tunnel: &'a Tunnel,
    reply_to: Option<&'a Weak<dyn PathTransport>>,
}

impl Deliver for Rx<'_> {
    fn deliver(
        &mut self,
        lane: usize,
        _path: PathId,
        packet: &[u8],
        info: Option<&PacketInfo>,
    ) -> Option<(DropReason, u64)> {
        // The core delivers only in lanes the tunnel has.
        let Some(l) = self.tunnel.lanes.get(lane) else {
            return Some((DropReason::Malformed, 1));
        };
        // Server: each packet from the client marks its flow's answers with its class.
        if let Some(marks) = &self.tunnel.marks {
            let parsed;
            let info = match info {
                Some(i) => Some(i),
                None => {
                    parsed = PacketInfo::parse(packet);
                    parsed.as_ref()
                }
            };
            if let Some(info) = info {
                marks.lock().unwrap_or_else(|e| e.into_inner()).mark(
                    info.reply_hash(),
                    l.send.rank,
                    Instant::now(),
                );
            }
        }
        self.tunnel.refusal(l.tun.queue(packet))
    }

    fn answer(&mut self, msg: &[u8]) {
        if let Some(t) = self.reply_to.and_then(Weak::upgrade) {
            let _ = t.send_control(msg);
        }
    }
}

/// Seconds since the epoch, UTC, for the data budgets' calendar (a budget resets on calendar
/// days). A clock before 1970 reads as 0.
fn wall_clock() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use TransportMode::{Auto, Datagram, Reliable};

    /// The connections carry every class: a stream when one class needs it, the path's loss
    /// deciding when one class adapts; each class then travels as it asked.
    #[test]
    fn the_connections_carry_every_class_as_it_asked() {
        assert_eq!(Carriage::connection_mode([Datagram]), Datagram);
        assert_eq!(Carriage::connection_mode([Datagram, Reliable]), Reliable);
        assert_eq!(Carriage::connection_mode([Reliable, Auto, Datagram]), Auto);
        for (mode, conn, carry) in [
            (Datagram, Datagram, LaneCarry::Path),
            (Datagram, Auto, LaneCarry::Datagram),
            (Datagram, Reliable, LaneCarry::Datagram),
            (Reliable, Auto, LaneCarry::Stream),
            (Reliable, Reliable, LaneCarry::Path),
            (Auto, Auto, LaneCarry::Path),
        ] {
            assert_eq!(lane_carry(mode, conn), carry, "{mode:?} on {conn:?}");
        }
    }
}
