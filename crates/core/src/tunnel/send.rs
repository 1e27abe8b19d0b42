//! What leaves: each inner packet of a batch gets its path from the bond, the bond's numbering
//! for the peer's resequencer (per-packet policies), and its path's FEC; `redundant`, and a
//! Starlink path around its reconfigurations, add a numbered copy for a second path. Decided
//! here for the binary and the simulator alike; the shell hands the packets to the paths'
//! transports.

use std::time::Instant;

use crate::wire;
use crate::{DropReason, PacketInfo, PathId};

use super::TunnelCore;

/// The packets of a send as the core sees them: the shell's batch, with room in front of
/// each packet for the headers the core writes (the bond's numbering first, then FEC's).
pub trait Outgoing {
    /// Packet `i` as it came in (no header).
    fn packet(&self, i: usize) -> &[u8];
    /// Packet `i` with the headers written in front of it so far.
    fn headed(&self, i: usize) -> &[u8];
    /// Put `header` in front of packet `i`'s headers; false when it cannot (no headroom left,
    /// or the packets are already shared with a transport).
    fn push_header(&mut self, i: usize, header: &[u8]) -> bool;
    /// Whether headers can still be written at all.
    fn headers_writable(&self) -> bool;
}

/// Where a batch's packets go. Owned by the shell and reused from batch to batch.
#[derive(Default)]
pub struct Routing {
    /// By `PathId::index()`: the packets (batch indices) each path carries, and the repair
    /// packets of FEC groups they closed there.
    pub per_path: Vec<PathPicks>,
    /// `redundant`: second copies (numbered like the first) and the repairs of the FEC groups
    /// they closed on their path, each a whole datagram.
    pub copies: Vec<SecondCopy>,
    /// The core's next deadline may have moved earlier (an FEC group opened, a packet woke a
    /// quiet tunnel): wake the timers.
    pub wake: bool,
}

#[derive(Default)]
pub struct PathPicks {
    /// Set once the path has been used in some batch.
    path: Option<PathId>,
    pub picks: Vec<usize>,
    pub repairs: Vec<Vec<u8>>,
}

/// A datagram for a second path (`redundant`): a packet's copy, or a repair packet.
pub struct SecondCopy {
    pub path: PathId,
    pub bytes: Vec<u8>,
    pub repair: bool,
}

impl Routing {
    fn clear(&mut self) {
        for p in &mut self.per_path {
            p.picks.clear();
            p.repairs.clear();
        }
        self.copies.clear();
        self.wake = false;
    }

    fn on(&mut self, path: PathId) -> &mut PathPicks {
        if self.per_path.len() <= path.index() {
            self.per_path
                .resize_with(path.index() + 1, Default::default);
        }
        let share = &mut self.per_path[path.index()];
        share.path = Some(path);
        share
    }

    /// The paths that got packets or repairs, with their share.
    pub fn paths(&self) -> impl Iterator<Item = (PathId, &PathPicks)> {
        (self.per_path.iter())
            .filter(|p| !p.picks.is_empty() || !p.repairs.is_empty())
            .filter_map(|p| Some((p.path?, p)))
    }
}

impl TunnelCore {
    /// Route packets `which` of `batch` (`infos`: their parsed headers, indexed like the
    /// batch), all of `lane` (their traffic class), and write their headers. `connected`: whether the shell has a connection for a
    /// path (a packet routed to a path without one is dropped and counted as `no_path`).
    /// Nothing is sent: the shell sends `out` once every tunnel sharing the batch has routed
    /// (no header can be written once a transport holds packets of it).
    #[allow(clippy::too_many_arguments)]
    pub fn route_batch(
        &mut self,
        lane: usize,
        which: &[usize],
        infos: &[Option<PacketInfo>],
        batch: &mut impl Outgoing,
        connected: impl Fn(PathId) -> bool,
        now: Instant,
        out: &mut Routing,
    ) {
        out.clear();
        let mut opened = false;
        let lane_header = u8::try_from(lane).ok().and_then(wire::encode_classed);
        let protect = self.protects(lane);
        for &i in which {
            let len = batch.packet(i).len();
            let Some(route) = self.router.route(lane, infos[i].as_ref(), len, now) else {
                continue; // counted as no_path by the lane's bond
            };
            // The bond's numbering goes first, next to the packet; the lane's header (not the
            // first lane's) in front of it, so FEC protects both.
            // A copy goes only with the numbering that lets the receiver drop the second.
            let numbered = route
                .seq
                .is_none_or(|(slot, seq)| batch.push_header(i, &wire::encode_bonded(slot, seq)));
            if let Some(h) = &lane_header {
                batch.push_header(i, h);
            }
            // `redundant`, or a small packet's copy (`bond::copies`): a copy for the second
            // path, numbered the same (the receiver keeps the first to arrive), in that path's
            // own FEC groups.
            if let Some(also) = route.also.filter(|a| numbered && connected(*a)) {
                // A path that carries copies alone (`bond::copies`) is judged by its probes,
                // not by its ACKs: its copies lost in a dip of its own link cost nothing, and
                // the ACK watch took it down for them and dialled it again (LTE beside a lossy
                // Starlink path: 4 connections in 2 minutes, against 1).
                if route.also_carries {
                    opened |= self.on_sent(also, now);
                }
                let mut copy = batch.headed(i).to_vec();
                let mut repairs = Vec::new();
                let (header, o) = match protect {
                    true => self.protect(also, &copy, now, &mut repairs),
                    false => (None, false),
                };
                opened |= o;
                if let Some(h) = header {
                    copy.splice(0..0, h);
                }
                out.copies.push(SecondCopy {
                    path: also,
                    bytes: copy,
                    repair: false,
                });
                out.copies
                    .extend(repairs.into_iter().map(|bytes| SecondCopy {
                        path: also,
                        bytes,
                        repair: true,
                    }));
            }
            let path = route.path;
            if !connected(path) {
                self.router.drop_tx(path, len, DropReason::NoPath);
                continue;
            }
            opened |= self.on_sent(path, now);
            let share = out.on(path);
            share.picks.push(i);
            // (Headers are writable until a transport takes packets: the shell routes before
            // any send. Should that ever not hold, the packet goes unprotected rather than into
            // a group whose data packet would lack its header.)
            if protect && batch.headers_writable() {
                let (header, o) = self.protect(path, batch.headed(i), now, &mut share.repairs);
                opened |= o;
                if let Some(h) = header {
                    batch.push_header(i, &h);
                }
            }
        }
        out.wake = self.router.take_woken() || opened;
    }
}
