//! What arrives on a path: every datagram kind (inner packets bare or numbered for the
//! resequencer, FEC data and repair, health probes and replies, MTU probes and replies) and the
//! inner packets of a reliable stream, dispatched in one place for the binary and the simulator.

use std::time::Instant;

use crate::reorder::reseq::Verdict;
use crate::wire::{self, Datagram};
use crate::{DropReason, PacketInfo, PathId, Transition};

use super::TunnelCore;

/// Where the core's receive side puts its results (the shell's TUN device and connection, or
/// the simulator's records).
pub trait Deliver {
    /// An inner packet of `lane` (its traffic class) from `path` for the TUN device; `info`:
    /// its headers, when the core parsed them. Returns packets the device refused and why
    /// (counted on the lane).
    fn deliver(
        &mut self,
        lane: usize,
        path: PathId,
        packet: &[u8],
        info: Option<&PacketInfo>,
    ) -> Option<(DropReason, u64)>;
    /// A reply to send back on the connection the datagram came on (health and MTU probes).
    /// Not sent when its buffer is full, like our own probes: a reply never evicts data.
    fn answer(&mut self, msg: &[u8]);
}

/// A `Deliver` that keeps copies of what it is handed: for tests and the simulator.
#[derive(Debug, Default)]
pub struct Recorded {
    pub delivered: Vec<Vec<u8>>,
    /// The lane of each packet in `delivered`.
    pub lanes: Vec<usize>,
    pub answers: Vec<Vec<u8>>,
}

impl Deliver for Recorded {
    fn deliver(
        &mut self,
        lane: usize,
        _: PathId,
        p: &[u8],
        _: Option<&PacketInfo>,
    ) -> Option<(DropReason, u64)> {
        self.delivered.push(p.to_vec());
        self.lanes.push(lane);
        None
    }
    fn answer(&mut self, msg: &[u8]) {
        self.answers.push(msg.to_vec());
    }
}

/// What the shell must act on after a receive.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Received {
    /// The path changed state (log it; a path that went down hands its packets over).
    pub transition: Option<Transition>,
    /// The core's next deadline may have moved earlier: wake the timers.
    pub wake: bool,
}

impl TunnelCore {
    /// A datagram from `path`'s connection.
    pub fn on_datagram(
        &mut self,
        path: PathId,
        bytes: &[u8],
        now: Instant,
        out: &mut impl Deliver,
    ) -> Received {
        let mut got = Received::default();
        let decoded = wire::decode(bytes);
        if let Some(
            Datagram::Packet(_)
            | Datagram::Bonded { .. }
            | Datagram::Classed { .. }
            | Datagram::FecData { .. }
            | Datagram::FecRepair(_),
        ) = decoded
        {
            // Counted as it arrives, before any check: what the prober compares with what it
            // sent (`path/delivery.rs`).
            self.router.on_arrived(path);
        }
        match decoded {
            Some(d @ Datagram::Packet(_)) => self.deliver_inner(path, d, now, out, &mut got),
            // A peer that speaks IP only sends nothing else.
            Some(_) if self.plain => self.router.drop_on(path, DropReason::Malformed, 1),
            Some(d @ (Datagram::Bonded { .. } | Datagram::Classed { .. })) => {
                self.deliver_inner(path, d, now, out, &mut got)
            }
            Some(Datagram::Probe { seq, view }) => {
                let counts = self
                    .counted_replies
                    .then(|| self.router.paths().counts(path));
                out.answer(&wire::encode_probe_reply(seq, counts));
                got.transition = self.router.on_peer_probe(path, seq, view.as_ref(), now);
            }
            Some(Datagram::ProbeReply { seq, counts }) => {
                got.transition = self.router.on_probe_reply(path, seq, counts, now);
                // A transition makes a probe due now (it carries the new view to the peer).
                got.wake = got.transition.is_some();
            }
            Some(Datagram::FecData {
                group,
                index,
                packet,
            }) => {
                let mut recovered = Vec::new();
                let fresh = self
                    .fec
                    .get_mut(path.index())
                    .is_some_and(|f| f.dec.on_data(now, group, index, packet, &mut recovered));
                if fresh {
                    self.receive_inner(path, packet, now, out, &mut got);
                }
                for p in recovered {
                    self.receive_inner(path, &p, now, out, &mut got);
                }
            }
            Some(Datagram::FecRepair(r)) => {
                let mut recovered = Vec::new();
                if let Some(f) = self.fec.get_mut(path.index()) {
                    f.dec.on_repair(now, &r, &mut recovered);
                }
                for p in recovered {
                    self.receive_inner(path, &p, now, out, &mut got);
                }
            }
            Some(Datagram::MtuProbe { seq, len }) => {
                // Answered at the same size, so the probe tests the way back too; a reply
                // too big for this side's packets is not sent, as a smaller MTU would do.
                out.answer(&wire::encode_mtu_probe(wire::MTU_PROBE_REPLY, seq, len));
            }
            Some(Datagram::MtuProbeReply(seq)) => self.with_watch(path, |w| w.on_reply(seq)),
            None => self.router.drop_on(path, DropReason::Malformed, 1),
        }
        if let Some(t) = &got.transition {
            self.on_transition(t);
        }
        got
    }

    /// A packet from `path`'s reliable stream (`None`: a frame that did not parse).
    pub fn on_stream_packet(
        &mut self,
        path: PathId,
        packet: Option<&[u8]>,
        now: Instant,
        out: &mut impl Deliver,
    ) -> Received {
        let mut got = Received::default();
        match packet {
            Some(p) => {
                self.router.on_arrived(path);
                self.receive_inner(path, p, now, out, &mut got)
            }
            None => self.router.drop_on(path, DropReason::Malformed, 1),
        }
        got
    }

    /// An inner packet as the peer's bond sent it (inside an FEC data packet or a stream
    /// frame): bare, or numbered for the resequencer, in the first lane or with a lane's
    /// header.
    fn receive_inner(
        &mut self,
        path: PathId,
        bytes: &[u8],
        now: Instant,
        out: &mut impl Deliver,
        got: &mut Received,
    ) {
        match wire::decode(bytes) {
            Some(
                d @ (Datagram::Packet(_) | Datagram::Bonded { .. } | Datagram::Classed { .. }),
            ) => self.deliver_inner(path, d, now, out, got),
            _ => self.router.drop_on(path, DropReason::Malformed, 1),
        }
    }

    /// An inner packet: its lane from its header (none: the first), then bare or numbered.
    fn deliver_inner(
        &mut self,
        path: PathId,
        d: Datagram<'_>,
        now: Instant,
        out: &mut impl Deliver,
        got: &mut Received,
    ) {
        let (lane, d) = match d {
            Datagram::Classed { lane, inner } => (usize::from(lane), wire::decode(inner)),
            d => (0, Some(d)),
        };
        // A lane this tunnel does not have: the peer's classes are not ours.
        if lane >= self.router.lanes().len() {
            self.router.drop_on(path, DropReason::Malformed, 1);
            return;
        }
        match d {
            Some(Datagram::Packet(p)) => self.deliver(lane, path, p, now, out, got),
            Some(Datagram::Bonded { slot, seq, packet }) => {
                // Delivered now, held for the ones before it, or dropped as a duplicate
                // (counted by the resequencer); what it releases goes on behind it.
                let v = self.router.on_bonded(lane, path, slot, seq, packet, now);
                // The first packet held sets a deadline the timers do not know yet (later
                // ones' deadlines come after it).
                got.wake |= v == Verdict::Held && self.router.lanes()[lane].reseq().holding() == 1;
                if v == Verdict::Deliver {
                    self.deliver(lane, path, packet, now, out, got);
                }
                let _ = self.deliver_released(now, out, got);
            }
            // Callers pass inner packets only; anything else is counted, never a panic.
            _ => self.router.drop_on(path, DropReason::Malformed, 1),
        }
    }

    /// Packets the resequencer let go (their predecessors arrived, or waiting ran out).
    /// Returns whether there were any.
    pub(super) fn deliver_released(
        &mut self,
        now: Instant,
        out: &mut impl Deliver,
        got: &mut Received,
    ) -> bool {
        let mut any = false;
        while let Some((lane, p, pkt)) = self.router.released() {
            self.deliver(lane, p, &pkt, now, out, got);
            any = true;
        }
        any
    }

    /// An inner packet of `lane` for the TUN device, once its source passes (server side).
    fn deliver(
        &mut self,
        lane: usize,
        path: PathId,
        packet: &[u8],
        now: Instant,
        out: &mut impl Deliver,
        got: &mut Received,
    ) {
        let info = self.expect_src.is_some().then(|| PacketInfo::parse(packet));
        if !self.check_source(path, info.as_ref().and_then(Option::as_ref)) {
            return;
        }
        let refused = out.deliver(lane, path, packet, info.as_ref().and_then(Option::as_ref));
        self.router.on_received(lane, path, packet.len(), now);
        got.wake |= self.router.take_woken();
        if let Some((reason, n)) = refused {
            self.router.drop_unrouted(lane, reason, n);
        }
    }
}
