//! A path's writer task: what `send_batch` hands over, queued by class and flow, paced and
//! written as datagrams or on the path's streams (reliable mode).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use bytes::{Bytes, BytesMut};
use mpquic_core::pacing::Pacer;
use mpquic_core::sendq::{RankedQueues, SparseLane, WaitingFlows};
use mpquic_core::DropReason;
use tokio::sync::mpsc;

use super::{controller, settings, Frame, Queued, STREAM_HEADER};
use crate::transport::{stream_rx, Dropped, LaneCarry, Sink, TunnelBacklog};

/// What QUIC's datagram buffer may hold of a path's packets (`engine_room`), and how long the
/// writer waits for it to drain below that (the timer's granularity).
const ENGINE_QUEUE_TIME: Duration = Duration::from_millis(2);
const ENGINE_QUEUE_MIN: usize = 16 * 1024;
const ENGINE_WAIT: Duration = Duration::from_millis(1);
/// Packets the writer's queue holds at most: the most bytes a datagram carriage may have
/// waiting (`settings::datagram_queue_limit`) in packets of a few hundred bytes.
const WRITER_QUEUE: usize = settings::DATAGRAM_SEND_BUFFER / 512;
/// What the stream writer remembers of what it wrote (for `abandon`): at most this much, and
/// nothing older than `RECENT_AGE`.
const RECENT_BYTES: usize = 4 << 20;
const RECENT_AGE: Duration = Duration::from_secs(1);
/// Bytes written to a stream in one call (batching amortises the per-write cost).
const STREAM_BATCH: usize = 64 * 1024;
/// What the sparse streams may hold beyond the send window the bulk streams fill: a sparse
/// packet is written at once even when a dead mapping's or a lossy round trip's unacknowledged
/// data fills the window (it would otherwise wait for acknowledgements, as on the bulk stream).
const SPARSE_ROOM: u64 = 2 * STREAM_BATCH as u64;
/// `auto` on the stream: a packet that is not TCP (a call, a video, a game, DNS, a ping, a
/// QUIC connection) goes as a datagram while the path's probes lose less than this. The
/// stream's recovery is for inner TCP, which takes loss for congestion; these flows recover
/// (or not) for themselves, as they would without a tunnel. On the stream, a loss at a
/// queue's overflow (a controller's start-up, a burst) cost such a flow a round trip and held
/// every later packet of it behind the retransmission, and the receiver held its packets to
/// the stream's playout delay, set by the bulk's head-of-line waits (up to
/// `playout::MAX_DELAY`): a call beside one upload (20 Mbit/s, 40 ms, 10 ms jitter) had 16-39%
/// of its packets later than 150 ms, pings a 260 ms plateau for a second. Where the link
/// itself loses more, the stream's recovery serves them better than datagrams would.
const DATAGRAM_LOSS: f64 = 0.02;
/// ... unless the path's round trip is too long for that recovery to be in time. A lost packet
/// comes again on the stream about 9/8 of a round trip (QUIC's time threshold) after it was
/// sent and half a round trip later reaches the receiver: past a call's one-way budget of
/// 150 ms (ITU-T G.114) beyond this RTT, so the retransmission is late for the call anyway,
/// and meanwhile it held every packet behind it on the stream (the flow's and the other
/// sparse flows' of its class). One LTE link with a 150 ms queue under bulk transfers (the
/// Verizon recording, 20 ms one way plus the queue): pings p99 2.3 s with 7% of them later
/// than 1 s on the stream, 0.6 s and 0.5% now.
const RECOVERY_RTT: Duration = Duration::from_millis(92);

/// Whether a packet that is not TCP rides the path's stream in `auto` while the path is on it:
/// the path's probes lose `DATAGRAM_LOSS` or more, and their smoothed RTT is `RECOVERY_RTT` or
/// less (none measured yet: the stream).
pub(super) fn non_tcp_on_stream(probe_loss: f64, probe_srtt: Option<Duration>) -> bool {
    probe_loss >= DATAGRAM_LOSS && probe_srtt.is_none_or(|rtt| rtt <= RECOVERY_RTT)
}

/// Whether a packet goes as a datagram while its path is on the stream: in `auto`
/// (`adaptive`), not TCP, and not where `non_tcp_on_stream` said the stream serves it
/// (`stream_for_non_tcp`).
pub(super) fn datagram_beside_stream(
    adaptive: bool,
    tcp: bool,
    stream_for_non_tcp: &AtomicBool,
) -> bool {
    adaptive && !tcp && !stream_for_non_tcp.load(Ordering::Relaxed)
}

/// Keep `frame`, sent as a datagram where the stream would have carried it, for a hand-over as
/// the stream's chunks are (while another path could take it: `hand_over`).
pub(super) fn keep_for_hand_over(
    recent: &Mutex<Recent>,
    hand_over: &AtomicBool,
    now: Instant,
    frame: Bytes,
) {
    if hand_over.load(Ordering::Relaxed) {
        (recent.lock().unwrap_or_else(|e| e.into_inner())).push(now, frame);
    }
}

/// The chunks a stream writer wrote lately, with when: bounded by `RECENT_BYTES` and
/// `RECENT_AGE`. A chunk is a run of frames (length, packet) exactly as written.
#[derive(Default)]
pub(super) struct Recent {
    chunks: VecDeque<(Instant, Bytes)>,
    bytes: usize,
}

impl Recent {
    fn push(&mut self, now: Instant, chunk: Bytes) {
        self.bytes += chunk.len();
        self.chunks.push_back((now, chunk));
        self.prune(now);
    }

    pub(super) fn clear(&mut self) {
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
    pub(super) fn packets_since(&mut self, since: Instant) -> Vec<Bytes> {
        let mut out = Vec::new();
        for (at, chunk) in std::mem::take(&mut self.chunks) {
            if at < since {
                continue;
            }
            out.extend(packets(chunk));
        }
        self.bytes = 0;
        out
    }
}

/// The packets of a chunk (a run of frames as written), as views.
fn packets(mut rest: Bytes) -> impl Iterator<Item = Bytes> {
    std::iter::from_fn(move || {
        let (n, _) = mpquic_core::reorder::reassembly::parse_header(rest.first_chunk()?);
        if n == 0 || rest.len() < STREAM_HEADER + n {
            return None;
        }
        let packet = rest.slice(STREAM_HEADER..STREAM_HEADER + n);
        rest = rest.slice(STREAM_HEADER + n..);
        Some(packet)
    })
}

/// Chunks a writer has taken for its streams and not yet wholly written, by stream
/// (`LaneStreams::slot`), in order: a bulk stream's write that waits for room in the send
/// window gives way when a sparse packet arrives (`write_out`), and the rest is written next
/// turn, after the sparse packet.
#[derive(Default)]
struct Unwritten {
    /// Per slot: its chunks, and how much of the first is written.
    slots: Vec<(VecDeque<Bytes>, usize)>,
    /// Not yet written, in all slots.
    bytes: usize,
}

/// Unwritten bytes up to which a bulk write still gives way to sparse packets; beyond, it
/// waits for its room as before (which bounds what waits here to about two turns' chunks).
const GIVE_WAY_BYTES: usize = 2 * STREAM_BATCH;

impl Unwritten {
    fn push(&mut self, slot: usize, chunk: Bytes) {
        if self.slots.len() <= slot {
            self.slots.resize_with(slot + 1, Default::default);
        }
        self.bytes += chunk.len();
        self.slots[slot].0.push_back(chunk);
    }

    fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    fn has(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| !s.0.is_empty())
    }

    /// Everything unwritten is lost with the stream: counted, and let go. (It no longer
    /// counted as waiting once taken from the queue.)
    fn lose(&mut self, sink: &dyn Sink) {
        let mut lost = Dropped::default();
        for (chunks, _) in &mut self.slots {
            for chunk in chunks.drain(..) {
                packets(chunk).for_each(|p| lost.add(p.len()));
            }
        }
        self.bytes = 0;
        lost.report(sink, DropReason::SendFailed);
    }
}

/// Write `slot`'s unwritten chunks to `send`, in order, handing each wholly written chunk to
/// `done`. With `give_way` (a bulk stream's write, and little unwritten), a write that has to
/// wait for room in the send window is abandoned (quinn's `write_chunks` writes nothing unless
/// it completes) as soon as a packet arrives that joins the sparse queue and will pass the
/// bulk stream (`GiveWay::passes`): it goes first, next turn. Waiting there, the writer held
/// a call's packets until a whole chunk's worth of the bulk stream was acknowledged (64 KB
/// is 100 ms at 5 Mbit/s), although the sparse stream has room of its own (`SPARSE_ROOM`);
/// and a flow with more than `sendq::SPARSE_PACKETS` waiting meanwhile left through the bulk
/// queue, which made it bulk for the sparse lane (`SparseLane`): on the bulk stream, behind
/// its backlog, for as long as it kept sending.
async fn write_out(
    send: &mut quinn::SendStream,
    unwritten: &mut Unwritten,
    slot: usize,
    give_way: Option<GiveWay<'_>>,
    mut done: impl FnMut(Bytes),
) -> Result<(), quinn::WriteError> {
    let mut give_way = give_way;
    // Until nothing more can arrive: then the write waits for its room.
    let mut open = give_way.is_some();
    let (chunks, at) = &mut unwritten.slots[slot];
    while let Some(front) = chunks.front() {
        let mut rest = [front.slice(*at..)];
        let written = match give_way.as_mut() {
            Some(w) if open => tokio::select! {
                biased;
                written = send.write_chunks(&mut rest) => written,
                next = w.rx.recv() => {
                    let Some(next) = next else {
                        open = false;
                        continue;
                    };
                    let passes = (w.passes)(&next);
                    enqueue(w.queue, w.flows, w.refused, next);
                    if passes && w.queue.has_sparse() {
                        return Ok(());
                    }
                    continue;
                }
            },
            _ => send.write_chunks(&mut rest).await,
        }?;
        *at += written.bytes;
        unwritten.bytes -= written.bytes;
        if *at == front.len() {
            *at = 0;
            done(chunks.pop_front().expect("front checked"));
        }
    }
    Ok(())
}

/// What a bulk write that gives way (`write_out`) takes arrivals into.
struct GiveWay<'a> {
    rx: &'a mut mpsc::Receiver<Queued>,
    queue: &'a mut RankedQueues<Frame>,
    flows: &'a WaitingFlows,
    refused: &'a mut Dropped,
    /// Whether an arrival would pass the bulk stream (it gives way only to such).
    passes: &'a (dyn Fn(&Queued) -> bool + Sync),
}

/// What a path's writer task (`path_writer`) works with.
pub(super) struct Writer {
    pub(super) sink: Arc<dyn Sink>,
    pub(super) conn: quinn::Connection,
    /// The first lane's stream (none on a CONNECT-IP connection: datagrams only).
    pub(super) send: Option<quinn::SendStream>,
    pub(super) rx: mpsc::Receiver<Queued>,
    /// Bytes waiting, shared with `send_batch`'s bound: the writer takes off what leaves.
    pub(super) waiting: Arc<AtomicU64>,
    /// Their flows, likewise.
    pub(super) flows: Arc<WaitingFlows>,
    /// The carriage of the moment (reliable, `auto`); `None`: datagram mode, no stream.
    pub(super) on_stream: Option<Arc<AtomicBool>>,
    /// `auto`: the carriage is the tunnel's choice, and a packet that is not TCP may go as a
    /// datagram while the path is on the stream (`DATAGRAM_LOSS`). Reliable mode recovers all.
    pub(super) adaptive: bool,
    /// `non_tcp_on_stream` of the path's probes (`set_path_probes`).
    pub(super) stream_for_non_tcp: Arc<AtomicBool>,
    pub(super) recent: Arc<Mutex<Recent>>,
    /// Whether to keep them (`set_hand_over`).
    pub(super) hand_over: Arc<AtomicBool>,
    /// The controller's figures without cloning it (`pace`).
    pub(super) meter: Option<Arc<controller::WindowMeter>>,
    /// `rate_limit` (bits/s, 0: none).
    pub(super) rate_cap: Arc<AtomicU64>,
    /// The tunnel's paths' backlogs (`Transport::join_tunnel`): whether the traffic offers
    /// less than the paths take when this writer's queue empties.
    pub(super) tunnel: Arc<std::sync::OnceLock<TunnelBacklog>>,
    /// Bytes of the CONNECT-IP prefix between each frame's header and its packet's headers
    /// (`QuicTransport::prefix`; 0 on an mpquic connection).
    pub(super) prefix_len: usize,
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
pub(super) async fn path_writer(w: Writer) {
    let Writer {
        sink,
        conn,
        send,
        mut rx,
        waiting,
        flows,
        on_stream,
        adaptive,
        stream_for_non_tcp,
        recent,
        hand_over,
        meter,
        rate_cap,
        tunnel,
        prefix_len,
    } = w;
    let mut streams = LaneStreams::new(send);
    // What goes on the streams this turn, by stream (`LaneStreams::slot`: each lane's sparse
    // and bulk stream).
    let mut batches: Vec<BytesMut> = vec![
        BytesMut::new(),
        BytesMut::with_capacity(STREAM_BATCH + 65_538),
    ];
    let mut unwritten = Unwritten::default();
    let mut sparse_lane = SparseLane::default();
    let mut queue = RankedQueues::new(WRITER_QUEUE, mpquic_core::reliable::HANDOFF_TIME);
    let mut pacer = Pacer::default();
    let mut stale = Dropped::default();
    // Packets marked "congestion experienced" since the last report (`mark_ce`).
    let mut ce_marked = 0u64;
    let mut refused = Dropped::default();
    let mut failed = (Dropped::default(), Dropped::default(), Dropped::default());
    let mut loss = mpquic_core::path::loss::LossEstimate::default();
    // What left the writer's hands, sent or dropped, no longer waits.
    let gone = |d: &mut Dropped, reason: DropReason| {
        waiting.fetch_sub(d.bytes, Ordering::Relaxed);
        d.report(&*sink, reason);
    };
    loop {
        // Take what has arrived; wait for something when nothing is queued or unwritten.
        if queue.is_empty() && unwritten.is_empty() {
            // Nothing waits to be written: a closed connection ends the writer here (its
            // queue's sender lives as long as the transport, which may outlive it), and what
            // it remembers goes once it is too old to hand over (a path that fell idle, a
            // failover's backup, would otherwise keep up to `RECENT_BYTES` for good).
            let kept = !recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .chunks
                .is_empty();
            // Its traffic offers less than the path takes: the pacer may save up for the burst
            // that ends the quiet spell (not on a path that reorders, where the rate it would
            // save at may run high), and the controller hears that the round was
            // application-limited (`Pacer::idle`, `WindowMeter::reorders`, `on_idle`).
            if tunnel.get().is_some_and(TunnelBacklog::empty) {
                let meter = meter.as_deref();
                if !meter.is_some_and(controller::WindowMeter::reorders) {
                    pacer.idle(Instant::now(), conn.rtt());
                }
                if let Some(m) = meter {
                    m.on_idle();
                }
            }
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
            unwritten.lose(&*sink);
            return;
        }
        let stream = on_stream
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Relaxed));
        // Whether a packet goes as a datagram rather than on a stream.
        let as_datagram = |carry: LaneCarry, tcp: bool| match carry {
            LaneCarry::Path => {
                !stream || datagram_beside_stream(adaptive, tcp, &stream_for_non_tcp)
            }
            LaneCarry::Datagram => true,
            // A connection without a stream (datagram mode) has no other way.
            LaneCarry::Stream => on_stream.is_none(),
        };
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
        let wait = max_wait(stream, conn.rtt());
        queue.set_max_wait(wait);
        queue.set_mark_after(mpquic_core::sendq::mark_after(conn.rtt(), wait));
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
        // The send time, for the receiver's playout (`stream_rx`): when the frames enter the
        // stream, so the wait in our own queue is not taken for the path's. One clock read
        // serves the batch.
        let sent_us = stream_rx::clock_us();
        // While a bulk write waits for its room, only sparse packets join it (`write_out`).
        while sent + batched < budget && (unwritten.is_empty() || queue.has_sparse()) {
            let Some((
                Frame {
                    bytes: frame,
                    rank,
                    carry,
                    flow,
                    tcp,
                },
                left_sparse,
            )) = queue.pop_marking(
                now,
                &mut |f: Frame| {
                    flows.sub(f.flow);
                    stale.add(f.bytes.len() - STREAM_HEADER)
                },
                &mut |f: &mut Frame| ce_marked += u64::from(mark_ce(&mut f.bytes, prefix_len)),
            )
            else {
                break;
            };
            let len = frame.len() - STREAM_HEADER;
            waiting.fetch_sub(len as u64, Ordering::Relaxed);
            flows.sub(flow);
            let datagram = as_datagram(carry, tcp);
            // While the path is on its stream, the sparse lane sees a flow's packets whichever
            // way they go: a call or a ping that rode datagrams beside the stream takes the
            // sparse stream as soon as the path's loss moves it onto the stream. Seen there
            // first, it was a new flow and rode the bulk stream for its first second, behind
            // the bulk's backlog (pings 46 -> 219 ms at once over a replayed Starlink link).
            let seen =
                (stream || !datagram).then(|| sparse_lane.on_stream_sparse(now, flow, left_sparse));
            if datagram {
                match send_datagram(&conn, frame.slice(STREAM_HEADER..)) {
                    Ok(()) => {
                        sent += len;
                        // Where the stream would have carried it (`DATAGRAM_LOSS`), it is kept
                        // for a hand-over as the stream's chunks are: a path that goes down
                        // loses none of a ping or a call's last round trip either.
                        if stream {
                            keep_for_hand_over(&recent, &hand_over, now, frame);
                        }
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
            let sparse =
                seen.unwrap_or_else(|| sparse_lane.on_stream_sparse(now, flow, left_sparse));
            let slot = LaneStreams::slot(rank, sparse);
            if batches.len() <= slot {
                batches.resize_with(slot + 1, BytesMut::new);
            }
            let batch = &mut batches[slot];
            let at = batch.len();
            batch.extend_from_slice(&frame);
            batched += frame.len();
            let len = u16::from_be_bytes([frame[0], frame[1]]);
            batch[at..at + STREAM_HEADER].copy_from_slice(&stream_rx::header(len, sent_us));
        }
        // A frame that waited too long was dropped rather than added to the delay of
        // everything behind it (`max_wait`).
        gone(&mut stale, DropReason::QueueFull);
        if ce_marked > 0 {
            sink.on_ce_marked(std::mem::take(&mut ce_marked));
        }
        failed.0.report(&*sink, DropReason::QueueFull);
        failed.1.report(&*sink, DropReason::Oversized);
        failed.2.report(&*sink, DropReason::SendFailed);
        if batched == 0 && sent == 0 && unwritten.is_empty() {
            continue;
        }
        let path = conn.stats().path;
        pacer.spend(mpquic_core::pacing::on_the_wire(
            sent + batched,
            path.current_mtu,
        ));
        if batched == 0 && unwritten.is_empty() {
            continue;
        }
        loss.on_counters(now, path.sent_packets, path.lost_packets);
        // Sized by the backlog window (`WindowMeter::backlog_window`): through bbr's dips (Drain,
        // ProbeRtt, the regrowth after them) the stream holds the window bbr cruises at, and the
        // inner flows' packets wait the dip out in it instead of going stale in front of it.
        let window = meter
            .as_deref()
            .map_or(path.cwnd, |m| m.backlog_window().max(path.cwnd));
        let window = mpquic_core::reliable::stream_window(window, path.rtt, loss.loss());
        // The sparse streams first (with `SPARSE_ROOM` beyond the window), then the bulk
        // streams, highest class first.
        let order = (0..batches.len())
            .step_by(2)
            .chain((1..batches.len()).step_by(2));
        for (slot, batch) in batches.iter_mut().enumerate() {
            if !batch.is_empty() {
                unwritten.push(slot, batch.split().freeze());
            }
        }
        for slot in order {
            if !unwritten.has(slot) {
                continue;
            }
            let sparse = slot % 2 == 0;
            conn.set_send_window(window + if sparse { SPARSE_ROOM } else { 0 });
            // What passes a bulk write: a sparse flow's packet that goes as a datagram or on
            // the sparse stream.
            let passes = |&(_, lane, flow, tcp, _): &Queued| {
                as_datagram(lane.carry, tcp) || sparse_lane.takes_sparse(Instant::now(), flow)
            };
            let give_way = (!sparse && unwritten.bytes <= GIVE_WAY_BYTES).then(|| GiveWay {
                rx: &mut rx,
                queue: &mut queue,
                flows: &flows,
                refused: &mut refused,
                passes: &passes,
            });
            let keep = |chunk: Bytes| {
                if hand_over.load(Ordering::Relaxed) {
                    recent
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(Instant::now(), chunk);
                }
            };
            let written_ok = match streams.get(&conn, slot) {
                Some(send) => write_out(send, &mut unwritten, slot, give_way, keep)
                    .await
                    .is_ok(),
                None => false,
            };
            if !written_ok {
                // Everything not yet written and everything still queued is lost with the
                // stream; closing the queue makes later packets fail (and count) in
                // `send_batch`.
                close_queue(&mut rx, &mut queue, &flows, &mut refused);
                gone(&mut refused, DropReason::SendFailed);
                unwritten.lose(&*sink);
                return;
            }
            // A sparse packet arrived while a bulk write waited: it goes next turn.
            if unwritten.has(slot) {
                break;
            }
        }
    }
}

/// The streams a path's writer sends on, two per traffic class (lane):
///
/// - its **bulk** stream: the hello stream for the first class (and for a tunnel without
///   classes), a unidirectional stream for each other class that goes on a stream, opened when
///   it first does and prioritised by rank (quinn sends a higher-priority stream's data first,
///   its retransmissions included). Head-of-line blocking is per stream, so a class never
///   waits behind a lower class's retransmissions (scenario 01: critical pings on a 30%-loss
///   link waited behind bulk's on one shared stream, median 45.6 ms against 16.8 on a stream
///   of their own);
/// - its **sparse** stream, unidirectional, above every bulk stream, for the packets
///   `SparseLane` sends there (flows sparse for a second and never bulk: pings, voice,
///   interactive sessions): they pass the bulk streams' backlog and retransmissions, as they
///   pass bulk in the send queue.
///
/// The receiver reads every stream the peer opens alike (each frame carries its lane). A peer
/// that takes fewer streams (one that predates the sparse streams allows `MAX_LANES - 1`)
/// leaves a stream it has no room for unopened: its packets go on the lane's bulk stream, or
/// on the first one, instead of waiting for a stream that never comes.
struct LaneStreams {
    /// By `slot`; the hello stream at 1 (none on a CONNECT-IP connection).
    streams: Vec<Option<quinn::SendStream>>,
}

/// The hello stream's slot: the first lane's bulk stream.
const FIRST: usize = 1;

impl LaneStreams {
    fn new(first: Option<quinn::SendStream>) -> LaneStreams {
        LaneStreams {
            streams: vec![None, first],
        }
    }

    /// The index of lane `rank`'s sparse or bulk stream: sparse ones even, bulk ones odd.
    fn slot(rank: u8, sparse: bool) -> usize {
        2 * usize::from(rank) + usize::from(!sparse)
    }

    /// The stream of `slot`, opened when first needed, or the one that stands in for it
    /// (above); `None` when the connection has none (closed, or datagrams only).
    fn get(&mut self, conn: &quinn::Connection, slot: usize) -> Option<&mut quinn::SendStream> {
        if slot != FIRST && !self.open(conn, slot) {
            // A lane's sparse stream is stood in for by its bulk one, a bulk one by the first.
            return match slot % 2 {
                0 => self.get(conn, slot + 1),
                _ => self.streams[FIRST].as_mut(),
            };
        }
        self.streams[slot].as_mut()
    }

    /// Whether `slot`'s stream is open, opening it if the peer has room for one more now
    /// (asked once, not waited for).
    fn open(&mut self, conn: &quinn::Connection, slot: usize) -> bool {
        use std::future::Future;
        use std::task::{Context, Poll, Waker};
        if self.streams.len() <= slot {
            self.streams.resize_with(slot + 1, || None);
        }
        if self.streams[slot].is_some() {
            return true;
        }
        let fut = std::pin::pin!(conn.open_uni());
        let Poll::Ready(Ok(s)) = fut.poll(&mut Context::from_waker(Waker::noop())) else {
            return false;
        };
        // Every sparse stream above every bulk one; the bulk ones by rank, the hello stream's
        // quinn's default, 0.
        let rank = (slot / 2) as i32;
        let priority = match slot % 2 {
            0 => mpquic_core::wire::MAX_LANES as i32 - rank,
            _ => -rank,
        };
        let _ = s.set_priority(priority);
        self.streams[slot] = Some(s);
        true
    }
}

/// Queue a packet handed to the writer in its lane's queue, by its flow; what a full queue
/// refuses (this packet, or a bulk one a sparse packet displaced) is counted in `refused`.
fn enqueue(
    queue: &mut RankedQueues<Frame>,
    flows: &WaitingFlows,
    refused: &mut Dropped,
    (at, lane, flow, tcp, bytes): Queued,
) {
    let frame = Frame {
        bytes,
        // Lanes are fewer (a tunnel's); the peer takes no more streams than that.
        rank: lane.rank.min(mpquic_core::wire::MAX_LANES as u8 - 1),
        carry: lane.carry,
        flow,
        tcp,
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
    while let Ok((_, _, flow, _, frame)) = rx.try_recv() {
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
fn pace(
    conn: &quinn::Connection,
    meter: Option<&controller::WindowMeter>,
    stream: bool,
) -> Option<u64> {
    let paced = stream || conn.rtt() >= PACE_DATAGRAMS_FROM;
    let rate = controller_rate(conn, meter).filter(|_| paced);
    match (rate, stream) {
        (Some(bits), _) => Some(bits),
        (None, true) => None,
        (None, false) => Some(settings::rate_per_rtt(
            conn.congestion_state().window(),
            conn.rtt(),
        )),
    }
    .map(|bits| bits / 8)
}

/// The rate (bits/s) the connection's controller paces at, when it gives one: from the meter
/// (no clone of the controller) where there is one.
fn controller_rate(
    conn: &quinn::Connection,
    meter: Option<&controller::WindowMeter>,
) -> Option<u64> {
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
    let held = settings::DATAGRAM_SEND_BUFFER.saturating_sub(conn.datagram_send_buffer_space());
    let rate = settings::rate_per_rtt(conn.congestion_state().window(), conn.rtt()) / 8;
    let limit = (rate.saturating_mul(ENGINE_QUEUE_TIME.as_micros() as u64) / 1_000_000)
        .max(ENGINE_QUEUE_MIN as u64) as usize;
    limit.saturating_sub(held)
}

/// Mark the inner packet of a queued frame "congestion experienced" if its sender takes ECN
/// marks (`sendq::SendQueue::pop_marking`); whether it did. The frame is its header, the
/// CONNECT-IP prefix (`prefix_len` bytes, which no wire type describes), then the packet with
/// the bond's headers in front. It is copied only when marked.
fn mark_ce(frame: &mut Bytes, prefix_len: usize) -> bool {
    let Some(body) = frame.get(STREAM_HEADER + prefix_len..) else {
        return false;
    };
    let Some(at) = mpquic_core::wire::inner_packet_at(body) else {
        return false;
    };
    if !mpquic_core::packet::ecn::is_ect(&body[at..]) {
        return false;
    }
    let mut copy = BytesMut::from(&frame[..]);
    let marked = mpquic_core::packet::ecn::mark_ce(&mut copy[STREAM_HEADER + prefix_len + at..]);
    *frame = copy.freeze();
    marked
}

/// How long a packet may wait in a path's writer queue: on the stream, `reliable::queue_wait`
/// (three round trips); as datagrams the queue's bound in bytes (`settings::datagram_queue_limit`,
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
pub(super) fn on_the_link(st: &quinn::ConnectionStats, remote: SocketAddr) -> u64 {
    let header = mpquic_core::pacing::ip_udp_header(remote.is_ipv6()) as u64;
    st.udp_tx.bytes + st.udp_rx.bytes + (st.udp_tx.datagrams + st.udp_rx.datagrams) * header
}

/// Send one datagram, refusing (and reporting) rather than letting the QUIC engine silently
/// drop older queued datagrams when its buffer is full. `send_datagram_wait` checks for space
/// and queues under one lock and never evicts; polled once, "would wait" means the buffer is
/// full. (`send_datagram` would make room by discarding queued datagrams uncounted, and a
/// separate space check before it races with the other threads that send.)
pub(super) fn send_datagram(conn: &quinn::Connection, pkt: Bytes) -> Result<(), DropReason> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::LaneSend;

    #[test]
    fn non_tcp_rides_the_stream_only_where_its_recovery_is_in_time() {
        let ms = |n| Some(Duration::from_millis(n));
        // A clean link: such flows recover for themselves, as without a tunnel.
        assert!(!non_tcp_on_stream(0.01, ms(30)));
        // A lossy link of a short round trip: the stream brings a lost packet back in time.
        assert!(non_tcp_on_stream(0.03, ms(60)));
        assert!(non_tcp_on_stream(0.03, None));
        // The same loss where a retransmission would arrive past a call's budget.
        assert!(!non_tcp_on_stream(0.03, ms(93)));
        assert!(!non_tcp_on_stream(0.5, ms(300)));
        let on = AtomicBool::new(true);
        assert!(!datagram_beside_stream(true, false, &on));
        on.store(false, Ordering::Relaxed);
        assert!(datagram_beside_stream(true, false, &on));
        assert!(!datagram_beside_stream(true, true, &on));
        assert!(!datagram_beside_stream(false, false, &on));
    }

    /// A stream on a real QUIC connection over loopback whose peer takes `window` bytes of it
    /// until it reads: a write beyond waits for room, as it does for the send window.
    async fn narrow_stream(
        window: u32,
    ) -> (
        [quinn::Endpoint; 2],
        quinn::SendStream,
        quinn::Connection,
        tempfile::TempDir,
    ) {
        use crate::{pki, tls};
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        pki::init(d, false).unwrap();
        pki::issue(d, "mpquic-server", pki::Kind::Server { sans: vec![] }).unwrap();
        pki::issue(d, "site1", pki::Kind::Client).unwrap();
        let crypto = tls::server_crypto(
            &d.join("mpquic-server.crt"),
            &d.join("mpquic-server.key"),
            &d.join("ca.crt"),
            false,
            &[],
            tls::Served::Native,
        )
        .unwrap();
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(Arc::new(crypto)).unwrap(),
        ));
        let mut transport = quinn::TransportConfig::default();
        transport.stream_receive_window(window.into());
        server.transport_config(Arc::new(transport));
        let server = quinn::Endpoint::server(server, "127.0.0.1:0".parse().unwrap()).unwrap();
        let crypto = tls::client_crypto(
            Some(&d.join("ca.crt")),
            false,
            Some((&d.join("site1.crt"), &d.join("site1.key"))),
            false,
            tls::Served::Native,
        )
        .unwrap();
        let mut client = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        client.set_default_client_config(quinn::ClientConfig::new(Arc::new(
            quinn::crypto::rustls::QuicClientConfig::try_from(crypto).unwrap(),
        )));
        let addr = server.local_addr().unwrap();
        let (conn, accepted) = tokio::join!(
            async {
                client
                    .connect(addr, "mpquic-server")
                    .unwrap()
                    .await
                    .unwrap()
            },
            async { server.accept().await.unwrap().await.unwrap() }
        );
        let send = conn.open_uni().await.unwrap();
        ([server, client], send, accepted, dir)
    }

    /// An ECN-capable packet is marked where it lies in its frame: past the bond's header, and
    /// past a CONNECT-IP prefix, whose bytes would otherwise read as a wire type or as an IP
    /// header of their own (a quarter stream id of 64 or more begins with 0x4_).
    /// The Internet checksum of an IPv4 header (0 over one with a valid checksum).
    fn ip_checksum(h: &[u8]) -> u16 {
        let mut sum: u32 = h
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    #[test]
    fn the_mark_finds_the_packet_past_the_prefix() {
        let mut ip = vec![
            0x45, 0x02, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        ip.resize(40, 0);
        let c = ip_checksum(&ip[..20]);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let bond = mpquic_core::wire::encode_bonded(3, 9);
        for prefix in [vec![], mpquic_core::connect_ip::datagram::ip_prefix(4 * 70)] {
            for with_bond in [false, true] {
                let mut body = prefix.clone();
                if with_bond {
                    body.extend_from_slice(&bond);
                }
                let at = STREAM_HEADER + body.len();
                body.extend_from_slice(&ip);
                let mut frame = BytesMut::new();
                frame.extend_from_slice(&stream_rx::header(body.len() as u16, 0));
                frame.extend_from_slice(&body);
                let mut frame = frame.freeze();
                let before = frame.clone();
                assert!(mark_ce(&mut frame, prefix.len()), "{prefix:?} {with_bond}");
                assert_eq!(frame[at + 1] & 0b11, 0b11, "CE at the packet's TOS");
                assert_eq!(ip_checksum(&frame[at..at + 20]), 0);
                assert_eq!(
                    frame[..at],
                    before[..at],
                    "header, prefix and bond untouched"
                );
                assert!(!mark_ce(&mut frame, prefix.len()), "marked once");
            }
        }
        // Not ECN-capable, or not a packet: untouched.
        let mut plain = BytesMut::new();
        plain.extend_from_slice(&stream_rx::header(20, 0));
        plain.extend_from_slice(&[0x45, 0x00]);
        plain.resize(STREAM_HEADER + 20, 0);
        let mut plain = plain.freeze();
        assert!(!mark_ce(&mut plain, 0));
        let mut short = Bytes::from_static(&[0, 1]);
        assert!(!mark_ce(&mut short, 4));
    }

    /// A run of `n` frames of `len` bytes, numbered in their first bytes.
    fn frames(n: u32, len: u16) -> Bytes {
        let mut b = BytesMut::new();
        for i in 0..n {
            b.extend_from_slice(&stream_rx::header(len, 0));
            let mut p = vec![0u8; usize::from(len)];
            p[..4].copy_from_slice(&i.to_be_bytes());
            b.extend_from_slice(&p);
        }
        b.freeze()
    }

    /// A bulk write that waits for room gives way to a packet of a flow that passes the bulk
    /// stream, and to no other; what it had not written is written afterwards, once, in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_bulk_write_gives_way_to_a_sparse_packet_and_loses_nothing() {
        const CALL: u64 = 7;
        const BULK: u64 = 9;
        let (_endpoints, mut send, peer, _dir) = narrow_stream(16 * 1024).await;
        let chunk = frames(60, 1200);
        let mut unwritten = Unwritten::default();
        unwritten.push(1, chunk.clone());
        let (tx, mut rx) = mpsc::channel(8);
        let mut queue = RankedQueues::new(64, Duration::from_secs(1));
        let flows = WaitingFlows::default();
        let mut refused = Dropped::default();
        let passes = |q: &Queued| q.2 == Some(CALL);
        let packet = |flow| {
            let lane = LaneSend {
                rank: 0,
                carry: LaneCarry::Path,
            };
            (Instant::now(), lane, Some(flow), false, frames(1, 200))
        };
        let mut written = Vec::new();
        // A bulk flow's packet arrives: it joins the queue and the write goes on waiting (the
        // peer reads nothing yet), until a packet of the call arrives.
        tx.send(packet(BULK)).await.unwrap();
        let call = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            call.send(packet(CALL)).await.unwrap();
        });
        let started = Instant::now();
        let give_way = GiveWay {
            rx: &mut rx,
            queue: &mut queue,
            flows: &flows,
            refused: &mut refused,
            passes: &passes,
        };
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            write_out(&mut send, &mut unwritten, 1, Some(give_way), |c| {
                written.push(c)
            }),
        )
        .await;
        assert!(matches!(r, Ok(Ok(()))), "{r:?}");
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "gave way to the bulk packet"
        );
        assert_eq!(queue.len(), 2, "both arrivals queued");
        assert!(unwritten.has(1) && unwritten.bytes > 0 && unwritten.bytes < chunk.len());
        assert!(written.is_empty(), "the chunk is not whole yet");
        // The peer reads; the rest goes without giving way.
        let reader = tokio::spawn(async move {
            let mut recv = peer.accept_uni().await.unwrap();
            recv.read_to_end(1 << 20).await.unwrap()
        });
        write_out(&mut send, &mut unwritten, 1, None, |c| written.push(c))
            .await
            .unwrap();
        assert!(unwritten.is_empty() && !unwritten.has(1));
        assert_eq!(
            written,
            vec![chunk.clone()],
            "kept for a hand-over whole, once"
        );
        send.finish().unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), reader)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, chunk, "every byte once, in order");
    }
}
