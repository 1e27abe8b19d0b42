//! One tunnel's data path, shared by the client and by each client session on the server: the
//! sans-IO `Router` (paths, health, the bond's scheduler) plus the transport of each path
//! (`transport.rs`; the tunnel never sees QUIC).
//! It sends inner packets on the path the bond picks, receives from every path into the TUN
//! device, answers and sends probes, runs the core's timers, and counts every packet it does not
//! deliver.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use mpquic_core::classify::{FlowClasses, Prefix};
use mpquic_core::fec::{self, FecMode};
use mpquic_core::pmtu::{PathMtu, Resize};
use mpquic_core::reseq::Verdict;
use mpquic_core::wire::{self, Datagram};
use mpquic_core::{
    DropReason, HealthConfig, HealthMode, PacketInfo, PathId, PathSpec, PathState, Policy,
    ProbeDue, Router, Transition,
};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::batch::PacketBatch;
use crate::config::TransportMode;
use crate::status::{PathStatus, TunnelStatus};
use crate::transport::{PathTransport, Sink};
use crate::tun::Tun;

/// QUIC application error codes used when closing a connection.
pub mod close {
    pub const SHUTDOWN: u32 = 0;
    pub const REPLACED: u32 = 1;
    pub const REFUSED: u32 = 2;
    pub const PROTOCOL: u32 = 3;
    /// Reliable mode: the path went down and its recent packets were sent on another path.
    pub const PATH_DOWN: u32 = 4;
    /// The path was taken out of the client's configuration (a reload): the server retires it.
    pub const REMOVED: u32 = 5;
    /// The server's rules for the client changed (a reload): it rejoins under the new ones.
    pub const RULES_CHANGED: u32 = 6;
}

/// How long a replaced connection stays open to drain what is already in flight on it.
const REPLACE_GRACE: Duration = Duration::from_millis(250);
/// A live transport carrying one path.
struct Link {
    transport: Arc<dyn PathTransport>,
    generation: u64,
}

struct State {
    router: Router,
    /// The live connection of each path, by `PathId::index()`.
    links: Vec<Option<Link>>,
    /// Each path's FEC state, by `PathId::index()` (kept across reconnections: its counters
    /// are the path's, and group numbers simply continue).
    fec: Vec<PathFec>,
    /// Each path's packet size: the MTU watch (prober side) and what was done about packets
    /// too big for it, by `PathId::index()` (kept across reconnections).
    sizes: Vec<PathSize>,
    next_generation: u64,
}

/// A path's packet size (`pmtu.rs`): watched by the side that probes, acted on by its shell
/// (`take_resize`: reconnect with smaller packets).
#[derive(Default)]
struct PathSize {
    watch: Option<PathMtu>,
    pending: Option<Resize>,
    too_big_sent: u64,
}

/// Repair packets of FEC groups closed by their timer, for one path's transport.
type DueRepairs = (PathId, Arc<dyn PathTransport>, Vec<Vec<u8>>);

/// FEC on one path: what we send (encoder) and what we receive (decoder).
struct PathFec {
    enc: fec::Encoder,
    dec: fec::Decoder,
}

impl State {
    fn link(&self, path: PathId) -> Option<&Link> {
        self.links.get(path.index()).and_then(Option::as_ref)
    }
}

/// The traffic class a tunnel carries: one of a client's `classes:` (each has its own tunnel:
/// bond, connections, controllers), or on the server that class of a client's session.
pub struct ClassTag {
    pub name: String,
    /// Priority: 0 is the highest (the order of `classes:`).
    pub rank: u8,
    /// Server: each packet delivered from the client marks its flow's answers as this class
    /// (`classify::FlowClasses`, shared by the session's classes).
    pub marks: Option<Arc<Mutex<FlowClasses>>>,
}

pub struct Tunnel {
    /// Client name on the server, instance name on the client.
    pub peer: String,
    /// The traffic class this tunnel carries; `None` when the instance has no classes.
    pub class: Option<ClassTag>,
    tun: Arc<Tun>,
    mode: TransportMode,
    /// FEC on what this side sends (the client's choice, for both directions).
    fec: FecMode,
    /// Server side: inner packets from the peer must carry this source address.
    expect_src: Option<Sources>,
    /// This side probes its paths (the client): it also watches their MTU.
    watch_mtu: bool,
    /// The policy spreads a flow's packets (numbered for the peer's resequencer): routing
    /// needs each path's load first.
    per_packet: bool,
    state: Mutex<State>,
    /// Wakes the timer task when the core's next deadline may have moved earlier (a path was
    /// connected, a state changed, a packet woke a quiet tunnel), so it can sleep until that
    /// deadline rather than tick.
    timers_changed: Notify,
}

/// How a tunnel carries its packets: the client's choices (for a class, the class's), which the
/// server learns from the hello.
pub struct Carriage {
    pub mode: TransportMode,
    pub policy: Policy,
    pub fec: FecMode,
    pub class: Option<ClassTag>,
}

/// The inner sources a client may send from (server side): its tunnel address, and the site
/// LAN prefixes routed to it (routed LANs).
#[derive(Debug, Clone)]
pub struct Sources {
    pub addr: Ipv4Addr,
    /// A dual-stack tunnel: the client's IPv6 address.
    pub addr6: Option<Ipv6Addr>,
    pub lans: Vec<Prefix>,
}

impl Sources {
    fn allows(&self, src: IpAddr) -> bool {
        src == IpAddr::V4(self.addr)
            || self.addr6.is_some_and(|a| src == IpAddr::V6(a))
            || self.lans.iter().any(|p| p.contains(src))
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
        carriage: Carriage,
    ) -> Arc<Tunnel> {
        let Carriage {
            mode,
            policy,
            fec,
            class,
        } = carriage;
        Arc::new(Tunnel {
            peer,
            class,
            tun,
            mode,
            fec,
            expect_src,
            watch_mtu: health == HealthMode::Probe,
            per_packet: policy.per_packet(),
            state: Mutex::new(State {
                router: Router::new(
                    policy,
                    HealthConfig {
                        mode: health,
                        ..Default::default()
                    },
                ),
                links: Vec::new(),
                fec: Vec::new(),
                sizes: Vec::new(),
                next_generation: 1,
            }),
            timers_changed: Notify::new(),
        })
    }

    /// Send order among tunnels sharing a batch (`Shares`): the class's rank; no class last.
    pub fn rank(&self) -> u8 {
        self.class.as_ref().map_or(u8::MAX, |c| c.rank)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug; keep serving rather than cascade.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of the path called `name`, created if new; its spec is refreshed. `None` when the
    /// tunnel already has `limit` paths (or no room at all) and this one is new.
    pub fn path(&self, spec: PathSpec, limit: usize) -> Option<PathId> {
        let mut s = self.lock();
        let id = s.router.path_within(spec, limit)?;
        if s.links.len() <= id.index() {
            s.links.resize_with(id.index() + 1, || None);
        }
        let fec = self.fec;
        if s.fec.len() <= id.index() {
            s.fec.resize_with(id.index() + 1, || PathFec {
                enc: fec::Encoder::new(fec),
                dec: fec::Decoder::new(),
            });
        }
        if s.sizes.len() <= id.index() {
            s.sizes.resize_with(id.index() + 1, Default::default);
        }
        Some(id)
    }

    pub fn policy(&self) -> Policy {
        self.lock().router.bond().policy()
    }

    /// Schedule by `policy` from now on (a reload; `Bond::set_policy` says which changes
    /// are possible).
    pub fn set_policy(&self, policy: Policy) -> Result<(), String> {
        let mut s = self.lock();
        let before = s.router.bond().policy();
        s.router.set_policy(policy)?;
        drop(s);
        if before != policy {
            info!(tunnel = %self.peer, from = before.as_str(), to = policy.as_str(), "bonding policy changed");
        }
        Ok(())
    }

    /// The id of the path called `name`, if the tunnel has one.
    pub fn path_id(&self, name: &str) -> Option<PathId> {
        self.lock().router.paths().find(name)
    }

    pub fn path_name(&self, path: PathId) -> String {
        self.lock().router.paths().get(path).spec.name.clone()
    }

    /// Put a fresh transport on `path`, replacing any previous one (closed after a short
    /// drain), and start its receive side. Returns the link generation for `remove` (0, and the
    /// transport closed, when the path was retired meanwhile: no generation is 0).
    pub fn install(self: &Arc<Self>, path: PathId, transport: Arc<dyn PathTransport>) -> u64 {
        let now = Instant::now();
        let (generation, old) = {
            let mut s = self.lock();
            if s.router.paths().get(path).retired {
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
            s.router.connected(path, now);
            let st = transport.stats();
            if let (Some(payload), Some(link), true) =
                (st.udp_payload, st.link_payload, self.watch_mtu)
            {
                let size = &mut s.sizes[path.index()];
                size.pending = None;
                match &mut size.watch {
                    Some(w) => w.reset(payload, now),
                    None => size.watch = Some(PathMtu::new(link, payload, now)),
                }
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
            s.router.disconnected(path);
            let name = s.router.paths().get(path).spec.name.clone();
            drop(s);
            self.with_watch(path, PathMtu::on_outage);
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
            s.router.retire(path);
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

    pub fn unusable_for(&self, path: PathId) -> Option<Duration> {
        self.lock().router.unusable_for(path, Instant::now())
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
    /// indexed like the batch), each on the path the policy picks: `route_batch`, then
    /// `send_routed`. `scratch` is the caller's, kept from batch to batch so routing allocates
    /// nothing in the steady state.
    pub fn send_batch(
        &self,
        batch: &mut PacketBatch,
        which: &[usize],
        infos: &[Option<PacketInfo>],
        scratch: &mut Routed,
    ) {
        self.route_batch(batch, which, infos, scratch);
        self.send_routed(batch, scratch);
    }

    /// The first half of `send_batch`: pick each packet's path and write every header (the
    /// bond's numbering, FEC's, the transports' framing) into the batch, recording the picks in
    /// `scratch`. One lock covers the decisions for the whole batch. Nothing is sent, so the
    /// batch stays writable: the server routes one batch for each of its client sessions before
    /// any is sent (a transport that takes packets shares the batch, and no header can be
    /// written after that; later sessions' packets went unnumbered and without FEC).
    pub fn route_batch(
        &self,
        batch: &mut PacketBatch,
        which: &[usize],
        infos: &[Option<PacketInfo>],
        scratch: &mut Routed,
    ) {
        let now = Instant::now();
        scratch.clear();
        if self.per_packet {
            self.refresh_loads(scratch);
        }
        {
            let mut s = self.lock();
            for (path, load) in scratch.loads.drain(..) {
                s.router.set_load(path, load);
            }
            let mut group_opened = false;
            for &i in which {
                let len = batch.packet(i).len();
                let Some(route) = s.router.route(infos[i].as_ref(), len, now) else {
                    continue; // counted as no_path by the bond
                };
                let path = route.path;
                // The bond's numbering goes first, next to the packet.
                if let Some((slot, seq)) = route.seq {
                    batch.push_header(i, &wire::encode_bonded(slot, seq));
                }
                // `redundant`: a copy for the second path, numbered the same (the receiver
                // keeps the first to arrive), as a datagram in that path's own FEC groups.
                if let Some((also, t)) = route
                    .also
                    .and_then(|a| s.link(a).map(|l| (a, l.transport.clone())))
                {
                    let mut copy = batch.headed(i, 0).to_vec();
                    let mut repairs = Vec::new();
                    if self.fec != FecMode::Off {
                        let enc = &mut s.fec[also.index()].enc;
                        group_opened |= enc.deadline().is_none();
                        if let Some(h) = enc.on_data(now, &copy, &mut repairs) {
                            copy.splice(0..0, h);
                        }
                    }
                    let second = |bytes, repair| SecondCopy {
                        path: also,
                        to: t.clone(),
                        bytes,
                        repair,
                    };
                    scratch.copies.push(second(copy, false));
                    for r in repairs {
                        scratch.copies.push(second(r, true));
                    }
                }
                let Some(link) = s.link(path) else {
                    s.router.drop_tx(path, len, DropReason::NoPath);
                    continue;
                };
                let share = scratch.add(path, &link.transport, i);
                // (A batch is writable until a transport takes packets: `route_batch` runs
                // before any send. Should that ever not hold, the packet goes unprotected
                // rather than into a group whose data packet would lack its header.)
                if self.fec != FecMode::Off && batch.headers_writable() {
                    let enc = &mut s.fec[path.index()].enc;
                    let idle = enc.deadline().is_none();
                    if let Some(h) = enc.on_data(now, batch.headed(i, 0), &mut share.repairs) {
                        group_opened |= idle;
                        batch.push_header(i, &h);
                    }
                }
            }
            self.wake_timers_if(s.router.take_woken() || group_opened);
        }
        // Every transport writes its headers before any takes packets (then they are shared).
        for share in scratch.per_path.iter() {
            if let Some((_, t)) = &share.to {
                t.prepare(batch, &share.picks);
            }
        }
    }

    /// The second half of `send_batch`: send what `route_batch` put in `scratch`, outside the
    /// tunnel's lock (grouped per path, so the receive side never waits behind the sends), and
    /// count what the transports refused.
    pub fn send_routed(&self, batch: &mut PacketBatch, scratch: &mut Routed) {
        let mut refused_copies: Vec<(PathId, usize, DropReason, bool)> = Vec::new();
        let Routed {
            per_path,
            refused,
            copies,
            ..
        } = scratch;
        for c in copies.drain(..) {
            if let Err(reason) = c.to.send_control(&c.bytes) {
                refused_copies.push((c.path, c.bytes.len(), reason, c.repair));
            }
        }
        let mut repairs_refused = false;
        for share in per_path.iter_mut() {
            if let Some((path, t)) = &share.to {
                t.send_batch(batch, &share.picks, &mut |i, reason| {
                    refused.push((*path, i, reason))
                });
                share.repairs_refused = send_repairs(&**t, share.repairs.drain(..));
                repairs_refused |= share.repairs_refused > 0;
            }
        }
        if !refused_copies.is_empty() {
            let mut s = self.lock();
            for (path, len, reason, repair) in refused_copies {
                match repair {
                    true => s.fec[path.index()].enc.refused(1),
                    false => s.router.drop_tx(path, len, reason),
                }
            }
        }
        if !refused.is_empty() || repairs_refused {
            let mut too_big = Vec::new();
            let mut s = self.lock();
            for &(path, i, reason) in refused.iter() {
                s.router.drop_tx(path, batch.packet(i).len(), reason);
                if reason == DropReason::Oversized {
                    let limit = per_path[path.index()]
                        .to
                        .as_ref()
                        .and_then(|(_, t)| t.stats().max_datagram);
                    if let Some(reply) = limit.and_then(|l| too_big_reply(batch, i, l)) {
                        s.sizes[path.index()].too_big_sent += 1;
                        too_big.push(reply);
                    }
                }
            }
            for share in per_path.iter() {
                if let (Some((path, _)), n @ 1..) = (&share.to, share.repairs_refused) {
                    s.fec[path.index()].enc.refused(n);
                }
            }
            drop(s);
            // The TUN write forwards the message to the sender; outside the lock.
            for reply in too_big {
                let refused = self.tun.send(&reply);
                self.count_refused(refused);
            }
        }
    }

    /// Each connected path's load as its transport sees it now (`PathLoad`) into
    /// `scratch.loads`, read outside the tunnel's lock (it takes the QUIC connection's).
    fn refresh_loads(&self, scratch: &mut Routed) {
        {
            let s = self.lock();
            let links = s.router.paths().ids();
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
        let mut counted = false;
        self.with_watch(path, |w| {
            counted = w.on_resize_failed(payload, Instant::now());
        });
        self.timers_changed.notify_one();
        counted
    }

    /// `path` could be connected only at the smallest packet size (`pmtu::PathMtu::on_fallback`);
    /// called before the new transport is installed.
    pub fn fell_back(&self, path: PathId) {
        self.with_watch(path, PathMtu::on_fallback);
    }

    /// Apply `f` to `path`'s MTU watch, if this side has one for it.
    fn with_watch(&self, path: PathId, f: impl FnOnce(&mut PathMtu)) {
        if let Some(w) = self
            .lock()
            .sizes
            .get_mut(path.index())
            .and_then(|s| s.watch.as_mut())
        {
            f(w);
        }
    }

    /// A size change the MTU watch decided for `path` (client: reconnect it with packets of
    /// this UDP payload at most), once.
    pub fn take_resize(&self, path: PathId) -> Option<Resize> {
        self.lock()
            .sizes
            .get_mut(path.index())
            .and_then(|s| s.pending.take())
    }

    /// `n` packets dropped before routing (counted on the tunnel, not on a path).
    pub fn drop_unsent(&self, reason: DropReason, n: u64) {
        if n > 0 {
            self.lock().router.drop_unrouted(reason, n);
        }
    }

    /// Deliver a packet received on `path` to the TUN device. The TUN write (which runs the
    /// kernel's forwarding of the packet) happens outside the lock.
    fn deliver(&self, path: PathId, pkt: &[u8]) {
        let marks = self
            .class
            .as_ref()
            .and_then(|c| Some((c.marks.as_ref()?, c.rank)));
        if self.expect_src.is_some() || marks.is_some() {
            let info = PacketInfo::parse(pkt);
            let refused = match (&info, &self.expect_src) {
                (None, _) => Some(DropReason::Malformed),
                (Some(info), Some(expect)) if !expect.allows(info.src) => {
                    debug!(tunnel = %self.peer, src = %info.src, "spoofed inner source dropped");
                    Some(DropReason::SpoofedSource)
                }
                _ => None,
            };
            if let Some(reason) = refused {
                self.lock().router.drop_on(path, reason, 1);
                return;
            }
            if let (Some(info), Some((marks, rank))) = (info, marks) {
                marks.lock().unwrap_or_else(|e| e.into_inner()).mark(
                    info.reply_hash(),
                    rank,
                    Instant::now(),
                );
            }
        }
        // Written at the end of this receive wake-up (`flush_tun`), coalesced with the
        // packets around it; a full outbox is written now.
        let refused = self.tun.queue(pkt);
        let mut s = self.lock();
        s.router.on_received(path, pkt.len(), Instant::now());
        self.wake_timers_if(s.router.take_woken());
        drop(s);
        self.count_refused(refused);
    }

    /// Write what this wake-up delivered to the TUN device (`Sink::on_batch_end`).
    pub fn flush_tun(&self) {
        let refused = self.tun.flush();
        self.count_refused(refused);
    }

    /// Packets the TUN device refused, counted on the tunnel: a coalesced write carries
    /// packets of several paths (and, on a server, of several clients' tunnels).
    fn count_refused(&self, refused: Option<crate::tun::Refused>) {
        let Some(r) = refused else { return };
        let reason = if r.error.raw_os_error() == Some(libc::EAGAIN) {
            DropReason::QueueFull
        } else {
            DropReason::TunRefused
        };
        debug!(tunnel = %self.peer, packets = r.packets, error = %r.error, "TUN write refused");
        self.lock().router.drop_unrouted(reason, r.packets);
    }

    /// An inner packet from `path` as the peer's bond sent it (inside an FEC data packet or a
    /// stream frame): bare, or numbered for the resequencer (`BOND_DATA`).
    fn receive_inner(&self, path: PathId, bytes: &[u8]) {
        match wire::decode(bytes) {
            Some(d @ (Datagram::Packet(_) | Datagram::Bonded { .. })) => {
                self.deliver_inner(path, d)
            }
            _ => self.lock().router.drop_on(path, DropReason::Malformed, 1),
        }
    }

    /// An inner packet, bare or numbered: to the TUN device, or through the resequencer.
    fn deliver_inner(&self, path: PathId, d: Datagram<'_>) {
        match d {
            Datagram::Packet(p) => self.deliver(path, p),
            Datagram::Bonded { slot, seq, packet } => self.deliver_bonded(path, slot, seq, packet),
            // Callers pass inner packets only; anything else is counted, never a panic.
            _ => self.lock().router.drop_on(path, DropReason::Malformed, 1),
        }
    }

    /// A numbered packet: delivered now, held for the ones before it, or dropped as a
    /// duplicate (counted by the resequencer); what it releases goes on behind it.
    fn deliver_bonded(&self, path: PathId, slot: u16, seq: u32, packet: &[u8]) {
        let mut released = Vec::new();
        let verdict = {
            let mut s = self.lock();
            let v = s.router.on_bonded(path, slot, seq, packet, Instant::now());
            while let Some(r) = s.router.released() {
                released.push(r);
            }
            // The first packet held sets a deadline the timer task does not know yet (later
            // ones' deadlines come after it).
            if v == Verdict::Held && s.router.reseq().holding() == 1 {
                self.timers_changed.notify_one();
            }
            v
        };
        if verdict == Verdict::Deliver {
            self.deliver(path, packet);
        }
        for (p, pkt) in released {
            self.deliver(p, &pkt);
        }
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
        let answer = |msg: &[u8]| {
            // Not sent when the buffer is full, like our own probes: never evict data.
            if let Some(t) = transport.upgrade() {
                let _ = t.send_control(msg);
            }
        };
        match wire::decode(d) {
            Some(d @ (Datagram::Packet(_) | Datagram::Bonded { .. })) => {
                self.deliver_inner(path, d)
            }
            Some(Datagram::Probe { seq, view }) => {
                answer(&wire::encode_probe(wire::PROBE_REPLY, seq));
                let t = self
                    .lock()
                    .router
                    .on_peer_probe(path, seq, view.as_ref(), Instant::now());
                if let Some(t) = t {
                    self.on_transition(&t);
                }
            }
            Some(Datagram::ProbeReply(seq)) => {
                let t = self.lock().router.on_probe_reply(path, seq, Instant::now());
                if let Some(t) = t {
                    self.on_transition(&t);
                    // A transition makes a probe due now (it carries the new view to the peer).
                    self.timers_changed.notify_one();
                }
            }
            Some(Datagram::FecData {
                group,
                index,
                packet,
            }) => {
                let mut recovered = Vec::new();
                let fresh = self.lock().fec.get_mut(path.index()).is_some_and(|f| {
                    f.dec
                        .on_data(Instant::now(), group, index, packet, &mut recovered)
                });
                if fresh {
                    self.receive_inner(path, packet);
                }
                for p in recovered {
                    self.receive_inner(path, &p);
                }
            }
            Some(Datagram::MtuProbe { seq, len }) => {
                // Answered at the same size, so the probe tests the way back too; a reply
                // too big for this side's packets is not sent, as a smaller MTU would do.
                answer(&wire::encode_mtu_probe(wire::MTU_PROBE_REPLY, seq, len));
            }
            Some(Datagram::MtuProbeReply(seq)) => self.with_watch(path, |w| w.on_reply(seq)),
            Some(Datagram::FecRepair(r)) => {
                let mut recovered = Vec::new();
                if let Some(f) = self.lock().fec.get_mut(path.index()) {
                    f.dec.on_repair(Instant::now(), &r, &mut recovered);
                }
                for p in recovered {
                    self.receive_inner(path, &p);
                }
            }
            None => self.lock().router.drop_on(path, DropReason::Malformed, 1),
        }
    }

    /// Advance health: send due probes, log transitions. Returns when the core next has work
    /// (`None`: no connected path, nothing to do until one is installed).
    fn tick(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut probes: Vec<ProbeDue> = Vec::new();
        let mut changes: Vec<Transition> = Vec::new();
        let mut repairs: Vec<DueRepairs> = Vec::new();
        let mut mtu_probes: Vec<(Arc<dyn PathTransport>, Vec<u8>)> = Vec::new();
        let mut released = Vec::new();
        let (due, next): (Vec<(ProbeDue, Arc<dyn PathTransport>)>, _) = {
            let mut s = self.lock();
            s.router.poll(now, &mut probes, &mut changes);
            while let Some(r) = s.router.released() {
                released.push(r);
            }
            let due = probes
                .iter()
                .filter_map(|p| s.link(p.path).map(|l| (*p, l.transport.clone())))
                .collect();
            let mut next = s.router.next_deadline();
            if self.fec != FecMode::Off {
                self.poll_fec(&mut s, now, &mut repairs);
                let fec_next = s.fec.iter().filter_map(|f| f.enc.deadline()).min();
                next = next.into_iter().chain(fec_next).min();
            }
            if self.watch_mtu {
                let mtu_next = self.poll_mtu(&mut s, now, &mut mtu_probes);
                next = next.into_iter().chain(mtu_next).min();
            }
            (due, next)
        };
        // Packets whose wait for the ones before them ran out.
        if !released.is_empty() {
            for (path, pkt) in released {
                self.deliver(path, &pkt);
            }
            self.flush_tun();
        }
        for (transport, probe) in mtu_probes {
            // Refused when the datagram buffer is full: then it is lost, as it should be.
            let _ = transport.send_control(&probe);
        }
        for (path, transport, r) in repairs {
            let n = send_repairs(&*transport, r.into_iter());
            if n > 0 {
                self.lock().fec[path.index()].enc.refused(n);
            }
        }
        for (p, transport) in due {
            let path = p.path;
            // A probe that finds the datagram buffer full is not sent (it would evict data);
            // health counts it as unanswered, which is what a full buffer means.
            if transport
                .send_control(&wire::encode_probe_view(p.seq, &p.view))
                .is_err()
            {
                debug!(tunnel = %self.peer, path = %self.path_name(path), "probe not sent: datagram buffer full");
            }
        }
        for t in &changes {
            self.on_transition(t);
        }
        next
    }

    /// FEC's timers: close groups that waited long enough (their repairs into `repairs`), feed
    /// each encoder its path's loss counters, let decoders forget old groups.
    fn poll_fec(&self, s: &mut State, now: Instant, repairs: &mut Vec<DueRepairs>) {
        let State {
            links, fec, router, ..
        } = s;
        for id in router.paths().ids() {
            let (Some(f), link) = (fec.get_mut(id.index()), links.get(id.index())) else {
                continue;
            };
            f.dec.expire(now);
            let Some(link) = link.and_then(Option::as_ref) else {
                continue;
            };
            let st = link.transport.stats();
            let probe_loss = router
                .paths()
                .get(id)
                .health
                .as_ref()
                .map_or(0.0, |h| h.loss());
            f.enc
                .on_counters(now, st.sent_packets, st.lost_packets, probe_loss);
            let mut out = Vec::new();
            f.enc.poll(now, &mut out);
            if !out.is_empty() {
                repairs.push((id, link.transport.clone(), out));
            }
        }
    }

    /// The MTU watch of every connected path: padded probes due into `probes`, verdicts kept
    /// for the shell (`take_resize`). Returns the watches' next deadline.
    fn poll_mtu(
        &self,
        s: &mut State,
        now: Instant,
        probes: &mut Vec<(Arc<dyn PathTransport>, Vec<u8>)>,
    ) -> Option<Instant> {
        let State {
            links,
            sizes,
            router,
            ..
        } = s;
        let mut next: Option<Instant> = None;
        let mut out = Vec::new();
        for id in router.paths().ids() {
            let (Some(size), Some(link)) = (
                sizes.get_mut(id.index()),
                links.get(id.index()).and_then(Option::as_ref),
            ) else {
                continue;
            };
            let Some(watch) = size.watch.as_mut() else {
                continue;
            };
            let path = router.paths().get(id);
            let srtt = path.health.as_ref().and_then(|h| h.srtt());
            let up = path.state() == Some(PathState::Up);
            let quiet = router.paths().is_quiet();
            let st = link.transport.stats();
            // What a datagram costs on the wire beyond its bytes (QUIC header, frame, tag).
            let overhead = match (st.udp_payload, st.max_datagram) {
                (Some(p), Some(m)) => usize::from(p).saturating_sub(m),
                _ => continue,
            };
            out.clear();
            if let Some(v) = watch.poll(now, up, quiet, srtt, &mut out) {
                let name = &path.spec.name;
                if v.recheck {
                    info!(tunnel = %self.peer, path = %name, payload = v.payload,
                          "path MTU: trying larger packets");
                } else {
                    warn!(tunnel = %self.peer, path = %name, was = watch.current(), payload = v.payload,
                          "path MTU fell (full-size packets lost, small ones answered): reconnecting with smaller packets");
                }
                size.pending = Some(v);
            }
            for p in &out {
                let len = usize::from(p.size).saturating_sub(overhead);
                probes.push((
                    link.transport.clone(),
                    wire::encode_mtu_probe(wire::MTU_PROBE, p.seq, len),
                ));
            }
            next = next
                .into_iter()
                .chain(watch.next_deadline(srtt, quiet))
                .min();
        }
        next
    }

    /// Serve the core's timers for the tunnel's life: sleep until its next deadline, or until a
    /// path is installed (which may bring the deadline forward). No fixed tick.
    pub async fn run_timers(&self) {
        loop {
            let next = self.tick();
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
        // Whatever the path's MTU watch waits for fails now for the outage alone.
        self.with_watch(t.path, PathMtu::on_outage);
        let now = Instant::now();
        let handover = {
            let s = self.lock();
            s.link(t.path).and_then(|l| {
                let since = s.router.hand_over_since(t.path, now)?;
                Some((l.transport.clone(), since))
            })
        };
        let Some((transport, since)) = handover else {
            return;
        };
        let packets = transport.abandon(since);
        self.lock().router.handed_over(t.path, packets.len() as u64);
        info!(tunnel = %self.peer, path = %self.path_name(t.path), resent = packets.len(),
              "path down: connection closed, its recent packets sent again on the live paths");
        self.resend(&packets);
    }

    /// Send packets again (a dead path's, `on_transition`), routed like new ones.
    fn resend(&self, packets: &[bytes::Bytes]) {
        let mut batch = PacketBatch::new();
        let mut scratch = Routed::default();
        let mut infos = Vec::with_capacity(crate::batch::BATCH_PACKETS);
        for chunk in packets.chunks(crate::batch::BATCH_PACKETS) {
            batch.clear();
            infos.clear();
            for frame in chunk {
                // The frame as the dead path carried it: a per-packet policy's numbering goes
                // (the packet is numbered again where it goes now; sent with it, the receiver
                // took the old header for the packet: `malformed` on the live path).
                let p = match wire::decode(frame) {
                    Some(Datagram::Packet(p)) => p,
                    Some(Datagram::Bonded { packet, .. }) => packet,
                    _ => {
                        self.drop_unsent(DropReason::Malformed, 1);
                        continue;
                    }
                };
                batch.slot(p.len())[..p.len()].copy_from_slice(p);
                batch.commit(p.len());
                infos.push(PacketInfo::parse(p));
            }
            let which: Vec<usize> = (0..batch.len()).collect();
            self.send_batch(&mut batch, &which, &infos, &mut scratch);
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
        let s = self.lock();
        let paths = s
            .router
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
                    tx_bytes: p.counters.tx_bytes,
                    tx_packets: p.counters.tx_packets,
                    rx_bytes: p.counters.rx_bytes,
                    rx_packets: p.counters.rx_packets,
                    handed_over_packets: p.counters.handed_over,
                    flows: s.router.bond().flows_on(id) as u64,
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
                if let (Some(f), true) = (s.fec.get(id.index()), self.fec != FecMode::Off) {
                    fec_status(&mut ps, f);
                }
                if let Some(size) = s.sizes.get(id.index()) {
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
        TunnelStatus {
            peer: self.peer.clone(),
            class: self.class.as_ref().map(|c| c.name.clone()),
            // The shell that classifies fills these in.
            classified_packets: 0,
            unmatched_packets: 0,
            address,
            // The shell knows it (a dual-stack tunnel).
            address6: None,
            lans: (self.expect_src.iter())
                .flat_map(|e| &e.lans)
                .map(Prefix::to_string)
                .collect(),
            policy: s.router.bond().policy().as_str().into(),
            mode: self.mode.as_str().into(),
            fec: self.fec.to_string(),
            paths,
            drops: s
                .router
                .bond()
                .drops
                .iter()
                .map(|(r, n)| (r.as_str().to_string(), n))
                .collect(),
            reorder: reorder_status(s.router.reseq()),
        }
    }
}

/// The resequencer's counters for status (`TunnelStatus::reorder`).
fn reorder_status(r: &mpquic_core::reseq::Resequencer) -> std::collections::BTreeMap<String, u64> {
    let c = r.counters;
    [
        ("held", c.held),
        ("skipped", c.skipped),
        ("timeouts", c.timeouts),
        ("late", c.late),
        ("duplicates", c.duplicates),
        ("holding", r.holding() as u64),
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
    mpquic_core::icmp::too_big(batch.packet(i), u16::try_from(mtu).ok()?)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A TUN batch's packets shared among tunnels: a server's client sessions, a client's (or a
/// session's) traffic classes. Every tunnel routes its share and writes its headers before any
/// sends (a transport that takes packets shares the batch, and no header can be written after
/// that), and the shares go out highest class first, so a critical packet reaches its
/// transport before the bulk read with it. Owned by a TUN reader and reused for every batch.
#[derive(Default)]
pub struct Shares {
    groups: Vec<(Arc<Tunnel>, Vec<usize>, Routed)>,
}

impl Shares {
    /// Packet `i` of the batch goes through `tunnel`.
    pub fn add(&mut self, tunnel: &Arc<Tunnel>, i: usize) {
        match self
            .groups
            .iter_mut()
            .find(|(t, ..)| Arc::ptr_eq(t, tunnel))
        {
            Some((_, picks, _)) => picks.push(i),
            None => self
                .groups
                .push((tunnel.clone(), vec![i], Routed::default())),
        }
    }

    /// Route and send every share of `batch`, then start over for the next batch.
    pub fn send(&mut self, batch: &mut PacketBatch, infos: &[Option<PacketInfo>]) {
        self.groups.sort_by_key(|(t, ..)| t.rank());
        for (t, picks, routed) in &mut self.groups {
            if !picks.is_empty() {
                t.route_batch(batch, picks, infos, routed);
            }
        }
        for (t, picks, routed) in &mut self.groups {
            if !picks.is_empty() {
                t.send_routed(batch, routed);
            }
        }
        // Forget tunnels that took nothing this time (ended ones go with them).
        self.groups.retain(|(_, picks, _)| !picks.is_empty());
        for (_, picks, _) in &mut self.groups {
            picks.clear();
        }
    }
}

/// A batch's routing, per path: the transport and the packets it got. Owned by a TUN reader and
/// reused for every batch (`Tunnel::send_batch`).
#[derive(Default)]
pub struct Routed {
    /// By `PathId::index()`: the path's share of this batch.
    per_path: Vec<PathShare>,
    /// Packets a transport refused: (path, packet, reason).
    refused: Vec<(PathId, usize, DropReason)>,
    /// Per-packet policies: the paths' loads read before routing, and the transports they are
    /// read from (kept from batch to batch: no allocation per batch).
    loads: Vec<(PathId, mpquic_core::PathLoad)>,
    links: Vec<(PathId, Arc<dyn PathTransport>)>,
    /// `redundant`: second copies, and the repair packets of the FEC groups they closed.
    copies: Vec<SecondCopy>,
}

/// A datagram for `redundant`'s second path: a packet's copy, or a repair packet (`repair`) of
/// that path's FEC group it closed.
struct SecondCopy {
    path: PathId,
    to: Arc<dyn PathTransport>,
    bytes: Vec<u8>,
    repair: bool,
}

/// The packets of a batch that go on one path, and that path's transport (`None`: none).
#[derive(Default)]
struct PathShare {
    to: Option<(PathId, Arc<dyn PathTransport>)>,
    picks: Vec<usize>,
    /// FEC repair packets of groups this batch closed on the path, and how many the transport
    /// refused.
    repairs: Vec<Vec<u8>>,
    repairs_refused: u64,
}

/// Send FEC repair packets as datagrams; returns how many the transport refused (a full
/// buffer: repair never evicts data).
fn send_repairs(t: &dyn PathTransport, repairs: impl Iterator<Item = Vec<u8>>) -> u64 {
    repairs.filter(|r| t.send_control(r).is_err()).count() as u64
}

impl Routed {
    fn clear(&mut self) {
        self.copies.clear();
        for share in &mut self.per_path {
            share.to = None;
            share.picks.clear();
            share.repairs.clear();
            share.repairs_refused = 0;
        }
        self.refused.clear();
    }

    fn add(
        &mut self,
        path: PathId,
        transport: &Arc<dyn PathTransport>,
        packet: usize,
    ) -> &mut PathShare {
        if self.per_path.len() <= path.index() {
            self.per_path
                .resize_with(path.index() + 1, Default::default);
        }
        let share = &mut self.per_path[path.index()];
        share.to.get_or_insert_with(|| (path, transport.clone()));
        share.picks.push(packet);
        share
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
        match pkt {
            Some(p) => self.tunnel.receive_inner(self.path, p),
            None => self
                .tunnel
                .lock()
                .router
                .drop_on(self.path, DropReason::Malformed, 1),
        }
    }

    fn on_send_dropped(&self, reason: DropReason, packets: u64, bytes: u64) {
        self.tunnel
            .lock()
            .router
            .drop_tx_batch(self.path, packets, bytes, reason);
    }

    fn on_received_dropped(&self, reason: DropReason) {
        self.tunnel.lock().router.drop_on(self.path, reason, 1);
    }

    fn on_closed(&self, peer_code: Option<u32>) {
        match peer_code {
            // The client took the path out of its configuration: so does the server's view
            // (the side that does not probe, `watch_mtu` false).
            Some(close::REMOVED) if !self.tunnel.watch_mtu => {
                self.tunnel.retire(self.path, Some(self.generation))
            }
            _ => self.tunnel.remove(self.path, self.generation),
        }
    }
}
