//! QUIC as a path transport: one connection per path. Session setup is a TLS 1.3 handshake with
//! client certificates (the identity is the certificate's CN) and the hello on the first
//! bidirectional stream (`hello.rs`); then inner packets travel as DATAGRAM frames, or in
//! reliable mode length-prefixed on that same stream. Probes are always datagrams.
//!
//! Here: the path's transport (`QuicTransport`: framing, the hand-over to its writer, the
//! receiver). Beside it: `settings` (the transport parameters both sides use), `controller`
//! (congestion controllers and the window meter the schedulers read), `dial` (the client's
//! connections and hello), `listen` (the server's), `writer` (the task that paces and writes a
//! path's datagrams or stream frames), `pipes` (UDP pipes that share one controller).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use mpquic_core::recovery::Carry;
use mpquic_core::sendq::WaitingFlows;
use mpquic_core::{DropReason, PathLoad};
use tokio::sync::mpsc;

pub use super::admit::Refused;
use super::{
    stream_rx, BoxFuture, Closed, LaneCarry, LaneSend, PathTransport, Sink, TransportStats,
    TunnelBacklog,
};
use crate::config::{PathConfig, TransportMode};
use crate::io::batch::PacketBatch;
use crate::transport::close;

pub(crate) mod controller;
mod dial;
mod listen;
mod pipes;
pub(crate) mod settings;
mod writer;

pub use dial::QuicDialer;
pub use listen::{server_quic, QuicListener};

use writer::{on_the_link, path_writer, send_datagram, Recent, Writer};

/// Bytes a path may have waiting for its writer while it carries packets on its stream, before
/// new ones are refused (counted `queue_full`): only a hand-over between the TUN reader and the
/// writer, since the stream's own backlog is bounded by its send window
/// (`reliable::stream_window`), and every packet here is delay too (2048 packets were 650 ms at
/// 35 Mbit/s; 512 of them).
const STREAM_QUEUE_BYTES: u64 = 512 * 1400;
/// The channel from `send_batch` to the writer (packets; the writer empties it at every turn).
const WRITER_CHANNEL: usize = 1024;
/// What `send_batch` lets past its bounds for sparse flows' packets (`WaitingFlows`), which the
/// writer's queue serves first: places in the channel beyond `WRITER_CHANNEL`, and bytes beyond
/// the queue's limit. A ping across a saturated path was otherwise refused with the upload's
/// packets whenever the writer fell behind (1 ping in ~360 lost under a 1.5 Gbit/s upload, in
/// about half the runs).
const SPARSE_CHANNEL: usize = 64;
const SPARSE_BYTES: i64 = 64 * 1024;
/// Reliable mode's frame header: the packet's length and its send time (`stream_rx`).
pub(super) const STREAM_HEADER: usize = stream_rx::HEADER;
/// Datagrams taken in one wake-up of a path's receiver at most before they are written to the
/// TUN device (more wait for the next wake-up, so other tasks get their turn).
const RECEIVE_BATCH: usize = 128;

/// A path over one QUIC connection.
pub struct QuicTransport {
    conn: quinn::Connection,
    /// The queue into the path's writer task (`path_writer`), every mode: inner packets framed
    /// for the stream, sent on it or as datagrams as the carriage says when they leave.
    queue_tx: mpsc::Sender<Queued>,
    /// Bytes of inner packets waiting for the writer (its channel and its queue).
    waiting: Arc<AtomicU64>,
    /// And their flows (`send_batch` lets a sparse flow's packet past its bounds).
    flows: Arc<WaitingFlows>,
    /// Reliable and `auto`: the connection has the stream (its receiver runs, the writer may
    /// write to it); datagram mode: never used for packets.
    has_stream: bool,
    /// Reliable mode: what the writer wrote lately, as written (length-prefixed frames), kept
    /// only while `hand_over` says another path could take it.
    recent: Arc<Mutex<Recent>>,
    hand_over: Arc<AtomicBool>,
    /// Reliable mode: the playout its streams' packets are held to (`stream_rx`), one for all.
    playout: Arc<stream_rx::SharedPlayout>,
    /// `auto`: the tunnel core's choice for the path (`set_carry`); inner packets go on the
    /// stream only while it says so. Reliable mode: always the stream.
    adaptive: bool,
    on_stream: Arc<AtomicBool>,
    /// `auto`: whether a packet that is not TCP rides the stream while the path is on it
    /// (`set_path_probes`, `writer::non_tcp_on_stream`).
    stream_for_non_tcp: Arc<AtomicBool>,
    /// Taken by `start`: the hello stream (reliable mode carries the packets on it), and the
    /// writer's queue.
    start: std::sync::Mutex<Option<StartParts>>,
    /// Kept so the client's per-path socket lives as long as the connection (and its local
    /// port tells a path's pipes apart in status).
    endpoint: Option<quinn::Endpoint>,
    /// The client's link payload (`TransportStats::link_payload`).
    link_payload: Option<u16>,
    /// The controller's window and bytes in flight (`load`).
    meter: Option<Arc<controller::WindowMeter>>,
    /// `rate_limit` in bits/s, 0 for none (`set_rate_cap`): the writer's pacer keeps under it.
    rate_cap: Arc<AtomicU64>,
    /// The tunnel's paths' backlogs, once the tunnel has told it (`Transport::join_tunnel`).
    tunnel: Arc<OnceLock<TunnelBacklog>>,
    /// CONNECT-IP (`transport/masque`): the HTTP Datagram prefix (the request's quarter stream
    /// ID, context 0) in front of every datagram each way. Empty on the native protocol.
    prefix: Vec<u8>,
    /// The peer's address as last seen, and how often it changed (`peer_moves`).
    peer: Mutex<(SocketAddr, u64)>,
}

/// What `start` takes. The hello stream is missing on a CONNECT-IP connection, whose request
/// stream belongs to its HTTP/3 driver (datagram mode: the writer never needs it).
struct StartParts {
    send: Option<quinn::SendStream>,
    recv: Option<quinn::RecvStream>,
    queue_rx: mpsc::Receiver<Queued>,
}

/// A packet on its way to the path's writer: when it was handed over, its lane, its flow,
/// whether it is TCP (`Facts::tcp`), and the packet framed for the stream (`stream_frame`).
pub(super) type Queued = (Instant, LaneSend, Option<u64>, bool, Bytes);

/// A packet in the writer's queue: framed for the stream, its lane's rank (which stream it
/// takes) and how its lane wants it carried.
pub(super) struct Frame {
    bytes: Bytes,
    rank: u8,
    carry: LaneCarry,
    flow: Option<u64>,
    tcp: bool,
}

impl QuicTransport {
    /// A connection whose hello exchange is done on (`send`, `recv`).
    fn new(
        conn: quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        endpoint: Option<quinn::Endpoint>,
        mode: TransportMode,
        link_payload: Option<u16>,
    ) -> Arc<QuicTransport> {
        Self::with_parts(
            conn,
            Some((send, recv)),
            endpoint,
            mode,
            link_payload,
            Vec::new(),
        )
    }

    /// A CONNECT-IP connection whose request stream `stream_id` was answered 2xx: inner packets
    /// are HTTP Datagrams of that request (datagram mode; the stream stays with the HTTP/3
    /// driver). `endpoint`: the client's per-path socket, as for `new`.
    pub(crate) fn http_datagrams(
        conn: quinn::Connection,
        stream_id: u64,
        endpoint: Option<quinn::Endpoint>,
        link_payload: Option<u16>,
    ) -> Arc<QuicTransport> {
        let prefix = mpquic_core::connect_ip::datagram::ip_prefix(stream_id);
        let mode = TransportMode::Datagram;
        Self::with_parts(conn, None, endpoint, mode, link_payload, prefix)
    }

    fn with_parts(
        conn: quinn::Connection,
        streams: Option<(quinn::SendStream, quinn::RecvStream)>,
        endpoint: Option<quinn::Endpoint>,
        mode: TransportMode,
        link_payload: Option<u16>,
        prefix: Vec<u8>,
    ) -> Arc<QuicTransport> {
        let (queue_tx, queue_rx) = mpsc::channel(WRITER_CHANNEL + SPARSE_CHANNEL);
        let (send, recv) = streams.unzip();
        Arc::new(QuicTransport {
            meter: controller::window_meter(&conn),
            peer: Mutex::new((conn.remote_address(), 0)),
            conn,
            queue_tx,
            waiting: Arc::default(),
            flows: Arc::default(),
            has_stream: mode.has_stream(),
            recent: Arc::default(),
            hand_over: Arc::default(),
            playout: Arc::default(),
            adaptive: mode == TransportMode::Auto,
            on_stream: Arc::new(AtomicBool::new(mode == TransportMode::Reliable)),
            stream_for_non_tcp: Arc::new(AtomicBool::new(false)),
            start: std::sync::Mutex::new(Some(StartParts {
                send,
                recv,
                queue_rx,
            })),
            endpoint,
            link_payload,
            rate_cap: Arc::default(),
            tunnel: Arc::default(),
            prefix,
        })
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        // Every path connection (and pipe, and stripe path's control connection) ends here.
        crate::runtime::released();
    }
}

impl QuicTransport {
    /// The connection (a stripe path takes its keys from its TLS session, `stripe`).
    pub(crate) fn connection(&self) -> &quinn::Connection {
        &self.conn
    }

    /// The controller's window and the bytes in flight in it.
    fn window(&self) -> (u64, u64) {
        match &self.meter {
            Some(m) => m.read(),
            None => (self.conn.congestion_state().window(), 0),
        }
    }

    /// The window the backlog in front of the path is sized by
    /// (`WindowMeter::backlog_window`): the window but for the controller's momentary dips.
    fn backlog_window(&self) -> u64 {
        match &self.meter {
            Some(m) => m.backlog_window(),
            None => self.window().0,
        }
    }

    /// Whether inner packets go on the stream now (reliable mode; `auto` on a losing path).
    fn stream_now(&self) -> bool {
        self.has_stream && self.on_stream.load(Ordering::Relaxed)
    }

    /// `auto` on the stream, a link that loses little: a packet that is not TCP goes as a
    /// datagram (`writer::DATAGRAM_LOSS`), and one of a flow with nothing on its way (a call, a
    /// ping, DNS) goes at once, not through the writer, whose turn may wait for room on the
    /// stream behind the bulk (a write held 173 ms after bbr's start-up, the call's packets
    /// with it).
    fn datagram_at_once(&self, facts: &crate::io::batch::Facts) -> bool {
        self.flows.is_idle(facts.flow)
            && self.stream_now()
            && writer::datagram_beside_stream(self.adaptive, facts.tcp, &self.stream_for_non_tcp)
    }

    /// Bytes waiting to be sent: for the writer, and in QUIC's datagram queue.
    fn queued(&self) -> u64 {
        let datagrams =
            settings::DATAGRAM_SEND_BUFFER.saturating_sub(self.conn.datagram_send_buffer_space());
        self.waiting.load(Ordering::Relaxed) + datagrams as u64
    }

    /// How many bytes may wait: for datagrams, bounded in time at the path's rate from its
    /// backlog window and RTT (`settings::datagram_queue_limit`); on the stream, whose own
    /// backlog its send window bounds (`reliable::stream_window`), a hand-over's worth.
    fn queue_limit(&self, rtt: Duration) -> u64 {
        match self.stream_now() {
            true => STREAM_QUEUE_BYTES,
            false => settings::datagram_queue_limit(self.backlog_window(), rtt),
        }
    }

    /// Bytes in flight (as the controller last saw them) and waiting to be sent.
    fn outstanding(&self) -> u64 {
        self.window().1 + self.queued()
    }
}

impl QuicTransport {
    /// The peer's address changes seen so far: QUIC's connection migration follows a client
    /// whose NAT gave it a new port or address (and validates the new path; a forged packet
    /// cannot move it, it does not decrypt). Counted when seen (status and metrics read this
    /// every probe interval), and logged.
    fn peer_moves(&self) -> u64 {
        let now = self.conn.remote_address();
        let mut peer = self.peer.lock().unwrap_or_else(|e| e.into_inner());
        if peer.0 != now {
            tracing::info!(from = %peer.0, to = %now, "peer address changed; the connection followed (NAT rebinding)");
            *peer = (now, peer.1 + 1);
        }
        peer.1
    }
}

impl PathTransport for QuicTransport {
    /// Reliable mode frames each packet with its length (docs/PROTOCOL.md) in its headroom, so
    /// the stream takes the packet where it lies; the send time is stamped when the stream
    /// writer takes it.
    fn prepare(&self, batch: &mut PacketBatch, which: &[usize]) {
        // Every mode: the writer decides the carriage when a packet leaves its queue, and a
        // datagram is the frame without its header (`path_writer`).
        for &i in which {
            if !self.prefix.is_empty() {
                batch.push_header(i, &self.prefix);
            }
            // The frame carries the packet with the headers in front of it (the bond's).
            let len = (batch.header_len(i) + batch.packet(i).len()) as u16;
            batch.push_header(i, &stream_rx::header(len, 0));
        }
    }

    /// Inner packets join the writer's queue (`path_writer`: sparse flows first, paced at the
    /// controller's rate), within the bound `queue_limit` gives for the carriage of the moment;
    /// beyond it they are refused (`queue_full`), the inner flows' loss signal, except a sparse
    /// flow's (`SPARSE_BYTES`, `SPARSE_CHANNEL`): the backlog is not its doing. Pure TCP ACKs
    /// go as datagrams at once (`Facts::pure_ack`): nothing waits for them, and a lost
    /// one is covered by the next. A packet too big for a datagram goes on the stream in
    /// `auto`, and is refused `oversized` in datagram mode (the tunnel answers its sender
    /// with ICMP).
    fn send_batch(
        &self,
        batch: &mut PacketBatch,
        which: &[usize],
        lane: LaneSend,
        refused: &mut dyn FnMut(usize, DropReason),
    ) {
        let now = Instant::now();
        // The bound for the whole batch (`auto` may change the carriage meanwhile); taken once,
        // and the writer only drains meanwhile, so this errs on the short side.
        let mut room = self.queue_limit(self.conn.rtt()) as i64 - self.queued() as i64;
        let max_datagram = self.conn.max_datagram_size();
        for &i in which {
            let facts = batch.facts(i);
            if facts.pure_ack {
                if let Err(reason) = send_datagram(&self.conn, unframed(batch, i, &self.prefix)) {
                    refused(i, reason);
                }
                continue;
            }
            if self.datagram_at_once(&facts) {
                let frame = stream_frame(batch, i, &self.prefix);
                match send_datagram(&self.conn, frame.slice(STREAM_HEADER..)) {
                    Ok(()) => {
                        writer::keep_for_hand_over(&self.recent, &self.hand_over, now, frame);
                        continue;
                    }
                    // Too big for a datagram: the stream takes it, through the writer.
                    Err(DropReason::Oversized) => {}
                    Err(reason) => {
                        refused(i, reason);
                        continue;
                    }
                }
            }
            let frame = stream_frame(batch, i, &self.prefix);
            let len = (frame.len() - STREAM_HEADER) as u64;
            if !self.has_stream && max_datagram.is_some_and(|m| len > m as u64) {
                refused(i, DropReason::Oversized);
                continue;
            }
            let flow = facts.flow;
            let within = len as i64 <= room && self.queue_tx.capacity() > SPARSE_CHANNEL;
            let sparse = len as i64 <= room + SPARSE_BYTES && self.flows.is_sparse(flow);
            if !(within || sparse) {
                refused(i, DropReason::QueueFull);
                continue;
            }
            // Counted before the writer can see it (it takes off what leaves).
            self.waiting.fetch_add(len, Ordering::Relaxed);
            self.flows.add(flow);
            let refusal = match self.queue_tx.try_send((now, lane, flow, facts.tcp, frame)) {
                Ok(()) => {
                    room -= len as i64;
                    continue;
                }
                Err(mpsc::error::TrySendError::Full(_)) => DropReason::QueueFull,
                Err(mpsc::error::TrySendError::Closed(_)) => DropReason::SendFailed,
            };
            self.waiting.fetch_sub(len, Ordering::Relaxed);
            self.flows.sub(flow);
            refused(i, refusal);
        }
    }

    fn send_control(&self, msg: &[u8]) -> Result<(), DropReason> {
        send_datagram(&self.conn, [&self.prefix[..], msg].concat().into())
    }

    fn set_yielding(&self) {
        if let Some(m) = &self.meter {
            m.set_yielding(true);
        }
    }

    fn join_tunnel(&self, backlog: &TunnelBacklog) {
        backlog.join(&self.waiting);
        let _ = self.tunnel.set(backlog.clone());
    }

    fn set_rate_cap(&self, bits_per_s: Option<u64>) {
        self.rate_cap
            .store(bits_per_s.unwrap_or(0), Ordering::Relaxed);
    }

    fn set_carry(&self, carry: Carry) {
        if self.adaptive {
            self.on_stream
                .store(carry == Carry::Stream, Ordering::Relaxed);
        }
    }

    fn set_path_probes(&self, loss: f64, srtt: Option<Duration>) {
        self.stream_for_non_tcp
            .store(writer::non_tcp_on_stream(loss, srtt), Ordering::Relaxed);
    }

    /// A path with no other up keeps no copies: at a fast stream's rate they are `RECENT_BYTES`
    /// held for nothing (one unshaped veth, ~3.5 Gbit/s on the stream for a flow's first 0.3 s
    /// in `auto`: the sender's peak RSS 21 MiB with them, 13-14 without, as in datagram mode).
    fn set_hand_over(&self, possible: bool) {
        if !self.hand_over.swap(possible, Ordering::Relaxed) || possible {
            return;
        }
        self.recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    fn remote(&self) -> SocketAddr {
        self.conn.remote_address()
    }

    fn stats(&self) -> TransportStats {
        let st = self.conn.stats();
        TransportStats {
            rtt: Some(st.path.rtt),
            cwnd: Some(st.path.cwnd),
            pacing_rate: self.conn.congestion_state().metrics().pacing_rate,
            sent_packets: st.path.sent_packets,
            lost_packets: st.path.lost_packets,
            udp_payload: Some(st.path.current_mtu),
            max_datagram: self.conn.max_datagram_size(),
            link_payload: self.link_payload,
            playout: self.has_stream.then(|| stream_rx::delay(&self.playout)),
            streams_in: self.has_stream.then(|| stream_rx::streams(&self.playout)),
            acks: self.meter.as_ref().map(|m| m.acked()),
            wire_bytes: Some(on_the_link(&st, self.conn.remote_address())),
            peer_moves: self.peer_moves(),
            // QUIC retransmits what went into a dead mapping itself.
            rebind_resent: 0,
            reordering: Some(super::Reordering {
                reordered: st.path.reordered_packets,
                depth: st.path.reordering_depth,
                spurious: st.path.spurious_lost_packets,
                packet_threshold: st.path.reordering_packet_threshold,
                extra_delay: st.path.reordering_extra_delay,
            }),
        }
    }

    /// Rate: the window per RTT, which is what the pacer lets out whatever the controller
    /// (a BBR's own pacing rate under-reads a path it has seen little traffic on, and the
    /// scheduler then starves it: scenario 05 at one stream, 282 vs 308 Mbit/s).
    /// Backlog: `queued`, its bound `queue_limit`.
    fn load(&self) -> PathLoad {
        let (window, in_flight) = self.window();
        let rtt = self.conn.rtt();
        PathLoad {
            rate: Some(settings::rate_per_rtt(window, rtt)),
            rtt: Some(rtt),
            backlog: self.queued(),
            window: Some(window),
            in_flight,
            backlog_limit: Some(self.queue_limit(rtt)),
        }
    }

    fn close(&self, code: u32, reason: &str) {
        self.conn.close(code.into(), reason.as_bytes());
    }

    fn closed(&self) -> BoxFuture<'static, Closed> {
        let conn = self.conn.clone();
        Box::pin(async move { Closed::of(&conn.closed().await) })
    }

    fn kind(&self) -> &'static str {
        match self.prefix.is_empty() {
            true => "quic",
            false => "masque",
        }
    }

    /// Reliable mode hands back what its stream wrote since `since`; datagram mode keeps no
    /// copies. Either way the connection is closed: quinn holds the datagrams it could not send
    /// while the path was dark and sends them once it answers again (the demo's pings came back
    /// up to 5.8 s late with our bbr), and a stream would deliver its backlog (again, and late).
    /// The client dials the path anew.
    fn abandon(&self, since: Instant) -> Vec<Bytes> {
        let packets = match self.has_stream {
            true => self
                .recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .packets_since(since),
            false => Vec::new(),
        };
        self.conn.close(
            close::PATH_DOWN.into(),
            b"path down: packets sent on another path",
        );
        packets
    }

    fn start(self: Arc<Self>, sink: Arc<dyn Sink>) {
        let Some(parts) = self.start.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return; // started already
        };
        // Datagrams: probes always, inner packets in datagram mode.
        let c = self.conn.clone();
        let s = match self.prefix.is_empty() {
            true => sink.clone(),
            false => Arc::new(HttpDatagrams {
                inner: sink.clone(),
                prefix: self.prefix.clone(),
            }),
        };
        tokio::spawn(async move {
            while let Ok(d) = c.read_datagram().await {
                s.on_datagram(&d);
                // What arrived with it goes to the TUN device in the same (coalesced) write.
                for _ in 0..RECEIVE_BATCH {
                    match c.read_datagram().now_or_never() {
                        Some(Ok(d)) => s.on_datagram(&d),
                        _ => break,
                    }
                }
                s.on_batch_end();
            }
            s.on_closed(c.close_reason().and_then(|e| Closed::of(&e).peer_code));
        });
        let StartParts {
            send,
            recv,
            queue_rx,
        } = parts;
        match (self.has_stream, recv) {
            (true, Some(recv)) => {
                let (s, c, d) = (sink.clone(), self.conn.clone(), self.playout.clone());
                tokio::spawn(stream_rx::run(s, recv, c, d));
                // The peer's streams of its other traffic classes (`LaneStreams`): each read as the
                // first one is (its frames carry their lane's header).
                let (s, c, d) = (sink.clone(), self.conn.clone(), self.playout.clone());
                tokio::spawn(async move {
                    while let Ok(recv) = c.accept_uni().await {
                        tokio::spawn(stream_rx::run(s.clone(), recv, c.clone(), d.clone()));
                    }
                });
            }
            (false, Some(recv)) => {
                // Keep the control stream's receiving half open for the connection's life.
                let conn = self.conn.clone();
                tokio::spawn(async move {
                    let _keep = recv;
                    conn.closed().await;
                });
            }
            // CONNECT-IP: the request stream is its HTTP/3 driver's.
            (_, None) => {}
        }
        let writer = Writer {
            sink,
            conn: self.conn.clone(),
            send,
            rx: queue_rx,
            waiting: self.waiting.clone(),
            flows: self.flows.clone(),
            on_stream: self.has_stream.then(|| self.on_stream.clone()),
            adaptive: self.adaptive,
            stream_for_non_tcp: self.stream_for_non_tcp.clone(),
            recent: self.recent.clone(),
            hand_over: self.hand_over.clone(),
            meter: self.meter.clone(),
            rate_cap: self.rate_cap.clone(),
            tunnel: self.tunnel.clone(),
            prefix_len: self.prefix.len(),
        };
        tokio::spawn(path_writer(writer));
    }
}

/// A carriage that rides on a QUIC path connection for its keys and control (the stripe
/// transport), plugged into the dialer and the listener by the shells, so this module names
/// none of them. The client's side: given the path's connection, accepted by the server, and
/// the port the carriage's packets go to, make the path's transport.
pub type RideClient = Arc<
    dyn Fn(
            Arc<QuicTransport>,
            PathConfig,
            u16,
        ) -> BoxFuture<'static, Result<Arc<dyn PathTransport>>>
        + Send
        + Sync,
>;

/// The server's side of a riding carriage.
pub trait RideServer: Send + Sync {
    /// Where the carriage's packets arrive (told to the client in the hello's answer).
    fn port(&self) -> u16;
    /// A path accepted with the carriage in its hello (its name, its pipe count): known from
    /// now on, before the client hears the answer.
    fn join(&self, conn: &quinn::Connection, path: &str, pipes: u8) -> Result<Box<dyn Joined>>;
}

/// A path joined to a riding carriage on the server.
pub trait Joined: Send {
    /// The client was not told (the answer failed): the path is dropped.
    fn forget(self: Box<Self>);
    /// The path's transport over its QUIC connection `t`.
    fn transport(self: Box<Self>, t: Arc<QuicTransport>) -> Arc<dyn PathTransport>;
}

/// Whether `prepare` framed packet `i` for the stream: its outermost header is a frame header
/// for exactly the rest (its send time still unset).
fn stream_framed(batch: &PacketBatch, i: usize) -> bool {
    let (h, len) = (batch.header_len(i), batch.packet(i).len());
    h >= STREAM_HEADER
        && batch.headed(i, 0)[..STREAM_HEADER]
            == stream_rx::header((h - STREAM_HEADER + len) as u16, 0)
}

/// Packet `i` as a datagram carries it: with the headers in front (the CONNECT-IP `prefix`
/// among them), without the stream's frame header if `prepare` wrote one. A view of the
/// batch's buffer when `prepare` framed it: no copy, no allocation.
fn unframed(batch: &mut PacketBatch, i: usize, prefix: &[u8]) -> Bytes {
    match (stream_framed(batch, i), prefix.is_empty()) {
        (true, _) => batch.framed_from(i, STREAM_HEADER),
        (false, true) => batch.framed_from(i, 0),
        (false, false) => [prefix, batch.headed(i, 0)].concat().into(),
    }
}

/// A packet with its header in front, as the stream carries it (the send time is stamped by
/// the writer): framed in the batch's headroom by `prepare` (no copy), or copied when it was
/// not, with the datagrams' `prefix` (CONNECT-IP) as `prepare` puts it.
fn stream_frame(batch: &mut PacketBatch, i: usize, prefix: &[u8]) -> Bytes {
    if stream_framed(batch, i) {
        return batch.framed(i);
    }
    let p = batch.headed(i, 0);
    let mut b = BytesMut::with_capacity(STREAM_HEADER + prefix.len() + p.len());
    b.extend_from_slice(&stream_rx::header((prefix.len() + p.len()) as u16, 0));
    b.extend_from_slice(prefix);
    b.extend_from_slice(p);
    b.freeze()
}

/// A CONNECT-IP connection's receive side: each datagram must start with its request's prefix
/// (`QuicTransport::prefix`); the rest goes to the tunnel. Another request's datagram or a
/// context this end did not negotiate (RFC 9484 section 6: an extension's) is dropped and
/// counted `malformed`.
struct HttpDatagrams {
    inner: Arc<dyn Sink>,
    prefix: Vec<u8>,
}

impl Sink for HttpDatagrams {
    fn on_datagram(&self, d: &[u8]) {
        match d.strip_prefix(&self.prefix[..]) {
            Some(packet) => self.inner.on_datagram(packet),
            None => self.inner.on_received_dropped(DropReason::Malformed),
        }
    }
    fn on_batch_end(&self) {
        self.inner.on_batch_end()
    }
    fn on_stream_packet(&self, pkt: Option<&[u8]>) {
        self.inner.on_stream_packet(pkt)
    }
    fn on_send_dropped(&self, reason: DropReason, packets: u64, bytes: u64) {
        self.inner.on_send_dropped(reason, packets, bytes)
    }
    fn on_received_dropped(&self, reason: DropReason) {
        self.inner.on_received_dropped(reason)
    }
    fn on_ce_marked(&self, packets: u64) {
        self.inner.on_ce_marked(packets)
    }
    fn on_closed(&self, peer_code: Option<u32>) {
        self.inner.on_closed(peer_code)
    }
}
