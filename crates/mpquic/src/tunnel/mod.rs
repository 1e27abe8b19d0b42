//! One tunnel's I/O shell, shared by the client and by each client session on the server: the
//! sans-IO `TunnelCore` (mpquic-core `tunnel`: router, health, bonds, resequencers, per-path FEC
//! and packet-size watch, receive dispatch) plus the transport of each path (`transport/`;
//! the tunnel never sees QUIC). The shell holds the connections and the lock, hands the core
//! what arrives and the time, and carries out what it says: sends, TUN writes, wake-ups.
//!
//! A tunnel with traffic classes has one lane per class (`Lane`): the classes share the paths
//! (one connection, prober, health and congestion controller each), each lane has its own bond
//! and resequencer in the core, its rank in every path's send queue and its carriage.
//!
//! Here: the tunnel, its paths' connections (install, retire) and settings. Beside it: `send`
//! (a batch routed and handed to the transports), `receive` (what the transports hand up, to
//! the core and the TUN device), `timers` (the core polled, path transitions carried out),
//! `status`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mpquic_core::classify::FlowClasses;
use mpquic_core::fec::FecMode;
use mpquic_core::path::budget::{Budget, Usage};
use mpquic_core::path::pmtu::Resize;
use mpquic_core::path::reconfig::WallClock;
use mpquic_core::tunnel::{LinkStats, TunnelCore};
use mpquic_core::{HealthMode, PathId, PathSpec, Policy};
use tokio::sync::Notify;
use tracing::info;

use crate::config::{Congestion, TransportMode};
use crate::io::tun::Tun;
use crate::transport::{LaneCarry, LaneSend, PathTransport, TunnelBacklog};

mod receive;
mod send;
mod status;
mod timers;

use receive::LinkSink;
pub use send::{Routed, Shares};

pub use crate::transport::close;
pub use mpquic_core::tunnel::Sources;

/// How long a replaced connection stays open to drain what is already in flight on it, at
/// least; on a long path two of its round trips (what is in flight takes one to arrive, and a
/// retransmission of it another).
const REPLACE_GRACE: Duration = Duration::from_millis(250);
/// A live transport carrying one path.
struct Link {
    transport: Arc<dyn PathTransport>,
    generation: u64,
}

pub(super) struct State {
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

/// What a connection tells the core about itself.
pub(super) fn link_stats(t: &dyn PathTransport) -> LinkStats {
    let st = t.stats();
    LinkStats {
        sent_packets: st.sent_packets,
        lost_packets: st.lost_packets,
        spurious_lost: st.reordering.map_or(0, |r| r.spurious),
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
    /// What waits for each of its paths (`Transport::join_tunnel`).
    backlog: TunnelBacklog,
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
            backlog: TunnelBacklog::default(),
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
            .set_budget(path, budget, usage, wall_clock().unix_secs());
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
        let (generation, old, grace) = {
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
            transport.join_tunnel(&self.backlog);
            let rtt = s.core.router().paths().get(path).srtt();
            (
                generation,
                old,
                REPLACE_GRACE.max(2 * rtt.unwrap_or_default()),
            )
        };
        // A new path probes at once.
        self.timers_changed.notify_one();
        if let Some(old) = old {
            // Let the replaced connection drain: datagrams already queued or in flight on it
            // (either way) still arrive and are delivered by its reader; new packets use the
            // new connection. Closing at once would discard them.
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
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

    /// How long `path` has been up (`None`: it is not).
    pub fn up_for(&self, path: PathId) -> Option<Duration> {
        self.lock()
            .core
            .router()
            .paths()
            .up_for(path, Instant::now())
    }

    /// The way `path` stopped delivering while its probes were answered, if it did: its
    /// connection must be replaced (`path/delivery.rs`).
    pub fn stalled(&self, path: PathId) -> Option<mpquic_core::path::delivery::Direction> {
        self.lock().core.router().paths().stalled(path)
    }

    /// The peer's hello asked for counted probe replies (`TunnelCore::peer_reads_counts`).
    pub fn peer_reads_counts(&self) {
        self.lock().core.peer_reads_counts();
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
}

/// The wall clock now, as the core takes it (`TunnelCore::set_wall_clock`): UTC, for the data
/// budgets' calendar (a budget resets on calendar days) and Starlink's reconfigurations. A clock
/// before 1970 reads as 0.
pub(super) fn wall_clock() -> WallClock {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    WallClock::new(Instant::now(), since_epoch)
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
