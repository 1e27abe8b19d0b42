//! Copies of small real-time packets on a second path, so that what one path loses reaches the
//! peer anyway. A call, a game, DNS or a ping cannot wait for a retransmission (a call's budget
//! is 150 ms one way), so where one of their packets would meet a loss it also goes on another
//! path that is up, and the receiver keeps the first copy (`reorder::reseq`, its copies mode).
//! Two occasions:
//!
//! - **Around a reconfiguration** of a Starlink path (`path::reconfig`): from `BEFORE` to
//!   `AFTER` each boundary, where the link loses a burst.
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
//! Copies made for loss are bounded (`RATE` a second, `BURST` at once, per tunnel lane): a
//! flood of small packets on a lossy path must not flood the other link (a metered LTE) too;
//! beyond the bound packets simply go once, as they would without copies. A path whose data
//! budget is used up takes no copies for loss.

use std::time::{Duration, Instant};

use crate::packet::{PacketInfo, PROTO_TCP};
use crate::path::{reconfig, PathId, PathSet};

/// How long after its last declared loss a path's small packets are still copied. Losses at
/// an overflowing queue come in episodes of seconds (a slot's lower capacity until the
/// controller follows it); a second covers the gaps between the losses of one episode.
pub const AFTER_LOSS: Duration = Duration::from_secs(1);
/// Copies for loss per second, and at once: ten calls' worth (50 packets a second each way),
/// 2 Mbit/s at the largest copied size.
pub const RATE: f64 = 500.0;
pub const BURST: f64 = 50.0;

/// Why a packet got a copy (each counted on its first path).
pub use crate::path::CopyReason as Why;

/// The bound on copies for loss (a token bucket).
#[derive(Debug, Default)]
pub struct Copies {
    tokens: f64,
    at: Option<Instant>,
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
        if !copied(info, len) || !paths.lost_data_within(first, now, AFTER_LOSS) {
            return None;
        }
        let other = second_path(paths, first, true)?;
        self.take(now).then_some((other, Why::Loss))
    }

    /// One copy's token, if the bucket has one.
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
    second_path(paths, first, false)
}

/// Another path that is up for a copy of a packet routed to `first`: a link of another kind
/// first (two dishes reconfigure together), then the better tier and the shorter RTT.
/// `budgeted`: not a path whose data budget is used up.
fn second_path(paths: &PathSet, first: PathId, budgeted: bool) -> Option<PathId> {
    let kind = paths.get(first).link();
    paths
        .iter()
        .filter(|&(id, p)| id != first && p.is_up() && !p.retired && !(budgeted && p.used_up))
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

    /// Paths `a` and `b`, both up at `now`.
    fn two_up(now: Instant) -> (PathSet, PathId, PathId) {
        let mut paths = PathSet::new(HealthConfig::default());
        let mut add = |name: &str| {
            paths
                .add(PathSpec {
                    name: name.into(),
                    priority: 1,
                    weight: 1,
                    ..Default::default()
                })
                .unwrap()
        };
        let (a, b) = (add("a"), add("b"));
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
