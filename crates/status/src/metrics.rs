//! `/metrics`: the status report in the OpenMetrics text format, through the `prometheus-client`
//! crate (escaping, TYPE/HELP lines, `_total` suffixes and `# EOF` are its job). The report is a
//! snapshot, so each scrape fills a fresh registry from it; every metric is declared here with
//! its kind and help, read from a typed field, and labelled by tunnel, path and pipe (and class,
//! for a traffic class's own series).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::{PathStatus, StatusReport, TunnelStatus};

/// The HTTP Content-Type of what `to_openmetrics` returns.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabels {
    role: String,
}

/// A label set: `tunnel`, then the metric's own labels (`path`, `class`, `reason`, `event`,
/// `pipe`: a pipe is "path.N", as in the seed's `wan5.0`). Drops of the instance have an empty
/// tunnel and path.
type Labels = Vec<(&'static str, String)>;

fn labels(t: Option<&TunnelStatus>, own: &[(&'static str, &str)]) -> Labels {
    let mut l = vec![("tunnel", t.map(|t| t.peer.clone()).unwrap_or_default())];
    l.extend(own.iter().map(|(k, v)| (*k, v.to_string())));
    l
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CertificateLabels {
    role: String,
    name: String,
    serial: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupLabels {
    group: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    queue: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: String,
}

/// The MPTCP lane's series (`mpquic_lane_*`).
fn register_lane(registry: &mut Registry, lane: &crate::LaneStatus) {
    let counter = |n: u64| {
        let c = Counter::<u64, AtomicU64>::default();
        c.inc_by(n);
        c
    };
    registry.register(
        "mpquic_lane_connections",
        "MPTCP lane connections taken",
        counter(lane.connections),
    );
    registry.register(
        "mpquic_lane_connected",
        "MPTCP lane connections relayed to their destination",
        counter(lane.connected),
    );
    let active = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
    active.set(lane.active as i64);
    registry.register(
        "mpquic_lane_active",
        "MPTCP lane connections open now",
        active,
    );
    registry.register(
        "mpquic_lane_ahead",
        "MPTCP lane connections that went out on one set up ahead (client)",
        counter(lane.ahead),
    );
    let ready = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
    ready.set(lane.ready as i64);
    registry.register(
        "mpquic_lane_ready",
        "MPTCP lane connections set up ahead and ready now (client)",
        ready,
    );
    let failed = Family::<ReasonLabels, Counter>::default();
    for (reason, n) in &lane.failed {
        failed
            .get_or_create(&ReasonLabels {
                reason: reason.clone(),
            })
            .inc_by(*n);
    }
    registry.register(
        "mpquic_lane_failed",
        "MPTCP lane connections not relayed, by reason",
        failed,
    );
    let bytes = Family::<DirectionLabels, Counter>::default();
    for (d, n) in [("up", lane.bytes_up), ("down", lane.bytes_down)] {
        bytes
            .get_or_create(&DirectionLabels {
                direction: d.into(),
            })
            .inc_by(n);
    }
    registry.register(
        "mpquic_lane_bytes",
        "MPTCP lane bytes toward the destination (up) and back (down)",
        bytes,
    );
    let subflows = Family::<PathLabels, Gauge>::default();
    for (path, n) in &lane.subflows {
        subflows
            .get_or_create(&PathLabels { path: path.clone() })
            .set(*n as i64);
    }
    registry.register(
        "mpquic_lane_subflows",
        "The MPTCP lane's TCP subflows now, by path",
        subflows,
    );
}

/// A per-path metric: its name (counters without `_total`, the encoder adds it), help and value.
enum PathValue {
    Counter(fn(&PathStatus) -> u64),
    /// `None`: not known yet (no RTT sample), so no sample is exported.
    Gauge(fn(&PathStatus) -> Option<f64>),
}

const PATH_METRICS: &[(&str, &str, PathValue)] = &[
    (
        "mpquic_path_up",
        "1 when the path is up (answering probes), else 0",
        PathValue::Gauge(|p| Some(if p.state == "up" { 1.0 } else { 0.0 })),
    ),
    (
        "mpquic_path_state_for_s",
        "Seconds in the current state",
        PathValue::Gauge(|p| Some(p.state_for_s)),
    ),
    (
        "mpquic_path_priority",
        "Configured priority (lower is preferred)",
        PathValue::Gauge(|p| Some(p.priority as f64)),
    ),
    (
        "mpquic_path_weight",
        "Configured weight",
        PathValue::Gauge(|p| Some(p.weight as f64)),
    ),
    (
        "mpquic_path_backup",
        "1 while the path carries only as a backup (role backup or overflow, or its data budget used up), else 0",
        PathValue::Gauge(|p| Some(if p.role.is_empty() || p.role == "primary" { 0.0 } else { 1.0 })),
    ),
    (
        "mpquic_path_rate_limit_mbit",
        "The path's rate_limit (Mbit/s each way)",
        PathValue::Gauge(|p| p.rate_limit_mbit),
    ),
    (
        "mpquic_path_budget_limit_bytes",
        "The path's data budget for its period (bytes, both directions)",
        PathValue::Gauge(|p| p.budget.as_ref().map(|b| b.limit_bytes as f64)),
    ),
    (
        "mpquic_path_budget_used_bytes",
        "Bytes of its data budget the path has used in the period (IP packets, both directions)",
        PathValue::Gauge(|p| p.budget.as_ref().map(|b| b.used_bytes as f64)),
    ),
    (
        "mpquic_path_budget_used_up",
        "1 while the path's data budget is used up (it carries only as a backup), else 0",
        PathValue::Gauge(|p| p.budget.as_ref().map(|b| if b.state == "used up" { 1.0 } else { 0.0 })),
    ),
    (
        "mpquic_path_budget_period_end_timestamp_seconds",
        "When the path's budget period ends (UNIX seconds)",
        PathValue::Gauge(|p| p.budget.as_ref().map(|b| b.period_end_unix as f64)),
    ),
    (
        "mpquic_path_budget_runs_out_timestamp_seconds",
        "When the path's budget runs out at the period's pace so far (UNIX seconds; absent: not within the period)",
        PathValue::Gauge(|p| p.budget.as_ref().and_then(|b| b.runs_out_unix).map(|t| t as f64)),
    ),
    (
        "mpquic_path_srtt_ms",
        "Smoothed probe round trip (ms)",
        PathValue::Gauge(|p| p.srtt_ms),
    ),
    (
        "mpquic_path_min_rtt_ms",
        "Minimum probe round trip (ms)",
        PathValue::Gauge(|p| p.min_rtt_ms),
    ),
    (
        "mpquic_path_probe_loss_pct",
        "Share of recent probes unanswered (%)",
        PathValue::Gauge(|p| Some(p.probe_loss_pct)),
    ),
    (
        "mpquic_path_probe_interval_ms",
        "Probe interval in force (ms): slower while the tunnel is quiet",
        PathValue::Gauge(|p| p.probe_interval_ms),
    ),
    (
        "mpquic_path_quic_rtt_ms",
        "The QUIC connection's RTT estimate (ms)",
        PathValue::Gauge(|p| p.quic_rtt_ms),
    ),
    (
        "mpquic_path_cwnd_bytes",
        "The QUIC connection's congestion window (bytes)",
        PathValue::Gauge(|p| p.cwnd_bytes.map(|c| c as f64)),
    ),
    (
        "mpquic_path_pacing_mbit",
        "The congestion controller's pacing rate (Mbit/s), for controllers that have one",
        PathValue::Gauge(|p| p.pacing_mbit),
    ),
    (
        "mpquic_path_playout_ms",
        "Reliable mode: the steady delay the receiver holds the path's TCP packets to (ms; after the loss stops, bulk flows' for 20 s)",
        PathValue::Gauge(|p| p.playout_ms),
    ),
    (
        "mpquic_path_streams_in",
        "Reliable mode: the peer's streams the path's receiver reads (a class's stream opens with its first packet)",
        PathValue::Gauge(|p| p.streams_in.map(|n| n as f64)),
    ),
    (
        "mpquic_path_on_stream",
        "transport_mode auto: 1 while the path carries inner packets on its stream (losing, quiet, or alone at a rate the stream carries as well: status carry_why), 0 as datagrams (clean)",
        PathValue::Gauge(|p| p.carry.as_deref().map(|c| if c == "stream" { 1.0 } else { 0.0 })),
    ),
    (
        "mpquic_path_recovery_loss_pct",
        "transport_mode auto: the path's loss estimate its carriage follows (%)",
        PathValue::Gauge(|p| p.recovery_loss_pct),
    ),
    (
        "mpquic_path_ack_silences",
        "Times the path was taken out of use for leaving the data it carried unacknowledged",
        PathValue::Counter(|p| p.ack_silences),
    ),
    (
        "mpquic_path_peer_moves",
        "Times the peer's address changed under the path's connection and the connection followed it (a NAT rebinding)",
        PathValue::Counter(|p| p.peer_moves),
    ),
    (
        "mpquic_path_delivery_stalls",
        "Times the path answered its probes while delivering nothing one way, and was taken down and reconnected for it",
        PathValue::Counter(|p| p.delivery_stalls),
    ),
    (
        "mpquic_path_starlink",
        "1 when the path is treated as Starlink: configured (link: starlink) or recognised by how it changes at the reconfigurations",
        PathValue::Gauge(|p| Some(if p.link == "starlink" { 1.0 } else { 0.0 })),
    ),
    (
        "mpquic_path_reconfig_copies",
        "Packets sent on the path that were copied to another path across its reconfigurations (link: starlink)",
        PathValue::Counter(|p| p.reconfig_copies),
    ),
    (
        "mpquic_path_loss_copies",
        "Small real-time packets sent on the path that were also copied to another path while it was losing data",
        PathValue::Counter(|p| p.loss_copies),
    ),
    (
        "mpquic_path_spare_copies",
        "Small real-time packets sent on the path that were also copied to a spare path (of the same priority, a primary, not metered)",
        PathValue::Counter(|p| p.spare_copies),
    ),
    (
        "mpquic_path_ce_marked",
        "Inner packets the path's sender marked congestion-experienced (ECN) after a long wait in its queue, rather than dropping them later",
        PathValue::Counter(|p| p.ce_marked),
    ),
    (
        "mpquic_path_flows_moved",
        "Bulk flows moved onto the path while they ran, from the best path that could not carry them all (failover)",
        PathValue::Counter(|p| p.flows_moved),
    ),
    (
        "mpquic_path_probes_across_reconfig",
        "Probes that met one of the path's reconfigurations on their way, not counted in its loss or round trip (link: starlink)",
        PathValue::Counter(|p| p.probes_across_reconfig),
    ),
    (
        "mpquic_path_to_stream",
        "transport_mode auto: times the path went to its stream",
        PathValue::Counter(|p| p.to_stream),
    ),
    (
        "mpquic_path_stream_s",
        "transport_mode auto: seconds the path carried inner packets on its stream",
        PathValue::Gauge(|p| Some(p.stream_s)),
    ),
    (
        "mpquic_path_quic_loss_pct",
        "QUIC packets lost / sent over the connection's life (%)",
        PathValue::Gauge(|p| Some(p.quic_loss_pct)),
    ),
    (
        "mpquic_path_tx_mbit",
        "Inner traffic sent on the path over the last second or so (Mbit/s)",
        PathValue::Gauge(|p| Some(p.tx_mbit)),
    ),
    (
        "mpquic_path_rx_mbit",
        "Inner traffic received on the path over the last second or so (Mbit/s)",
        PathValue::Gauge(|p| Some(p.rx_mbit)),
    ),
    (
        "mpquic_path_flows",
        "Flows placed on the path",
        PathValue::Gauge(|p| Some(p.flows as f64)),
    ),
    (
        "mpquic_path_quic_sent_packets",
        "QUIC packets sent",
        PathValue::Counter(|p| p.quic_sent_packets),
    ),
    (
        "mpquic_path_quic_lost_packets",
        "QUIC packets declared lost (spurious ones included)",
        PathValue::Counter(|p| p.quic_lost_packets),
    ),
    (
        "mpquic_path_spurious_losses",
        "QUIC packets declared lost and acknowledged afterwards (late: the link reorders or jitters)",
        PathValue::Counter(|p| p.reordering.as_ref().map_or(0, |r| r.spurious_losses)),
    ),
    (
        "mpquic_path_reordered_packets",
        "QUIC packets acknowledged after a later packet was",
        PathValue::Counter(|p| p.reordering.as_ref().map_or(0, |r| r.reordered_packets)),
    ),
    (
        "mpquic_path_reordering_depth_packets",
        "The deepest reordering the path's loss detection has seen, in packets",
        PathValue::Gauge(|p| p.reordering.as_ref().map(|r| r.depth_packets as f64)),
    ),
    (
        "mpquic_path_loss_threshold_packets",
        "Later packets acknowledged before loss detection declares a packet lost (3, or what the path's reordering taught it)",
        PathValue::Gauge(|p| p.reordering.as_ref().map(|r| r.loss_threshold_packets as f64)),
    ),
    (
        "mpquic_path_loss_extra_delay_ms",
        "Delay loss detection tolerates beyond RFC 9002's 9/8 of the RTT (what the path's jitter taught it)",
        PathValue::Gauge(|p| p.reordering.as_ref().map(|r| r.loss_extra_delay_ms)),
    ),
    (
        "mpquic_path_tx_bytes",
        "Tunnel bytes sent on the path",
        PathValue::Counter(|p| p.tx_bytes),
    ),
    (
        "mpquic_path_tx_packets",
        "Tunnel packets sent on the path",
        PathValue::Counter(|p| p.tx_packets),
    ),
    (
        "mpquic_path_rx_bytes",
        "Tunnel bytes received on the path",
        PathValue::Counter(|p| p.rx_bytes),
    ),
    (
        "mpquic_path_rx_packets",
        "Tunnel packets received on the path",
        PathValue::Counter(|p| p.rx_packets),
    ),
    (
        "mpquic_path_connects",
        "Connections (re)established on the path",
        PathValue::Counter(|p| p.connects),
    ),
    (
        "mpquic_path_rebind_resent_packets",
        "Stripe: packets a pipe had sent into a NAT mapping that died, sent again to the client's new address after the rebinding",
        PathValue::Counter(|p| p.rebind_resent_packets),
    ),
    (
        "mpquic_path_handed_over_packets",
        "Reliable mode: packets sent again on a live path when this one went down",
        PathValue::Counter(|p| p.handed_over_packets),
    ),
    (
        "mpquic_path_udp_payload",
        "UDP payload the path's packets have now, bytes (below the link's after an MTU fall)",
        PathValue::Gauge(|p| p.udp_payload.map(|b| b as f64)),
    ),
    (
        "mpquic_path_udp_payload_max",
        "UDP payload the path's link carries, bytes",
        PathValue::Gauge(|p| p.udp_payload_max.map(|b| b as f64)),
    ),
    (
        "mpquic_path_mtu_changes",
        "Reconnections of the path at another packet size (MTU fall found, or recheck)",
        PathValue::Counter(|p| p.mtu_changes),
    ),
    (
        "mpquic_path_too_big_sent",
        "Inner packets too big for the path whose sender got ICMP packet-too-big",
        PathValue::Counter(|p| p.too_big_sent),
    ),
    (
        "mpquic_path_fec_parity",
        "FEC repair packets a full group gets now (auto follows the measured loss)",
        PathValue::Gauge(|p| p.fec_parity),
    ),
    (
        "mpquic_path_fec_loss_pct",
        "Loss the FEC encoder measures on the path (%)",
        PathValue::Gauge(|p| p.fec_loss_pct),
    ),
    (
        "mpquic_path_fec_overhead_pct",
        "FEC repair bytes per protected data byte sent (%)",
        PathValue::Gauge(|p| p.fec_overhead_pct),
    ),
    (
        "mpquic_path_fec_protected_packets",
        "Data packets sent under FEC",
        PathValue::Counter(|p| p.fec_protected_packets),
    ),
    (
        "mpquic_path_fec_repair_sent",
        "FEC repair packets sent",
        PathValue::Counter(|p| p.fec_repair_sent),
    ),
    (
        "mpquic_path_fec_repair_refused",
        "FEC repair packets not sent (transport buffer full)",
        PathValue::Counter(|p| p.fec_repair_refused),
    ),
    (
        "mpquic_path_fec_repair_received",
        "FEC repair packets received",
        PathValue::Counter(|p| p.fec_repair_received),
    ),
    (
        "mpquic_path_fec_recovered",
        "Lost packets rebuilt from FEC repair packets",
        PathValue::Counter(|p| p.fec_recovered),
    ),
    (
        "mpquic_path_fec_unrecoverable_groups",
        "FEC groups that lost more than their repairs could rebuild",
        PathValue::Counter(|p| p.fec_unrecoverable_groups),
    ),
    (
        "mpquic_path_fec_unrecovered_packets",
        "Packets lost in unrecoverable FEC groups",
        PathValue::Counter(|p| p.fec_unrecovered_packets),
    ),
    (
        "mpquic_path_fec_duplicates",
        "FEC packets received twice or after their rebuild (not delivered again)",
        PathValue::Counter(|p| p.fec_duplicates),
    ),
    (
        "mpquic_path_fec_inconsistent",
        "FEC packets that contradict their group (dropped)",
        PathValue::Counter(|p| p.fec_inconsistent),
    ),
];

impl StatusReport {
    /// The report as an OpenMetrics text exposition (`CONTENT_TYPE`).
    pub fn to_openmetrics(&self) -> String {
        let mut registry = Registry::default();

        let uptime = Family::<RoleLabels, FloatGauge>::default();
        uptime
            .get_or_create(&RoleLabels {
                role: self.role.clone(),
            })
            .set(self.uptime_s);
        registry.register("mpquic_uptime_seconds", "Seconds since start", uptime);

        let drops = Family::<Labels, Counter>::default();
        for (t, path, reason, n) in self.all_drops() {
            drops
                .get_or_create(&labels(t, &[("path", path), ("reason", reason)]))
                .inc_by(n);
        }
        registry.register(
            "mpquic_drops",
            "Packets dropped, by reason (docs/OPERATIONS.md lists them)",
            drops,
        );

        let refused = Family::<ReasonLabels, Counter>::default();
        for (reason, n) in &self.refused {
            refused
                .get_or_create(&ReasonLabels {
                    reason: reason.clone(),
                })
                .inc_by(*n);
        }
        registry.register(
            "mpquic_refused_connections",
            "Connections the server refused, by reason",
            refused,
        );

        if let Some(lane) = &self.lane {
            register_lane(&mut registry, lane);
        }

        // The process collector's standard names, so stock dashboards find them.
        for (name, help, v) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                self.process.rss_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                self.process.open_fds,
            ),
            (
                "mpquic_runtime_tasks",
                "Tasks alive in the async runtime",
                self.process.tasks,
            ),
            (
                "mpquic_heap_in_use_bytes",
                "Bytes of the allocator's blocks in use",
                self.process.heap_in_use_bytes,
            ),
        ] {
            let g = Gauge::<i64>::default();
            g.set(v as i64);
            registry.register(name, help, g);
        }

        let handshakes = Family::<GroupLabels, Counter>::default();
        for (group, n) in &self.tls.key_exchanges {
            handshakes
                .get_or_create(&GroupLabels {
                    group: group.clone(),
                })
                .inc_by(*n);
        }
        registry.register(
            "mpquic_tls_handshakes",
            "TLS handshakes completed, by the key exchange group negotiated",
            handshakes,
        );

        let updates = Counter::<u64>::default();
        updates.inc_by(self.tls.key_updates);
        registry.register(
            "mpquic_tls_key_updates",
            "QUIC 1-RTT key updates over all connections",
            updates,
        );

        let expiry = Family::<CertificateLabels, Gauge>::default();
        for c in &self.tls.certificates {
            expiry
                .get_or_create(&CertificateLabels {
                    role: c.role.clone(),
                    name: c.name.clone(),
                    serial: c.serial.clone(),
                })
                .set(c.expires_unix);
        }
        registry.register(
            "mpquic_tls_certificate_expiry_timestamp_seconds",
            "When each certificate in use expires (Unix time): this instance's, its CA, connected clients'",
            expiry,
        );

        let queues = Family::<QueueLabels, Counter>::default();
        for (queue, n) in self.tun_queue_packets.iter().enumerate() {
            queues
                .get_or_create(&QueueLabels {
                    queue: queue.to_string(),
                })
                .inc_by(*n);
        }
        registry.register(
            "mpquic_tun_queue_read_packets",
            "Packets read from each queue of the TUN device (server, one queue per thread)",
            queues,
        );

        // As Prometheus's own `..._config_last_reload_successful`: alert on a refused reload.
        if let Some(r) = &self.last_reload {
            let ok = Gauge::<i64>::default();
            ok.set(i64::from(r.ok));
            registry.register(
                "mpquic_config_last_reload_successful",
                "1 if the last configuration reload was applied, 0 if it was refused",
                ok,
            );
            let at = Gauge::<i64>::default();
            at.set(r.at_unix as i64);
            registry.register(
                "mpquic_config_last_reload_timestamp_seconds",
                "When the last configuration reload was tried (Unix time)",
                at,
            );
        }

        let reorder = Family::<Labels, Counter>::default();
        let holding = Family::<Labels, Gauge>::default();
        let wait = Family::<Labels, FloatGauge>::default();
        for t in &self.tunnels {
            for (event, n) in &t.reorder {
                if event == "holding" {
                    holding.get_or_create(&labels(Some(t), &[])).set(*n as i64);
                } else if event == "wait_ms" {
                    wait.get_or_create(&labels(Some(t), &[]))
                        .set(*n as f64 / 1000.0);
                } else {
                    reorder
                        .get_or_create(&labels(Some(t), &[("event", event)]))
                        .inc_by(*n);
                }
            }
        }
        registry.register(
            "mpquic_reorder",
            "Per-packet bonding at the receiver: packets held for earlier ones, missing ones skipped (timeouts: of those, after the wait ran out), late arrivals, duplicates dropped",
            reorder,
        );
        registry.register(
            "mpquic_reorder_holding",
            "Packets the resequencer holds now",
            holding,
        );
        registry.register(
            "mpquic_reorder_wait_seconds",
            "How long the resequencer waits for a missing packet that not every path has passed (from the paths' RTTs, stretched while given-up packets arrive late)",
            wait,
        );

        self.register_classes(&mut registry);

        for (name, help, value) in PATH_METRICS {
            let labelled = self.tunnels.iter().flat_map(|t| {
                t.paths
                    .iter()
                    .map(move |p| (labels(Some(t), &[("path", &p.name)]), p))
            });
            match value {
                PathValue::Counter(f) => {
                    let fam = Family::<Labels, Counter>::default();
                    for (l, p) in labelled {
                        fam.get_or_create(&l).inc_by(f(p));
                    }
                    registry.register(*name, *help, fam);
                }
                PathValue::Gauge(f) => {
                    let fam = Family::<Labels, FloatGauge>::default();
                    for (l, p) in labelled {
                        if let Some(v) = f(p) {
                            fam.get_or_create(&l).set(v);
                        }
                    }
                    registry.register(*name, *help, fam);
                }
            }
        }

        self.register_pipes(&mut registry);

        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

impl StatusReport {
    /// Per-pipe metrics of paths with several pipes.
    fn register_pipes(&self, registry: &mut Registry) {
        type Read = fn(&crate::PipeStatus) -> u64;
        let counters: [(&str, &str, Read); 4] = [
            (
                "mpquic_pipe_tx_bytes",
                "UDP payload bytes sent on the pipe",
                |p| p.tx_bytes,
            ),
            (
                "mpquic_pipe_rx_bytes",
                "UDP payload bytes received on the pipe",
                |p| p.rx_bytes,
            ),
            (
                "mpquic_pipe_sent_packets",
                "QUIC packets sent on the pipe",
                |p| p.sent_packets,
            ),
            (
                "mpquic_pipe_lost_packets",
                "QUIC packets lost on the pipe",
                |p| p.lost_packets,
            ),
        ];
        let pipes = || {
            self.tunnels.iter().flat_map(|t| {
                t.paths.iter().flat_map(move |path| {
                    path.pipes.iter().enumerate().map(move |(i, p)| {
                        let pipe = format!("{}.{i}", path.name);
                        (labels(Some(t), &[("path", &path.name), ("pipe", &pipe)]), p)
                    })
                })
            })
        };
        for (name, help, read) in counters {
            let fam = Family::<Labels, Counter>::default();
            for (l, p) in pipes() {
                fam.get_or_create(&l).inc_by(read(p));
            }
            registry.register(name, help, fam);
        }
        let rtt = Family::<Labels, FloatGauge>::default();
        let in_flight = Family::<Labels, Gauge>::default();
        for (l, p) in pipes() {
            rtt.get_or_create(&l).set(p.rtt_ms);
            in_flight.get_or_create(&l).set(p.in_flight_bytes as i64);
        }
        registry.register(
            "mpquic_pipe_rtt_ms",
            "The pipe's QUIC RTT estimate (ms)",
            rtt,
        );
        registry.register(
            "mpquic_pipe_in_flight_bytes",
            "Bytes the pipe has in flight, of the path's shared window",
            in_flight,
        );
    }
}

impl StatusReport {
    /// Each traffic class's packets (by how they were classified) and its drops that belong to
    /// no path.
    fn register_classes(&self, registry: &mut Registry) {
        let packets = Family::<Labels, Counter>::default();
        let drops = Family::<Labels, Counter>::default();
        for t in &self.tunnels {
            for c in &t.classes {
                for (how, n) in [
                    ("matched", c.classified_packets),
                    ("unmatched", c.unmatched_packets),
                ] {
                    packets
                        .get_or_create(&labels(Some(t), &[("class", &c.name), ("how", how)]))
                        .inc_by(n);
                }
                for (reason, n) in &c.drops {
                    drops
                        .get_or_create(&labels(Some(t), &[("class", &c.name), ("reason", reason)]))
                        .inc_by(*n);
                }
            }
        }
        registry.register(
            "mpquic_class_packets",
            "Packets put in each traffic class: by a rule or the class their flow arrived in (matched), or because nothing matched (unmatched, the default class)",
            packets,
        );
        registry.register(
            "mpquic_class_drops",
            "Each traffic class's drops that belong to no path, by reason (in mpquic_drops with an empty path too)",
            drops,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TunnelStatus;

    fn report() -> StatusReport {
        let mut p = PathStatus {
            name: "wan1".into(),
            state: "up".into(),
            tx_bytes: 10,
            cwnd_bytes: Some(12000),
            ..Default::default()
        };
        p.drops.insert("oversized".into(), 2);
        StatusReport {
            role: "server".into(),
            refused: [("handshake_failed".to_string(), 3)].into(),
            tls: crate::TlsStatus {
                post_quantum: true,
                key_exchanges: [("X25519MLKEM768".to_string(), 5)].into(),
                key_updates: 3,
                certificates: vec![crate::CertificateStatus {
                    role: "ca".into(),
                    name: "mpquic-ca".into(),
                    serial: "a1b".into(),
                    expires_unix: 2_000_000_000,
                }],
            },
            drops: [("no_route".to_string(), 4)].into(),
            tun_queue_packets: vec![7, 9],
            last_reload: Some(crate::ReloadStatus {
                ok: false,
                at_unix: 1_700_000_000,
                message: "bad".into(),
            }),
            tunnels: vec![TunnelStatus {
                peer: "site\"1".into(),
                paths: vec![p],
                lans: vec!["192.168.50.0/24".into()],
                reorder: [("late", 5), ("holding", 2), ("wait_ms", 40)]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect(),
                classes: vec![crate::ClassStatus {
                    name: "critical".into(),
                    classified_packets: 21,
                    drops: [("no_path".to_string(), 1)].into(),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn every_field_is_exported_typed_and_labelled() {
        let m = report().to_openmetrics();
        assert!(m.contains("# TYPE mpquic_path_tx_bytes counter"), "{m}");
        assert!(
            m.contains("mpquic_path_tx_bytes_total{tunnel=\"site\\\"1\",path=\"wan1\"} 10"),
            "{m}"
        );
        assert!(m.contains("# TYPE mpquic_path_cwnd_bytes gauge"), "{m}");
        // The resequencer's counters, and its two gauges apart.
        assert!(
            m.contains("mpquic_reorder_total{tunnel=\"site\\\"1\",event=\"late\"} 5"),
            "{m}"
        );
        assert!(
            m.contains("mpquic_reorder_holding{tunnel=\"site\\\"1\"} 2"),
            "{m}"
        );
        assert!(
            m.contains("mpquic_reorder_wait_seconds{tunnel=\"site\\\"1\"} 0.04"),
            "{m}"
        );
        assert!(
            m.contains("mpquic_path_up{tunnel=\"site\\\"1\",path=\"wan1\"} 1"),
            "{m}"
        );
        assert!(m.contains("mpquic_config_last_reload_successful 0"), "{m}");
        assert!(
            m.contains(
                "mpquic_drops_total{tunnel=\"site\\\"1\",path=\"wan1\",reason=\"oversized\"} 2"
            ),
            "{m}"
        );
        assert!(
            m.contains("mpquic_drops_total{tunnel=\"\",path=\"\",reason=\"no_route\"} 4"),
            "{m}"
        );
        assert!(
            m.contains(
                "mpquic_class_packets_total{tunnel=\"site\\\"1\",class=\"critical\",how=\"matched\"} 21"
            ),
            "{m}"
        );
        assert!(
            m.contains(
                "mpquic_class_drops_total{tunnel=\"site\\\"1\",class=\"critical\",reason=\"no_path\"} 1"
            ),
            "{m}"
        );
        assert!(
            m.contains("mpquic_refused_connections_total{reason=\"handshake_failed\"} 3"),
            "{m}"
        );
        assert!(
            m.contains("mpquic_tls_handshakes_total{group=\"X25519MLKEM768\"} 5"),
            "{m}"
        );
        assert!(m.contains("mpquic_tls_key_updates_total 3"), "{m}");
        assert!(
            m.contains("mpquic_tls_certificate_expiry_timestamp_seconds{role=\"ca\",name=\"mpquic-ca\",serial=\"a1b\"} 2000000000"),
            "{m}"
        );
        assert!(
            m.contains("mpquic_tun_queue_read_packets_total{queue=\"1\"} 9"),
            "{m}"
        );
        // An unknown RTT is no sample, not a zero.
        assert!(!m.contains("mpquic_path_srtt_ms{"), "{m}");
        assert!(m.ends_with("# EOF\n"), "{m}");
    }

    #[test]
    fn a_path_metric_per_numeric_field() {
        // A numeric field added to PathStatus without a metric fails here: every number in the
        // JSON form of a path must have its metric.
        let names: Vec<&str> = PATH_METRICS.iter().map(|(n, _, _)| *n).collect();
        let p = PathStatus {
            srtt_ms: Some(1.0),
            min_rtt_ms: Some(1.0),
            quic_rtt_ms: Some(1.0),
            cwnd_bytes: Some(1),
            pacing_mbit: Some(1.0),
            playout_ms: Some(1.0),
            streams_in: Some(1),
            probe_interval_ms: Some(1.0),
            fec_parity: Some(1.0),
            fec_loss_pct: Some(1.0),
            fec_overhead_pct: Some(1.0),
            udp_payload: Some(1),
            udp_payload_max: Some(1),
            recovery_loss_pct: Some(1.0),
            carry: Some("stream".into()),
            ..Default::default()
        };
        let json = serde_json::to_value(&p).unwrap();
        for (field, v) in json.as_object().unwrap() {
            if v.is_number() {
                let metric = format!("mpquic_path_{field}");
                assert!(names.contains(&metric.as_str()), "no metric for {field}");
            }
        }
    }

    #[test]
    fn the_table_shows_paths_and_refusals() {
        let r = report();
        assert!(r
            .render()
            .contains("refused connections: handshake_failed=3"));
        assert!(r
            .render()
            .contains("tun queues 2, packets read per queue: 7 / 9"));
        assert!(r.render().contains(" lan 192.168.50.0/24"));
        assert!(r.render().contains("wan1"));
        assert!(!r.render().contains("mtu wan1"));
        let mut r = r;
        let p = &mut r.tunnels[0].paths[0];
        (p.udp_payload, p.udp_payload_max, p.mtu_changes) = (Some(1360), Some(1472), 1);
        assert!(
            r.render()
                .contains("mtu wan1   UDP payload 1360 of 1472 bytes"),
            "{}",
            r.render()
        );
    }
}
