//! The send side: a TUN batch routed by the core under one lock (each packet's path, the
//! headers written), then handed to the paths' transports outside it; what they refuse counted.
//! `Shares` splits a reader's batch among tunnels and lanes, `Routed` is a batch's routing.

use std::sync::Arc;
use std::time::Instant;

use mpquic_core::tunnel::Routing;
use mpquic_core::{DropReason, PacketInfo, PathId};

use super::{State, Tunnel};
use crate::io::batch::{Facts, PacketBatch};
use crate::transport::PathTransport;

impl Tunnel {
    /// Send the packets `which` of `batch` (already MSS-clamped, `infos` their parsed headers,
    /// indexed like the batch), all of `lane`, each on the path its lane's policy picks:
    /// `route_batch`, then `send_routed`. `scratch` is the caller's, kept from batch to batch
    /// so routing allocates nothing in the steady state.
    pub fn send_batch(
        &self,
        lane: usize,
        batch: &mut PacketBatch,
        which: &[usize],
        infos: &[Option<PacketInfo>],
        scratch: &mut Routed,
    ) {
        self.route_batch(lane, batch, which, infos, scratch);
        self.send_routed(batch, scratch);
    }

    /// The first half of `send_batch`: the core picks each packet's path and writes every
    /// header (the bond's numbering, FEC's), then the transports write their framing; the picks
    /// stay in `scratch`. One lock covers the decisions for the whole batch. Nothing is sent,
    /// so the batch stays writable: the server routes one batch for each of its client sessions
    /// before any is sent (a transport that takes packets shares the batch, and no header can
    /// be written after that; later sessions' packets went unnumbered and without FEC).
    pub fn route_batch(
        &self,
        lane: usize,
        batch: &mut PacketBatch,
        which: &[usize],
        infos: &[Option<PacketInfo>],
        scratch: &mut Routed,
    ) {
        let now = Instant::now();
        scratch.clear();
        let Some(l) = self.lanes.get(lane) else {
            self.drop_unsent(0, DropReason::Malformed, which.len() as u64);
            return;
        };
        // What the transports queue and carry by, from the headers parsed once.
        for &i in which {
            let facts = Facts::of(batch.packet(i), infos.get(i).and_then(Option::as_ref));
            batch.set_facts(i, facts);
        }
        scratch.lane = lane;
        if l.per_packet {
            self.refresh_loads(scratch);
        }
        {
            let mut s = self.lock();
            let State { core, links, .. } = &mut *s;
            for (path, load) in scratch.loads.drain(..) {
                core.router_mut().set_load(path, load);
            }
            let link = |id: PathId| links.get(id.index()).and_then(Option::as_ref);
            let routing = &mut scratch.routing;
            let connected = |id: PathId| link(id).is_some();
            core.route_batch(lane, which, infos, batch, connected, now, routing);
            // The transports of the paths used, while their links are at hand.
            let used = routing.paths().map(|(id, _)| id);
            for id in used.chain(routing.copies.iter().map(|c| c.path)) {
                if scratch.to.len() <= id.index() {
                    scratch.to.resize_with(id.index() + 1, || None);
                }
                scratch.to[id.index()] = link(id).map(|l| l.transport.clone());
            }
            self.wake_timers_if(routing.wake);
        }
        // Every transport writes its headers before any takes packets (then they are shared).
        for (id, share) in scratch.routing.paths() {
            if let Some(t) = scratch.transport(id) {
                t.prepare(batch, &share.picks);
            }
        }
    }

    /// The second half of `send_batch`: send what `route_batch` put in `scratch`, outside the
    /// tunnel's lock (grouped per path, so the receive side never waits behind the sends), and
    /// count what the transports refused.
    pub fn send_routed(&self, batch: &mut PacketBatch, scratch: &mut Routed) {
        let mut refused_copies: Vec<(PathId, usize, DropReason, bool)> = Vec::new();
        for c in &scratch.routing.copies {
            let Some(t) = scratch.transport(c.path) else {
                continue;
            };
            if let Err(reason) = t.send_control(&c.bytes) {
                refused_copies.push((c.path, c.bytes.len(), reason, c.repair));
            }
        }
        let mut refused = std::mem::take(&mut scratch.refused);
        let mut repairs_refused: Vec<(PathId, u64)> = Vec::new();
        let lane = &self.lanes[scratch.lane];
        for (path, share) in scratch.routing.paths() {
            if let Some(t) = scratch.transport(path) {
                t.send_batch(batch, &share.picks, lane.send, &mut |i, reason| {
                    refused.push((path, i, reason))
                });
                let n = send_repairs(&**t, &share.repairs);
                if n > 0 {
                    repairs_refused.push((path, n));
                }
            }
        }
        if !refused_copies.is_empty() || !refused.is_empty() || !repairs_refused.is_empty() {
            let mut too_big = Vec::new();
            let mut s = self.lock();
            for (path, len, reason, repair) in refused_copies {
                match repair {
                    true => s.core.repairs_refused(path, 1),
                    false => s.core.router_mut().drop_tx(path, len, reason),
                }
            }
            for &(path, i, reason) in refused.iter() {
                s.core
                    .router_mut()
                    .drop_tx(path, batch.packet(i).len(), reason);
                if reason == DropReason::Oversized {
                    let limit = scratch.transport(path).and_then(|t| t.stats().max_datagram);
                    if let Some(reply) = limit.and_then(|l| too_big_reply(batch, i, l)) {
                        s.core.too_big_sent(path);
                        too_big.push(reply);
                    }
                }
            }
            for (path, n) in repairs_refused {
                s.core.repairs_refused(path, n);
            }
            drop(s);
            // The TUN write forwards the message to the sender; outside the lock.
            for reply in too_big {
                let refused = lane.tun.send(&reply);
                self.count_refused(refused);
            }
        }
        refused.clear();
        scratch.refused = refused;
    }

    /// Each connected path's load as its transport sees it now (`PathLoad`) into
    /// `scratch.loads`, read outside the tunnel's lock (it takes the QUIC connection's).
    pub(super) fn refresh_loads(&self, scratch: &mut Routed) {
        {
            let s = self.lock();
            let links = s.core.router().paths().ids();
            scratch
                .links
                .extend(links.filter_map(|id| s.link(id).map(|l| (id, l.transport.clone()))));
        }
        let loads = scratch.links.drain(..).map(|(id, t)| (id, t.load()));
        scratch.loads.extend(loads);
    }

    /// `n` packets of `lane` dropped before routing (counted on the lane, not on a path).
    pub fn drop_unsent(&self, lane: usize, reason: DropReason, n: u64) {
        if n > 0 {
            self.lock().core.router_mut().drop_unrouted(lane, reason, n);
        }
    }
}

/// ICMP "too big" for packet `i` of `batch`, which a transport refused: it carries datagrams of
/// `max_datagram` bytes, this packet's header included.
fn too_big_reply(batch: &PacketBatch, i: usize, max_datagram: usize) -> Option<Vec<u8>> {
    let mtu = max_datagram.checked_sub(batch.header_len(i))?;
    mpquic_core::packet::icmp::too_big(batch.packet(i), u16::try_from(mtu).ok()?)
}

/// A TUN batch's packets shared among tunnels and their lanes: a server's client sessions, a
/// client's (or a session's) traffic classes. Every share is routed and has its headers written
/// before any is sent (a transport that takes packets shares the batch, and no header can be
/// written after that), and the shares go out highest class first, so a critical packet
/// reaches its path's queue before the bulk read with it. Owned by a TUN reader and reused for
/// every batch.
#[derive(Default)]
pub struct Shares {
    groups: Vec<Share>,
}

struct Share {
    tunnel: Arc<Tunnel>,
    lane: usize,
    picks: Vec<usize>,
    routed: Routed,
}

impl Shares {
    /// Packet `i` of the batch goes through `tunnel`, in its lane `lane`.
    pub fn add(&mut self, tunnel: &Arc<Tunnel>, lane: usize, i: usize) {
        let same = |g: &&mut Share| g.lane == lane && Arc::ptr_eq(&g.tunnel, tunnel);
        match self.groups.iter_mut().find(same) {
            Some(g) => g.picks.push(i),
            None => self.groups.push(Share {
                tunnel: tunnel.clone(),
                lane,
                picks: vec![i],
                routed: Routed::default(),
            }),
        }
    }

    /// Route and send every share of `batch`, then start over for the next batch.
    pub fn send(&mut self, batch: &mut PacketBatch, infos: &[Option<PacketInfo>]) {
        self.groups.sort_by_key(|g| g.lane);
        for g in &mut self.groups {
            if !g.picks.is_empty() {
                (g.tunnel).route_batch(g.lane, batch, &g.picks, infos, &mut g.routed);
            }
        }
        for g in &mut self.groups {
            if !g.picks.is_empty() {
                g.tunnel.send_routed(batch, &mut g.routed);
            }
        }
        // Forget tunnels that took nothing this time (ended ones go with them).
        self.groups.retain(|g| !g.picks.is_empty());
        for g in &mut self.groups {
            g.picks.clear();
        }
    }
}

/// A batch's routing: the core's picks per path and the transports they go to. Owned by a
/// TUN reader and reused for every batch (`Tunnel::send_batch`).
#[derive(Default)]
pub struct Routed {
    routing: Routing,
    /// The lane the batch's packets are in.
    lane: usize,
    /// By `PathId::index()`: the transport of each path this batch uses.
    to: Vec<Option<Arc<dyn PathTransport>>>,
    /// Packets a transport refused: (path, packet, reason).
    refused: Vec<(PathId, usize, DropReason)>,
    /// Per-packet policies: the paths' loads read before routing, and the transports they are
    /// read from (kept from batch to batch: no allocation per batch).
    loads: Vec<(PathId, mpquic_core::PathLoad)>,
    links: Vec<(PathId, Arc<dyn PathTransport>)>,
}

/// Send FEC repair packets as datagrams; returns how many the transport refused (a full
/// buffer: repair never evicts data).
pub(super) fn send_repairs(t: &dyn PathTransport, repairs: &[Vec<u8>]) -> u64 {
    repairs
        .iter()
        .filter(|r| t.send_control(r).is_err())
        .count() as u64
}

impl Routed {
    pub(super) fn clear(&mut self) {
        self.to.iter_mut().for_each(|t| *t = None);
        self.refused.clear();
    }

    pub(super) fn transport(&self, path: PathId) -> Option<&Arc<dyn PathTransport>> {
        self.to.get(path.index()).and_then(Option::as_ref)
    }
}
