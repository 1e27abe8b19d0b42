//! A stripe path's send side: packets from `send_batch` wait in a `SendQueue` (sparse flows
//! first, bounded, nothing older than `reliable::queue_wait`) and leave at the controller's
//! pacing rate while its window has room. They go in runs: up to `RUN` packets of one size to
//! one pipe in a single send (UDP GSO where the socket has it), each run to the pipe with the
//! fewest bytes in flight. One system call per packet cost too much: in scenario 06 (two paths,
//! 540 Mbit/s) the sender fell behind on the shared runtime thread and its queue dropped 24k
//! packets per path.
//!
//! The server's sender also keeps what each pipe sent lately, to send again when a NAT
//! rebinding moved the pipe (`Resend`, `Link::follow`).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mpquic_core::sendq::SendQueue;
use mpquic_core::stripe::Kind;
use mpquic_core::DropReason;
use quinn::udp::Transmit;
use tokio::sync::mpsc;

use super::{queue_limit, Handed, Link, OVERHEAD, PACED_PACKET, QUEUE};
use crate::transport::{Dropped, Sink};

/// Packets sent to one pipe in one go, at most: their counters are consecutive, so a run
/// reaches the peer behind the other pipes' packets by at most its own length (8 full packets
/// are 0.9 ms at 100 Mbit/s), which the resequencer or inner TCP absorbs.
const RUN: usize = 8;
/// Outer IPv4 and UDP headers, for the pacer (it counts what the link carries).
const IP_UDP: usize = 28;
/// What `Resend` keeps: at most this many bytes of datagrams, none sent longer ago than this
/// (a rebinding is followed within a round trip of the mapping's death).
const RESEND_BYTES: usize = 2 << 20;
const RESEND_AGE_US: u64 = 1_000_000;

/// A data packet in the sender's queue: its inner flow (`Facts::flow`) and the datagram.
type Flowed = (Option<u64>, Bytes);

/// Queue a packet by its flow (sparse flows first); a full queue refuses it, counted in
/// `refused`.
fn enqueue(
    queue: &mut SendQueue<Flowed>,
    refused: &mut Dropped,
    at: Instant,
    flow: Option<u64>,
    d: Bytes,
) {
    if let Err((_, d)) = queue.push(at, flow, (flow, d)) {
        refused.add(d.len());
    }
}

/// Server: the data packets sent lately, with when (µs since the link started) and on which
/// pipe, so that what a pipe sent into a NAT mapping that died can be sent again to its new
/// address (`Link::follow`). Bounded by `RESEND_BYTES` and `RESEND_AGE_US`.
#[derive(Default)]
struct Resend {
    sent: VecDeque<(u64, usize, Flowed)>,
    bytes: usize,
}

impl Resend {
    fn keep(&mut self, at_us: u64, pipe: usize, packet: Flowed) {
        self.bytes += packet.1.len();
        self.sent.push_back((at_us, pipe, packet));
        while let Some((t, _, (_, d))) = self.sent.front() {
            if self.bytes <= RESEND_BYTES && at_us.saturating_sub(*t) <= RESEND_AGE_US {
                break;
            }
            self.bytes -= d.len();
            self.sent.pop_front();
        }
    }

    /// Queue again, in the order they were sent, the packets `pipe` sent from `since_us` on,
    /// and forget them (they are kept again as they leave); returns how many.
    fn queue_again(
        &mut self,
        pipe: usize,
        since_us: u64,
        queue: &mut SendQueue<Flowed>,
        refused: &mut Dropped,
        now: Instant,
    ) -> usize {
        let mut again = 0;
        let mut kept = VecDeque::with_capacity(self.sent.len());
        for (at, p, (flow, d)) in self.sent.drain(..) {
            if p == pipe && at >= since_us {
                self.bytes -= d.len();
                enqueue(queue, refused, now, flow, d);
                again += 1;
            } else {
                kept.push_back((at, p, (flow, d)));
            }
        }
        self.sent = kept;
        again
    }
}

/// Sealed packets for one pipe, back to back in one buffer: all `seg` bytes long but the last.
#[derive(Default)]
struct Run {
    pipe: usize,
    dest: Option<std::net::SocketAddr>,
    seg: usize,
    buf: Vec<u8>,
    /// The packets in it: (counter, sealed length).
    packets: Vec<(u64, usize)>,
    /// The last packet is shorter than `seg`: nothing may follow it.
    closed: bool,
}

impl Run {
    fn is_empty(&self) -> bool {
        self.packets.is_empty()
    }

    /// Whether a sealed packet of `len` bytes may join.
    fn takes(&self, len: usize, max: usize) -> bool {
        !self.is_empty() && !self.closed && self.packets.len() < max && len <= self.seg
    }

    fn push(&mut self, counter: u64, sealed: &[u8]) {
        if self.is_empty() {
            self.seg = sealed.len();
        }
        self.closed = sealed.len() < self.seg;
        self.buf.extend_from_slice(sealed);
        self.packets.push((counter, sealed.len()));
    }

    fn clear(&mut self) {
        self.buf.clear();
        self.packets.clear();
        self.closed = false;
    }

    /// Send it on its pipe's socket.
    fn send(&self, link: &Link) -> std::io::Result<()> {
        let Some(destination) = self.dest else {
            return Err(std::io::ErrorKind::NotConnected.into());
        };
        let t = Transmit {
            destination,
            ecn: None,
            contents: &self.buf,
            segment_size: (self.packets.len() > 1).then_some(self.seg),
            src_ip: None,
        };
        link.pipes[self.pipe].socket.try_send(&t)
    }

    /// It left: count it on its pipe.
    fn sent(&self, link: &Link) {
        let p = &link.pipes[self.pipe];
        p.sent
            .fetch_add(self.packets.len() as u64, Ordering::Relaxed);
        p.tx_bytes
            .fetch_add(self.buf.len() as u64, Ordering::Relaxed);
    }

    /// Its packets as datagrams lost to the sink (inner bytes).
    fn dropped(&self, sink: &dyn Sink, reason: DropReason) {
        let bytes: usize = self.packets.iter().map(|(_, l)| l - OVERHEAD).sum();
        sink.on_send_dropped(reason, self.packets.len() as u64, bytes as u64);
    }
}

enum Wait {
    No,
    Until(Instant),
    Window,
}

pub(super) async fn run(
    link: Arc<Link>,
    mut rx: mpsc::Receiver<Handed>,
    sink: Arc<dyn Sink>,
    conn: quinn::Connection,
) {
    let mut queue: SendQueue<Flowed> = SendQueue::new(QUEUE, mpquic_core::reliable::HANDOFF_TIME);
    let mut resend = Resend::default();
    let (mut stale, mut full, mut failed) =
        (Dropped::default(), Dropped::default(), Dropped::default());
    let mut pollers: Vec<_> = link
        .pipes
        .iter()
        .map(|p| p.socket.clone().create_io_poller())
        .collect();
    let max_run: Vec<usize> = link
        .pipes
        .iter()
        .map(|p| p.socket.max_transmit_segments().clamp(1, RUN))
        .collect();
    let mut run = Run::default();
    // A packet taken from the queue while the socket was blocked: it goes first.
    let mut carry: Option<Flowed> = None;
    // Set when the connection was found closed while the window was full.
    let mut ended = false;
    loop {
        if ended {
            // The path has ended while the window was full: the feedback that would open it
            // never comes, and a sender waiting for it would keep the path's sockets for good.
            for (_, d) in queue.drain().chain(carry.take()) {
                failed.add(d.len());
            }
            while let Ok((_, _, d)) = rx.try_recv() {
                failed.add(d.len());
            }
            if !run.is_empty() {
                run.dropped(&*sink, DropReason::SendFailed);
            }
            failed.report(&*sink, DropReason::SendFailed);
            return;
        }
        if queue.is_empty() && carry.is_none() {
            tokio::select! {
                got = rx.recv() => match got {
                    Some((at, flow, d)) => enqueue(&mut queue, &mut full, at, flow, d),
                    None => return,
                },
                _ = link.resend_due.notified() => {}
                _ = conn.closed() => return,
            }
        }
        while let Ok((at, flow, d)) = rx.try_recv() {
            enqueue(&mut queue, &mut full, at, flow, d);
        }
        let now = Instant::now();
        // Pipes a NAT rebinding moved: what they sent into the dead mapping is lost (its window
        // freed now) and sent again, ahead of bulk where its flow is sparse.
        let moved = match link.resend_pending.swap(false, Ordering::Acquire) {
            true => std::mem::take(&mut *link.resend.lock().unwrap_or_else(|e| e.into_inner())),
            false => Vec::new(),
        };
        for (pipe, since_us) in moved {
            let since = link.started + Duration::from_micros(since_us);
            link.tx().flight.on_moved(now, pipe as u8, since);
            let again = resend.queue_again(pipe, since_us, &mut queue, &mut full, now);
            link.resent.fetch_add(again as u64, Ordering::Relaxed);
        }
        full.report(&*sink, DropReason::QueueFull);
        let mut blocked = false;
        let wait = {
            let mut tx = link.tx();
            let rate = tx.flight.pacing_rate();
            tx.pacer.set_rate(rate);
            queue.set_max_wait(mpquic_core::reliable::queue_wait(
                tx.flight.rtt().unwrap_or(Duration::from_millis(100)),
            ));
            let limit = queue_limit(tx.flight.backlog_window(), tx.flight.rtt());
            queue.set_limit(limit);
            link.meter.limit.store(limit as u64, Ordering::Relaxed);
            let wait = if tx.flight.room() < PACED_PACKET as u64 {
                Wait::Window
            } else {
                let at = tx.pacer.ready_at(now, PACED_PACKET);
                if at > now {
                    Wait::Until(at)
                } else {
                    let mut budget = tx.pacer.budget(now);
                    let now_us = now.saturating_duration_since(link.started).as_micros() as u64;
                    while budget > 0 && tx.flight.room() >= PACED_PACKET as u64 {
                        let next = carry
                            .take()
                            .or_else(|| queue.pop(now, &mut |(_, d): Flowed| stale.add(d.len())));
                        let Some((flow, d)) = next else {
                            break;
                        };
                        let tx = &mut *tx;
                        let len = d.len() + OVERHEAD;
                        if !run.takes(len, max_run[run.pipe]) {
                            if !run.is_empty() && flush(&link, &mut run, &sink).is_err() {
                                // The socket would block: this packet goes first once the run
                                // that waits for it has left.
                                blocked = true;
                                carry = Some((flow, d));
                                break;
                            }
                            let Some(pipe) = link.pick_data(&tx.flight, tx.next) else {
                                failed.add(d.len());
                                continue;
                            };
                            tx.next = pipe + 1;
                            run.pipe = pipe;
                            run.dest = link.pipes[pipe].dest();
                        }
                        tx.buf.clear();
                        let counter = tx.seal.sealed();
                        tx.seal.seal(Kind::Data, &d, &mut tx.buf);
                        run.push(counter, &tx.buf);
                        if !link.client {
                            resend.keep(now_us, run.pipe, (flow, d));
                        }
                        let app_limited = queue.is_empty() && rx.is_empty();
                        tx.flight
                            .on_sent(now, counter, len, app_limited, run.pipe as u8);
                        tx.pacer.spend(len + IP_UDP);
                        budget = budget.saturating_sub(len + IP_UDP);
                    }
                    if !blocked && !run.is_empty() && flush(&link, &mut run, &sink).is_err() {
                        blocked = true;
                    }
                    Wait::No
                }
            };
            link.publish(&tx);
            wait
        };
        link.meter
            .backlog
            .store(queue.len() as u64 * PACED_PACKET as u64, Ordering::Relaxed);
        stale.report(&*sink, DropReason::QueueFull);
        failed.report(&*sink, DropReason::SendFailed);
        if blocked {
            // The socket's buffer is full: wait until it drains (bounded), then send the run
            // that waits (already sealed and counted in flight) before anything else.
            let ready = std::future::poll_fn(|cx| pollers[run.pipe].as_mut().poll_writable(cx));
            let _ = tokio::time::timeout(Duration::from_millis(100), ready).await;
            if run.send(&link).is_ok() {
                run.sent(&link);
            } else {
                run.dropped(&*sink, DropReason::SendFailed);
            }
            run.clear();
            continue;
        }
        match wait {
            Wait::No => {}
            Wait::Until(at) => tokio::time::sleep_until(at.into()).await,
            // A feedback (or the loss timer) opens the window; the timeout only guards a wake-up
            // that came before this wait began.
            Wait::Window => {
                let _ =
                    tokio::time::timeout(Duration::from_millis(5), link.window_opened.notified())
                        .await;
                ended = conn.close_reason().is_some();
            }
        }
    }
}

/// Send `run` and empty it; `Err` when the socket would block (the run is kept to retry).
/// Other errors drop its packets, counted.
fn flush(link: &Link, run: &mut Run, sink: &Arc<dyn Sink>) -> Result<(), ()> {
    match run.send(link) {
        Ok(()) => run.sent(link),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Err(()),
        Err(_) => run.dropped(&**sink, DropReason::SendFailed),
    }
    run.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run takes packets of its first packet's size up to the limit; a shorter one ends it,
    /// a longer one never joins (GSO: all segments equal but the last).
    #[test]
    fn runs_hold_equal_packets_and_end_at_a_short_one() {
        let mut run = Run::default();
        assert!(
            !run.takes(100, RUN),
            "an empty run takes nothing: a pipe is chosen first"
        );
        run.push(0, &[1u8; 100]);
        assert!(run.takes(100, RUN) && run.takes(60, RUN) && !run.takes(101, RUN));
        run.push(1, &[2u8; 100]);
        assert!(!run.takes(100, 2), "full at the socket's segment limit");
        run.push(2, &[3u8; 60]);
        assert!(
            !run.takes(60, RUN) && !run.takes(10, RUN),
            "a short packet ends the run"
        );
        assert_eq!((run.seg, run.buf.len(), run.packets.len()), (100, 260, 3));
        run.clear();
        assert!(run.is_empty() && run.buf.is_empty() && !run.closed);
    }
}
