//! Copies of small real-time packets on a second path, so that what one path loses reaches the
//! peer anyway. A call, a game, DNS or a ping cannot wait for a retransmission (a call's budget
//! is 150 ms one way), so where one of their packets would meet a loss it also goes on another
//! path that is up, and the receiver keeps the first copy (`reorder::reseq`, its copies mode).
//! Three occasions:
//!
//! - **Around a reconfiguration** of a Starlink path (`path::reconfig`): from `BEFORE` to
//!   `AFTER` each boundary, where the link loses a burst.
//! - **Whenever a spare path is up**: another primary path of the same priority that is not
//!   metered (a data budget), for flows of up to `FLOW_RATE` packets a second. A radio
//!   link loses some packets at random and stalls without warning (an LTE cell's delivery
//!   stops for up to 0.9 s; Starlink's recording loses 2-3 packets of a call's 50 in some
//!   seconds between its boundaries), and neither is known until a round trip after it: a
//!   copy sent only then is too late for the packets that met it. What a copy costs is the
//!   flow's own rate on the second link (80 kbit/s a call), and a link paid by the byte, or
//!   one kept standing by (a backup, a higher priority number), takes none. A flow is copied
//!   whole or not at all (`Spare`): a copy on a faster path overtakes the packets of its flow
//!   that went once, so copying some of a flow's packets reorders it. A flow of small packets
//!   faster than a call or a game (a QUIC download's ACKs) is not copied, nor are more than
//!   `MAX_FLOWS` flows in a second (a flood of small flows: the flows copied in the second
//!   before keep their places), beyond which copies follow loss.
//! - **While the path loses data**: for `AFTER_LOSS` after its connection last declared a
//!   packet lost. A bulk flow that fills the path's bottleneck overflows its queue now and then
//!   (a capacity that fell at a Starlink slot, an LTE cell's dip, the controller probing for
//!   more), and the call's packets queued beside the bulk are lost with it: over Starlink + LTE,
//!   one upload made 10% of a call's packets bad in two seconds (scenario 27g) where the other
//!   link had room for every one of them. The copies follow the first loss a round trip late
//!   (the connection declares it when a later packet is acknowledged), plus up to the core's
//!   poll interval (it reads the connections' counters at its polls: every probe interval
//!   under traffic), and stop a second after the last.
//!
//! The receiver drops a second copy by its number among the last `reseq::WINDOW` (1024) of
//! its flow slot: at `RATE` copies a second, a second copy more than two seconds behind the
//! first would pass as new (a duplicate handed on; RTP and ping take those).
//!
//! Only packets of up to `reconfig::COPY_MAX_LEN` bytes that are not TCP are copied: TCP
//! recovers for itself, and a copy of a bulk flow would cost the second link its capacity.
//! Copies made for loss are bounded (`RATE` a second, `BURST` at once, per tunnel lane), and
//! those on a spare path by their flows (`MAX_FLOWS` of `FLOW_RATE` at most): a flood of small
//! packets on a lossy path must not flood the other link (a metered LTE) too; beyond the bound
//! packets simply go once, as they would without copies. A path whose data budget is used up
//! takes no copies for loss.

use std::time::{Duration, Instant};

use crate::packet::{PacketInfo, PROTO_TCP};
use crate::path::{reconfig, Path, PathId, PathSet};
use crate::role::Role;

/// How long after its last declared loss a path's small packets are still copied. Losses at
/// an overflowing queue come in episodes of seconds (a slot's lower capacity until the
/// controller follows it); a second covers the gaps between the losses of one episode.
pub const AFTER_LOSS: Duration = Duration::from_secs(1);
/// Copies for loss per second, and at once: ten calls' worth (50 packets a second each way),
/// 2 Mbit/s at the largest copied size.
pub const RATE: f64 = 500.0;
pub const BURST: f64 = 50.0;

/// A flow of up to this many packets a second is copied on a spare path: a call sends 50, a
/// game 60-64, pings every 10 ms 100.
pub const FLOW_RATE: u32 = 100;
/// How many flows are copied on a spare path in a second at most: ten calls both ways (4
/// Mbit/s at the largest copied size and `FLOW_RATE`, 1.6 Mbit/s at a call's).
pub const MAX_FLOWS: u32 = 20;
/// The window flows are counted and admitted in.
const WINDOW: Duration = Duration::from_secs(1);
/// Flows are counted in this many slots by their hash (8 KiB, made at the first packet that
/// could go on a spare path): flows in one slot count together.
const FLOW_SLOTS: usize = 256;

/// Why a packet got a copy (each counted on its first path).
pub use crate::path::CopyReason as Why;

/// The bounds on copies: for loss a token bucket, on a spare path the flows admitted.
#[derive(Debug, Default)]
pub struct Copies {
    tokens: f64,
    at: Option<Instant>,
    spare: Spare,
}

/// Which flows are copied on a spare path: in each `WINDOW`, those that sent at most
/// `FLOW_RATE` packets in the one before and so far in this one: those copied in the window
/// before, and others while fewer than `MAX_FLOWS` are. A flow keeps its verdict for the
/// window, so it is copied whole or not at all.
#[derive(Debug, Default)]
struct Spare {
    flows: Vec<FlowCount>,
    /// The current window's start; the flows copied in the window before (a place kept for
    /// each) and those admitted since; the flows copied in this window.
    window: Option<Instant>,
    admitted: u32,
    copied_now: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct FlowCount {
    /// The window it was last counted in, its packets there, and whether it is copied there.
    window: Option<Instant>,
    count: u32,
    copied: bool,
}

impl Spare {
    /// Whether the packet of the flow with hash `flow` gets a copy on a spare path.
    fn copies(&mut self, flow: u64, now: Instant) -> bool {
        let window = match self.window {
            Some(w) if now < w + WINDOW => w,
            // A new window (aligned to the last, or afresh after a quiet one).
            Some(w) if now < w + 2 * WINDOW => self.roll(w + WINDOW, true),
            _ => self.roll(now, false),
        };
        if self.flows.is_empty() {
            self.flows = vec![FlowCount::default(); FLOW_SLOTS];
        }
        let f = &mut self.flows[(flow % FLOW_SLOTS as u64) as usize];
        if f.window != Some(window) {
            // Its count and verdict are the window before's only if it was counted there.
            let (before, kept) = match f.window {
                Some(w) if Some(w) == window.checked_sub(WINDOW) => (f.count, f.copied),
                _ => (0, false),
            };
            f.count = 0;
            f.window = Some(window);
            // A flow copied in the window before stays copied (a call does not lose its
            // copies to a burst of new flows at a window's start): its place was kept.
            f.copied = before <= FLOW_RATE && (kept || self.admitted < MAX_FLOWS);
            self.admitted += u32::from(f.copied && !kept);
            self.copied_now += u32::from(f.copied);
        }
        f.count += 1;
        // Faster than a call after all: copies stop here (once; it is not admitted again
        // while it is).
        f.copied &= f.count <= FLOW_RATE;
        f.copied
    }

    /// A new window from `start`; `next`: right after the current one, whose copied flows
    /// keep their places.
    fn roll(&mut self, start: Instant, next: bool) -> Instant {
        self.window = Some(start);
        self.admitted = if next { self.copied_now } else { 0 };
        self.copied_now = 0;
        start
    }
}

impl Copies {
    /// The path for a copy of a packet routed to `first` (`len` bytes, `info` its headers),
    /// and why; `None`: it goes once.
    pub fn path(
        &mut self,
        paths: &PathSet,
        first: PathId,
        info: Option<&PacketInfo>,
        len: usize,
        now: Instant,
    ) -> Option<(PathId, Why)> {
        if let Some(p) = near_boundary_path(paths, first, info, len, now) {
            return Some((p, Why::Reconfig));
        }
        let info = info.filter(|_| copied(info, len))?;
        let rank = paths.get(first).spec.priority;
        if let Some(spare) = second_path(paths, first, |p| spare(p, rank)) {
            if self.spare.copies(info.flow_hash(), now) {
                return Some((spare, Why::Spare));
            }
        }
        if !paths.lost_data_within(first, now, AFTER_LOSS) {
            return None;
        }
        let other = second_path(paths, first, |p| !p.used_up)?;
        self.take(now).then_some((other, Why::Loss))
    }

    /// One copy for loss, if the bucket has a token.
    fn take(&mut self, now: Instant) -> bool {
        let since = self
            .at
            .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
        self.tokens = (self.tokens + since.as_secs_f64().min(1.0) * RATE).min(BURST);
        self.at = Some(now);
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// A path free to carry copies whatever the first path (of priority `rank`) does: one of the
/// same rank (a higher `priority` number is a link kept standing by), a primary (a backup
/// carries only when the primaries cannot), not paid by the byte.
fn spare(p: &Path, rank: u32) -> bool {
    p.spec.priority == rank && p.role() == Role::Primary && !p.spec.metered
}

/// Whether a packet of `len` bytes with headers `info` is one to copy: small, and not TCP.
fn copied(info: Option<&PacketInfo>, len: usize) -> bool {
    len <= reconfig::COPY_MAX_LEN && info.is_some_and(|i| i.proto != PROTO_TCP)
}

/// The path for a copy of a packet routed to `first` across `first`'s reconfiguration, if
/// it is one to copy and `first` is near a boundary now.
pub fn near_boundary_path(
    paths: &PathSet,
    first: PathId,
    info: Option<&PacketInfo>,
    len: usize,
    now: Instant,
) -> Option<PathId> {
    if !copied(info, len) || !reconfig::near_boundary(paths, first, now) {
        return None;
    }
    second_path(paths, first, |_| true)
}

/// Another path that is up and that `may` take a copy of a packet routed to `first`: a link
/// of another kind first (two dishes reconfigure together), then the better tier and the
/// shorter RTT.
fn second_path(paths: &PathSet, first: PathId, may: impl Fn(&Path) -> bool) -> Option<PathId> {
    let kind = paths.get(first).link();
    paths
        .iter()
        .filter(|&(id, p)| id != first && p.is_up() && !p.retired && may(p))
        .min_by_key(|(_, p)| (p.link() == kind, p.tier(), p.srtt()))
        .map(|(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::tcp4;
    use crate::packet::PROTO_UDP;
    use crate::{HealthConfig, PathSpec};

    /// An IPv4 UDP packet of `len` bytes (a call's, at 200).
    fn udp4(len: usize) -> Vec<u8> {
        let mut p = vec![0u8; len];
        p[..12].copy_from_slice(&[0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, PROTO_UDP, 0, 0]);
        p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        p[12..20].copy_from_slice(&[10, 0, 0, 1, 10, 0, 0, 2]);
        p[20..24].copy_from_slice(&[0x13, 0x88, 0x13, 0x88]);
        p[24..26].copy_from_slice(&((len - 20) as u16).to_be_bytes());
        p
    }

    /// Paths `a` and `b`, both up at `now`; `b` as `b_spec` makes it (a data budget, a role).
    fn two_up_with(now: Instant, b_spec: PathSpec) -> (PathSet, PathId, PathId) {
        let mut paths = PathSet::new(HealthConfig::default());
        let spec = |name: &str| PathSpec {
            name: name.into(),
            priority: 1,
            weight: 1,
            ..Default::default()
        };
        let a = paths.add(spec("a")).unwrap();
        let b = paths.add(b_spec).unwrap();
        paths.connected(a, now);
        paths.connected(b, now);
        let mut probes = Vec::new();
        paths.poll(now, &mut probes, &mut Vec::new());
        for p in probes {
            paths.on_probe_reply(p.path, p.seq, None, now);
        }
        assert!(paths.get(a).is_up() && paths.get(b).is_up());
        (paths, a, b)
    }

    /// `b` metered: copies only while `a` loses.
    fn two_up(now: Instant) -> (PathSet, PathId, PathId) {
        two_up_with(now, metered_b())
    }

    fn metered_b() -> PathSpec {
        PathSpec {
            name: "b".into(),
            priority: 1,
            weight: 1,
            metered: true,
            ..Default::default()
        }
    }

    #[test]
    fn small_packets_go_twice_on_a_spare_path_within_each_flows_bound() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let spare = PathSpec {
            metered: false,
            ..metered_b()
        };
        let (mut paths, a, b) = two_up_with(t0, spare.clone());
        paths.on_data_counters(a, ms(0), 100, 0);
        let mut c = Copies::default();
        let copy = |c: &mut Copies, pkt: &[u8], at: Instant| {
            c.path(&paths, a, PacketInfo::parse(pkt).as_ref(), pkt.len(), at)
        };
        let call = udp4(200);
        assert_eq!(
            copy(&mut c, &call, ms(5)),
            Some((b, Why::Spare)),
            "a clean path"
        );
        let tcp = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 100, 80, None);
        assert_eq!(copy(&mut c, &tcp, ms(5)), None);
        let video = udp4(reconfig::COPY_MAX_LEN + 1);
        assert_eq!(copy(&mut c, &video, ms(5)), None);
        // A flow faster than `FLOW_RATE` is copied until it is (the first went above), then not
        // for the rest of the window, nor in the next.
        let copied = (1..200)
            .filter(|_| copy(&mut c, &call, ms(10)).is_some())
            .count();
        assert_eq!(copied + 1, FLOW_RATE as usize);
        assert_eq!(copy(&mut c, &call, ms(1500)), None, "the window after");
        // A window later, at a call's rate, it is copied again.
        assert!(copy(&mut c, &call, ms(2500)).is_some(), "two windows later");
        // Other flows: the first `MAX_FLOWS` of a window are copied, whole.
        let flow = |port: u16| {
            let mut p = call.clone();
            p[20..22].copy_from_slice(&port.to_be_bytes());
            p
        };
        let mut c = Copies::default();
        // Flows of distinct slots (flows of one slot count as one).
        let mut slots = std::collections::HashSet::new();
        let ports: Vec<u16> = (1..1000u16)
            .filter(|&p| {
                let hash = PacketInfo::parse(&flow(p)).unwrap().flow_hash();
                slots.insert(hash % FLOW_SLOTS as u64)
            })
            .take(3 * MAX_FLOWS as usize)
            .collect();
        let (ports, later) = ports.split_at(2 * MAX_FLOWS as usize);
        let first: Vec<bool> = ports
            .iter()
            .map(|&p| copy(&mut c, &flow(p), ms(3000)).is_some())
            .collect();
        assert_eq!(first.iter().filter(|&&x| x).count(), MAX_FLOWS as usize);
        // In the next window the flows copied keep their places, ahead of new ones.
        for &p in later {
            assert_eq!(copy(&mut c, &flow(p), ms(4100)), None, "new port {p}");
        }
        for (&p, &was) in ports.iter().zip(&first) {
            assert_eq!(copy(&mut c, &flow(p), ms(4200)).is_some(), was, "port {p}");
        }
        // No copies on a backup, a metered path or one of a higher priority number while `a`
        // is clean.
        for spec in [
            PathSpec {
                role: Role::Backup,
                ..spare.clone()
            },
            metered_b(),
            PathSpec {
                priority: 2,
                ..spare
            },
        ] {
            let (mut paths, a, _) = two_up_with(t0, spec);
            paths.on_data_counters(a, ms(0), 100, 0);
            let info = PacketInfo::parse(&call);
            assert_eq!(
                Copies::default().path(&paths, a, info.as_ref(), call.len(), ms(5)),
                None
            );
        }
    }

    #[test]
    fn small_packets_go_twice_while_their_path_loses_within_the_bound() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let (mut paths, a, b) = two_up(t0);
        let call = udp4(200);
        let info = PacketInfo::parse(&call);
        assert!(info.is_some());
        let mut c = Copies::default();
        let copy = |c: &mut Copies, paths: &PathSet, pkt: &[u8], at: Instant| {
            c.path(paths, a, PacketInfo::parse(pkt).as_ref(), pkt.len(), at)
        };
        paths.on_data_counters(a, ms(0), 100, 0);
        assert_eq!(copy(&mut c, &paths, &call, ms(5)), None, "a clean path");
        paths.on_data_counters(a, ms(10), 200, 1);
        assert_eq!(copy(&mut c, &paths, &call, ms(20)), Some((b, Why::Loss)));
        // TCP, and packets over the copied size, go once.
        let tcp = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1000, 80, None);
        assert_eq!(copy(&mut c, &paths, &tcp, ms(20)), None);
        let video = udp4(reconfig::COPY_MAX_LEN + 1);
        assert_eq!(copy(&mut c, &paths, &video, ms(20)), None);
        // The same count again is no new loss: a second after the last, no more copies.
        paths.on_data_counters(a, ms(500), 300, 1);
        assert!(copy(&mut c, &paths, &call, ms(1009)).is_some());
        assert_eq!(copy(&mut c, &paths, &call, ms(1010)), None);
        // A new connection's counts start from zero: no loss in that.
        paths.on_data_counters(a, ms(1100), 10, 0);
        assert_eq!(copy(&mut c, &paths, &call, ms(1100)), None);
        // The bound: `BURST` at once, then `RATE` a second.
        paths.on_data_counters(a, ms(2000), 100, 1);
        let burst = (0..1000)
            .filter(|_| copy(&mut c, &paths, &call, ms(2500)).is_some())
            .count();
        assert_eq!(burst, BURST as usize);
        let later = (0..1000)
            .filter(|_| copy(&mut c, &paths, &call, ms(2540)).is_some())
            .count();
        assert_eq!(later, (RATE * 0.04) as usize);
    }

    #[test]
    fn a_path_whose_budget_is_used_up_takes_no_copies_for_loss() {
        let t0 = Instant::now();
        let (mut paths, a, b) = two_up(t0);
        paths.set_used_up(b, true, Some(t0));
        paths.on_data_counters(a, t0, 100, 0);
        paths.on_data_counters(a, t0 + Duration::from_millis(10), 200, 3);
        let call = udp4(200);
        let info = PacketInfo::parse(&call);
        let at = t0 + Duration::from_millis(20);
        assert_eq!(
            Copies::default().path(&paths, a, info.as_ref(), 200, at),
            None
        );
    }
}
