//! The stripe transport (`transport: stripe`; seed 000 section 14): a path's datagrams travel in
//! sealed raw UDP packets (`mpquic_core::stripe`: ChaCha20-Poly1305, replay window) over one or
//! more UDP sockets, "pipes", beside the path's QUIC connection. The QUIC connection does what
//! needs a handshake: the client's certificate, the hello, and the keys (a TLS exporter of that
//! session, so only its two ends can make or read the path's stripe packets); it also carries
//! control messages until a pipe is registered, and its end is the path's end.
//!
//! - **Registration** (`client.rs`): each client pipe sends REGISTER `[index, count]` to the
//!   server's stripe port every 200 ms until its REGISTER ACK arrives; a path with no answer
//!   within 1 s fails to connect (the client retries it like any path). The server learns each
//!   pipe's address from its authenticated REGISTER (and KEEPALIVEs, every 5 s, which also keep
//!   NAT mappings open).
//! - **Congestion control**: one controller per path, over all its pipes (`Flight`, a core
//!   controller): the receiver reports which counters arrived (`Feedback`, every second
//!   packet, or 5 ms after a lone one), the sender paces at the controller's rate (`Pacer`) within its
//!   window, and packets wait in a bounded queue in front of it (sparse flows first,
//!   `SendQueue`). A data packet goes to the registered pipe with the fewest bytes in flight.
//! - **Loss** is not retransmitted here: the tunnel's FEC (`stripe_data_shards` /
//!   `stripe_parity_shards`) repairs it, as on a datagram-mode QUIC path. The one exception is
//!   a NAT rebinding: what a pipe sent into the dead mapping is sent again to its new address
//!   (`Link::follow`, `sender::Resend`).
//! - **Refused packets** are counted: a packet that names this path's session but fails its tag
//!   or the replay window is a drop of the path (`unauthenticated`, `replayed`); on the server,
//!   packets that name no session are counted by the stripe socket (`server.rs`).
//! - A session that hears nothing on its pipes for 30 s is closed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use mpquic_core::pacing::Pacer;
use mpquic_core::stripe::feedback::Acks;
use mpquic_core::stripe::{self, Feedback, Flight, Kind, Opener, Refused, Sealer};
use mpquic_core::{DropReason, PathLoad};
use mpquic_status::PipeStatus;
use quinn::udp::Transmit;
use tokio::sync::{mpsc, Notify};

use super::quic::QuicTransport;
use super::{BoxFuture, Closed, LaneSend, PathTransport, Sink, TransportStats};
use crate::config::Congestion;
use crate::io::batch::PacketBatch;

pub mod client;
mod sender;
pub mod server;

/// A packet handed to the sender task: when, its inner flow, the stripe datagram.
pub(super) type Handed = (Instant, Option<u64>, Bytes);

/// Packets handed to the sender task and not yet taken, at most; and the least its queue may
/// hold waiting for the pacer (a packet beyond is refused, `queue_full`). The sender's queue
/// grows with the path: `queue_limit`.
const QUEUE: usize = 512;
/// A client pipe's keepalive, when it sent nothing else for this long.
const KEEPALIVE: Duration = Duration::from_secs(5);
/// A session whose pipes carried nothing authentic for this long is closed.
const SESSION_TIMEOUT: Duration = Duration::from_secs(30);
/// Registration: resent this often until answered; a path with no pipe answered after
/// `REGISTER_DEADLINE` fails to connect.
const REGISTER_RESEND: Duration = Duration::from_millis(200);
const REGISTER_DEADLINE: Duration = Duration::from_secs(1);
/// Datagrams read per receive call, and the buffer of each (a GRO batch fits).
const RECV_BATCH: usize = 16;
const RECV_BUF: usize = 64 * 1024;
/// Datagrams kept for the sink while there is none yet (`Link::early`).
const EARLY: usize = 1024;
/// A packet's size for the pacer's wait: one full packet.
const PACED_PACKET: usize = 1500;
/// Outer IPv4 and UDP headers: the stripe payload is the link's UDP payload less its own.
const OVERHEAD: usize = stripe::HEADER + stripe::TAG;

/// A UDP 5-tuple of the path.
struct Pipe {
    socket: Arc<dyn quinn::AsyncUdpSocket>,
    /// Client: the server's stripe address. Server: the client pipe's address, once registered.
    dest: Mutex<Option<SocketAddr>>,
    registered: AtomicBool,
    /// When the client last sent a KEEPALIVE (or REGISTER) on it, as µs since the link started.
    keepalive_us: AtomicU64,
    /// When an authentic packet last came from its address, as µs since the link started
    /// (server: the pipe a rebinding moved is the one that fell silent, `follow`).
    heard_us: AtomicU64,
    sent: AtomicU64,
    tx_bytes: AtomicU64,
    rx_bytes: AtomicU64,
}

impl Pipe {
    fn new(socket: Arc<dyn quinn::AsyncUdpSocket>, dest: Option<SocketAddr>) -> Pipe {
        Pipe {
            socket,
            dest: Mutex::new(dest),
            registered: AtomicBool::new(false),
            keepalive_us: AtomicU64::new(0),
            heard_us: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            tx_bytes: AtomicU64::new(0),
            rx_bytes: AtomicU64::new(0),
        }
    }

    fn dest(&self) -> Option<SocketAddr> {
        *self.dest.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The sending half: one counter and one controller for all pipes.
struct Tx {
    seal: Sealer,
    flight: Flight,
    pacer: Pacer,
    /// The pipe the next data packet tries first.
    next: usize,
    /// A sealed packet on its way out, and a payload being built (feedback).
    buf: Vec<u8>,
    scratch: Vec<u8>,
}

/// The receiving half.
struct Rx {
    open: Opener,
    acks: Acks,
    last: Instant,
}

/// Figures read without a lock (before every batch, `load`).
#[derive(Default)]
struct Meter {
    window: AtomicU64,
    in_flight: AtomicU64,
    rtt_us: AtomicU64,
    rate: AtomicU64,
    backlog: AtomicU64,
    /// The sender queue's limit, in packets (`queue_limit`).
    limit: AtomicU64,
}

/// Packets the sender's queue may hold for a path with this window and RTT: the same bound in
/// time as a QUIC path's datagram queue (`quic::datagram_queue_limit`), at least `QUEUE`. A
/// fixed 512 packets was 20 ms at 300 Mbit/s: in scenario 06 (2 x 300 Mbit/s) the stripe
/// sender refused 26k packets a path in 15 s where QUIC's pipes, 512 KiB each, refused 0.2-1k.
fn queue_limit(window: u64, rtt: Option<Duration>) -> usize {
    let bytes = rtt.map_or(0, |r| {
        super::quic::settings::datagram_queue_limit(window, r)
    });
    (bytes as usize / PACED_PACKET).max(QUEUE)
}

/// One path's stripe session: shared by the transport, its tasks, and (server) the stripe
/// socket's receive loop.
pub(crate) struct Link {
    client: bool,
    session: u64,
    pipes: Vec<Pipe>,
    tx: Mutex<Tx>,
    rx: Mutex<Rx>,
    sink: OnceLock<Arc<dyn Sink>>,
    /// Datagrams that arrived before `start` gave the sink (the client reads its pipes while it
    /// registers them, and the server may already be sending): handed over at `start`, at most
    /// `EARLY` of them (the rest counted `queue_full` then). Dropped uncounted they were a gap
    /// the sender believed delivered (its feedback had acknowledged them).
    early: Mutex<(Vec<Vec<u8>>, u64)>,
    meter: Meter,
    started: Instant,
    /// A feedback opened the window: the sender may go on.
    window_opened: Notify,
    /// Feedback became pending: the timer task schedules it.
    ack_pending: Notify,
    /// A pipe's registration was answered (client).
    registered: Notify,
    next_control: AtomicUsize,
    /// Server: the last sender address seen and its pipe (`pipe_of`).
    last_from: Mutex<Option<(SocketAddr, usize)>>,
    /// Server: pipes moved to a new client address by an authentic packet (`follow`).
    moves: AtomicU64,
    /// Server: what the sender is to send again after a move (`follow`): the pipe, and from
    /// when on (µs since the link started) its packets may have gone to the dead address.
    resend: Mutex<Vec<(usize, u64)>>,
    /// There is something in `resend` (read by the sender every turn, without the lock), and
    /// the wake-up of an idle sender for it.
    resend_pending: AtomicBool,
    resend_due: Notify,
    /// Server: packets sent again after a move (`sender::Resend`).
    resent: AtomicU64,
}

impl Link {
    fn new(client: bool, keys: stripe::Keys, pipes: Vec<Pipe>, flight: Flight) -> Arc<Link> {
        let now = Instant::now();
        Arc::new(Link {
            client,
            session: keys.session,
            pipes,
            tx: Mutex::new(Tx {
                seal: keys.seal,
                flight,
                pacer: Pacer::default(),
                next: 0,
                buf: Vec::with_capacity(65_536),
                scratch: Vec::with_capacity(256),
            }),
            rx: Mutex::new(Rx {
                open: keys.open,
                acks: Acks::default(),
                last: now,
            }),
            sink: OnceLock::new(),
            early: Mutex::new((Vec::new(), 0)),
            meter: Meter::default(),
            started: now,
            window_opened: Notify::new(),
            ack_pending: Notify::new(),
            registered: Notify::new(),
            next_control: AtomicUsize::new(0),
            last_from: Mutex::new(None),
            moves: AtomicU64::new(0),
            resend: Mutex::new(Vec::new()),
            resend_pending: AtomicBool::new(false),
            resend_due: Notify::new(),
            resent: AtomicU64::new(0),
        })
    }

    fn tx(&self) -> std::sync::MutexGuard<'_, Tx> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn rx(&self) -> std::sync::MutexGuard<'_, Rx> {
        self.rx.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn any_registered(&self) -> bool {
        self.pipes
            .iter()
            .any(|p| p.registered.load(Ordering::Relaxed))
    }

    /// The registered pipes, from `from` on (round robin).
    fn registered_from(&self, from: usize) -> impl Iterator<Item = usize> + '_ {
        let n = self.pipes.len();
        (0..n)
            .map(move |k| (from + k) % n)
            .filter(|&i| self.pipes[i].registered.load(Ordering::Relaxed))
    }

    /// The registered pipe to use after `from` (round robin), if any.
    fn pick(&self, from: usize) -> Option<usize> {
        self.registered_from(from).next()
    }

    /// The registered pipe for the next data packet: the one with the fewest bytes in flight
    /// (ties from `from` on, round robin). Pipes behind their own per-session shapers queue
    /// differently; sent round robin, a slower pipe's packets arrived behind the others'
    /// (scenario 06b: inner TCP retransmitted 58k times), while the fewest bytes in flight
    /// keeps their queues, and so their delays, alike (as `quic/pipes.rs` does).
    fn pick_data(&self, flight: &Flight, from: usize) -> Option<usize> {
        self.registered_from(from)
            .min_by_key(|&i| flight.in_flight_by_tag(i as u8))
    }

    /// Client: send REGISTER on every pipe not answered yet; how many are answered.
    fn register_unanswered(&self) -> usize {
        let count = self.pipes.len() as u8;
        let mut answered = 0;
        for (i, p) in self.pipes.iter().enumerate() {
            if p.registered.load(Ordering::Relaxed) {
                answered += 1;
                continue;
            }
            let mut tx = self.tx();
            let _ = self.send_one(&mut tx, Kind::Register, &[i as u8, count], i, false);
            p.keepalive_us.store(self.elapsed_us(), Ordering::Relaxed);
        }
        answered
    }

    /// Publish the controller's figures for `load` and `stats`.
    fn publish(&self, tx: &Tx) {
        let f = &tx.flight;
        let m = &self.meter;
        m.window.store(f.window(), Ordering::Relaxed);
        m.in_flight.store(f.in_flight(), Ordering::Relaxed);
        m.rtt_us.store(
            f.rtt().map_or(0, |r| r.as_micros() as u64),
            Ordering::Relaxed,
        );
        m.rate
            .store(f.pacing_rate().unwrap_or(0) * 8, Ordering::Relaxed);
    }

    /// Seal `payload` as `kind` and send it on pipe `pipe`, to the pipe's destination.
    /// `track`: the controller counts it (it is acknowledged like data).
    fn send_one(
        &self,
        tx: &mut Tx,
        kind: Kind,
        payload: &[u8],
        pipe: usize,
        track: bool,
    ) -> Result<(), DropReason> {
        let p = &self.pipes[pipe];
        let dest = p.dest().ok_or(DropReason::NoPath)?;
        tx.buf.clear();
        let counter = tx.seal.sealed();
        tx.seal.seal(kind, payload, &mut tx.buf);
        let t = Transmit {
            destination: dest,
            ecn: None,
            contents: &tx.buf,
            segment_size: None,
            src_ip: None,
        };
        p.socket.try_send(&t).map_err(|_| DropReason::SendFailed)?;
        let len = tx.buf.len();
        p.sent.fetch_add(1, Ordering::Relaxed);
        p.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
        if track {
            tx.flight
                .on_sent(Instant::now(), counter, len, true, pipe as u8);
        }
        Ok(())
    }

    fn elapsed_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// A control message (probe, reply) on the next registered pipe.
    fn send_control(&self, msg: &[u8]) -> Result<(), DropReason> {
        let from = self.next_control.fetch_add(1, Ordering::Relaxed);
        let pipe = self.pick(from).ok_or(DropReason::NoPath)?;
        let mut tx = self.tx();
        let r = self.send_one(&mut tx, Kind::Data, msg, pipe, true);
        self.publish(&tx);
        r
    }

    fn keep_early(&self, d: &[u8]) {
        let mut early = self.early.lock().unwrap_or_else(|e| e.into_inner());
        match early.0.len() < EARLY {
            true => early.0.push(d.to_vec()),
            // Counted at `give_sink` (there is no sink to tell yet).
            false => early.1 += 1,
        }
    }

    /// The sink, from now on; what arrived before goes to it first.
    fn give_sink(&self, sink: Arc<dyn Sink>) {
        let hand_over = |sink: &Arc<dyn Sink>| {
            let (kept, over) =
                std::mem::take(&mut *self.early.lock().unwrap_or_else(|e| e.into_inner()));
            for d in &kept {
                sink.on_datagram(d);
            }
            for _ in 0..over {
                sink.on_received_dropped(DropReason::QueueFull);
            }
        };
        hand_over(&sink);
        let _ = self.sink.set(sink.clone());
        // What arrived while the first ones were handed over.
        hand_over(&sink);
        sink.on_batch_end();
    }

    /// The end of a receive batch: what it delivered goes to the TUN device, the feedback it
    /// made due goes out.
    pub(crate) fn end_batch(&self) {
        if let Some(sink) = self.sink.get() {
            sink.on_batch_end();
        }
        self.flush_feedback();
    }

    /// Send the feedback that is due, if any (after each receive batch, and from the timer).
    pub(crate) fn flush_feedback(&self) {
        let fb = {
            let mut rx = self.rx();
            let Rx { open, acks, .. } = &mut *rx;
            acks.take(Instant::now(), open.window())
        };
        if let Some(fb) = fb {
            self.send_feedback(&fb);
        }
    }

    fn send_feedback(&self, fb: &Feedback) {
        let from = self.next_control.fetch_add(1, Ordering::Relaxed);
        if let Some(pipe) = self.pick(from) {
            let mut tx = self.tx();
            // The payload in the sender's scratch buffer: no allocation per feedback.
            let mut payload = std::mem::take(&mut tx.scratch);
            payload.clear();
            fb.encode(&mut payload);
            // Lost feedback is repaired by the next one, which repeats it.
            let _ = self.send_one(&mut tx, Kind::Feedback, &payload, pipe, false);
            tx.scratch = payload;
        }
    }

    /// A packet arrived on pipe `pipe` (client), or from `from` at the server's socket.
    /// Opened, acknowledged, and handled; a data payload is handed to the sink. The feedback it
    /// may make due goes out at `flush_feedback`, once per receive batch: under load one
    /// feedback covers a batch (a system call each way saved per two packets), at low rates
    /// it still follows every second packet.
    pub(crate) fn on_packet(&self, pkt: &mut [u8], from: SocketAddr, pipe: Option<usize>) {
        let now = Instant::now();
        let len = pkt.len() as u64;
        let counter =
            u64::from_be_bytes(pkt[10..18].try_into().expect("opened packets are longer"));
        let (opened, newest) = {
            let mut rx = self.rx();
            let newest = rx.open.window().newest(counter);
            let opened = match rx.open.open(pkt) {
                Err(r) => {
                    drop(rx);
                    self.refused(r);
                    return;
                }
                Ok((kind, payload)) => {
                    rx.last = now;
                    let was_idle = rx.acks.due().is_none();
                    rx.acks.on_packet(now, counter, kind);
                    if was_idle && rx.acks.due().is_some() {
                        self.ack_pending.notify_one();
                    }
                    (kind, payload)
                }
            };
            (opened, newest)
        };
        let (kind, payload) = opened;
        // REGISTER and KEEPALIVE name their pipe (`handle` places it); any other authentic
        // packet newer than all before, from an address no pipe has, is a NAT rebinding.
        let names_pipe = matches!(kind, Kind::Register | Kind::Keepalive);
        let pipe = pipe
            .or_else(|| self.pipe_of(from))
            .or_else(|| (newest && !names_pipe).then(|| self.follow(from)).flatten());
        if let Some(p) = pipe.and_then(|i| self.pipes.get(i)) {
            p.rx_bytes.fetch_add(len, Ordering::Relaxed);
            // From the `now` this packet was stamped with: no second clock read per packet.
            let heard = now.saturating_duration_since(self.started).as_micros() as u64;
            p.heard_us.store(heard, Ordering::Relaxed);
        }
        if let Some(d) = self.handle(kind, payload, from) {
            match self.sink.get() {
                Some(sink) => sink.on_datagram(d),
                None => self.keep_early(d),
            }
        }
    }

    /// Server: the pipe a packet from `from` came on. Packets come in runs from one pipe, so
    /// the last answer is tried first; the pipes' addresses (each behind a lock) are searched
    /// only when the sender changes.
    fn pipe_of(&self, from: SocketAddr) -> Option<usize> {
        let mut last = self.last_from.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((addr, i)) = *last {
            if addr == from {
                return Some(i);
            }
        }
        let i = self.pipes.iter().position(|p| p.dest() == Some(from))?;
        *last = Some((from, i));
        Some(i)
    }

    /// Server: an authentic packet, newer than every one before, came from `from`, which no
    /// pipe has: the client's NAT gave one of its pipes a new port (or address). The pipe heard
    /// from least recently is the one that moved (after a rebinding, the old addresses fall
    /// silent); it is answered at `from` from now on, so the server's half of the path follows
    /// within the packet's one-way delay instead of waiting for the pipe's next KEEPALIVE (up
    /// to 5 s), which still names the pipe and corrects the guess. A forged packet fails its
    /// tag and a replayed one the window before this: neither moves a pipe.
    ///
    /// What the pipe sent since the old mapping may have died is sent again to the new address
    /// (`sender::Resend`): stripe does not retransmit, and about a round trip of the server's
    /// packets went into the dead mapping (under a download, 3-4 pings' replies lost in a run
    /// at every rebinding). The mapping died after the client sent the last packet heard from
    /// it, so a packet the server sent up to a round trip before that arrived may have met it
    /// dead.
    fn follow(&self, from: SocketAddr) -> Option<usize> {
        let i = self
            .pipes
            .iter()
            .enumerate()
            .filter(|(_, p)| p.registered.load(Ordering::Relaxed))
            .min_by_key(|(_, p)| p.heard_us.load(Ordering::Relaxed))?
            .0;
        *self.pipes[i].dest.lock().unwrap_or_else(|e| e.into_inner()) = Some(from);
        *self.last_from.lock().unwrap_or_else(|e| e.into_inner()) = Some((from, i));
        self.moves.fetch_add(1, Ordering::Relaxed);
        let heard = self.pipes[i].heard_us.load(Ordering::Relaxed);
        let rtt = self.meter.rtt_us.load(Ordering::Relaxed);
        self.resend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((i, heard.saturating_sub(rtt)));
        self.resend_pending.store(true, Ordering::Release);
        self.resend_due.notify_one();
        Some(i)
    }

    /// What a packet of `kind` does; a data packet's payload is returned, for the sink.
    fn handle<'a>(&self, kind: Kind, payload: &'a [u8], from: SocketAddr) -> Option<&'a [u8]> {
        match kind {
            Kind::Data => return Some(payload),
            Kind::Feedback => match Feedback::decode(payload) {
                Some(fb) => {
                    let mut tx = self.tx();
                    tx.flight.on_feedback(Instant::now(), &fb);
                    self.publish(&tx);
                    drop(tx);
                    self.window_opened.notify_one();
                }
                None => self.drop_received(DropReason::Malformed),
            },
            // The server learns (or re-learns, after a NAT rebinding) where a pipe is.
            Kind::Register | Kind::Keepalive if !self.client => {
                let index = payload.first().map(|&i| usize::from(i));
                let count_ok = kind == Kind::Keepalive
                    || payload.get(1).map(|&c| usize::from(c)) == Some(self.pipes.len());
                match index.filter(|&i| i < self.pipes.len() && count_ok) {
                    Some(i) => {
                        let p = &self.pipes[i];
                        *p.dest.lock().unwrap_or_else(|e| e.into_inner()) = Some(from);
                        *self.last_from.lock().unwrap_or_else(|e| e.into_inner()) = None;
                        p.registered.store(true, Ordering::Relaxed);
                        if kind == Kind::Register {
                            let mut tx = self.tx();
                            let _ = self.send_one(&mut tx, Kind::RegisterAck, &[i as u8], i, false);
                        }
                    }
                    None => self.drop_received(DropReason::Malformed),
                }
            }
            Kind::RegisterAck if self.client => {
                match payload
                    .first()
                    .and_then(|&i| self.pipes.get(usize::from(i)))
                {
                    Some(p) => {
                        p.registered.store(true, Ordering::Relaxed);
                        self.registered.notify_waiters();
                    }
                    None => self.drop_received(DropReason::Malformed),
                }
            }
            Kind::Keepalive => {}
            // A client never gets REGISTER, a server never REGISTER ACK: authentic but wrong.
            Kind::Register | Kind::RegisterAck => self.drop_received(DropReason::Malformed),
        }
        None
    }

    fn refused(&self, r: Refused) {
        self.drop_received(match r {
            Refused::Unauthenticated => DropReason::Unauthenticated,
            Refused::Replayed => DropReason::Replayed,
            Refused::Malformed | Refused::UnknownSession => DropReason::Malformed,
        });
    }

    fn drop_received(&self, reason: DropReason) {
        if let Some(sink) = self.sink.get() {
            sink.on_received_dropped(reason);
        }
    }

    /// The timer's work: feedback that waited long enough, the controller's loss timeout,
    /// keepalives and registration resends (client). Returns when it wants to run again, or
    /// `None` when the session timed out.
    fn on_timer(&self, now: Instant) -> Option<Instant> {
        self.flush_feedback();
        let last = self.rx().last;
        if now.saturating_duration_since(last) >= SESSION_TIMEOUT {
            return None;
        }
        let loss_due = {
            let mut tx = self.tx();
            tx.flight.on_timeout(now);
            self.publish(&tx);
            tx.flight.next_timeout()
        };
        self.window_opened.notify_one();
        let mut next = now + KEEPALIVE.min(SESSION_TIMEOUT);
        if self.client {
            if self.register_unanswered() < self.pipes.len() {
                next = next.min(now + REGISTER_RESEND);
            }
            // Every registered pipe, busy or not, every `KEEPALIVE`: a NAT that rebinds a pipe
            // to another port is learnt by the server from it (data packets do not say their
            // pipe).
            let due_us = self
                .elapsed_us()
                .saturating_sub(KEEPALIVE.as_micros() as u64);
            for (i, p) in self.pipes.iter().enumerate() {
                if p.registered.load(Ordering::Relaxed)
                    && p.keepalive_us.load(Ordering::Relaxed) <= due_us
                {
                    let mut tx = self.tx();
                    let _ = self.send_one(&mut tx, Kind::Keepalive, &[i as u8], i, false);
                    p.keepalive_us.store(self.elapsed_us(), Ordering::Relaxed);
                }
            }
        }
        let ack_due = self.rx().acks.due();
        Some(
            [Some(next), loss_due, ack_due]
                .into_iter()
                .flatten()
                .min()
                .expect("one is set"),
        )
    }
}

/// Buffers for reading a UDP socket a batch at a time (GRO batches split into datagrams).
struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    meta: Vec<quinn::udp::RecvMeta>,
    n: usize,
}

impl RecvBatch {
    fn new() -> RecvBatch {
        RecvBatch {
            bufs: vec![vec![0u8; RECV_BUF]; RECV_BATCH],
            meta: vec![quinn::udp::RecvMeta::default(); RECV_BATCH],
            n: 0,
        }
    }

    /// Wait for the next batch from `socket`.
    async fn recv(&mut self, socket: &dyn quinn::AsyncUdpSocket) -> std::io::Result<()> {
        let RecvBatch { bufs, meta, n } = self;
        let mut slices: Vec<std::io::IoSliceMut<'_>> = bufs
            .iter_mut()
            .map(|b| std::io::IoSliceMut::new(b))
            .collect();
        *n = std::future::poll_fn(|cx| socket.poll_recv(cx, &mut slices, meta)).await?;
        Ok(())
    }

    /// Each datagram of the batch, with its sender.
    fn each(&mut self, mut f: impl FnMut(&mut [u8], SocketAddr)) {
        for (buf, m) in self.bufs.iter_mut().zip(&self.meta).take(self.n) {
            for pkt in buf[..m.len].chunks_mut(m.stride.max(1)) {
                f(pkt, m.addr);
            }
        }
    }
}

/// A path whose datagrams go in stripe packets.
pub struct StripeTransport {
    quic: Arc<QuicTransport>,
    link: Arc<Link>,
    /// Packets for the sender task, with their flow (`Facts::flow`).
    queue: mpsc::Sender<Handed>,
    start: Mutex<Option<mpsc::Receiver<Handed>>>,
    /// The server's socket, which forgets the session when the path ends.
    server: Option<Arc<server::StripeServer>>,
}

/// The path's controller: one of the core's (`Congestion::is_ours`; the config refuses others
/// for stripe paths).
fn controller(cc: Congestion, payload: u16) -> Box<dyn mpquic_core::cc::Controller> {
    match cc {
        Congestion::Bbr3 => Box::new(mpquic_core::cc::Bbr3::new(payload)),
        _ => Box::new(mpquic_core::cc::Bbr::new(payload)),
    }
}

/// The keys of `conn`'s stripe session for path `path` (the TLS exporter, both ends alike).
fn keys(conn: &quinn::Connection, path: &str, client: bool) -> anyhow::Result<stripe::Keys> {
    let mut secret = [0u8; stripe::SECRET_LEN];
    conn.export_keying_material(&mut secret, stripe::EXPORTER_LABEL, path.as_bytes())
        .map_err(|_| anyhow::anyhow!("the TLS session gives no keying material"))?;
    Ok(stripe::Keys::from_secret(&secret, client))
}

impl StripeTransport {
    fn new(
        quic: Arc<QuicTransport>,
        link: Arc<Link>,
        server: Option<Arc<server::StripeServer>>,
    ) -> Arc<StripeTransport> {
        let (queue, rx) = mpsc::channel(QUEUE);
        {
            let tx = link.tx();
            link.publish(&tx);
        }
        Arc::new(StripeTransport {
            quic,
            link,
            queue,
            start: Mutex::new(Some(rx)),
            server,
        })
    }

    /// The largest datagram a stripe packet carries on this path.
    fn max_datagram(&self) -> Option<usize> {
        self.quic
            .stats()
            .link_payload
            .or(self.quic.stats().udp_payload)
            .map(|p| usize::from(p) - OVERHEAD)
    }
}

impl PathTransport for StripeTransport {
    fn send_batch(
        &self,
        batch: &mut PacketBatch,
        which: &[usize],
        lane: LaneSend,
        refused: &mut dyn FnMut(usize, DropReason),
    ) {
        if !self.link.any_registered() {
            // The server's first moments, before the client's pipes registered.
            return self.quic.send_batch(batch, which, lane, refused);
        }
        let now = Instant::now();
        let max = self.max_datagram().unwrap_or(usize::MAX);
        for &i in which {
            let flow = batch.facts(i).flow;
            let d = batch.framed(i);
            if d.len() > max {
                refused(i, DropReason::Oversized);
                continue;
            }
            if let Err(e) = self.queue.try_send((now, flow, d)) {
                refused(
                    i,
                    match e {
                        mpsc::error::TrySendError::Full(_) => DropReason::QueueFull,
                        mpsc::error::TrySendError::Closed(_) => DropReason::SendFailed,
                    },
                );
            }
        }
    }

    fn send_control(&self, msg: &[u8]) -> Result<(), DropReason> {
        match self.link.any_registered() {
            true => self.link.send_control(msg),
            false => self.quic.send_control(msg),
        }
    }

    fn remote(&self) -> SocketAddr {
        self.quic.remote()
    }

    fn stats(&self) -> TransportStats {
        let q = self.quic.stats();
        let m = &self.link.meter;
        let counts = self.link.tx().flight.counts();
        let rtt_us = m.rtt_us.load(Ordering::Relaxed);
        TransportStats {
            rtt: (rtt_us > 0)
                .then(|| Duration::from_micros(rtt_us))
                .or(q.rtt),
            cwnd: Some(m.window.load(Ordering::Relaxed)),
            pacing_rate: Some(m.rate.load(Ordering::Relaxed)).filter(|&r| r > 0),
            sent_packets: counts.sent,
            lost_packets: counts.lost,
            udp_payload: q.udp_payload,
            max_datagram: self.max_datagram(),
            link_payload: q.link_payload,
            // The stripe sockets' bytes are not counted (`data_budget` is refused there).
            wire_bytes: None,
            playout: None,
            streams_in: q.streams_in,
            // Stripe packets are acknowledged by their own feedback, not by QUIC's ACKs.
            acks: None,
            // The pipes' and the QUIC connection's (it rides the same NAT).
            peer_moves: self.link.moves.load(Ordering::Relaxed) + q.peer_moves,
            rebind_resent: self.link.resent.load(Ordering::Relaxed),
            // Stripe packets' losses are the stripe's own to detect (`stripe/flight.rs`).
            reordering: None,
        }
    }

    fn load(&self) -> PathLoad {
        let m = &self.link.meter;
        let window = m.window.load(Ordering::Relaxed);
        let rtt_us = m.rtt_us.load(Ordering::Relaxed);
        let rtt = (rtt_us > 0).then(|| Duration::from_micros(rtt_us));
        let queued = (QUEUE - self.queue.capacity()) as u64 * PACED_PACKET as u64;
        let limit = m.limit.load(Ordering::Relaxed).max(QUEUE as u64);
        PathLoad {
            // As a QUIC path's (`QuicTransport::load`): the schedulers compare paths by it.
            rate: rtt.map(|r| super::quic::settings::rate_per_rtt(window, r)),
            rtt,
            backlog: m.backlog.load(Ordering::Relaxed) + queued,
            window: Some(window),
            in_flight: m.in_flight.load(Ordering::Relaxed),
            backlog_limit: Some(limit * PACED_PACKET as u64),
        }
    }

    fn close(&self, code: u32, reason: &str) {
        self.quic.close(code, reason);
    }

    fn closed(&self) -> BoxFuture<'static, Closed> {
        self.quic.closed()
    }

    fn start(self: Arc<Self>, sink: Arc<dyn Sink>) {
        let Some(rx) = self.start.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        self.link.give_sink(sink.clone());
        // The QUIC connection: control messages before registration, and the path's end.
        self.quic.clone().start(sink.clone());
        let conn = self.quic.connection().clone();
        tokio::spawn(sender::run(self.link.clone(), rx, sink, conn.clone()));
        tokio::spawn(timer(self.link.clone(), conn.clone()));
        // (A client's pipes are read from `client::connect` on.)
        if let Some(server) = self.server.clone() {
            let (link, session) = (Arc::downgrade(&self.link), self.link.session);
            tokio::spawn(async move {
                conn.closed().await;
                server.forget(session, &link);
            });
        }
    }

    fn set_hand_over(&self, possible: bool) {
        self.quic.set_hand_over(possible);
    }

    fn abandon(&self, since: Instant) -> Vec<Bytes> {
        self.quic.abandon(since)
    }

    fn kind(&self) -> &'static str {
        "stripe"
    }

    fn pipes(&self) -> Vec<PipeStatus> {
        let m = &self.link.meter;
        let n = self.link.pipes.len() as u64;
        let tx = self.link.tx();
        let lost: Vec<u64> = (0..n).map(|i| tx.flight.lost_by_tag(i as u8)).collect();
        drop(tx);
        let rtt_ms = m.rtt_us.load(Ordering::Relaxed) as f64 / 1000.0;
        self.link
            .pipes
            .iter()
            .zip(lost)
            .map(|(p, lost_packets)| {
                let port = match self.link.client {
                    true => p.socket.local_addr().map_or(0, |a| a.port()),
                    false => p.dest().map_or(0, |a| a.port()),
                };
                PipeStatus {
                    port,
                    rtt_ms,
                    // One controller for all pipes: each pipe is its share of the window.
                    in_flight_bytes: m.in_flight.load(Ordering::Relaxed) / n,
                    sent_packets: p.sent.load(Ordering::Relaxed),
                    lost_packets,
                    tx_bytes: p.tx_bytes.load(Ordering::Relaxed),
                    rx_bytes: p.rx_bytes.load(Ordering::Relaxed),
                }
            })
            .collect()
    }
}

/// Feedback, loss timeouts, keepalives and registration resends; closes the path when the
/// session timed out.
async fn timer(link: Arc<Link>, conn: quinn::Connection) {
    loop {
        let Some(next) = link.on_timer(Instant::now()) else {
            tracing::warn!(
                session = link.session,
                "stripe: nothing from the peer for {SESSION_TIMEOUT:?}; closing the path"
            );
            conn.close(
                crate::transport::close::PATH_DOWN.into(),
                b"stripe session timed out",
            );
            return;
        };
        tokio::select! {
            _ = tokio::time::sleep_until(next.into()) => {}
            _ = link.ack_pending.notified() => {}
            _ = conn.closed() => return,
        }
    }
}
