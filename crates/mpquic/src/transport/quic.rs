//! QUIC as a path transport: one connection per path. Session setup is a TLS 1.3 handshake with
//! client certificates (the identity is the certificate's CN) and the hello on the first
//! bidirectional stream (`hello.rs`); then inner packets travel as DATAGRAM frames, or in
//! reliable mode length-prefixed on that same stream. Probes are always datagrams.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use mpquic_core::admission;
use mpquic_core::pacing::Pacer;
use mpquic_core::packet::is_pure_tcp_ack;
use mpquic_core::recovery::Carry;
use mpquic_core::sendq::{RankedQueues, WaitingFlows};
use mpquic_core::{DropReason, PathLoad};
use tokio::sync::mpsc;
use tracing::{info, warn};

pub use super::admit::Refused;
use super::admit::{self, InFlight};
use super::{
    flow_of, stream_rx, BoxFuture, Carrier, Closed, Dialed, Dialer, Dropped, Known, LaneCarry,
    LaneSend, Listener, Offer, OfferReply, PathTransport, Sink, TransportStats, Unfinished,
};
use crate::config::{Config, PathConfig, PathKind, TransportMode};
use crate::hello::{self, Hello, HelloAck};
use crate::io::batch::PacketBatch;
use crate::io::platform::Platform;
use crate::transport::close;
use crate::{quic, tls};

mod pipes;
use pipes::{PipeKey, PipeSets, QuicPipes};

/// Bytes a path may have waiting for its writer while it carries packets on its stream, before
/// new ones are refused (counted `queue_full`): only a hand-over between the TUN reader and the
/// writer, since the stream's own backlog is bounded by its send window
/// (`reliable::stream_window`), and every packet here is delay too (2048 packets were 650 ms at
/// 35 Mbit/s; 512 of them).
const STREAM_QUEUE_BYTES: u64 = 512 * 1400;
/// What QUIC's datagram buffer may hold of a path's packets (`engine_room`), and how long the
/// writer waits for it to drain below that (the timer's granularity).
const ENGINE_QUEUE_TIME: Duration = Duration::from_millis(2);
const ENGINE_QUEUE_MIN: usize = 16 * 1024;
const ENGINE_WAIT: Duration = Duration::from_millis(1);
/// The channel from `send_batch` to the writer (packets; the writer empties it at every turn).
const WRITER_CHANNEL: usize = 1024;
/// What `send_batch` lets past its bounds for sparse flows' packets (`WaitingFlows`), which the
/// writer's queue serves first: places in the channel beyond `WRITER_CHANNEL`, and bytes beyond
/// the queue's limit. A ping across a saturated path was otherwise refused with the upload's
/// packets whenever the writer fell behind (1 ping in ~360 lost under a 1.5 Gbit/s upload, in
/// about half the runs).
const SPARSE_CHANNEL: usize = 64;
const SPARSE_BYTES: i64 = 64 * 1024;
/// Packets the writer's queue holds at most: the most bytes a datagram carriage may have
/// waiting (`quic::datagram_queue_limit`) in packets of a few hundred bytes.
const WRITER_QUEUE: usize = quic::DATAGRAM_SEND_BUFFER / 512;
/// What the stream writer remembers of what it wrote (for `abandon`): at most this much, and
/// nothing older than `RECENT_AGE`.
const RECENT_BYTES: usize = 4 << 20;
const RECENT_AGE: Duration = Duration::from_secs(1);
/// Bytes written to a stream in one call (batching amortises the per-write cost).
const STREAM_BATCH: usize = 64 * 1024;
/// Reliable mode's frame header: the packet's length and its send time (`stream_rx`).
const STREAM_HEADER: usize = stream_rx::HEADER;
/// Bound on the server's wait for a client's hello after the handshake.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Offers waiting for the server to take them; beyond this, new connections wait in the accept
/// loop (backpressure, not loss).
const OFFER_QUEUE: usize = 64;
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
    /// Reliable mode: the delay the stream's receiver holds packets to (µs, `stream_rx`).
    playout_us: Arc<std::sync::atomic::AtomicU64>,
    /// `auto`: the tunnel core's choice for the path (`set_carry`); inner packets go on the
    /// stream only while it says so. Reliable mode: always the stream.
    adaptive: bool,
    on_stream: Arc<AtomicBool>,
    /// Taken by `start`: the hello stream (reliable mode carries the packets on it), and the
    /// writer's queue.
    start: std::sync::Mutex<Option<StartParts>>,
    /// Kept so the client's per-path socket lives as long as the connection (and its local
    /// port tells a path's pipes apart in status).
    endpoint: Option<quinn::Endpoint>,
    /// The client's link payload (`TransportStats::link_payload`).
    link_payload: Option<u16>,
    /// The controller's window and bytes in flight (`load`).
    meter: Option<Arc<quic::WindowMeter>>,
    /// `rate_limit` in bits/s, 0 for none (`set_rate_cap`): the writer's pacer keeps under it.
    rate_cap: Arc<AtomicU64>,
    /// CONNECT-IP (`transport/masque`): the HTTP Datagram prefix (the request's quarter stream
    /// ID, context 0) in front of every datagram each way. Empty on the native protocol.
    prefix: Vec<u8>,
}

/// What `start` takes. The hello stream is missing on a CONNECT-IP connection, whose request
/// stream belongs to its HTTP/3 driver (datagram mode: the writer never needs it).
struct StartParts {
    send: Option<quinn::SendStream>,
    recv: Option<quinn::RecvStream>,
    queue_rx: mpsc::Receiver<Queued>,
}

/// A packet on its way to the path's writer: when it was handed over, its lane, its flow, and
/// the packet framed for the stream (`stream_frame`).
type Queued = (Instant, LaneSend, Option<u64>, Bytes);

/// A packet in the writer's queue: framed for the stream, its lane's rank (which stream it
/// takes) and how its lane wants it carried.
struct Frame {
    bytes: Bytes,
    rank: u8,
    carry: LaneCarry,
    flow: Option<u64>,
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
            meter: quic::window_meter(&conn),
            conn,
            queue_tx,
            waiting: Arc::default(),
            flows: Arc::default(),
            has_stream: mode.has_stream(),
            recent: Arc::default(),
            hand_over: Arc::default(),
            playout_us: Arc::default(),
            adaptive: mode == TransportMode::Auto,
            on_stream: Arc::new(AtomicBool::new(mode == TransportMode::Reliable)),
            start: std::sync::Mutex::new(Some(StartParts {
                send,
                recv,
                queue_rx,
            })),
            endpoint,
            link_payload,
            rate_cap: Arc::default(),
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

    /// Whether inner packets go on the stream now (reliable mode; `auto` on a losing path).
    fn stream_now(&self) -> bool {
        self.has_stream && self.on_stream.load(Ordering::Relaxed)
    }

    /// Bytes waiting to be sent: for the writer, and in QUIC's datagram queue.
    fn queued(&self) -> u64 {
        let datagrams =
            quic::DATAGRAM_SEND_BUFFER.saturating_sub(self.conn.datagram_send_buffer_space());
        self.waiting.load(Ordering::Relaxed) + datagrams as u64
    }

    /// How many bytes may wait: for datagrams, bounded in time at the path's rate from its
    /// window and RTT (`quic::datagram_queue_limit`); on the stream, whose own backlog its send
    /// window bounds (`reliable::stream_window`), a hand-over's worth.
    fn queue_limit(&self, window: u64, rtt: Duration) -> u64 {
        match self.stream_now() {
            true => STREAM_QUEUE_BYTES,
            false => quic::datagram_queue_limit(window, rtt),
        }
    }

    /// Bytes in flight (as the controller last saw them) and waiting to be sent.
    fn outstanding(&self) -> u64 {
        self.window().1 + self.queued()
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
    /// go as datagrams at once (`packet::is_pure_tcp_ack`): nothing waits for them, and a lost
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
        let mut room =
            self.queue_limit(self.window().0, self.conn.rtt()) as i64 - self.queued() as i64;
        let max_datagram = self.conn.max_datagram_size();
        for &i in which {
            if is_pure_tcp_ack(batch.packet(i)) {
                if let Err(reason) = send_datagram(&self.conn, unframed(batch, i, &self.prefix)) {
                    refused(i, reason);
                }
                continue;
            }
            let frame = stream_frame(batch, i, &self.prefix);
            let len = (frame.len() - STREAM_HEADER) as u64;
            if !self.has_stream && max_datagram.is_some_and(|m| len > m as u64) {
                refused(i, DropReason::Oversized);
                continue;
            }
            let flow = flow_of(&frame, STREAM_HEADER);
            let within = len as i64 <= room && self.queue_tx.capacity() > SPARSE_CHANNEL;
            let sparse = len as i64 <= room + SPARSE_BYTES && self.flows.is_sparse(flow);
            if !(within || sparse) {
                refused(i, DropReason::QueueFull);
                continue;
            }
            // Counted before the writer can see it (it takes off what leaves).
            self.waiting.fetch_add(len, Ordering::Relaxed);
            self.flows.add(flow);
            let refusal = match self.queue_tx.try_send((now, lane, flow, frame)) {
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
            playout: self.has_stream.then(|| stream_rx::delay(&self.playout_us)),
            acks: self.meter.as_ref().map(|m| m.acked()),
            wire_bytes: Some(on_the_link(&st, self.conn.remote_address())),
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
            rate: Some(quic::rate_per_rtt(window, rtt)),
            rtt: Some(rtt),
            backlog: self.queued(),
            window: Some(window),
            in_flight,
            backlog_limit: Some(self.queue_limit(window, rtt)),
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
                let (s, c, d) = (sink.clone(), self.conn.clone(), self.playout_us.clone());
                tokio::spawn(stream_rx::run(s, recv, c, d));
                // The peer's streams of its other traffic classes (`LaneStreams`): each read as the
                // first one is (its frames carry their lane's header).
                let (s, c, d) = (sink.clone(), self.conn.clone(), self.playout_us.clone());
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
            recent: self.recent.clone(),
            hand_over: self.hand_over.clone(),
            meter: self.meter.clone(),
            rate_cap: self.rate_cap.clone(),
        };
        tokio::spawn(path_writer(writer));
    }
}

/// The client's TLS (its files read now) and QUIC settings for links of `link_mtu`.
fn client_quic(
    cfg: &Config,
    ccfg: &crate::config::ClientConfig,
    link_mtu: u32,
) -> Result<quinn::ClientConfig> {
    let cert_key = match (&cfg.cert_file, &cfg.key_file) {
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        _ => None,
    };
    let crypto = tls::client_crypto(
        ccfg.ca_file.as_deref(),
        ccfg.insecure_skip_verify,
        cert_key,
        cfg.tls_post_quantum,
        match ccfg.masque {
            None => tls::Served::Native,
            Some(_) => tls::Served::Http3,
        },
    )?;
    let mut client = quinn::ClientConfig::new(Arc::new(tls::key_update::CountedClient(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .context("TLS config unusable for QUIC")?,
    ))));
    client.transport_config(quic::client_transport(
        cfg.congestion,
        link_mtu,
        None,
        ccfg.masque.is_some(),
        None,
    ));
    Ok(client)
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

/// The client's QUIC session setup: a socket per path (bound as the path says), the handshake
/// with the client certificate, then the hello.
pub struct QuicDialer {
    /// TLS and QUIC settings of new connections; a reload rebuilds them (`reload_tls`).
    client: std::sync::RwLock<quinn::ClientConfig>,
    congestion: crate::config::Congestion,
    /// The smallest MTU of the client's links (the QUIC packet size follows it).
    link_mtu: u32,
    server_name: String,
    platform: Platform,
    /// The client's `stripe_port`, over the one the server announces.
    stripe_port: Option<u16>,
    /// The stripe transport, when the shell plugged it in (`with_stripe`).
    stripe: Option<RideClient>,
    /// `protocol: masque`: a CONNECT-IP request (`masque::request`) instead of the hello.
    masque: Option<crate::config::MasqueClient>,
}

impl QuicDialer {
    /// TLS from the instance's files; QUIC settings for links of `link_mtu`.
    pub fn new(
        cfg: &Config,
        ccfg: &crate::config::ClientConfig,
        link_mtu: u32,
        platform: Platform,
    ) -> Result<QuicDialer> {
        Ok(QuicDialer {
            client: std::sync::RwLock::new(client_quic(cfg, ccfg, link_mtu)?),
            congestion: cfg.congestion,
            link_mtu,
            server_name: ccfg.server_name.clone(),
            platform,
            stripe_port: ccfg.stripe_port,
            stripe: None,
            masque: ccfg.masque.clone(),
        })
    }

    /// With the stripe transport for `transport: stripe` paths.
    pub fn with_stripe(mut self, ride: RideClient) -> QuicDialer {
        self.stripe = Some(ride);
        self
    }

    async fn dial_inner(&self, p: &PathConfig, h: &Hello, known: Known) -> Result<Dialed> {
        let remote: SocketAddr = tokio::net::lookup_host((p.remote_addr.as_str(), p.remote_port))
            .await
            .with_context(|| format!("cannot resolve {}", p.remote_addr))?
            .next()
            .ok_or_else(|| anyhow!("{} has no address", p.remote_addr))?;
        // A smaller payload is announced to the server (it caps what the server sends) and is
        // this side's packet size and floor: the route carries no more. (Over CONNECT-IP it is
        // the size a connection reached, where the next one starts: `client_transport`.)
        let standard = self.masque.is_some();
        let link_mtu = match known.payload {
            Some(p) if !standard => mpquic_core::mtu::link_mtu_for_payload(p).min(self.link_mtu),
            _ => self.link_mtu,
        };
        let mut client = (self.client.read().unwrap_or_else(|e| e.into_inner())).clone();
        if link_mtu != self.link_mtu || known.rtt.is_some() || known.payload.is_some() {
            client.transport_config(quic::client_transport(
                self.congestion,
                link_mtu,
                known.rtt,
                standard,
                known.payload.filter(|_| standard),
            ));
        }
        let to = &Target {
            remote,
            link_mtu,
            client,
        };
        if let Some(m) = &self.masque {
            return self.dial_connect_ip(p, to, h, m).await;
        }
        let native = |(transport, ack): (Arc<dyn PathTransport>, HelloAck)| Dialed {
            transport,
            ack,
            carrier: Carrier::Native,
        };
        if p.transport == PathKind::Stripe {
            return self.dial_stripe(p, to, h).await.map(native);
        }
        if p.pipes <= 1 {
            let (t, ack) = self.dial_one(p, to, h).await?;
            return Ok(native((t, ack)));
        }
        // Pipe 0 joins the session like a path; the others then join pipe 0 (`pipes.rs`).
        let hello_for = |index: u8| Hello {
            pipe: Some(hello::PipeOf {
                index,
                count: p.pipes,
            }),
            ..h.clone()
        };
        let (first, ack) = self.dial_one(p, to, &hello_for(0)).await?;
        if !ack.ok {
            return Ok(native((first, ack)));
        }
        let group =
            quic::PipeGroup::new(self.congestion, mpquic_core::mtu::udp_payload(to.link_mtu));
        let set = Unfinished::new(QuicPipes::new(group, p.pipes, ack.clone(), first));
        let hellos: Vec<Hello> = (1..p.pipes).map(hello_for).collect();
        let rest =
            futures_util::future::join_all(hellos.iter().map(|hk| self.dial_one(p, to, hk))).await;
        let mut failed = None;
        for (k, r) in (1..p.pipes).zip(rest) {
            match r {
                Ok((t, a)) if a.ok => {
                    set.get().add(t);
                }
                Ok((t, a)) => {
                    t.close(close::SHUTDOWN, "refused");
                    let why = a.error.unwrap_or_else(|| "refused".into());
                    failed.get_or_insert_with(|| anyhow!("pipe {k}: {why}"));
                }
                Err(e) => {
                    failed.get_or_insert(e.context(format!("pipe {k}")));
                }
            }
        }
        if let Some(e) = failed {
            set.get()
                .close(close::SHUTDOWN, "a pipe of the path failed");
            return Err(e);
        }
        Ok(native((set.keep(), ack)))
    }

    /// A stripe path: one QUIC connection (hello, keys, control), then its stripe pipes
    /// registered with the server's stripe socket (`stripe::client`).
    async fn dial_stripe(
        &self,
        p: &PathConfig,
        to: &Target,
        h: &Hello,
    ) -> Result<(Arc<dyn PathTransport>, HelloAck)> {
        let h = Hello {
            stripe: Some(hello::StripeOf { pipes: p.pipes }),
            ..h.clone()
        };
        let (quic, ack) = self.dial_one(p, to, &h).await?;
        if !ack.ok {
            return Ok((quic, ack));
        }
        // Its pipes' receive loops hold the connection from the start of registration.
        let quic = Unfinished::new(quic);
        let Some(port) = self.stripe_port.or(ack.stripe_port) else {
            return Err(anyhow!(
                "the server accepted the path but named no stripe port"
            ));
        };
        let ride = self
            .stripe
            .as_ref()
            .context("a stripe path, but this client has no stripe transport")?;
        let t = ride(quic.get().clone(), p.clone(), port).await?;
        quic.keep();
        Ok((t, ack))
    }

    /// One QUIC connection to `to` over its own socket, and its hello exchange.
    async fn dial_one(
        &self,
        p: &PathConfig,
        to: &Target,
        h: &Hello,
    ) -> Result<(Arc<QuicTransport>, HelloAck)> {
        let (endpoint, conn) = self.handshake(p, to).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        hello::write(&mut send, h).await?;
        let ack: HelloAck = hello::read(&mut recv)
            .await
            .context("no hello answer from the server")?;
        let link_payload = mpquic_core::mtu::udp_payload(self.link_mtu);
        let transport =
            QuicTransport::new(conn, send, recv, Some(endpoint), h.mode, Some(link_payload));
        Ok((transport, ack))
    }

    /// A CONNECT-IP path (`protocol: masque`): the handshake, then the request with the hello
    /// in it (`masque::request`), whose answer says what the server speaks.
    async fn dial_connect_ip(
        &self,
        p: &PathConfig,
        to: &Target,
        h: &Hello,
        m: &crate::config::MasqueClient,
    ) -> Result<Dialed> {
        let (endpoint, conn) = self.handshake(p, to).await?;
        // The address this client has (or asks for) is asked for again: a new path, or a
        // reconnection, keeps it.
        let ask = (h.previous.as_deref().or(h.addr.as_deref()))
            .and_then(crate::config::parse_cidr)
            .map(|(a, _)| a);
        let authority = format!("{}:{}", self.server_name, to.remote.port());
        let answered = super::masque::request(&conn, authority, m, h, ask).await?;
        let link_payload = mpquic_core::mtu::udp_payload(self.link_mtu);
        let transport = QuicTransport::http_datagrams(
            conn,
            answered.stream,
            Some(endpoint),
            Some(link_payload),
        );
        Ok(Dialed {
            transport,
            ack: answered.ack,
            carrier: answered.carrier,
        })
    }

    /// A QUIC connection to `to` over the path's own socket, handshaken.
    async fn handshake(
        &self,
        p: &PathConfig,
        to: &Target,
    ) -> Result<(quinn::Endpoint, quinn::Connection)> {
        let Target {
            remote,
            link_mtu,
            client,
        } = to;
        let (remote, link_mtu) = (*remote, *link_mtu);
        let socket = self.platform.client_socket(&p.bind, remote)?;
        let endpoint = quinn::Endpoint::new_with_abstract_socket(
            quic::client_endpoint(link_mtu),
            None,
            socket,
            Arc::new(quinn::TokioRuntime),
        )?;
        let started = Instant::now();
        let conn = endpoint
            .connect_with(client.clone(), remote, &self.server_name)?
            .await
            .with_context(|| format!("handshake with {remote} failed"))?;
        // What the handshake cost, for the operator and bench/handshake.py (post-quantum
        // against classic key exchange).
        let stats = conn.stats();
        let server_cert = tls::certificate::of_peer(&conn);
        info!(
            path = %p.name,
            %remote,
            server_serial = %server_cert.as_ref().map_or("?", |c| c.serial.as_str()),
            handshake_ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
            sent_bytes = stats.udp_tx.bytes,
            received_bytes = stats.udp_rx.bytes,
            "QUIC handshake done"
        );
        Ok((endpoint, conn))
    }
}

impl Dialer for QuicDialer {
    fn dial<'a>(
        &'a self,
        path: &'a PathConfig,
        hello: &'a Hello,
        known: Known,
    ) -> BoxFuture<'a, Result<Dialed>> {
        Box::pin(self.dial_inner(path, hello, known))
    }

    fn reload_tls(&self, cfg: &Config, ccfg: &crate::config::ClientConfig) -> Result<()> {
        let client = client_quic(cfg, ccfg, self.link_mtu)?;
        *self.client.write().unwrap_or_else(|e| e.into_inner()) = client;
        Ok(())
    }
}

/// Where one dial goes: the server's address, the link MTU its packets fill, and the QUIC
/// configuration for that size and the path's known RTT.
struct Target {
    remote: SocketAddr,
    link_mtu: u32,
    client: quinn::ClientConfig,
}

/// The server's QUIC session setup: one endpoint on the listening socket; each connection is
/// handshaken (client certificate required), named by its certificate's CN and asked for its
/// hello, each in its own task, and offered to the server. Failures before the offer are
/// logged and counted through `refused` (by reason).
pub struct QuicListener {
    endpoint: quinn::Endpoint,
    offers: tokio::sync::Mutex<mpsc::Receiver<Offer>>,
}

/// What the listener's connection tasks share: the refusal counter, the pipe sets, and the
/// controller a pipe set's group gets.
struct Accepting {
    refused: Refused,
    pipes: PipeSets,
    congestion: crate::config::Congestion,
    /// `stripe_enabled`: the stripe transport that stripe paths join.
    stripe: Option<Arc<dyn RideServer>>,
}

impl QuicListener {
    pub fn start(
        cfg: &Config,
        scfg: &crate::config::ServerConfig,
        platform: &Platform,
        refused: Refused,
        stripe: Option<Arc<dyn RideServer>>,
    ) -> Result<QuicListener> {
        let server_config = server_quic(cfg, scfg, tls::Served::Native)?;
        let endpoint = quinn::Endpoint::new_with_abstract_socket(
            quinn::EndpointConfig::default(),
            Some(server_config),
            platform.server_socket(scfg.listen)?,
            Arc::new(quinn::TokioRuntime),
        )?;
        let (tx, rx) = mpsc::channel(OFFER_QUEUE);
        let ep = endpoint.clone();
        let accepting = Arc::new(Accepting {
            refused: refused.clone(),
            pipes: PipeSets::default(),
            congestion: cfg.congestion,
            stripe,
        });
        admit::serve(ep, admit::Gate::new(refused), move |incoming, in_flight| {
            let (tx, accepting) = (tx.clone(), accepting.clone());
            tokio::spawn(async move {
                if let Some(offer) = offer(incoming, accepting, in_flight).await {
                    // The server is gone when the queue is closed; nothing to answer.
                    let _ = tx.send(offer).await;
                }
            });
        });
        Ok(QuicListener {
            endpoint,
            offers: tokio::sync::Mutex::new(rx),
        })
    }
}

/// The listener's QUIC and TLS settings, the TLS files read now.
pub fn server_quic(
    cfg: &Config,
    scfg: &crate::config::ServerConfig,
    served: tls::Served,
) -> Result<quinn::ServerConfig> {
    let cert = cfg.cert_file.clone().context("tls_cert_file is required")?;
    let key = cfg.key_file.clone().context("tls_key_file is required")?;
    let crypto = tls::server_crypto(
        &cert,
        &key,
        &scfg.client_ca_file,
        cfg.tls_post_quantum,
        &scfg.revoked,
        served,
    )?;
    let mut server_config =
        quinn::ServerConfig::with_crypto(Arc::new(tls::key_update::CountedServer(Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(Arc::new(crypto))
                .context("TLS config unusable for QUIC")?,
        ))));
    server_config.transport_config(quic::transport(
        cfg.congestion,
        crate::io::socket::DEFAULT_LINK_MTU,
        None,
    ));
    // Initials waiting for the accept loop (which decides at once): bounded well below
    // quinn's defaults (65536 of them, 100 MiB), so a flood cannot grow the server's memory.
    server_config
        .max_incoming(2 * admission::MAX_HANDSHAKES)
        .incoming_buffer_size(64 << 10)
        .incoming_buffer_size_total(8 << 20);
    Ok(server_config)
}

impl QuicListener {
    /// A reload's settings (`server_quic`: TLS files read again, the new `revoked:` list)
    /// for the handshakes from now on; running connections keep theirs.
    pub fn install(&self, settings: quinn::ServerConfig) {
        self.endpoint.set_server_config(Some(settings));
    }
}

impl Listener for QuicListener {
    fn next(&self) -> BoxFuture<'_, Option<Offer>> {
        admit::next_offer(&self.offers)
    }

    fn close(&self, code: u32, reason: &str) -> BoxFuture<'_, ()> {
        admit::close(&self.endpoint, code, reason)
    }
}

/// One incoming connection up to its offer: handshake, identity, hello. A pipe after a path's
/// first joins that pipe's set here, without an offer (`pipes.rs`).
async fn offer(
    incoming: quinn::Incoming,
    accepting: Arc<Accepting>,
    in_flight: InFlight,
) -> Option<Offer> {
    let refused = &accepting.refused;
    let remote = incoming.remote_address();
    let conn = admit::handshake(incoming, in_flight, refused).await?;
    let named = tls::certificate::of_peer(&conn).and_then(|c| Some((c.name.clone()?, c)));
    let Some((identity, certificate)) = named else {
        warn!(%remote, "client certificate has no common name; refused");
        refused("no_common_name");
        conn.close(close::REFUSED.into(), b"certificate has no common name");
        return None;
    };
    let hello = tokio::time::timeout(HELLO_TIMEOUT, async {
        let (send, mut recv) = conn.accept_bi().await?;
        let h: Hello = hello::read(&mut recv).await?;
        anyhow::Ok((send, recv, h))
    })
    .await;
    let (send, recv, hello) = match hello {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            warn!(client = %identity, %remote, error = %e, "bad hello; connection closed");
            refused("bad_hello");
            conn.close(close::PROTOCOL.into(), b"bad hello");
            return None;
        }
        Err(_) => {
            warn!(client = %identity, %remote, "no hello within {HELLO_TIMEOUT:?}; connection closed");
            refused("hello_timeout");
            conn.close(close::PROTOCOL.into(), b"no hello");
            return None;
        }
    };
    let stripe = match (hello.stripe, &accepting.stripe) {
        (None, _) => None,
        (Some(_), _) if hello.pipe.is_some() => {
            warn!(client = %identity, %remote, "hello asks for stripe and QUIC pipes at once; connection closed");
            refused("bad_hello");
            conn.close(close::PROTOCOL.into(), b"stripe and pipes");
            return None;
        }
        (Some(s), Some(server)) => Some((server.clone(), s.pipes)),
        (Some(_), None) => {
            warn!(client = %identity, %remote, path = %hello.path, "stripe path refused: stripe_enabled is not set");
            refused("stripe_disabled");
            let ack = HelloAck {
                ok: false,
                error: Some("this server has no stripe transport (stripe_enabled: false)".into()),
                ..Default::default()
            };
            refuse_on(conn, send, ack).await;
            return None;
        }
    };
    let pipe = match hello.pipe {
        None => None,
        Some(p) if p.count < 2 || p.index >= p.count => {
            warn!(client = %identity, %remote, index = p.index, count = p.count, "bad pipe numbers in hello; connection closed");
            refused("bad_hello");
            conn.close(close::PROTOCOL.into(), b"bad pipe numbers");
            return None;
        }
        Some(p) => {
            let key = (identity.clone(), hello.session, hello.path.clone());
            if p.index > 0 {
                join_pipe(&accepting, key, p, conn, send, recv, hello.mode).await;
                return None;
            }
            Some((accepting.clone(), key, p.count))
        }
    };
    Some(Offer {
        identity,
        certificate: Some(certificate),
        carrier: Carrier::Native,
        remote,
        reply: Box::new(QuicOffer {
            conn,
            send,
            recv,
            mode: hello.mode,
            pipe,
            stripe: stripe.map(|(server, pipes)| (server, hello.path.clone(), pipes)),
        }),
        hello,
    })
}

/// A later pipe of a path: joins the set its pipe 0 made, answered as pipe 0 was; refused
/// (and counted) when there is no such set.
async fn join_pipe(
    accepting: &Accepting,
    key: PipeKey,
    p: hello::PipeOf,
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
    mode: TransportMode,
) {
    let set = accepting.pipes.get(&key).filter(|s| s.count() == p.count);
    let Some(set) = set else {
        let (client, _, path) = &key;
        warn!(%client, %path, pipe = p.index, "pipe without its path's first pipe; refused");
        (accepting.refused)("pipe_without_path");
        let ack = HelloAck {
            ok: false,
            error: Some(format!(
                "pipe {} of path `{path}`: the path's pipe 0 is not connected",
                p.index
            )),
            ..Default::default()
        };
        refuse_on(conn, send, ack).await;
        return;
    };
    if hello::write(&mut send, &set.ack).await.is_err() {
        return;
    }
    set.add(QuicTransport::new(conn, send, recv, None, mode, None));
}

/// The connection behind an offer, waiting for the server's answer.
struct QuicOffer {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    mode: TransportMode,
    /// Pipe 0 of a path with pipes: where its set is kept, under which key, and how many.
    pipe: Option<(Arc<Accepting>, PipeKey, u8)>,
    /// A stripe path: the stripe transport, the path's name and its pipe count.
    stripe: Option<(Arc<dyn RideServer>, String, u8)>,
}

/// Answer `ack` (a refusal) and close the connection once it has reached the client (bounded).
async fn refuse_on(conn: quinn::Connection, mut send: quinn::SendStream, ack: HelloAck) {
    let _ = hello::write(&mut send, &ack).await;
    let _ = send.finish();
    let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
    let reason = ack.error.unwrap_or_default();
    conn.close(close::REFUSED.into(), reason.as_bytes());
}

impl OfferReply for QuicOffer {
    fn accept(
        self: Box<Self>,
        ack: HelloAck,
    ) -> BoxFuture<'static, Result<Arc<dyn PathTransport>>> {
        Box::pin(async move {
            let QuicOffer {
                conn,
                mut send,
                recv,
                mode,
                pipe,
                stripe,
            } = *self;
            if let Some((server, path, pipes)) = stripe {
                // The session is known before the client hears the answer and registers.
                let ack = HelloAck {
                    stripe_port: Some(server.port()),
                    ..ack
                };
                let joined = server.join(&conn, &path, pipes)?;
                if let Err(e) = hello::write(&mut send, &ack).await {
                    joined.forget();
                    return Err(e.context("cannot answer the hello"));
                }
                let t = QuicTransport::new(conn, send, recv, None, mode, None);
                return Ok(joined.transport(t));
            }
            hello::write(&mut send, &ack)
                .await
                .context("cannot answer the hello")?;
            let t = QuicTransport::new(conn, send, recv, None, mode, None);
            let Some((accepting, key, count)) = pipe else {
                return Ok(t as Arc<dyn PathTransport>);
            };
            // Kept as soon as the answer is queued: the client dials the other pipes when it has
            // the answer, a handshake later.
            let group = quic::PipeGroup::new(
                accepting.congestion,
                mpquic_core::mtu::udp_payload(crate::io::socket::DEFAULT_LINK_MTU),
            );
            let set = QuicPipes::new(group, count, ack, t);
            accepting.pipes.insert(key, &set);
            Ok(set as Arc<dyn PathTransport>)
        })
    }

    fn refuse(self: Box<Self>, ack: HelloAck) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let QuicOffer { conn, send, .. } = *self;
            refuse_on(conn, send, ack).await;
        })
    }
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
    fn on_closed(&self, peer_code: Option<u32>) {
        self.inner.on_closed(peer_code)
    }
}

/// The chunks a stream writer wrote lately, with when: bounded by `RECENT_BYTES` and
/// `RECENT_AGE`. A chunk is a run of frames (length, packet) exactly as written.
#[derive(Default)]
struct Recent {
    chunks: VecDeque<(Instant, Bytes)>,
    bytes: usize,
}

impl Recent {
    fn push(&mut self, now: Instant, chunk: Bytes) {
        self.bytes += chunk.len();
        self.chunks.push_back((now, chunk));
        self.prune(now);
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.bytes = 0;
    }

    /// Let go of what is older than `RECENT_AGE`, and of the oldest beyond `RECENT_BYTES`.
    fn prune(&mut self, now: Instant) {
        while let Some((at, c)) = self.chunks.front() {
            if self.bytes <= RECENT_BYTES && now.saturating_duration_since(*at) <= RECENT_AGE {
                break;
            }
            self.bytes -= c.len();
            self.chunks.pop_front();
        }
    }

    /// The packets of the chunks written since `since` (views, no copies), oldest first; the
    /// memory is let go.
    fn packets_since(&mut self, since: Instant) -> Vec<Bytes> {
        let mut out = Vec::new();
        for (at, chunk) in std::mem::take(&mut self.chunks) {
            if at < since {
                continue;
            }
            let mut rest = chunk;
            while let Some(h) = rest.first_chunk::<STREAM_HEADER>() {
                let (n, _) = mpquic_core::reassembly::parse_header(h);
                if n == 0 || rest.len() < STREAM_HEADER + n {
                    break;
                }
                out.push(rest.slice(STREAM_HEADER..STREAM_HEADER + n));
                rest = rest.slice(STREAM_HEADER + n..);
            }
        }
        self.bytes = 0;
        out
    }
}

/// What a path's writer task (`path_writer`) works with.
struct Writer {
    sink: Arc<dyn Sink>,
    conn: quinn::Connection,
    /// The first lane's stream (none on a CONNECT-IP connection: datagrams only).
    send: Option<quinn::SendStream>,
    rx: mpsc::Receiver<Queued>,
    /// Bytes waiting, shared with `send_batch`'s bound: the writer takes off what leaves.
    waiting: Arc<AtomicU64>,
    /// Their flows, likewise.
    flows: Arc<WaitingFlows>,
    /// The carriage of the moment (reliable, `auto`); `None`: datagram mode, no stream.
    on_stream: Option<Arc<AtomicBool>>,
    recent: Arc<Mutex<Recent>>,
    /// Whether to keep them (`set_hand_over`).
    hand_over: Arc<AtomicBool>,
    /// The controller's figures without cloning it (`pace`).
    meter: Option<Arc<quic::WindowMeter>>,
    /// `rate_limit` (bits/s, 0: none).
    rate_cap: Arc<AtomicU64>,
}

/// A path's send side, in every mode. Frames from `send_batch` wait in a `SendQueue` per lane
/// (`RankedQueues`: the tunnel's traffic classes in strict priority; in each, sparse flows
/// first, bounded, nothing older than `max_wait`), leave it paced (`pace`; on the stream at the
/// congestion controller's rate, `pacing.rs`: the engine would otherwise take a window of two
/// BDPs at once and queue one at the bottleneck), and go as the carriage of the moment says
/// (or as the frame's lane says: a class in datagram or reliable mode):
///
/// - **on the stream**, up to `STREAM_BATCH` bytes per write. The frames are copied into one
///   contiguous chunk: handing quinn the frames as separate chunks (`write_all_chunks`, no
///   copy) measured 8% slower here (its send buffer then carries a chunk per packet into
///   framing), and pinned more memory. The chunk is kept (`Recent`) for a hand-over to another
///   path, and before each write the stream's send window is set from the path's congestion
///   window, which bounds its backlog in time (`reliable::stream_window`).
/// - **as datagrams**, each frame without its header. Before the datagrams went through this
///   queue, QUIC's own first-in-first-out datagram buffer was their queue: a ping in the same
///   tunnel as one upload waited behind the upload's datagrams (50 Mbit/s, 20 ms, scenario 10:
///   median 86 ms under the upload against 20.8 idle).
async fn path_writer(w: Writer) {
    let Writer {
        sink,
        conn,
        send,
        mut rx,
        waiting,
        flows,
        on_stream,
        recent,
        hand_over,
        meter,
        rate_cap,
    } = w;
    let mut streams = LaneStreams::new(send);
    // What goes on the streams this turn, by lane rank (each lane its own stream).
    let mut batches: Vec<BytesMut> = vec![BytesMut::with_capacity(STREAM_BATCH + 65_538)];
    let mut queue = RankedQueues::new(WRITER_QUEUE, mpquic_core::reliable::HANDOFF_TIME);
    let mut pacer = Pacer::default();
    let mut stale = Dropped::default();
    let mut refused = Dropped::default();
    let mut failed = (Dropped::default(), Dropped::default(), Dropped::default());
    let mut loss = mpquic_core::loss::LossEstimate::default();
    // What left the writer's hands, sent or dropped, no longer waits.
    let gone = |d: &mut Dropped, reason: DropReason| {
        waiting.fetch_sub(d.bytes, Ordering::Relaxed);
        d.report(&*sink, reason);
    };
    loop {
        // Take what has arrived; wait for something when nothing is queued.
        if queue.is_empty() {
            // Nothing waits to be written: a closed connection ends the writer here (its
            // queue's sender lives as long as the transport, which may outlive it), and what
            // it remembers goes once it is too old to hand over (a path that fell idle, a
            // failover's backup, would otherwise keep up to `RECENT_BYTES` for good).
            let kept = !recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .chunks
                .is_empty();
            let next = tokio::select! {
                next = rx.recv() => next,
                _ = conn.closed() => None,
                _ = tokio::time::sleep(RECENT_AGE), if kept => {
                    recent.lock().unwrap_or_else(|e| e.into_inner()).prune(Instant::now());
                    continue;
                }
            };
            let Some(next) = next else {
                return;
            };
            enqueue(&mut queue, &flows, &mut refused, next);
        }
        while let Ok(next) = rx.try_recv() {
            enqueue(&mut queue, &flows, &mut refused, next);
        }
        gone(&mut refused, DropReason::QueueFull);
        // A closed connection takes nothing more: what waits is lost with it, and the writer
        // ends (it would otherwise wait for room in a buffer that never drains, holding the
        // connection, and the client's socket with it: 13 -> 32 fds after a flap storm).
        if conn.close_reason().is_some() {
            close_queue(&mut rx, &mut queue, &flows, &mut refused);
            gone(&mut refused, DropReason::SendFailed);
            return;
        }
        let stream = on_stream
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Relaxed));
        let cap = Some(rate_cap.load(Ordering::Relaxed))
            .filter(|&c| c > 0)
            .map(|c| {
                let ipv6 = conn.remote_address().is_ipv6();
                mpquic_core::pacing::link_cap(c, conn.stats().path.current_mtu, ipv6)
            });
        pacer.set_rate(mpquic_core::pacing::capped(
            pace(&conn, meter.as_deref(), stream),
            cap,
        ));
        let now = Instant::now();
        queue.set_max_wait(max_wait(stream, conn.rtt()));
        let at = pacer.ready_at(now, PACED_PACKET);
        if at > now {
            // What arrives meanwhile is queued, and a sparse packet leaves first.
            tokio::select! {
                _ = tokio::time::sleep_until(at.into()) => {}
                _ = conn.closed() => {}
            }
            continue;
        }
        // Datagrams: only as many as keep QUIC's own buffer short (`engine_room`).
        let room = match stream {
            true => STREAM_BATCH,
            false => engine_room(&conn),
        };
        if room == 0 {
            tokio::select! {
                _ = tokio::time::sleep(ENGINE_WAIT) => {}
                _ = conn.closed() => {}
            }
            continue;
        }
        let budget = pacer.budget(now).min(STREAM_BATCH).min(room);
        batches.iter_mut().for_each(BytesMut::clear);
        let mut batched = 0;
        let mut sent = 0;
        let mut written = Dropped::default();
        // The send time, for the receiver's playout (`stream_rx`): when the frames enter the
        // stream, so the wait in our own queue is not taken for the path's. One clock read
        // serves the batch.
        let sent_us = stream_rx::clock_us();
        while sent + batched < budget {
            let Some(Frame {
                bytes: frame,
                rank,
                carry,
                flow,
            }) = queue.pop(now, &mut |f: Frame| {
                flows.sub(f.flow);
                stale.add(f.bytes.len() - STREAM_HEADER)
            })
            else {
                break;
            };
            let len = frame.len() - STREAM_HEADER;
            waiting.fetch_sub(len as u64, Ordering::Relaxed);
            flows.sub(flow);
            let datagram = match carry {
                LaneCarry::Path => !stream,
                LaneCarry::Datagram => true,
                // A connection without a stream (datagram mode) has no other way.
                LaneCarry::Stream => on_stream.is_none(),
            };
            if datagram {
                match send_datagram(&conn, frame.slice(STREAM_HEADER..)) {
                    Ok(()) => {
                        sent += len;
                        continue;
                    }
                    // `auto`: a packet too big for a datagram still fits the stream.
                    Err(DropReason::Oversized) if on_stream.is_some() => {}
                    Err(DropReason::QueueFull) => {
                        failed.0.add(len);
                        continue;
                    }
                    Err(DropReason::Oversized) => {
                        failed.1.add(len);
                        continue;
                    }
                    Err(_) => {
                        failed.2.add(len);
                        continue;
                    }
                }
            }
            written.add(len);
            let r = usize::from(rank);
            if batches.len() <= r {
                batches.resize_with(r + 1, BytesMut::new);
            }
            let batch = &mut batches[r];
            let at = batch.len();
            batch.extend_from_slice(&frame);
            batched += frame.len();
            let len = u16::from_be_bytes([frame[0], frame[1]]);
            batch[at..at + STREAM_HEADER].copy_from_slice(&stream_rx::header(len, sent_us));
        }
        // A frame that waited too long was dropped rather than added to the delay of
        // everything behind it (`max_wait`).
        gone(&mut stale, DropReason::QueueFull);
        failed.0.report(&*sink, DropReason::QueueFull);
        failed.1.report(&*sink, DropReason::Oversized);
        failed.2.report(&*sink, DropReason::SendFailed);
        if batched == 0 && sent == 0 {
            continue;
        }
        let path = conn.stats().path;
        pacer.spend(mpquic_core::pacing::on_the_wire(
            sent + batched,
            path.current_mtu,
        ));
        if batched == 0 {
            continue;
        }
        loss.on_counters(now, path.sent_packets, path.lost_packets);
        conn.set_send_window(mpquic_core::reliable::stream_window(
            path.cwnd,
            path.rtt,
            loss.loss(),
        ));
        // Highest class first, each on its own stream.
        for (rank, batch) in batches.iter_mut().enumerate() {
            if batch.is_empty() {
                continue;
            }
            let chunk = batch.split().freeze();
            let written_ok = match streams.get(&conn, rank as u8).await {
                Some(send) => send.write_chunk(chunk.clone()).await.is_ok(),
                None => false,
            };
            if written_ok {
                if hand_over.load(Ordering::Relaxed) {
                    recent
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(Instant::now(), chunk);
                }
            } else {
                // Everything in this turn and everything still queued is lost with the
                // stream; closing the queue makes later packets fail (and count) in
                // `send_batch`.
                close_queue(&mut rx, &mut queue, &flows, &mut refused);
                gone(&mut refused, DropReason::SendFailed);
                written.report(&*sink, DropReason::SendFailed);
                return;
            }
        }
    }
}

/// The streams a path's writer sends on: the hello stream for the first traffic class (and for
/// a tunnel without classes), a unidirectional stream for each other class that goes on a
/// stream, opened when it first does and prioritised by rank (quinn sends a higher-priority
/// stream's data first). Head-of-line blocking is per stream, so a class never waits behind a
/// lower class's retransmissions (scenario 01: critical pings on a 30%-loss link waited
/// behind bulk's on one shared stream, median 45.6 ms against 16.8 on a stream of their own).
struct LaneStreams {
    first: Option<quinn::SendStream>,
    /// By rank - 1.
    others: Vec<Option<quinn::SendStream>>,
}

impl LaneStreams {
    fn new(first: Option<quinn::SendStream>) -> LaneStreams {
        LaneStreams {
            first,
            others: Vec::new(),
        }
    }

    /// The stream of lane `rank`; `None` when the connection takes no more streams (closed).
    async fn get(&mut self, conn: &quinn::Connection, rank: u8) -> Option<&mut quinn::SendStream> {
        let Some(i) = usize::from(rank).checked_sub(1) else {
            return self.first.as_mut();
        };
        if self.others.len() <= i {
            self.others.resize_with(i + 1, || None);
        }
        if self.others[i].is_none() {
            let s = conn.open_uni().await.ok()?;
            // The first class's stream has quinn's default priority, 0.
            let _ = s.set_priority(-i32::from(rank));
            self.others[i] = Some(s);
        }
        self.others[i].as_mut()
    }
}

/// Queue a packet handed to the writer in its lane's queue, by its flow; what a full queue
/// refuses (this packet, or a bulk one a sparse packet displaced) is counted in `refused`.
fn enqueue(
    queue: &mut RankedQueues<Frame>,
    flows: &WaitingFlows,
    refused: &mut Dropped,
    (at, lane, flow, bytes): Queued,
) {
    let frame = Frame {
        bytes,
        // Lanes are fewer (a tunnel's); the peer takes no more streams than that.
        rank: lane.rank.min(mpquic_core::wire::MAX_LANES as u8 - 1),
        carry: lane.carry,
        flow,
    };
    if let Err(f) = queue.push(lane.rank, at, flow, frame) {
        flows.sub(f.flow);
        refused.add(f.bytes.len() - STREAM_HEADER);
    }
}

/// Close the writer's channel (later packets fail, and count, in `send_batch`) and add
/// everything still waiting in it and in the queue to `lost`.
fn close_queue(
    rx: &mut mpsc::Receiver<Queued>,
    queue: &mut RankedQueues<Frame>,
    flows: &WaitingFlows,
    lost: &mut Dropped,
) {
    rx.close();
    while let Ok((_, _, flow, frame)) = rx.try_recv() {
        flows.sub(flow);
        lost.add(frame.len() - STREAM_HEADER);
    }
    for frame in queue.drain() {
        flows.sub(frame.flow);
        lost.add(frame.bytes.len() - STREAM_HEADER);
    }
}

/// Datagrams on a path with a shorter RTT go at the window's rate, as QUIC would send them:
/// the queue a window leaves at the bottleneck is about one RTT of waiting, nothing at these
/// RTTs, while paced at an estimate taken from bursty samples on an unshaped veth (RTT under
/// a millisecond) the download fell 10-20% (1.33-1.35 against 1.49-1.72 Gbit/s).
const PACE_DATAGRAMS_FROM: Duration = Duration::from_millis(5);

/// The writer's rate in bytes/s: our controller's pacing rate (`controller_rate`), on the
/// stream and as datagrams alike (datagrams from `PACE_DATAGRAMS_FROM` of RTT). It keeps a
/// path's backlog in our queue (where sparse flows pass it) rather than at the bottleneck, and
/// lets the controller drain a queue there: quinn lets datagrams out at 1.25 windows per RTT
/// and reads no rate from the controller, so
/// datagrams paced by the window alone left up to a BDP standing at the bottleneck (scenario
/// 10: ping median 38 ms under one upload at 21 ms idle; paced here, 31 ms; scenario 19's
/// critical pings beside a bulk instance: p99 +29 -> +14 ms over idle). quinn's own
/// controllers give no rate: their stream is not paced (its send window bounds it), their
/// datagrams go at the window per RTT. The schedulers still see the window and its room
/// (`QuicTransport::load`): told only the pacing rate, per-packet bonding split a flow by the
/// paths' rates, and a path fed no more than its estimate never showed it could carry more
/// (one flow over 200 + 100 Mbit/s: 64-143 Mbit/s against 240-256). What waits here while
/// they count the window's room as free reaches the peer later than the RTTs say, which the
/// resequencer's stretching wait absorbs (`reseq::Stretch`).
fn pace(conn: &quinn::Connection, meter: Option<&quic::WindowMeter>, stream: bool) -> Option<u64> {
    let paced = stream || conn.rtt() >= PACE_DATAGRAMS_FROM;
    let rate = controller_rate(conn, meter).filter(|_| paced);
    match (rate, stream) {
        (Some(bits), _) => Some(bits),
        (None, true) => None,
        (None, false) => Some(quic::rate_per_rtt(
            conn.congestion_state().window(),
            conn.rtt(),
        )),
    }
    .map(|bits| bits / 8)
}

/// The rate (bits/s) the connection's controller paces at, when it gives one: from the meter
/// (no clone of the controller) where there is one.
fn controller_rate(conn: &quinn::Connection, meter: Option<&quic::WindowMeter>) -> Option<u64> {
    match meter {
        Some(m) => m.pacing_rate(),
        None => conn.congestion_state().metrics().pacing_rate,
    }
}

/// Bytes of datagrams the writer may hand QUIC now: QUIC sends them as its window allows, first
/// in first out, so what it holds beyond a short run is where a ping would wait behind bulk
/// (`ENGINE_QUEUE_TIME` at the window's rate, `ENGINE_QUEUE_MIN` at least, which keeps the
/// engine busy between the writer's turns).
fn engine_room(conn: &quinn::Connection) -> usize {
    let held = quic::DATAGRAM_SEND_BUFFER.saturating_sub(conn.datagram_send_buffer_space());
    let rate = quic::rate_per_rtt(conn.congestion_state().window(), conn.rtt()) / 8;
    let limit = (rate.saturating_mul(ENGINE_QUEUE_TIME.as_micros() as u64) / 1_000_000)
        .max(ENGINE_QUEUE_MIN as u64) as usize;
    limit.saturating_sub(held)
}

/// How long a packet may wait in a path's writer queue: on the stream, `reliable::queue_wait`
/// (three round trips); as datagrams the queue's bound in bytes (`quic::datagram_queue_limit`,
/// 40 ms at the path's rate and at least 512 KiB) decides, and this is only the backstop.
fn max_wait(stream: bool, srtt: Duration) -> Duration {
    match stream {
        true => mpquic_core::reliable::queue_wait(srtt),
        false => mpquic_core::reliable::MAX_QUEUE_WAIT,
    }
}

/// A packet's size for the pacer: it waits until one full packet may go.
const PACED_PACKET: usize = 1500;

/// The bytes a connection has carried on its link both ways, its datagrams' IP and UDP headers
/// included: what a metered link counts (`data_budget`).
fn on_the_link(st: &quinn::ConnectionStats, remote: SocketAddr) -> u64 {
    let header = mpquic_core::pacing::ip_udp_header(remote.is_ipv6()) as u64;
    st.udp_tx.bytes + st.udp_rx.bytes + (st.udp_tx.datagrams + st.udp_rx.datagrams) * header
}

/// Send one datagram, refusing (and reporting) rather than letting the QUIC engine silently
/// drop older queued datagrams when its buffer is full. `send_datagram_wait` checks for space
/// and queues under one lock and never evicts; polled once, "would wait" means the buffer is
/// full. (`send_datagram` would make room by discarding queued datagrams uncounted, and a
/// separate space check before it races with the other threads that send.)
fn send_datagram(conn: &quinn::Connection, pkt: Bytes) -> Result<(), DropReason> {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let fut = std::pin::pin!(conn.send_datagram_wait(pkt));
    match fut.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(Ok(())) => Ok(()),
        Poll::Ready(Err(quinn::SendDatagramError::TooLarge)) => Err(DropReason::Oversized),
        Poll::Ready(Err(_)) => Err(DropReason::SendFailed),
        Poll::Pending => Err(DropReason::QueueFull),
    }
}
