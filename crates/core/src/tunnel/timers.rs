//! The tunnel's timers: health probes and path states, the resequencer's waits, FEC groups
//! closed by age and decoders' old groups, and the packet-size watch of each path.

use std::time::Instant;

use crate::fec::FecMode;
use crate::path::pmtu::Resize;
use crate::path::{ackwatch, reconfig};
use crate::recovery::{Carry, Why};
use crate::wire;
use crate::{PathId, PathState, ProbeDue, Transition};

use super::{Deliver, LinkStats, Received, TunnelCore};

/// What a `poll` asks the shell to send and to report. Owned by the shell and reused.
#[derive(Default)]
pub struct Polled {
    /// Health probes due, each on its path.
    pub probes: Vec<ProbeDue>,
    /// Path state changes (log them; a path that went down hands its packets over).
    pub transitions: Vec<Transition>,
    /// FEC repair packets of groups closed by their timer, per path (refusals go back through
    /// `TunnelCore::repairs_refused`).
    pub repairs: Vec<(PathId, Vec<Vec<u8>>)>,
    /// Padded MTU probes, each a whole datagram for its path.
    pub mtu_probes: Vec<(PathId, Vec<u8>)>,
    /// Size changes decided now (the shell reconnects the path: `take_resize`), with the size
    /// the path had.
    pub resized: Vec<(PathId, Resize, u16)>,
    /// `transport_mode: auto`: paths whose carriage changed now (tell their transports).
    pub carry: Vec<(PathId, Carry, Why)>,
    /// Metered paths whose standing against their budget changed now (log them; a path used
    /// up is a backup now).
    pub budgets: Vec<(PathId, crate::path::budget::Standing)>,
    /// Paths whose link was recognised as Starlink (true), or no longer (false), now (log
    /// them; `path::reconfig::detect`).
    pub recognised: Vec<(PathId, bool)>,
    /// Packets were delivered (released by the resequencer): flush the TUN device.
    pub delivered: bool,
    /// What each path's connection reported, read once per poll (by `PathId::index()`).
    links: Vec<Option<LinkStats>>,
}

impl Polled {
    fn clear(&mut self) {
        self.probes.clear();
        self.transitions.clear();
        self.repairs.clear();
        self.mtu_probes.clear();
        self.resized.clear();
        self.carry.clear();
        self.budgets.clear();
        self.recognised.clear();
        self.delivered = false;
    }
}

impl TunnelCore {
    /// Advance time to `now`. `links`: each connected path's connection as it reports itself
    /// (`None`: no connection). Returns when the core next has work (`None`: nothing until an
    /// event).
    pub fn poll(
        &mut self,
        now: Instant,
        links: impl Fn(PathId) -> Option<LinkStats>,
        rx: &mut impl Deliver,
        out: &mut Polled,
    ) -> Option<Instant> {
        out.clear();
        // Each connection once (the shell reads its counters under the connection's lock).
        let mut stats = std::mem::take(&mut out.links);
        stats.clear();
        stats.extend(self.router.paths().ids().map(links));
        let connected = |id: PathId| stats.get(id.index()).is_some_and(Option::is_some);
        self.router.poll(now, &mut out.probes, &mut out.transitions);
        self.router.take_recognised(&mut out.recognised);
        let silence_next = self.poll_silence(now, &stats, out);
        for i in 0..out.transitions.len() {
            let t = out.transitions[i];
            self.on_transition(&t);
        }
        // Probes only where a connection can carry them.
        out.probes.retain(|p| connected(p.path));
        // Packets whose wait for the ones before them ran out. (A packet that wakes a quiet
        // tunnel makes its probes due now: `next_deadline` below says so.)
        out.delivered = self.deliver_released(now, rx, &mut Received::default());
        let mut next = self
            .router
            .next_deadline()
            .into_iter()
            .chain(silence_next)
            .min();
        if self.fec_mode != FecMode::Off {
            self.poll_fec(now, &stats, out);
            let fec_next = self.fec.iter().filter_map(|f| f.enc.deadline()).min();
            next = next.into_iter().chain(fec_next).min();
        }
        self.poll_recovery(now, &stats, out);
        let budget_next = self.poll_budgets(now, &stats, out);
        next = next.into_iter().chain(budget_next).min();
        if self.watch_mtu {
            let mtu_next = self.poll_mtu(now, &stats, out);
            next = next.into_iter().chain(mtu_next).min();
        }
        out.links = stats;
        next
    }

    /// Close FEC groups that waited long enough, feed each encoder its path's loss counters,
    /// let decoders forget old groups.
    fn poll_fec(&mut self, now: Instant, links: &[Option<LinkStats>], out: &mut Polled) {
        for id in self.router.paths().ids() {
            let Some(f) = self.fec.get_mut(id.index()) else {
                continue;
            };
            f.dec.expire(now);
            let Some(st) = links.get(id.index()).copied().flatten() else {
                continue;
            };
            let probe_loss =
                (self.router.paths().get(id).health.as_ref()).map_or(0.0, |h| h.loss());
            f.enc
                .on_counters(now, st.sent_packets, st.lost_packets, probe_loss);
            let mut repairs = Vec::new();
            f.enc.poll(now, &mut repairs);
            if !repairs.is_empty() {
                out.repairs.push((id, repairs));
            }
        }
    }

    /// The watch over each path's ACKs (`ackwatch.rs`): a path that is up, sent, and has had
    /// no ACK for its bound goes down now, if another path is up to take its traffic (alone, it
    /// waits for its probes' verdict: there is nowhere better to send). Both sides watch: the
    /// client's data shows a dead path either way, the server's shows it too when it is the
    /// one sending (its follower state takes the client's view again with the next probe that
    /// arrives, which in a black hole is only after the repair). Returns the watches' next
    /// deadline.
    fn poll_silence(
        &mut self,
        now: Instant,
        links: &[Option<LinkStats>],
        out: &mut Polled,
    ) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut silent = Vec::new();
        let paths = self.router.paths();
        for id in paths.ids() {
            let st = links.get(id.index()).copied().flatten();
            let Some(w) = self.acks.get_mut(id.index()) else {
                continue;
            };
            w.on_acks(st.and_then(|s| s.acks), now);
            let Some(h) = paths
                .get(id)
                .health
                .as_ref()
                .filter(|h| h.state() == PathState::Up)
            else {
                continue;
            };
            let Some(rtt) = h.srtt().into_iter().chain(st.and_then(|s| s.rtt)).max() else {
                continue;
            };
            if let Some(end) = reconfig::excused_until(paths, id, now) {
                next = next.into_iter().chain([end]).min();
                continue;
            }
            let bound = ackwatch::bound(rtt, h.rttvar(), h.loss()).min(h.down_after());
            let quiet_for = w.silent_for(now);
            let judged = reconfig::judged_silence(paths, id, now, quiet_for);
            if judged > bound && paths.iter().any(|(o, p)| o != id && p.is_up()) {
                w.silenced();
                // The wait is known to a poll's step (a third of the bound): what was sent
                // that much before it began may be lost too.
                silent.push((id, quiet_for + bound / 3));
                continue;
            }
            next = next.into_iter().chain(w.deadline(now, bound)).min();
        }
        for (id, quiet_for) in silent {
            out.transitions
                .extend(self.router.declare_down(id, now, quiet_for));
        }
        // A connection that keeps losing its data while its probes pass (`LossWatch`).
        for id in self.router.paths().ids() {
            if let Some(st) = links.get(id.index()).copied().flatten() {
                let lost = st.lost_packets.saturating_sub(st.spurious_lost);
                out.transitions.extend(self.router.on_data_counters(
                    id,
                    now,
                    st.sent_packets,
                    lost,
                ));
            }
        }
        next
    }

    /// Feed each path's recovery its connection's loss counters; report changes of carriage.
    fn poll_recovery(&mut self, now: Instant, links: &[Option<LinkStats>], out: &mut Polled) {
        // Paths are bonded when a lane spreads flows over them per packet and two are up.
        let paths = self.router.paths();
        let per_packet = (self.router.lanes().iter()).any(|l| l.bond().policy().per_packet());
        let bonded = per_packet && paths.iter().filter(|(_, p)| p.is_up()).take(2).count() == 2;
        for id in paths.ids() {
            let (Some(r), Some(st)) = (
                self.recovery.get_mut(id.index()),
                links.get(id.index()).copied().flatten(),
            ) else {
                continue;
            };
            let path = paths.get(id);
            let probe_loss = path.health.as_ref().map_or(0.0, |h| h.loss());
            let bonded = bonded && path.is_up();
            if let Some(c) =
                r.on_counters(now, st.sent_packets, st.lost_packets, probe_loss, bonded)
            {
                out.carry.push((id, c.0, c.1));
            }
        }
    }

    /// The size watch of every connected path: padded probes due, verdicts kept for the shell
    /// (`take_resize`). Returns the watches' next deadline.
    fn poll_mtu(
        &mut self,
        now: Instant,
        links: &[Option<LinkStats>],
        out: &mut Polled,
    ) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut probes = Vec::new();
        let quiet = self.router.paths().is_quiet();
        for id in self.router.paths().ids() {
            let (Some(size), Some(st)) = (
                self.sizes.get_mut(id.index()),
                links.get(id.index()).copied().flatten(),
            ) else {
                continue;
            };
            let Some(watch) = size.watch.as_mut() else {
                continue;
            };
            // What a datagram costs on the wire beyond its bytes (QUIC header, frame, tag).
            let overhead = match (st.udp_payload, st.max_datagram) {
                (Some(p), Some(m)) => usize::from(p).saturating_sub(m),
                _ => continue,
            };
            let path = self.router.paths().get(id);
            let srtt = path.health.as_ref().and_then(|h| h.srtt());
            let up = path.state() == Some(PathState::Up);
            probes.clear();
            let was = watch.current();
            if let Some(v) = watch.poll(now, up, quiet, srtt, &mut probes) {
                size.pending = Some(v);
                out.resized.push((id, v, was));
            }
            for p in &probes {
                let len = usize::from(p.size).saturating_sub(overhead);
                out.mtu_probes
                    .push((id, wire::encode_mtu_probe(wire::MTU_PROBE, p.seq, len)));
            }
            next = next
                .into_iter()
                .chain(watch.next_deadline(srtt, quiet))
                .min();
        }
        next
    }
}
