//! A path over several QUIC connections, "pipes" (`pipes: N`): N UDP 5-tuples (distinct client
//! ports) over one link, so a carrier that caps or hashes each UDP session sees N sessions.
//! They are one path to the tunnel: one health state (probes rotate over the pipes), one
//! congestion controller (`quic::PipeGroup`: the pipes' controllers forward to it), and they
//! live and end together (when one pipe's connection ends, the others are closed, and the
//! client dials the path again).
//!
//! Each packet goes to the pipe with the fewest bytes outstanding (in flight plus queued), so
//! the pipes' queues at the carrier stay alike and one flow spread over them is hardly
//! reordered (they share the link's delay). Under a per-packet policy the tunnel's
//! resequencer puts what reordering there is right.
//!
//! Setup: the client dials pipe 0 like a path (the server's session registry decides), then
//! the others; the server's listener joins them to pipe 0's set (`PipeSets`) by the client's
//! identity, session and path name, and refuses a pipe whose pipe 0 is not connected.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Instant;

use bytes::Bytes;
use mpquic_core::{DropReason, PathLoad};
use mpquic_status::PipeStatus;

use super::controller::PipeGroup;
use super::QuicTransport;
use crate::hello::HelloAck;
use crate::io::batch::PacketBatch;
use crate::transport::close;
use crate::transport::{BoxFuture, Closed, LaneSend, PathTransport, Sink, TransportStats};

pub struct QuicPipes {
    pipes: RwLock<Vec<Arc<QuicTransport>>>,
    group: Arc<PipeGroup>,
    /// Pipes the client opens.
    count: u8,
    /// What pipe 0 was answered; the server answers the later pipes the same.
    pub(super) ack: HelloAck,
    /// Set by `start`; pipes added later start with it.
    sink: Mutex<Option<Arc<dyn Sink>>>,
    /// The pipe the next control message goes on, and the one the next batch tries first.
    next_control: AtomicUsize,
    next_send: AtomicUsize,
    /// Why the set ended (the first pipe's close); set once.
    ended: Arc<OnceLock<String>>,
    /// Per-batch scratch: the packets for each pipe, and each pipe's bytes outstanding.
    scratch: Mutex<(Vec<Vec<usize>>, Vec<u64>)>,
}

impl QuicPipes {
    /// A set of `count` pipes with `first` (pipe 0) in it, answered `ack`.
    pub(super) fn new(
        group: Arc<PipeGroup>,
        count: u8,
        ack: HelloAck,
        first: Arc<QuicTransport>,
    ) -> Arc<QuicPipes> {
        let set = Arc::new(QuicPipes {
            pipes: RwLock::new(Vec::new()),
            group,
            count,
            ack,
            sink: Mutex::new(None),
            next_control: AtomicUsize::new(0),
            next_send: AtomicUsize::new(0),
            ended: Arc::default(),
            scratch: Mutex::new((Vec::new(), Vec::new())),
        });
        set.add(first);
        set
    }

    pub(super) fn count(&self) -> u8 {
        self.count
    }

    pub(super) fn is_ended(&self) -> bool {
        self.ended.get().is_some()
    }

    /// Add a pipe: it joins the group's controller, and starts now if the set has started.
    /// False (and the pipe closed) when the set has ended or is complete.
    pub(super) fn add(self: &Arc<Self>, pipe: Arc<QuicTransport>) -> bool {
        let mut pipes = self.pipes.write().unwrap_or_else(|e| e.into_inner());
        if self.is_ended() || pipes.len() >= usize::from(self.count) {
            pipe.close(close::PROTOCOL, "no room for this pipe");
            return false;
        }
        if let Some(m) = &pipe.meter {
            self.group.join(m);
        }
        // The path's carriage (`auto`) is pipe 0's.
        if let Some(first) = pipes.first() {
            let on = first.on_stream.load(Ordering::Relaxed);
            pipe.on_stream.store(on, Ordering::Relaxed);
        }
        pipes.push(pipe.clone());
        drop(pipes);
        if let Some(sink) = self.sink.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            pipe.clone().start(sink);
        }
        // When this pipe's connection ends, the set ends with it.
        let set = Arc::downgrade(self);
        tokio::spawn(async move {
            let reason = pipe.conn.closed().await.to_string();
            if let Some(set) = set.upgrade() {
                set.end(reason);
            }
        });
        true
    }

    fn end(&self, reason: String) {
        if self.ended.set(reason.clone()).is_ok() {
            for p in self.list() {
                p.close(close::PATH_DOWN, "another pipe of the path ended");
            }
        }
    }

    fn list(&self) -> Vec<Arc<QuicTransport>> {
        self.pipes.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn first(&self) -> Arc<QuicTransport> {
        self.pipes.read().unwrap_or_else(|e| e.into_inner())[0].clone()
    }

    /// Each pipe's figures, for status and metrics. The client's pipes differ by local port
    /// (it has the endpoints), the server's by remote port.
    fn pipe_status(&self) -> Vec<PipeStatus> {
        self.list()
            .iter()
            .map(|p| {
                let st = p.conn.stats();
                let port = match &p.endpoint {
                    Some(e) => e.local_addr().map_or(0, |a| a.port()),
                    None => p.conn.remote_address().port(),
                };
                PipeStatus {
                    port,
                    rtt_ms: st.path.rtt.as_secs_f64() * 1e3,
                    in_flight_bytes: p.meter.as_ref().map_or(0, |m| m.read().1),
                    sent_packets: st.path.sent_packets,
                    lost_packets: st.path.lost_packets,
                    tx_bytes: st.udp_tx.bytes,
                    rx_bytes: st.udp_rx.bytes,
                }
            })
            .collect()
    }
}

impl PathTransport for QuicPipes {
    /// The pipes share the mode, so pipe 0's framing is every pipe's.
    fn prepare(&self, batch: &mut PacketBatch, which: &[usize]) {
        self.first().prepare(batch, which);
    }

    fn send_batch(
        &self,
        batch: &mut PacketBatch,
        which: &[usize],
        lane: LaneSend,
        refused: &mut dyn FnMut(usize, DropReason),
    ) {
        // Held for the batch (pipes are only added, rarely): no copy of the list per batch.
        let pipes = self.pipes.read().unwrap_or_else(|e| e.into_inner());
        if pipes.len() == 1 {
            return pipes[0].send_batch(batch, which, lane, refused);
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (each, load) = &mut *scratch;
        each.resize_with(pipes.len(), Vec::new);
        load.clear();
        load.extend(pipes.iter().map(|p| p.outstanding()));
        // Ties go round the pipes from batch to batch, so light traffic (all pipes idle) uses
        // every pipe too, and keeps each one's NAT mapping and RTT fresh.
        let n = pipes.len();
        let first = self.next_send.fetch_add(1, Ordering::Relaxed) % n;
        for &i in which {
            // The least loaded pipe; what it takes counts at once.
            let k = (first..first + n)
                .map(|k| k % n)
                .min_by_key(|&k| load[k])
                .unwrap_or(0);
            load[k] += batch.packet(i).len() as u64;
            each[k].push(i);
        }
        for (p, w) in pipes.iter().zip(each.iter_mut()) {
            if !w.is_empty() {
                p.send_batch(batch, w, lane, refused);
                w.clear();
            }
        }
    }

    fn set_yielding(&self) {
        for p in self.pipes.read().unwrap_or_else(|e| e.into_inner()).iter() {
            p.set_yielding();
        }
    }

    fn set_carry(&self, carry: mpquic_core::recovery::Carry) {
        for p in self.pipes.read().unwrap_or_else(|e| e.into_inner()).iter() {
            p.set_carry(carry);
        }
    }

    fn set_hand_over(&self, possible: bool) {
        for p in self.pipes.read().unwrap_or_else(|e| e.into_inner()).iter() {
            p.set_hand_over(possible);
        }
    }

    fn set_path_probes(&self, loss: f64, srtt: Option<std::time::Duration>) {
        for p in self.pipes.read().unwrap_or_else(|e| e.into_inner()).iter() {
            p.set_path_probes(loss, srtt);
        }
    }

    /// Probes rotate over the pipes: a pipe that stops passing packets shows as probe loss.
    fn send_control(&self, msg: &[u8]) -> Result<(), DropReason> {
        let pipes = self.pipes.read().unwrap_or_else(|e| e.into_inner());
        let k = self.next_control.fetch_add(1, Ordering::Relaxed) % pipes.len();
        pipes[k].send_control(msg)
    }

    fn remote(&self) -> SocketAddr {
        self.first().remote()
    }

    /// The path as a whole: the group's window, the pipes' packets summed, the smallest sizes.
    fn stats(&self) -> TransportStats {
        let all: Vec<TransportStats> = self.list().iter().map(|p| p.stats()).collect();
        let rtts: Vec<_> = all.iter().filter_map(|s| s.rtt).collect();
        TransportStats {
            rtt: (!rtts.is_empty())
                .then(|| rtts.iter().sum::<std::time::Duration>() / rtts.len() as u32),
            cwnd: Some(self.group.read().0),
            pacing_rate: all.iter().map(|s| s.pacing_rate).sum(),
            sent_packets: all.iter().map(|s| s.sent_packets).sum(),
            lost_packets: all.iter().map(|s| s.lost_packets).sum(),
            udp_payload: all.iter().filter_map(|s| s.udp_payload).min(),
            max_datagram: all.iter().filter_map(|s| s.max_datagram).min(),
            link_payload: all.iter().find_map(|s| s.link_payload),
            playout: all.iter().filter_map(|s| s.playout).max(),
            streams_in: all.iter().map(|s| s.streams_in).sum(),
            // Any pipe's ACKs show the path alive.
            acks: all.iter().map(|s| s.acks).sum(),
            wire_bytes: all.iter().map(|s| s.wire_bytes).sum(),
            peer_moves: all.iter().map(|s| s.peer_moves).sum(),
            rebind_resent: 0,
            reordering: all
                .iter()
                .filter_map(|s| s.reordering)
                .reduce(super::super::Reordering::merge),
        }
    }

    fn pipes(&self) -> Vec<PipeStatus> {
        self.pipe_status()
    }

    /// The group's window and bytes in flight; the pipes' queues summed; the lowest RTT. Read
    /// before every batch: no allocation.
    fn load(&self) -> PathLoad {
        let pipes = self.pipes.read().unwrap_or_else(|e| e.into_inner());
        let (mut backlog, mut limit, mut rtt) = (0, 0, None::<std::time::Duration>);
        for p in pipes.iter() {
            // Each pipe's RTT read once (a lock on its connection).
            let r = p.conn.rtt();
            backlog += p.queued();
            limit += p.queue_limit(r);
            rtt = Some(rtt.map_or(r, |m| m.min(r)));
        }
        let (window, in_flight) = self.group.read();
        PathLoad {
            rate: rtt.map(|r| super::settings::rate_per_rtt(window, r)),
            rtt,
            backlog,
            window: Some(window),
            in_flight,
            backlog_limit: Some(limit),
        }
    }

    fn close(&self, code: u32, reason: &str) {
        for p in self.list() {
            p.close(code, reason);
        }
    }

    /// Pipe 0 closes when the set ends (`end` closes every pipe), by then with the reason set.
    fn closed(&self) -> BoxFuture<'static, Closed> {
        let (first, ended) = (self.first(), self.ended.clone());
        Box::pin(async move {
            let mut own = Closed::of(&first.conn.closed().await);
            if let Some(why) = ended.get() {
                own.reason = why.clone();
            }
            own
        })
    }

    fn start(self: Arc<Self>, sink: Arc<dyn Sink>) {
        *self.sink.lock().unwrap_or_else(|e| e.into_inner()) = Some(sink.clone());
        for p in self.list() {
            p.start(sink.clone());
        }
    }

    fn abandon(&self, since: Instant) -> Vec<Bytes> {
        self.list().iter().flat_map(|p| p.abandon(since)).collect()
    }
}

/// A path's pipes are known by (client identity, session, path name).
pub type PipeKey = (String, u64, String);

/// The server's pipe sets by key, so later pipes find pipe 0's set. Entries of ended sets are
/// forgotten as new ones come.
#[derive(Default)]
pub struct PipeSets {
    sets: Mutex<HashMap<PipeKey, Weak<QuicPipes>>>,
}

impl PipeSets {
    pub(super) fn insert(&self, key: PipeKey, set: &Arc<QuicPipes>) {
        let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        sets.retain(|_, s| s.upgrade().is_some_and(|s| !s.is_ended()));
        sets.insert(key, Arc::downgrade(set));
    }

    /// The live set for `key`.
    pub(super) fn get(&self, key: &PipeKey) -> Option<Arc<QuicPipes>> {
        let sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        sets.get(key)
            .and_then(Weak::upgrade)
            .filter(|s| !s.is_ended())
    }
}
