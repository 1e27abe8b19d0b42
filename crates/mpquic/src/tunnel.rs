//! One tunnel's data path, shared by the client and by each client session on the server: the
//! sans-IO `Router` (paths, health, the bond's scheduler) plus the QUIC connection of each path.
//! It sends inner packets on the path the bond picks, receives from every path into the TUN
//! device, answers and sends probes, runs the core's timers, and counts every packet it does not
//! deliver.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use mpquic_core::wire::{self, Datagram};
use mpquic_core::{
    DropReason, HealthConfig, HealthMode, PacketInfo, PathId, PathSpec, PathState, Policy,
    ProbeDue, Router, Transition,
};
use tokio::sync::{mpsc, Notify};
use tracing::{debug, info, warn};

use crate::config::TransportMode;
use crate::status::{PathStatus, TunnelStatus};
use crate::tun::Tun;

/// QUIC application error codes used when closing a connection.
pub mod close {
    pub const SHUTDOWN: u32 = 0;
    pub const REPLACED: u32 = 1;
    pub const REFUSED: u32 = 2;
    pub const PROTOCOL: u32 = 3;
}

/// Packets a reliable-mode path may queue before new ones are dropped (counted `queue_full`).
const STREAM_QUEUE: usize = 2048;
/// How long a replaced connection stays open to drain what is already in flight on it.
const REPLACE_GRACE: Duration = Duration::from_millis(250);
/// Bytes written to a stream in one call (batching amortises the per-write cost).
const STREAM_BATCH: usize = 64 * 1024;

/// How a packet leaves on a path, taken out of the lock for the send.
enum Sender {
    Datagram(quinn::Connection),
    Stream(mpsc::Sender<Bytes>),
}

/// A live connection carrying one path.
struct Link {
    conn: quinn::Connection,
    /// Reliable mode: the queue into the stream writer task.
    stream_tx: Option<mpsc::Sender<Bytes>>,
    generation: u64,
    /// Kept so the client's per-path socket lives as long as the connection.
    _endpoint: Option<quinn::Endpoint>,
}

struct State {
    router: Router,
    /// The live connection of each path, by `PathId::index()`.
    links: Vec<Option<Link>>,
    next_generation: u64,
}

impl State {
    fn link(&self, path: PathId) -> Option<&Link> {
        self.links.get(path.index()).and_then(Option::as_ref)
    }
}

pub struct Tunnel {
    /// Client name on the server, instance name on the client.
    pub peer: String,
    tun: Arc<Tun>,
    mode: TransportMode,
    /// Server side: inner packets from the peer must carry this source address.
    expect_src: Option<Ipv4Addr>,
    state: Mutex<State>,
    /// Wakes the timer task when the core's next deadline may have moved earlier (a path was
    /// connected), so it can sleep until that deadline rather than tick.
    timers_changed: Notify,
}

/// What a new path connection brings.
pub struct NewLink {
    pub conn: quinn::Connection,
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
    pub endpoint: Option<quinn::Endpoint>,
}

impl Tunnel {
    /// `expect_src`: on the server, the client's tunnel address (packets from any other source
    /// are dropped); `None` on the client.
    pub fn new(
        peer: String,
        tun: Arc<Tun>,
        mode: TransportMode,
        policy: Policy,
        expect_src: Option<Ipv4Addr>,
        health: HealthMode,
    ) -> Arc<Tunnel> {
        Arc::new(Tunnel {
            peer,
            tun,
            mode,
            expect_src,
            state: Mutex::new(State {
                router: Router::new(
                    policy,
                    HealthConfig {
                        mode: health,
                        ..Default::default()
                    },
                ),
                links: Vec::new(),
                next_generation: 1,
            }),
            timers_changed: Notify::new(),
        })
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
        Some(id)
    }

    pub fn path_name(&self, path: PathId) -> String {
        self.lock().router.paths().get(path).spec.name.clone()
    }

    /// Put a fresh connection on `path`, replacing any previous one (closed after a short drain),
    /// and start its receive tasks. Returns the link generation for `remove`.
    pub fn install(self: &Arc<Self>, path: PathId, new: NewLink) -> u64 {
        let NewLink {
            conn,
            send,
            recv,
            endpoint,
        } = new;
        let now = Instant::now();
        let (stream_tx, stream_rx) = match self.mode {
            TransportMode::Reliable => {
                let (tx, rx) = mpsc::channel(STREAM_QUEUE);
                (Some(tx), Some(rx))
            }
            TransportMode::Datagram => (None, None),
        };
        let (generation, old) = {
            let mut s = self.lock();
            let generation = s.next_generation;
            s.next_generation += 1;
            let old = s.links[path.index()].replace(Link {
                conn: conn.clone(),
                stream_tx,
                generation,
                _endpoint: endpoint,
            });
            s.router.connected(path, now);
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
                old.conn
                    .close(close::REPLACED.into(), b"replaced by a new connection");
            });
        }
        info!(tunnel = %self.peer, path = %self.path_name(path), remote = %conn.remote_address(), mode = self.mode.as_str(), "path connected");

        // Datagrams: probes always, inner packets in datagram mode.
        let me = self.clone();
        let c = conn.clone();
        tokio::spawn(async move {
            while let Ok(d) = c.read_datagram().await {
                me.on_datagram(path, &c, &d);
            }
            me.remove(path, generation);
        });
        match stream_rx {
            Some(rx) => {
                let me = self.clone();
                tokio::spawn(async move { me.stream_reader(path, recv).await });
                let me = self.clone();
                tokio::spawn(async move { me.stream_writer(path, send, rx).await });
            }
            None => {
                // Keep the control stream open for the connection's life.
                tokio::spawn(async move {
                    let _keep = (send, recv);
                    conn.closed().await;
                });
            }
        }
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
            info!(tunnel = %self.peer, path = %name, "path disconnected");
        }
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
            l.conn.close(code.into(), reason.as_bytes());
        }
    }

    /// Send one inner packet (already MSS-clamped) on the path the policy picks. The lock only
    /// covers the decision; the send itself runs outside it so the receive side never waits.
    pub fn send_packet(&self, pkt: &[u8], info: Option<&PacketInfo>) {
        let now = Instant::now();
        let (path, sender) = {
            let mut s = self.lock();
            let Some(path) = s.router.route(info, pkt.len(), now) else {
                return; // counted as no_path by the bond
            };
            match s.link(path) {
                Some(link) => match &link.stream_tx {
                    Some(tx) => (path, Sender::Stream(tx.clone())),
                    None => (path, Sender::Datagram(link.conn.clone())),
                },
                None => {
                    s.router.drop_tx(path, pkt.len(), DropReason::NoPath);
                    return;
                }
            }
        };
        let result = match sender {
            Sender::Stream(tx) => tx
                .try_send(Bytes::copy_from_slice(pkt))
                .map_err(|e| match e {
                    mpsc::error::TrySendError::Full(_) => DropReason::QueueFull,
                    mpsc::error::TrySendError::Closed(_) => DropReason::SendFailed,
                }),
            Sender::Datagram(conn) => send_datagram(&conn, pkt),
        };
        if let Err(reason) = result {
            self.lock().router.drop_tx(path, pkt.len(), reason);
        }
    }

    /// Deliver a packet received on `path` to the TUN device. The TUN write (which runs the
    /// kernel's forwarding of the packet) happens outside the lock.
    fn deliver(&self, path: PathId, pkt: &[u8]) {
        if let Some(expect) = self.expect_src {
            let refused = match PacketInfo::parse(pkt) {
                Some(info) if info.src == IpAddr::V4(expect) => None,
                Some(info) => {
                    debug!(tunnel = %self.peer, src = %info.src, "spoofed inner source dropped");
                    Some(DropReason::SpoofedSource)
                }
                None => Some(DropReason::Malformed),
            };
            if let Some(reason) = refused {
                self.lock().router.drop_on(path, reason, 1);
                return;
            }
        }
        let written = self.tun.send(pkt);
        let mut s = self.lock();
        match written {
            Ok(_) => s.router.on_received(path, pkt.len()),
            Err(e) => {
                let reason = if e.raw_os_error() == Some(libc::EAGAIN) {
                    DropReason::QueueFull
                } else {
                    DropReason::TunRefused
                };
                s.router.drop_on(path, reason, 1);
            }
        }
    }

    fn on_datagram(&self, path: PathId, conn: &quinn::Connection, d: &[u8]) {
        match wire::decode(d) {
            Some(Datagram::Packet(p)) => self.deliver(path, p),
            Some(Datagram::Probe { seq, view }) => {
                // Not sent when the buffer is full, like our own probes: never evict data.
                let _ = send_datagram(conn, &wire::encode_probe(wire::PROBE_REPLY, seq));
                let t = self
                    .lock()
                    .router
                    .on_peer_probe(path, seq, view.as_ref(), Instant::now());
                if let Some(t) = t {
                    self.log_transition(&t);
                }
            }
            Some(Datagram::ProbeReply(seq)) => {
                let t = self.lock().router.on_probe_reply(path, seq, Instant::now());
                if let Some(t) = t {
                    self.log_transition(&t);
                    // A transition makes a probe due now (it carries the new view to the peer).
                    self.timers_changed.notify_one();
                }
            }
            None => self.lock().router.drop_on(path, DropReason::Malformed, 1),
        }
    }

    /// Reliable mode, receive side: 2-byte big-endian length, then the packet.
    async fn stream_reader(&self, path: PathId, mut recv: quinn::RecvStream) {
        let mut buf = vec![0u8; 65_536];
        loop {
            let mut len = [0u8; 2];
            if recv.read_exact(&mut len).await.is_err() {
                return;
            }
            let n = usize::from(u16::from_be_bytes(len));
            if recv.read_exact(&mut buf[..n]).await.is_err() {
                return;
            }
            if n == 0 {
                self.lock().router.drop_on(path, DropReason::Malformed, 1);
                continue;
            }
            self.deliver(path, &buf[..n]);
        }
    }

    /// Reliable mode, send side: frames queued packets and writes them in batches.
    async fn stream_writer(
        &self,
        path: PathId,
        mut send: quinn::SendStream,
        mut rx: mpsc::Receiver<Bytes>,
    ) {
        let mut batch = BytesMut::with_capacity(STREAM_BATCH + 65_538);
        while let Some(first) = rx.recv().await {
            batch.clear();
            let frame = |p: &Bytes, b: &mut BytesMut| {
                b.extend_from_slice(&(p.len() as u16).to_be_bytes());
                b.extend_from_slice(p);
            };
            frame(&first, &mut batch);
            while batch.len() < STREAM_BATCH {
                match rx.try_recv() {
                    Ok(p) => frame(&p, &mut batch),
                    Err(_) => break,
                }
            }
            if send.write_all(&batch).await.is_err() {
                // Everything in this batch and everything still queued is lost with the stream;
                // closing the queue makes later packets fail (and count) in `send_packet`.
                rx.close();
                let (mut packets, mut bytes) = frames_in(&batch);
                while let Ok(p) = rx.try_recv() {
                    packets += 1;
                    bytes += p.len() as u64;
                }
                self.lock()
                    .router
                    .drop_tx_batch(path, packets, bytes, DropReason::SendFailed);
                return;
            }
        }
    }

    /// Advance health: send due probes, log transitions. Returns when the core next has work
    /// (`None`: no connected path, nothing to do until one is installed).
    fn tick(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut probes: Vec<ProbeDue> = Vec::new();
        let mut changes: Vec<Transition> = Vec::new();
        let (conns, next): (Vec<(ProbeDue, quinn::Connection)>, _) = {
            let mut s = self.lock();
            s.router.poll(now, &mut probes, &mut changes);
            let conns = probes
                .iter()
                .filter_map(|p| s.link(p.path).map(|l| (*p, l.conn.clone())))
                .collect();
            (conns, s.router.next_deadline())
        };
        for (p, conn) in conns {
            let path = p.path;
            // A probe that finds the datagram buffer full is not sent (it would evict data);
            // health counts it as unanswered, which is what a full buffer means.
            if send_datagram(&conn, &wire::encode_probe_view(p.seq, &p.view)).is_err() {
                debug!(tunnel = %self.peer, path = %self.path_name(path), "probe not sent: datagram buffer full");
            }
        }
        for t in &changes {
            self.log_transition(t);
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
                    state: p.state().map_or("disconnected", PathState::as_str).into(),
                    priority: p.spec.priority,
                    weight: p.spec.weight,
                    tx_bytes: p.counters.tx_bytes,
                    tx_packets: p.counters.tx_packets,
                    rx_bytes: p.counters.rx_bytes,
                    rx_packets: p.counters.rx_packets,
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
                    ps.state_for_s = now.saturating_duration_since(h.since()).as_secs_f64();
                    ps.srtt_ms = h.srtt().map(ms);
                    ps.min_rtt_ms = h.min_rtt().map(ms);
                    ps.probe_loss_pct = h.loss() * 100.0;
                }
                if let Some(l) = link {
                    let st = l.conn.stats();
                    ps.remote = l.conn.remote_address().to_string();
                    ps.quic_rtt_ms = Some(ms(st.path.rtt));
                    ps.cwnd_bytes = Some(st.path.cwnd);
                    ps.quic_sent_packets = st.path.sent_packets;
                    ps.quic_lost_packets = st.path.lost_packets;
                    if st.path.sent_packets > 0 {
                        ps.quic_loss_pct =
                            st.path.lost_packets as f64 * 100.0 / st.path.sent_packets as f64;
                    }
                }
                ps
            })
            .collect();
        TunnelStatus {
            peer: self.peer.clone(),
            address,
            policy: s.router.bond().policy().as_str().into(),
            mode: self.mode.as_str().into(),
            paths,
            drops: s
                .router
                .bond()
                .drops
                .iter()
                .map(|(r, n)| (r.as_str().to_string(), n))
                .collect(),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Send one datagram, refusing (and reporting) rather than letting the QUIC engine silently
/// drop older queued datagrams when its buffer is full. `send_datagram_wait` checks for space
/// and queues under one lock and never evicts; polled once, "would wait" means the buffer is
/// full. (`send_datagram` would make room by discarding queued datagrams uncounted, and a
/// separate space check before it races with the other threads that send.)
fn send_datagram(conn: &quinn::Connection, pkt: &[u8]) -> Result<(), DropReason> {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let fut = std::pin::pin!(conn.send_datagram_wait(Bytes::copy_from_slice(pkt)));
    match fut.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(())) => Ok(()),
        Poll::Ready(Err(quinn::SendDatagramError::TooLarge)) => Err(DropReason::Oversized),
        Poll::Ready(Err(_)) => Err(DropReason::SendFailed),
        Poll::Pending => Err(DropReason::QueueFull),
    }
}

/// Packets and payload bytes in a batch of length-prefixed frames (reliable mode).
fn frames_in(batch: &[u8]) -> (u64, u64) {
    let (mut packets, mut bytes, mut at) = (0, 0, 0);
    while at + 2 <= batch.len() {
        let n = usize::from(u16::from_be_bytes([batch[at], batch[at + 1]]));
        packets += 1;
        bytes += n as u64;
        at += 2 + n;
    }
    (packets, bytes)
}
