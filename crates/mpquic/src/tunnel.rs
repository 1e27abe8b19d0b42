//! One tunnel's data path, shared by the client and by each client session on the server: the
//! sans-IO `Bond` plus the QUIC connection of each path. It sends inner packets on the path the
//! bond picks, receives from every path into the TUN device, answers and sends probes, and
//! counts every packet it does not deliver.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use mpquic_core::wire::{self, Datagram};
use mpquic_core::{
    Bond, DropReason, PacketInfo, PathSpec, PathState, Policy, ProbeDue, Transition,
};
use tokio::sync::mpsc;
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
    bond: Bond,
    links: Vec<Option<Link>>,
    next_generation: u64,
}

pub struct Tunnel {
    /// Client name on the server, instance name on the client.
    pub peer: String,
    tun: Arc<Tun>,
    mode: TransportMode,
    /// Server side: inner packets from the peer must carry this source address.
    expect_src: Option<Ipv4Addr>,
    state: Mutex<State>,
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
    ) -> Arc<Tunnel> {
        Arc::new(Tunnel {
            peer,
            tun,
            mode,
            expect_src,
            state: Mutex::new(State {
                bond: Bond::new(policy, Default::default()),
                links: Vec::new(),
                next_generation: 1,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug; keep serving rather than cascade.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The index of the path called `name`, created if new; its spec is refreshed.
    pub fn path(&self, spec: PathSpec) -> usize {
        let mut s = self.lock();
        match s.bond.find(&spec.name) {
            Some(i) => {
                s.bond.set_spec(i, spec);
                i
            }
            None => {
                let i = s.bond.add_path(spec);
                s.links.push(None);
                i
            }
        }
    }

    pub fn path_name(&self, path: usize) -> String {
        self.lock().bond.paths()[path].spec.name.clone()
    }

    /// Put a fresh connection on `path`, replacing (and closing) any previous one, and start its
    /// receive tasks. Returns the link generation for `remove`.
    pub fn install(self: &Arc<Self>, path: usize, new: NewLink) -> u64 {
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
            let old = s.links[path].replace(Link {
                conn: conn.clone(),
                stream_tx,
                generation,
                _endpoint: endpoint,
            });
            s.bond.connected(path, now);
            (generation, old)
        };
        if let Some(old) = old {
            old.conn
                .close(close::REPLACED.into(), b"replaced by a new connection");
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
    pub fn remove(&self, path: usize, generation: u64) {
        let mut s = self.lock();
        if s.links[path]
            .as_ref()
            .is_some_and(|l| l.generation == generation)
        {
            s.links[path] = None;
            s.bond.disconnected(path);
            let name = s.bond.paths()[path].spec.name.clone();
            drop(s);
            info!(tunnel = %self.peer, path = %name, "path disconnected");
        }
    }

    pub fn connected_paths(&self) -> usize {
        self.lock().links.iter().filter(|l| l.is_some()).count()
    }

    pub fn unusable_for(&self, path: usize) -> Option<Duration> {
        self.lock().bond.unusable_for(path, Instant::now())
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
            let Some(path) = s.bond.route(info, pkt.len(), now) else {
                return; // counted as no_path by the bond
            };
            match s.links[path].as_ref() {
                Some(link) => match &link.stream_tx {
                    Some(tx) => (path, Sender::Stream(tx.clone())),
                    None => (path, Sender::Datagram(link.conn.clone())),
                },
                None => {
                    s.bond.drop_tx(path, pkt.len(), DropReason::NoPath);
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
            self.lock().bond.drop_tx(path, pkt.len(), reason);
        }
    }

    /// Deliver a packet received on `path` to the TUN device. The TUN write (which runs the
    /// kernel's forwarding of the packet) happens outside the lock.
    fn deliver(&self, path: usize, pkt: &[u8]) {
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
                self.lock().bond.drop_rx(path, reason);
                return;
            }
        }
        let written = self.tun.send(pkt);
        let mut s = self.lock();
        match written {
            Ok(_) => s.bond.on_received(path, pkt.len()),
            Err(e) => {
                let reason = if e.raw_os_error() == Some(libc::EAGAIN) {
                    DropReason::QueueFull
                } else {
                    DropReason::Malformed // the kernel refused the packet (EINVAL)
                };
                s.bond.drop_rx(path, reason);
            }
        }
    }

    fn on_datagram(&self, path: usize, conn: &quinn::Connection, d: &[u8]) {
        match wire::decode(d) {
            Some(Datagram::Packet(p)) => self.deliver(path, p),
            Some(Datagram::Probe(seq)) => {
                let reply = wire::encode_probe(wire::PROBE_REPLY, seq);
                let _ = conn.send_datagram(Bytes::copy_from_slice(&reply));
            }
            Some(Datagram::ProbeReply(seq)) => {
                let t = self.lock().bond.on_probe_reply(path, seq, Instant::now());
                if let Some(t) = t {
                    self.log_transition(&t);
                }
            }
            None => self.lock().bond.drop_rx(path, DropReason::Malformed),
        }
    }

    /// Reliable mode, receive side: 2-byte big-endian length, then the packet.
    async fn stream_reader(&self, path: usize, mut recv: quinn::RecvStream) {
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
                self.lock().bond.drop_rx(path, DropReason::Malformed);
                continue;
            }
            self.deliver(path, &buf[..n]);
        }
    }

    /// Reliable mode, send side: frames queued packets and writes them in batches.
    async fn stream_writer(
        &self,
        path: usize,
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
                let mut s = self.lock();
                s.bond.path_mut(path).drops.add(DropReason::SendFailed);
                return;
            }
        }
    }

    /// Advance health: send due probes, log transitions.
    pub fn tick(&self) {
        let now = Instant::now();
        let mut probes: Vec<ProbeDue> = Vec::new();
        let mut changes: Vec<Transition> = Vec::new();
        let conns: Vec<(u32, quinn::Connection)> = {
            let mut s = self.lock();
            s.bond.poll(now, &mut probes, &mut changes);
            probes
                .iter()
                .filter_map(|p| s.links[p.path].as_ref().map(|l| (p.seq, l.conn.clone())))
                .collect()
        };
        for (seq, conn) in conns {
            let probe = wire::encode_probe(wire::PROBE, seq);
            let _ = conn.send_datagram(Bytes::copy_from_slice(&probe));
        }
        for t in &changes {
            self.log_transition(t);
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
            .bond
            .paths()
            .iter()
            .zip(s.links.iter())
            .enumerate()
            .map(|(i, (p, link))| {
                let mut ps = PathStatus {
                    name: p.spec.name.clone(),
                    state: p.state().map_or("disconnected", PathState::as_str).into(),
                    priority: p.spec.priority,
                    weight: p.spec.weight,
                    tx_bytes: p.counters.tx_bytes,
                    tx_packets: p.counters.tx_packets,
                    rx_bytes: p.counters.rx_bytes,
                    rx_packets: p.counters.rx_packets,
                    flows: s.bond.flows().flows_on(i) as u64,
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
            policy: s.bond.policy().as_str().into(),
            mode: self.mode.as_str().into(),
            paths,
            drops: s
                .bond
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
/// drop older queued datagrams when its buffer is full.
/// (`send_datagram` itself reports a too-large packet and missing datagram support, so no size
/// check is needed first: each check takes the connection's lock, per packet.)
fn send_datagram(conn: &quinn::Connection, pkt: &[u8]) -> Result<(), DropReason> {
    if conn.datagram_send_buffer_space() < pkt.len() {
        return Err(DropReason::QueueFull);
    }
    conn.send_datagram(Bytes::copy_from_slice(pkt))
        .map_err(|e| match e {
            quinn::SendDatagramError::TooLarge => DropReason::Oversized,
            _ => DropReason::SendFailed,
        })
}
