//! The tunnel's timer task: the core polled at its deadlines (probes, health, FEC, budgets),
//! path transitions carried out and logged, a dead path's recent packets sent again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mpquic_core::path::budget::{iso_date, Standing};
use mpquic_core::recovery::Why;
use mpquic_core::tunnel::Polled;
use mpquic_core::wire::{self, Datagram};
use mpquic_core::{DropReason, PacketInfo, PathId, PathState, Transition};
use tracing::{debug, info, warn};

use super::receive::Rx;
use super::send::{send_repairs, Routed};
use super::{link_stats, wall_clock, State, Tunnel};
use crate::io::batch::PacketBatch;
use crate::transport::PathTransport;

impl Tunnel {
    /// A packet woke a quiet tunnel: its probes are due now, not when the timer task planned.
    pub(super) fn wake_timers_if(&self, woken: bool) {
        if woken {
            self.timers_changed.notify_one();
        }
    }

    /// Advance the core's timers: send due probes, FEC repairs and MTU probes, deliver what the
    /// resequencer released, log transitions. Returns when the core next has work (`None`: no
    /// connected path, nothing to do until one is installed).
    pub(super) fn tick(&self, polled: &mut Polled) -> Option<Instant> {
        let now = Instant::now();
        let mut rx = Rx {
            tunnel: self,
            reply_to: None,
        };
        let mut sends: Vec<(Arc<dyn PathTransport>, Vec<u8>)> = Vec::new();
        let mut repairs = Vec::new();
        let next = {
            let mut s = self.lock();
            let State { core, links, .. } = &mut *s;
            core.set_wall_clock(wall_clock());
            let link = |id: PathId| links.get(id.index()).and_then(Option::as_ref);
            let next = core.poll(
                now,
                |id| link(id).map(|l| link_stats(&*l.transport)),
                &mut rx,
                polled,
            );
            let to = |id: PathId| link(id).map(|l| l.transport.clone());
            for p in &polled.probes {
                if let Some(t) = to(p.path) {
                    sends.push((t, wire::encode_probe_view(p.seq, &p.view).to_vec()));
                }
            }
            // Refused when the datagram buffer is full: then an MTU probe is lost, as it should
            // be, and a health probe counts as unanswered, which is what a full buffer means.
            sends.extend(
                polled
                    .mtu_probes
                    .drain(..)
                    .filter_map(|(id, m)| Some((to(id)?, m))),
            );
            repairs.extend(
                polled
                    .repairs
                    .drain(..)
                    .filter_map(|(id, r)| Some((id, to(id)?, r))),
            );
            // Under the lock, so a connection installed meanwhile cannot miss the change.
            for &(id, c, _) in &polled.carry {
                if let Some(t) = to(id) {
                    t.set_carry(c);
                }
            }
            for id in core.router().paths().ids() {
                if let Some(l) = link(id) {
                    l.transport.set_hand_over(core.router().can_hand_over(id));
                    let health = core.router().paths().get(id).health.as_ref();
                    l.transport.set_path_probes(
                        health.map_or(0.0, |h| h.loss()),
                        health.and_then(|h| h.srtt()),
                    );
                }
            }
            next
        };
        if polled.delivered {
            self.flush_tun();
        }
        for (transport, msg) in sends {
            let _ = transport.send_control(&msg);
        }
        for (path, transport, r) in repairs {
            let n = send_repairs(&*transport, &r);
            if n > 0 {
                self.lock().core.repairs_refused(path, n);
            }
        }
        for &(path, v, was) in &polled.resized {
            let name = self.path_name(path);
            if v.recheck {
                info!(tunnel = %self.peer, path = %name, payload = v.payload,
                      "path MTU: trying larger packets");
            } else {
                warn!(tunnel = %self.peer, path = %name, was, payload = v.payload,
                      "path MTU fell (full-size packets lost, small ones answered): reconnecting with smaller packets");
            }
        }
        for &(path, _, why) in &polled.carry {
            let loss = self.lock().core.recovery(path).map_or(0.0, |r| r.loss());
            let name = self.path_name(path);
            // Debug for the quiet and slow cases: every lull in traffic does them.
            match why {
                Why::Loss => info!(tunnel = %self.peer, path = %name, loss_pct = loss * 100.0,
                    "path loses packets: inner packets on its stream (retransmitted, in order)"),
                Why::Quiet => debug!(tunnel = %self.peer, path = %name,
                    "path quiet: inner packets on its stream until traffic shows it clean"),
                Why::Single => debug!(tunnel = %self.peer, path = %name,
                    "path not bonded, at a rate its stream carries as well: inner packets on its stream"),
                Why::Clean => debug!(tunnel = %self.peer, path = %name,
                    "path clean under traffic: inner packets as datagrams"),
            }
        }
        for &(path, standing) in &polled.budgets {
            self.log_budget(path, standing);
        }
        for &(path, starlink) in &polled.recognised {
            let name = self.path_name(path);
            match starlink {
                true => info!(tunnel = %self.peer, path = %name,
                    "path's link changes at Starlink's reconfigurations (12, 27, 42, 57 s past the minute): treated as Starlink (`link: other` turns this off)"),
                false => info!(tunnel = %self.peer, path = %name,
                    "path's link no longer changes at Starlink's reconfigurations: no longer treated as Starlink"),
            }
        }
        for t in &polled.transitions {
            self.on_transition(t);
        }
        next
    }

    /// A metered path crossed its warning share, used its budget up, or started a new period.
    pub(super) fn log_budget(&self, path: PathId, standing: Standing) {
        let name = self.path_name(path);
        let Some(m) = self.lock().core.meter(path).copied() else {
            return;
        };
        let (used, limit) = (m.usage.used, m.budget.limit);
        match standing {
            Standing::Within => {
                info!(tunnel = %self.peer, path = %name, limit, "data budget: a new period starts; the path carries as configured again")
            }
            Standing::Warn => {
                warn!(tunnel = %self.peer, path = %name, used, limit, left = m.budget.left(&m.usage),
                      "data budget: past its warning share")
            }
            Standing::Exhausted => {
                warn!(tunnel = %self.peer, path = %name, used, limit,
                      ends = %iso_date(m.budget.period_end(m.usage.since)),
                      "data budget used up: the path carries only as a backup until its period ends")
            }
        }
    }

    /// Serve the core's timers for the tunnel's life: sleep until its next deadline, or until a
    /// path is installed (which may bring the deadline forward). No fixed tick.
    pub async fn run_timers(&self) {
        let mut polled = Polled::default();
        loop {
            let next = self.tick(&mut polled);
            let changed = self.timers_changed.notified();
            match next {
                Some(at) => {
                    // At least a millisecond (the timer's resolution): a deadline that a core
                    // bug left in the past must not turn this loop into a spin.
                    let at = at.max(Instant::now() + Duration::from_millis(1));
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }

    /// A path changed state: log it, and hand a path that went down over to the live ones
    /// (`reliable.rs`): its connection closed so it delivers nothing late, and in reliable
    /// mode its recent packets sent again there.
    pub(super) fn on_transition(&self, t: &Transition) {
        self.log_transition(t);
        if t.to != Some(PathState::Down) {
            return;
        }
        let now = Instant::now();
        let handover = {
            let s = self.lock();
            s.link(t.path).and_then(|l| {
                let since = s.core.router().hand_over_since(t.path, now)?;
                Some((l.transport.clone(), since))
            })
        };
        let Some((transport, since)) = handover else {
            return;
        };
        let packets = transport.abandon(since);
        let resent = self.resend(&packets);
        self.lock()
            .core
            .router_mut()
            .handed_over(t.path, resent as u64);
        info!(tunnel = %self.peer, path = %self.path_name(t.path), resent,
              "path down: connection closed, its recent packets sent again on the live paths");
    }

    /// Send packets again (a dead path's, `on_transition`), routed like new ones, each in its
    /// lane (a batch per lane: a batch's headers are written before any of it is sent). Returns
    /// how many it sent again.
    pub(super) fn resend(&self, packets: &[bytes::Bytes]) -> usize {
        // The frames as the dead path carried them: their lane's header and a per-packet
        // policy's numbering go (the packet is numbered again where it goes now; sent with it,
        // the receiver took the old header for the packet: `malformed` on the live path).
        let mut by_lane: Vec<Vec<&[u8]>> = vec![Vec::new(); self.lanes.len()];
        // A numbered packet of a lane whose policy numbers only what it copies
        // (`Policy::numbers_only_copies`) had its copy sent on another path: sent again under a
        // new number, the receiver could not tell it from the copy, and handed both on (14-21
        // duplicate pings in a 150 ms black hole at a Starlink boundary).
        let copied: Vec<bool> = {
            let s = self.lock();
            (s.core.router().lanes().iter())
                .map(|l| l.bond().policy().numbers_only_copies())
                .collect()
        };
        for frame in packets {
            let (lane, d) = match wire::decode(frame) {
                Some(Datagram::Classed { lane, inner }) => (usize::from(lane), wire::decode(inner)),
                d => (0, d),
            };
            match (by_lane.get_mut(lane), d) {
                (Some(_), Some(Datagram::Bonded { .. })) if copied.get(lane) == Some(&true) => {}
                (Some(l), Some(Datagram::Packet(p) | Datagram::Bonded { packet: p, .. })) => {
                    l.push(p)
                }
                _ => self.drop_unsent(0, DropReason::Malformed, 1),
            }
        }
        let mut batch = PacketBatch::new();
        let mut scratch = Routed::default();
        let mut infos = Vec::with_capacity(crate::io::batch::BATCH_PACKETS);
        for (lane, packets) in by_lane.iter().enumerate() {
            for chunk in packets.chunks(crate::io::batch::BATCH_PACKETS) {
                batch.clear();
                infos.clear();
                for p in chunk {
                    batch.slot(p.len())[..p.len()].copy_from_slice(p);
                    batch.commit(p.len());
                    infos.push(PacketInfo::parse(p));
                }
                let which: Vec<usize> = (0..batch.len()).collect();
                self.send_batch(lane, &mut batch, &which, &infos, &mut scratch);
            }
        }
        by_lane.iter().map(Vec::len).sum()
    }

    pub(super) fn log_transition(&self, t: &Transition) {
        let name = self.path_name(t.path);
        let to = t.to.map_or("disconnected", PathState::as_str);
        let from = t.from.map_or("disconnected", PathState::as_str);
        if t.to == Some(PathState::Down) {
            warn!(tunnel = %self.peer, path = %name, from, to, "path state");
        } else {
            info!(tunnel = %self.peer, path = %name, from, to, "path state");
        }
    }
}
