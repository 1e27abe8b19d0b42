//! A path's transport: how inner packets and control messages (probes) cross one path, and how a
//! path is set up (the client dials, the server accepts; identity and hello). The tunnel (and the
//! core's bonds behind it) only see `PathTransport`; the client and server shells only see
//! `Dialer` and `Listener`. QUIC is the first implementation (`quic.rs`: DATAGRAM frames, or in
//! reliable mode one stream per path), so a stripe or a MASQUE transport is one more module here,
//! not an edit of the tunnel, the client or the server.
//!
//! Sending takes batches (`PacketBatch`: packets in one reusable buffer, each with headroom for a
//! transport's own header). Receiving is pushed: a transport delivers what arrives to the `Sink`
//! it was started with (the tunnel's, for one path and one connection generation), a datagram at
//! a time, as the QUIC engine yields them (its own socket receive is batched underneath).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Weak};

use anyhow::Result;
use mpquic_core::DropReason;

use crate::hello::{Hello, HelloAck};
use crate::io::batch::PacketBatch;

pub(crate) mod admit;
pub mod masque;
pub mod quic;
mod stream_rx;
pub mod stripe;

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
    /// The client's certificate was revoked (a reload added it to `revoked:`).
    pub const REVOKED: u32 = 7;
    /// The client process is stopping: the server ends its session at once rather than keep
    /// it for a return (`sessions::Presence::Left`). Older servers read it as any close.
    pub const LEAVING: u32 = 8;
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How a transport ended.
#[derive(Debug, Clone)]
pub struct Closed {
    pub reason: String,
    /// The application code the peer closed it with (`close`), if it did.
    pub peer_code: Option<u32>,
}

impl Closed {
    /// A QUIC connection's end.
    pub fn of(e: &quinn::ConnectionError) -> Closed {
        let peer_code = match e {
            quinn::ConnectionError::ApplicationClosed(a) => {
                u32::try_from(a.error_code.into_inner()).ok()
            }
            _ => None,
        };
        Closed {
            reason: e.to_string(),
            peer_code,
        }
    }
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// The transport's own view of the path, for status and metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct TransportStats {
    pub rtt: Option<Duration>,
    pub cwnd: Option<u64>,
    /// The rate the congestion controller paces at (bits/s), when it says (model-based ones).
    pub pacing_rate: Option<u64>,
    pub sent_packets: u64,
    pub lost_packets: u64,
    /// The UDP payload its packets have now, and the largest control message or datagram-mode
    /// packet (with its header) it can send, when the transport has such limits.
    pub udp_payload: Option<u16>,
    pub max_datagram: Option<usize>,
    /// The UDP payload its link carries (the client's configured link), which a smaller
    /// `udp_payload` is below because the route carries less (`pmtu.rs`).
    pub link_payload: Option<u16>,
    /// Reliable mode: the delay the receiver holds the path's packets to (`stream_rx`).
    pub playout: Option<Duration>,
    /// Reliable mode: the peer's streams the receiver reads (`stream_rx::streams`).
    pub streams_in: Option<u64>,
    /// Packets the peer has newly acknowledged (the tunnel core's ACK watch); `None` where
    /// data is not acknowledged (stripe).
    pub acks: Option<u64>,
    /// Bytes on the link both ways, IP and UDP headers included (`data_budget`); `None`
    /// where the transport does not count them.
    pub wire_bytes: Option<u64>,
    /// Times the peer's address changed under the connection and the transport followed (a
    /// NAT rebinding: QUIC's connection migration, a stripe pipe's new port); seen by the side
    /// that receives from a moving peer, the server.
    pub peer_moves: u64,
    /// Stripe (server): packets sent again to the peer's new address after it moved.
    pub rebind_resent: u64,
    /// What the QUIC engine's loss detection learned of the link's reordering; `None` where
    /// the transport detects loss its own way (stripe).
    pub reordering: Option<Reordering>,
}

/// A link's reordering as the QUIC engine's loss detection saw it and adapted to it (the
/// engine's `connection/reordering.rs`, our change to quinn-proto: `vendor/README.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reordering {
    /// Packets acknowledged after a later packet was, and the deepest of them in packets.
    pub reordered: u64,
    pub depth: u64,
    /// Packets declared lost that were acknowledged afterwards (late, not lost).
    pub spurious: u64,
    /// The thresholds in force: packets, and the delay beyond RFC 9002's time threshold.
    pub packet_threshold: u64,
    pub extra_delay: Duration,
}

impl Reordering {
    /// Several connections of one path (pipes): counts summed, the widest thresholds.
    pub fn merge(self, o: Reordering) -> Reordering {
        Reordering {
            reordered: self.reordered + o.reordered,
            depth: self.depth.max(o.depth),
            spurious: self.spurious + o.spurious,
            packet_threshold: self.packet_threshold.max(o.packet_threshold),
            extra_delay: self.extra_delay.max(o.extra_delay),
        }
    }
}

/// Where a transport delivers what it receives, and reports what it lost after accepting it.
pub trait Sink: Send + Sync + 'static {
    /// A datagram: an inner packet or a control message (`wire::decode` tells them apart).
    fn on_datagram(&self, d: &[u8]);
    /// The end of what one wake-up of the transport's receiver delivered: the inner packets
    /// `on_datagram` and `on_stream_packet` queued go to the TUN device now, coalesced.
    /// Every receive loop calls it before it waits again.
    fn on_batch_end(&self);
    /// An inner packet from an ordered byte stream (reliable mode); `None` for a malformed frame.
    fn on_stream_packet(&self, pkt: Option<&[u8]>);
    /// Packets accepted by `send_batch` that the transport dropped after all (counted under
    /// `reason`): lost with a failed stream, or waited too long in its queue.
    fn on_send_dropped(&self, reason: DropReason, packets: u64, bytes: u64);
    /// Packets the transport's sender marked "congestion experienced" (ECN) as they left a
    /// queue they had waited in long (`sendq::SendQueue::pop_marking`).
    fn on_ce_marked(&self, packets: u64);
    /// A packet that arrived for this path and was refused before it was a datagram (a stripe
    /// packet that failed authentication or the replay check, or was malformed).
    fn on_received_dropped(&self, reason: DropReason);
    /// The transport has ended (connection closed); nothing more arrives. `peer_code`: the
    /// application code the peer closed it with (`close`), if it did.
    fn on_closed(&self, peer_code: Option<u32>);
}

/// The lane (traffic class) of the packets of one `send_batch`, as a path's transport needs
/// it: its rank, the order in which the path's writer serves its lanes (strict priority: rank
/// 0 first, so a critical packet never waits behind bulk in the tunnel's own queues), and how
/// its packets travel on the path. A tunnel without classes sends everything in rank 0, as
/// the path carries it (`LaneCarry::Path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneSend {
    pub rank: u8,
    pub carry: LaneCarry,
}

/// How a lane's packets travel on a path: as the path carries them now (the connection's mode;
/// `auto`: its loss decides), or always as datagrams, or always on the path's stream (a class's
/// `transport_mode: datagram` / `reliable` in a tunnel whose connections have a stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneCarry {
    Path,
    Datagram,
    Stream,
}

pub trait PathTransport: Send + Sync + 'static {
    /// Write this transport's header into the headroom of the packets `which` of `batch`
    /// (`PacketBatch::with_header_mut`). Called for every path of a batch before any
    /// `send_batch`, because once a transport takes packets the batch is shared and immutable.
    fn prepare(&self, _batch: &mut PacketBatch, _which: &[usize]) {}
    /// Send the packets `which` of `batch` (already MSS-clamped), all of `lane`. Each packet it
    /// cannot take is reported to `refused` with the reason (the caller counts it); the rest are
    /// on their way. A transport may write its header into a packet's headroom, or take it
    /// without a copy. A transport with one queue and one carriage ignores `lane`.
    fn send_batch(
        &self,
        batch: &mut PacketBatch,
        which: &[usize],
        lane: LaneSend,
        refused: &mut dyn FnMut(usize, DropReason),
    );
    /// Send a control message (probe, reply): never queued behind data, never evicting it.
    fn send_control(&self, msg: &[u8]) -> Result<(), DropReason>;
    /// `transport_mode: auto`: how the tunnel core wants the path's inner packets carried now
    /// (`mpquic_core::recovery`). A transport with one way of carrying them ignores it.
    fn set_carry(&self, _carry: mpquic_core::recovery::Carry) {}
    /// Whether another path is up to take what this one sent lately, should it go down
    /// (`Router::can_hand_over`): a transport that keeps copies for `abandon` keeps them only
    /// while someone could take them.
    fn set_hand_over(&self, _possible: bool) {}
    /// The path's loss and smoothed RTT as its probes see them (`PathHealth::loss`, `srtt`):
    /// the link's own loss, not the overflow a congestion controller causes at a queue, which
    /// a connection's loss counts too. `auto` decides by them how a packet that is not TCP
    /// goes (`quic::writer::non_tcp_on_stream`).
    fn set_path_probes(&self, _loss: f64, _srtt: Option<std::time::Duration>) {}
    /// The path carries traffic classes: its congestion controller keeps the bottleneck's
    /// queue short for the higher classes (`mpquic_core::cc::Bbr::yielding`). A transport or
    /// controller without that mode ignores it.
    fn set_yielding(&self) {}
    /// The transport carries one of the paths of a tunnel whose paths' backlogs `backlog`
    /// gathers: it tells its controller that its traffic offers less than the path takes only
    /// when no path of the tunnel has anything waiting (`TunnelBacklog`). A transport that is
    /// not told never does.
    fn join_tunnel(&self, _backlog: &TunnelBacklog) {}
    /// `rate_limit`: the path sends no faster than this (bits/s; `None`: as its controller
    /// allows). A transport without a pacer of its own ignores it.
    fn set_rate_cap(&self, _bits_per_s: Option<u64>) {}
    fn remote(&self) -> SocketAddr;
    fn stats(&self) -> TransportStats;
    /// What the per-packet schedulers need, cheaply (read before routing each batch).
    fn load(&self) -> mpquic_core::PathLoad;
    fn close(&self, code: u32, reason: &str);
    /// Resolves with the reason when the transport has ended (closed by either side, timed out).
    fn closed(&self) -> BoxFuture<'static, Closed>;
    /// Start the receive side (and, for streams, the writer), delivering to `sink`.
    fn start(self: Arc<Self>, sink: Arc<dyn Sink>);
    /// The path went down and another is up: stop using this transport (it closes, so
    /// nothing it still holds is delivered late, after the path recovers) and hand back the
    /// inner packets it sent since `since` that may not have arrived, to be sent on a live
    /// path. A transport that keeps no copies returns nothing.
    fn abandon(&self, since: std::time::Instant) -> Vec<bytes::Bytes>;
    /// What carries the path's datagrams (`quic`, `stripe`), for status.
    fn kind(&self) -> &'static str {
        "quic"
    }
    /// A path over several pipes: each pipe's figures. One pipe: nothing.
    fn pipes(&self) -> Vec<mpquic_status::PipeStatus> {
        Vec::new()
    }
}

/// A transport still being set up (a dial that has more steps: other pipes, stripe
/// registration, the client's own checks of the answer): closed if dropped before `keep`.
/// Such a transport may already run tasks that hold its connection open, so letting go of it
/// is not enough: a dial given up by its timeout, or failing half-way, would leave its
/// connection and socket behind for good.
pub(crate) struct Unfinished<T: PathTransport + ?Sized>(Option<Arc<T>>);

impl<T: PathTransport + ?Sized> Unfinished<T> {
    pub(crate) fn new(t: Arc<T>) -> Self {
        Unfinished(Some(t))
    }

    pub(crate) fn get(&self) -> &Arc<T> {
        self.0.as_ref().expect("taken only by keep")
    }

    /// Set up: the caller owns it now.
    pub(crate) fn keep(mut self) -> Arc<T> {
        self.0.take().expect("taken only by keep")
    }
}

impl<T: PathTransport + ?Sized> Drop for Unfinished<T> {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.close(close::SHUTDOWN, "path setup abandoned");
        }
    }
}

/// Packets a transport's sender dropped after `send_batch` accepted them, counted by packets
/// and inner bytes and told to its sink in one call.
#[derive(Default)]
pub(crate) struct Dropped {
    packets: u64,
    bytes: u64,
}

impl Dropped {
    pub(crate) fn add(&mut self, inner_bytes: usize) {
        self.packets += 1;
        self.bytes += inner_bytes as u64;
    }

    /// Tell the sink, and start again from zero.
    pub(crate) fn report(&mut self, sink: &dyn Sink, reason: DropReason) {
        if self.packets > 0 {
            sink.on_send_dropped(reason, self.packets, self.bytes);
        }
        *self = Dropped::default();
    }
}

/// Client side of session setup: open a path to the server and exchange the hello.
pub trait Dialer: Send + Sync + 'static {
    /// Dial the server over `path` (bound as its config says) and send `hello`. Returns the
    /// path's transport, not yet started, and the server's answer, which may be a refusal (the
    /// caller then closes the transport). `known`: what the client knows of the path from its
    /// earlier connections.
    fn dial<'a>(
        &'a self,
        path: &'a crate::config::PathConfig,
        hello: &'a Hello,
        known: Known,
    ) -> BoxFuture<'a, Result<Dialed>>;
    /// A reload: the TLS files read again for the connections dialled from now on (running
    /// ones keep theirs). An error leaves the running settings.
    fn reload_tls(
        &self,
        _cfg: &crate::config::Config,
        _ccfg: &crate::config::ClientConfig,
    ) -> Result<()> {
        Ok(())
    }
}

/// A dialled path: its transport (not yet started), the server's answer, and how the session
/// is carried.
pub struct Dialed {
    pub transport: Arc<dyn PathTransport>,
    pub ack: HelloAck,
    pub carrier: Carrier,
}

/// How a session's packets travel between its two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// mpquic's own protocol.
    Native,
    /// CONNECT-IP between two mpquic ends (the request carried our hello, the answer the
    /// server's: `connect_ip::request::HELLO_FIELD`): as the native protocol, with probes,
    /// bonding and per-packet policies, in HTTP Datagrams.
    ConnectIp,
    /// CONNECT-IP with a standard end: IP packets only, a session per connection.
    StandardConnectIp,
}

impl Carrier {
    pub fn as_str(self) -> &'static str {
        match self {
            Carrier::Native => "native",
            Carrier::ConnectIp => "connect-ip",
            Carrier::StandardConnectIp => "connect-ip (standard)",
        }
    }

    /// The other end speaks IP only: no probes, no bond headers (`HealthMode::Transport`).
    pub fn plain(self) -> bool {
        self == Carrier::StandardConnectIp
    }
}

/// What the client knows of a path when it dials it again.
#[derive(Debug, Clone, Copy, Default)]
pub struct Known {
    /// A UDP payload smaller than the link's, for a path whose route carries less (`pmtu.rs`);
    /// both directions keep within it.
    pub payload: Option<u16>,
    /// The path's RTT as its probes measured it: the handshake's first retransmission waits
    /// about three of these rather than a second, so a path that comes back from an outage is
    /// connected again within a fraction of a second of its return.
    pub rtt: Option<std::time::Duration>,
    /// Send each datagram on its own, without UDP GSO batches: the path answered its probes
    /// while its data did not arrive (`io::socket::Unsegmented`).
    pub unsegmented: bool,
}

/// Server side of session setup: paths offered by authenticated clients. Connections that fail
/// before that (handshake, identity, hello) are refused and counted by the listener itself.
pub trait Listener: Send + Sync + 'static {
    /// The next offer; `None` once the listener is closed.
    fn next(&self) -> BoxFuture<'_, Option<Offer>>;
    /// Stop accepting and close every connection; resolves once they are closed (bounded).
    fn close(&self, code: u32, reason: &str) -> BoxFuture<'_, ()>;
}

/// A path offered by an authenticated client: who it is, where from, and its hello. The server
/// decides (session registry) and answers through `reply`.
pub struct Offer {
    /// The identity its certificate proves (the CN), or a CONNECT-IP client's token names.
    pub identity: String,
    /// That certificate's serial and expiry (revocation by serial, status); none for a
    /// CONNECT-IP client with a token.
    pub certificate: Option<crate::tls::certificate::Facts>,
    pub remote: SocketAddr,
    /// What the client asks for (a standard CONNECT-IP client's is made up by its listener).
    pub hello: Hello,
    /// How it came: `Carrier::plain` for a standard CONNECT-IP client (no probes, no bond
    /// headers; its path is up while its connection is: `HealthMode::Transport`).
    pub carrier: Carrier,
    pub reply: Box<dyn OfferReply>,
}

pub trait OfferReply: Send + 'static {
    /// Send the (positive) answer; the path's transport, not yet started.
    fn accept(self: Box<Self>, ack: HelloAck)
        -> BoxFuture<'static, Result<Arc<dyn PathTransport>>>;
    /// Send the refusal and close the connection once it has reached the client (bounded).
    fn refuse(self: Box<Self>, ack: HelloAck) -> BoxFuture<'static, ()>;
}

/// What waits for each path of one tunnel (each transport's count of bytes waiting for its
/// writer), read when a path's own queue empties. A path's own queue says nothing of the
/// tunnel's traffic under per-packet bonding: `wlb` sends each packet where a window has room,
/// so every writer's queue empties while the tunnel as a whole is saturated; taken for a
/// traffic that offers less than the path, that gave the fast path of two room beyond its
/// window and the ping beside eight bonded uploads p99 61-63 ms instead of 42-44.
#[derive(Clone, Default)]
pub struct TunnelBacklog(Arc<Mutex<Vec<Weak<AtomicU64>>>>);

impl TunnelBacklog {
    /// A path's count joins (one whose transport has gone is forgotten here).
    pub fn join(&self, waiting: &Arc<AtomicU64>) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(waiting));
    }

    /// Nothing waits for any path of the tunnel.
    pub fn empty(&self) -> bool {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.iter()
            .filter_map(Weak::upgrade)
            .all(|w| w.load(Ordering::Relaxed) == 0)
    }
}
