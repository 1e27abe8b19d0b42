//! The receive side: what a path's transport hands up (datagrams, stream packets) to the core
//! under the lock, inner packets to the TUN device's outbox, written at the end of the wake-up.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use mpquic_core::tunnel::{Deliver, Received};
use mpquic_core::{DropReason, PacketInfo, PathId};
use tracing::debug;

use super::{close, Tunnel};
use crate::transport::{PathTransport, Sink};

impl Tunnel {
    /// Write what this wake-up delivered to the TUN devices (`Sink::on_batch_end`): the
    /// tunnel's, and a class's own.
    pub fn flush_tun(&self) {
        let refused = self.tun.flush();
        self.count_refused(refused);
        for (i, l) in self.lanes.iter().enumerate() {
            let own = !Arc::ptr_eq(&l.tun, &self.tun);
            // A device shared by classes (not the tunnel's) is flushed once, by its first.
            let first = own && !self.lanes[..i].iter().any(|o| Arc::ptr_eq(&o.tun, &l.tun));
            if first {
                let refused = l.tun.flush();
                self.count_refused(refused);
            }
        }
    }

    /// Packets a TUN device refused, counted on the tunnel (its first lane): a coalesced write
    /// carries packets of several paths and lanes (and, on a server, of several clients'
    /// tunnels).
    pub(super) fn count_refused(&self, refused: Option<crate::io::tun::Refused>) {
        if let Some((reason, n)) = self.refusal(refused) {
            self.lock().core.router_mut().drop_unrouted(0, reason, n);
        }
    }

    /// Why and how many packets the TUN device refused.
    pub(super) fn refusal(
        &self,
        refused: Option<crate::io::tun::Refused>,
    ) -> Option<(DropReason, u64)> {
        let r = refused?;
        let reason = if r.error.raw_os_error() == Some(libc::EAGAIN) {
            DropReason::QueueFull
        } else {
            DropReason::TunRefused
        };
        debug!(tunnel = %self.peer, packets = r.packets, error = %r.error, "TUN write refused");
        Some((reason, r.packets))
    }

    /// A datagram from `path`'s connection `transport` (probes are answered on it, while it
    /// lives).
    pub(super) fn on_datagram(&self, path: PathId, transport: &Weak<dyn PathTransport>, d: &[u8]) {
        let mut rx = Rx {
            tunnel: self,
            reply_to: Some(transport),
        };
        let got = self
            .lock()
            .core
            .on_datagram(path, d, Instant::now(), &mut rx);
        self.after_receive(got);
    }

    /// A packet from `path`'s reliable stream (`None`: a frame that did not parse).
    pub(super) fn on_stream_packet(&self, path: PathId, pkt: Option<&[u8]>) {
        let mut rx = Rx {
            tunnel: self,
            reply_to: None,
        };
        let got = self
            .lock()
            .core
            .on_stream_packet(path, pkt, Instant::now(), &mut rx);
        self.after_receive(got);
    }

    pub(super) fn after_receive(&self, got: Received) {
        self.wake_timers_if(got.wake);
        if let Some(t) = got.transition {
            self.on_transition(&t);
        }
    }
}

/// What the transport of one path (one connection generation) delivers to its tunnel.
pub(super) struct LinkSink {
    pub(super) tunnel: Arc<Tunnel>,
    pub(super) path: PathId,
    pub(super) generation: u64,
    /// Probes are answered on the transport they came on. Weak: the transport's tasks hold
    /// this sink, and a strong reference back would keep every replaced connection (its
    /// socket, queues and tasks) alive for good.
    pub(super) transport: Weak<dyn PathTransport>,
}

impl Sink for LinkSink {
    fn on_datagram(&self, d: &[u8]) {
        self.tunnel.on_datagram(self.path, &self.transport, d);
    }

    fn on_batch_end(&self) {
        self.tunnel.flush_tun();
    }

    fn on_stream_packet(&self, pkt: Option<&[u8]>) {
        self.tunnel.on_stream_packet(self.path, pkt);
    }

    fn on_send_dropped(&self, reason: DropReason, packets: u64, bytes: u64) {
        self.tunnel
            .lock()
            .core
            .router_mut()
            .drop_tx_batch(self.path, packets, bytes, reason);
    }

    fn on_received_dropped(&self, reason: DropReason) {
        (self.tunnel.lock().core.router_mut()).drop_on(self.path, reason, 1);
    }

    fn on_ce_marked(&self, packets: u64) {
        (self.tunnel.lock().core.router_mut()).ce_marked(self.path, packets);
    }

    fn on_closed(&self, peer_code: Option<u32>) {
        let prober = self.tunnel.watches_mtu();
        match peer_code {
            // The client took the path out of its configuration: so does the server's view
            // (the side that does not probe).
            Some(close::REMOVED) if !prober => self.tunnel.retire(self.path, Some(self.generation)),
            Some(close::LEAVING) => {
                self.tunnel.peer_leaving.store(true, Ordering::Relaxed);
                self.tunnel.remove(self.path, self.generation);
            }
            _ => self.tunnel.remove(self.path, self.generation),
        }
    }
}

/// The core's receive side as the shell carries it out: inner packets to the TUN device's
/// outbox (written at the end of the wake-up, `flush_tun`), replies on the connection the
/// datagram came on. Used under the tunnel's lock, so it never takes it.
pub(super) struct Rx<'a> {
    pub(super) tunnel: &'a Tunnel,
    pub(super) reply_to: Option<&'a Weak<dyn PathTransport>>,
}

impl Deliver for Rx<'_> {
    fn deliver(
        &mut self,
        lane: usize,
        _path: PathId,
        packet: &[u8],
        info: Option<&PacketInfo>,
    ) -> Option<(DropReason, u64)> {
        // The core delivers only in lanes the tunnel has.
        let Some(l) = self.tunnel.lanes.get(lane) else {
            return Some((DropReason::Malformed, 1));
        };
        // Server: each packet from the client marks its flow's answers with its class.
        if let Some(marks) = &self.tunnel.marks {
            let parsed;
            let info = match info {
                Some(i) => Some(i),
                None => {
                    parsed = PacketInfo::parse(packet);
                    parsed.as_ref()
                }
            };
            if let Some(info) = info {
                marks.lock().unwrap_or_else(|e| e.into_inner()).mark(
                    info.reply_hash(),
                    l.send.rank,
                    Instant::now(),
                );
            }
        }
        self.tunnel.refusal(l.tun.queue(packet))
    }

    fn answer(&mut self, msg: &[u8]) {
        if let Some(t) = self.reply_to.and_then(Weak::upgrade) {
            let _ = t.send_control(msg);
        }
    }
}
