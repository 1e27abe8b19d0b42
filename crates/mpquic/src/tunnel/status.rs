//! The tunnel's status report: paths, lanes, drops, reordering, FEC and budgets.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use mpquic_core::classify::Prefix;
use mpquic_core::fec::FecMode;
use mpquic_core::path::budget::{iso_date, Standing};
use mpquic_core::path::reconfig::{detect::Evidence, LinkKind};
use mpquic_core::tunnel::PathFec;
use mpquic_core::PathState;

use super::{wall_clock, Tunnel};
use crate::status::{ClassStatus, PathStatus, Reordering, TunnelStatus};

impl Tunnel {
    pub fn status(&self, address: Option<String>) -> TunnelStatus {
        let now = Instant::now();
        let wall = wall_clock().unix_secs();
        let s = self.lock();
        let router = s.core.router();
        let paths = router
            .paths()
            .iter()
            .map(|(id, p)| {
                let link = s.link(id);
                let mut ps = PathStatus {
                    name: p.spec.name.clone(),
                    // A removed path stays listed: its counters are part of the totals.
                    state: match p.retired {
                        true => "removed",
                        false => p.state().map_or("disconnected", PathState::as_str),
                    }
                    .into(),
                    priority: p.spec.priority,
                    weight: p.spec.weight,
                    role: p.role().as_str().into(),
                    link: p.link().known().unwrap_or_default().into(),
                    link_recognised: p.recognised && p.spec.link == LinkKind::Other,
                    link_evidence: match p.spec.detect_link {
                        true => link_evidence(p.detector.evidence()),
                        false => String::new(),
                    },
                    reconfig_copies: p.counters.reconfig_copies,
                    loss_copies: p.counters.loss_copies,
                    spare_copies: p.counters.spare_copies,
                    ce_marked: p.counters.ce_marked,
                    rate_limit_mbit: p.spec.rate_limit.map(|r| r as f64 / 1e6),
                    budget: s.core.meter(id).map(|m| budget_status(m, wall)),
                    tx_bytes: p.counters.tx_bytes,
                    tx_packets: p.counters.tx_packets,
                    rx_bytes: p.counters.rx_bytes,
                    rx_packets: p.counters.rx_packets,
                    handed_over_packets: p.counters.handed_over,
                    flows: (router.lanes().iter())
                        .map(|l| l.bond().flows_on(id) as u64)
                        .sum(),
                    flows_moved: (router.lanes().iter())
                        .map(|l| l.bond().flows_moved_to(id))
                        .sum(),
                    connects: p.connects,
                    drops: p
                        .drops
                        .iter()
                        .map(|(r, n)| (r.as_str().to_string(), n))
                        .collect(),
                    ..Default::default()
                };
                if let Some(h) = &p.health {
                    // Sampled while the path is connected (its probes keep the timers going).
                    ps.tx_mbit = p.throughput.tx_bps as f64 / 1e6;
                    ps.rx_mbit = p.throughput.rx_bps as f64 / 1e6;
                    ps.state_for_s = now.saturating_duration_since(h.since()).as_secs_f64();
                    ps.srtt_ms = h.srtt().map(ms);
                    ps.min_rtt_ms = h.min_rtt().map(ms);
                    ps.probe_loss_pct = h.loss() * 100.0;
                    ps.probes_across_reconfig = h.probes_across_reconfig;
                    ps.probe_interval_ms = Some(ms(h.probe_interval()));
                }
                if let (Some(f), true) = (s.core.fec(id), s.core.fec_mode() != FecMode::Off) {
                    fec_status(&mut ps, f);
                }
                ps.ack_silences = s.core.ack_watch(id).map_or(0, |w| w.silences);
                ps.delivery_stalls = p.delivery_stalls;
                if let Some(r) = s.core.recovery(id) {
                    ps.carry = Some(r.carry().as_str().into());
                    ps.carry_why = Some(r.why().as_str().into());
                    ps.recovery_loss_pct = Some(r.loss() * 100.0);
                    ps.to_stream = r.to_stream;
                    ps.stream_s = r.stream_time(now).as_secs_f64();
                }
                if let Some(size) = s.core.size(id) {
                    ps.too_big_sent = size.too_big_sent;
                    if let Some(w) = &size.watch {
                        ps.udp_payload_max = Some(u64::from(w.ceiling()));
                        ps.mtu_changes = w.changes;
                    }
                }
                if let Some(l) = link {
                    let st = l.transport.stats();
                    ps.remote = l.transport.remote().to_string();
                    ps.quic_rtt_ms = st.rtt.map(ms);
                    ps.cwnd_bytes = st.cwnd;
                    ps.pacing_mbit = st.pacing_rate.map(|r| r as f64 / 1e6);
                    ps.playout_ms = st.playout.map(ms);
                    ps.streams_in = st.streams_in;
                    ps.quic_sent_packets = st.sent_packets;
                    ps.udp_payload = st.udp_payload.map(u64::from);
                    ps.quic_lost_packets = st.lost_packets;
                    ps.peer_moves = st.peer_moves;
                    ps.rebind_resent_packets = st.rebind_resent;
                    ps.pipes = l.transport.pipes();
                    ps.transport = l.transport.kind().into();
                    let spurious = st.reordering.map_or(0, |r| r.spurious);
                    if st.sent_packets > 0 {
                        ps.quic_loss_pct = st.lost_packets.saturating_sub(spurious) as f64 * 100.0
                            / st.sent_packets as f64;
                    }
                    ps.reordering = st.reordering.map(|r| Reordering {
                        reordered_packets: r.reordered,
                        depth_packets: r.depth,
                        spurious_losses: r.spurious,
                        loss_threshold_packets: r.packet_threshold,
                        loss_extra_delay_ms: ms(r.extra_delay),
                    });
                }
                ps
            })
            .collect();
        let drops_of = |l: &mpquic_core::bond::router::Lane| -> BTreeMap<String, u64> {
            (l.bond().drops.iter())
                .map(|(r, n)| (r.as_str().to_string(), n))
                .collect()
        };
        let classes = self
            .lanes
            .iter()
            .zip(router.lanes())
            .filter_map(|(l, core)| {
                Some(ClassStatus {
                    name: l.name.clone()?,
                    policy: core.bond().policy().as_str().into(),
                    mode: l.mode.as_str().into(),
                    fec: s.core.protects(l.send.rank.into()),
                    // The shell that classifies fills these in.
                    classified_packets: 0,
                    unmatched_packets: 0,
                    tx_packets: core.counters.tx_packets,
                    tx_bytes: core.counters.tx_bytes,
                    rx_packets: core.counters.rx_packets,
                    rx_bytes: core.counters.rx_bytes,
                    drops: drops_of(core),
                    reorder: reorder_status(core.reseq()),
                })
            })
            .collect();
        TunnelStatus {
            peer: self.peer.clone(),
            classes,
            address,
            // The shell knows it (a dual-stack tunnel).
            address6: None,
            congestion: self.congestion(),
            lans: (s.core.expect_src().into_iter())
                .flat_map(|e| &e.lans)
                .map(Prefix::to_string)
                .collect(),
            policy: router.bond().policy().as_str().into(),
            mode: self.mode.as_str().into(),
            // The shell knows it (what the other end speaks).
            protocol: String::new(),
            fec: s.core.fec_mode().to_string(),
            paths,
            // The lanes' together (each class's in `classes`).
            drops: merge(router.lanes().iter().map(drops_of)),
            reorder: merge(router.lanes().iter().map(|l| reorder_status(l.reseq()))),
        }
    }
}

/// A metered path's budget for status, at `wall` (seconds since the epoch).
/// What a path's probes showed at Starlink's reconfigurations (empty before the first
/// boundary was judged).
fn link_evidence(e: Evidence) -> String {
    match e.boundaries_seen {
        0 => String::new(),
        n => format!(
            "{} of {n} boundaries changed, {} of {} points between",
            e.boundaries_changed, e.between_changed, e.between_seen
        ),
    }
}

fn budget_status(m: &mpquic_core::path::budget::Meter, wall: i64) -> crate::status::BudgetStatus {
    let (b, u) = (&m.budget, &m.usage);
    let end = b.period_end(u.since);
    let runs_out = b.runs_out(u, wall);
    crate::status::BudgetStatus {
        limit_bytes: b.limit,
        used_bytes: u.used,
        left_bytes: b.left(u),
        state: match m.standing() {
            Standing::Within => "within",
            Standing::Warn => "warn",
            Standing::Exhausted => "used up",
        }
        .into(),
        period_start: iso_date(u.since),
        period_end: iso_date(end),
        period_end_unix: end,
        runs_out: runs_out.map(iso_date),
        runs_out_unix: runs_out,
    }
}

/// Counters of several lanes as one: summed, but for the wait in force for a missing packet
/// (the same for every lane), of which the largest is kept.
fn merge(maps: impl Iterator<Item = BTreeMap<String, u64>>) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for m in maps {
        for (k, v) in m {
            let gauge = k == "wait_ms";
            let e = out.entry(k).or_insert(0);
            *e = if gauge { (*e).max(v) } else { *e + v };
        }
    }
    out
}

/// The resequencer's counters for status (`TunnelStatus::reorder`), with what it holds now
/// and the wait in force for a missing packet (gauges).
fn reorder_status(r: &mpquic_core::reorder::reseq::Resequencer) -> BTreeMap<String, u64> {
    let c = r.counters;
    [
        ("held", c.held),
        ("skipped", c.skipped),
        ("timeouts", c.timeouts),
        ("late", c.late),
        ("duplicates", c.duplicates),
        ("holding", r.holding() as u64),
        ("wait_ms", r.max_wait().as_millis() as u64),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A path's FEC figures (encoder: what we send; decoder: what we receive).
fn fec_status(ps: &mut PathStatus, f: &PathFec) {
    let (e, d) = (&f.enc.counters, &f.dec.counters);
    ps.fec_parity = Some(f.enc.parity() as f64);
    ps.fec_loss_pct = Some(f.enc.loss() * 100.0);
    ps.fec_overhead_pct = Some(e.overhead() * 100.0);
    ps.fec_protected_packets = e.protected_packets;
    ps.fec_repair_sent = e.repair_sent;
    ps.fec_repair_refused = e.repair_refused;
    ps.fec_repair_received = d.repair_received;
    ps.fec_recovered = d.recovered;
    ps.fec_unrecoverable_groups = d.unrecoverable_groups;
    ps.fec_unrecovered_packets = d.unrecovered_packets;
    ps.fec_duplicates = f.dec.duplicates;
    ps.fec_inconsistent = d.inconsistent;
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
