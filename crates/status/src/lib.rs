//! mpquic's status report: one set of typed structures feeds `mpquic status` (the table,
//! `table.rs`), `mpquic status --json` (serde), `/metrics` (OpenMetrics, `metrics.rs`) and the
//! lab, which reads a run's final status back into the same types.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

mod metrics;
mod table;

pub use metrics::CONTENT_TYPE;

/// A path's reordering, and how its loss detection adapted: a packet declared lost and then
/// acknowledged was late, not lost (`spurious_losses`), and widens the thresholds in force;
/// losses that stay lost narrow them again.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct Reordering {
    /// Packets acknowledged after a later packet was.
    pub reordered_packets: u64,
    /// The deepest reordering seen, in packets.
    pub depth_packets: u64,
    /// Packets declared lost and acknowledged afterwards (included in `quic_lost_packets`, not
    /// in `quic_loss_pct`).
    pub spurious_losses: u64,
    /// A packet is lost once this many later ones are acknowledged ...
    pub loss_threshold_packets: u64,
    /// ... or once it is this much older than RFC 9002's 9/8 of the RTT allows.
    pub loss_extra_delay_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct PathStatus {
    pub name: String,
    /// up, down, probing, or disconnected.
    pub state: String,
    /// Seconds in the current state.
    pub state_for_s: f64,
    pub priority: u32,
    pub weight: u32,
    pub remote: String,
    /// Probe round trip, smoothed and minimum (ms).
    pub srtt_ms: Option<f64>,
    pub min_rtt_ms: Option<f64>,
    /// Share of recent probes unanswered (%).
    pub probe_loss_pct: f64,
    /// Probe interval in force (ms): slower while the tunnel is quiet (no traffic for a while).
    #[serde(default)]
    pub probe_interval_ms: Option<f64>,
    /// The QUIC engine's view of the path.
    pub quic_rtt_ms: Option<f64>,
    pub cwnd_bytes: Option<u64>,
    /// The congestion controller's pacing rate (Mbit/s), for controllers that have one.
    #[serde(default)]
    pub pacing_mbit: Option<f64>,
    /// Reliable mode: the steady delay the receiver holds this path's packets to (ms; 0 while
    /// the path shows no head-of-line waits).
    #[serde(default)]
    pub playout_ms: Option<f64>,
    /// Reliable mode: the peer's streams the receiver reads (a lane's opens with its first
    /// packet; each is held until it or the connection ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streams_in: Option<u64>,
    /// `transport_mode: auto`: how the path carries inner packets now (`datagram`, `stream`)
    /// and why (`carry_why`: `loss`, `quiet`, `single`: not bonded and at a rate the stream
    /// carries as well, `clean`), the loss that choice follows (%), the times it went to its
    /// stream and the seconds it spent there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carry: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carry_why: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_loss_pct: Option<f64>,
    #[serde(default)]
    pub to_stream: u64,
    #[serde(default)]
    pub stream_s: f64,
    pub quic_sent_packets: u64,
    /// Packets declared lost, spurious ones included (`reordering`).
    pub quic_lost_packets: u64,
    /// Packets lost (declared lost and never acknowledged) / sent over the connection's life (%).
    pub quic_loss_pct: f64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub rx_bytes: u64,
    pub rx_packets: u64,
    /// Inner traffic over the last second or so (Mbit/s), sent and received on this path.
    #[serde(default)]
    pub tx_mbit: f64,
    #[serde(default)]
    pub rx_mbit: f64,
    pub flows: u64,
    /// Bulk flows moved onto it while they ran, from the best path that could not carry them
    /// all (`failover`: `mpquic_core::bond::spill`).
    #[serde(default)]
    pub flows_moved: u64,
    pub connects: u64,
    /// Times the client took the path out of use because it stopped acknowledging the data
    /// it carried (before its probes would have).
    #[serde(default)]
    pub ack_silences: u64,
    /// Times the peer's address changed under the path's connection and the connection
    /// followed (a NAT rebinding; seen by the server).
    #[serde(default)]
    pub peer_moves: u64,
    /// The link's reordering as loss detection saw it and adapted to it (QUIC paths).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reordering: Option<Reordering>,
    /// Times the path answered its probes while delivering nothing one way and was taken down
    /// for it (its connection replaced; from then on without UDP GSO).
    #[serde(default)]
    pub delivery_stalls: u64,
    /// Reliable mode: packets this path had sent when it went down, sent again on a live path
    /// (some may reach the peer twice).
    #[serde(default)]
    pub handed_over_packets: u64,
    /// Stripe (server): packets a pipe had sent into its client's NAT mapping that died, sent
    /// again to the new address after a rebinding (some may reach the peer twice).
    #[serde(default)]
    pub rebind_resent_packets: u64,
    pub drops: BTreeMap<String, u64>,
    /// UDP payload the path's packets have now (bytes), and the most its link carries: less
    /// once the path MTU watch found a smaller MTU on the route.
    #[serde(default)]
    pub udp_payload: Option<u64>,
    #[serde(default)]
    pub udp_payload_max: Option<u64>,
    /// Times the path was reconnected at another packet size (an MTU fall found, or a
    /// reduced path tried at full size again).
    #[serde(default)]
    pub mtu_changes: u64,
    /// Inner packets too big for the path (counted as `oversized` drops) whose sender was told
    /// the size that fits (ICMP packet too big).
    #[serde(default)]
    pub too_big_sent: u64,
    /// FEC (when the tunnel has it): repair packets a full group gets now, and the loss the
    /// encoder measures on the path (%), which `auto` follows.
    #[serde(default)]
    pub fec_parity: Option<f64>,
    #[serde(default)]
    pub fec_loss_pct: Option<f64>,
    /// Repair bytes per protected data byte sent (%).
    #[serde(default)]
    pub fec_overhead_pct: Option<f64>,
    #[serde(default)]
    pub fec_protected_packets: u64,
    #[serde(default)]
    pub fec_repair_sent: u64,
    /// Repair packets the transport refused (buffer full): not sent, counted.
    #[serde(default)]
    pub fec_repair_refused: u64,
    #[serde(default)]
    pub fec_repair_received: u64,
    /// Lost packets rebuilt from repair packets.
    #[serde(default)]
    pub fec_recovered: u64,
    /// Groups that lost more than their repairs could rebuild, and the packets lost in them.
    #[serde(default)]
    pub fec_unrecoverable_groups: u64,
    #[serde(default)]
    pub fec_unrecovered_packets: u64,
    /// FEC packets that arrived twice (or after their rebuild): not delivered again.
    #[serde(default)]
    pub fec_duplicates: u64,
    /// FEC packets that contradict their group: dropped.
    #[serde(default)]
    pub fec_inconsistent: u64,
    /// A path over several pipes (`pipes: N`): each pipe's figures; empty for one QUIC pipe.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipes: Vec<PipeStatus>,
    /// What carries the path's datagrams: `quic` or `stripe` (empty: not connected).
    #[serde(default)]
    pub transport: String,
    /// Its role now: `primary`, `backup` or `overflow` (a path whose data budget is used up
    /// is a `backup` until its period ends).
    #[serde(default)]
    pub role: String,
    /// What kind of link it runs over (`starlink`; empty: nothing known): as configured
    /// (`link`), or as its probes showed it (`link_recognised`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub link: String,
    /// `link` was recognised from how the path changes at Starlink's reconfigurations, not
    /// configured.
    #[serde(default)]
    pub link_recognised: bool,
    /// What the path's probes showed at Starlink's reconfigurations so far, when its `link` is
    /// not configured (the client): e.g. "7 of 8 boundaries changed, 4 of 33 points between".
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub link_evidence: String,
    /// Packets sent on it that were copied to another path across its reconfigurations
    /// (`link: starlink`).
    #[serde(default)]
    pub reconfig_copies: u64,
    /// Small real-time packets sent on it that were also copied to another path while it was
    /// losing data.
    #[serde(default)]
    pub loss_copies: u64,
    /// Small real-time packets sent on it that were also copied to a spare path (of the same
    /// priority, a primary, not metered) whatever it did.
    #[serde(default)]
    pub spare_copies: u64,
    /// Inner packets its sender marked "congestion experienced" (ECN) after they had waited
    /// in its queue, instead of dropping them later: flows that negotiated ECN slow down
    /// without a loss.
    #[serde(default)]
    pub ce_marked: u64,
    /// Probes that met one of its reconfigurations on their way, and were not counted in
    /// `probe_loss_pct` or the round trip (`link: starlink`).
    #[serde(default)]
    pub probes_across_reconfig: u64,
    /// `rate_limit` (Mbit/s each way, IP packets counted whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_mbit: Option<f64>,
    /// `data_budget`: the path's budget for the period and where it stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetStatus>,
}

/// A metered path's data budget (`data_budget`), both directions counted, IP packets whole.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct BudgetStatus {
    pub limit_bytes: u64,
    pub used_bytes: u64,
    pub left_bytes: u64,
    /// `within`, `warn` (past its warning share) or `used up` (a backup until `period_end`).
    pub state: String,
    /// The period: when it began and when the next begins (UTC dates, and seconds since the
    /// epoch for the metrics).
    pub period_start: String,
    pub period_end: String,
    pub period_end_unix: i64,
    /// When it runs out at the pace the period has had so far (UTC date; absent: not before
    /// the period ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs_out: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runs_out_unix: Option<i64>,
}

/// One pipe of a path: a UDP 5-tuple (its own QUIC connection) under the path's shared
/// congestion controller.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct PipeStatus {
    /// The local (client) or remote (server) UDP port that tells the pipes apart.
    pub port: u16,
    pub rtt_ms: f64,
    /// Its part of the path's window in use.
    pub in_flight_bytes: u64,
    pub sent_packets: u64,
    pub lost_packets: u64,
    /// UDP payload bytes sent and received on this pipe.
    pub tx_bytes: u64,
    pub rx_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct TunnelStatus {
    /// The client's name (server side: its identity, `identity/instance` for a site that runs
    /// several instances) or this instance's name (client side).
    pub peer: String,
    /// The traffic classes (`classes:`) in priority order: each a lane of the tunnel over its
    /// paths (which they share: one connection, prober and controller per path). Empty without
    /// classes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<ClassStatus>,
    pub address: Option<String>,
    /// A dual-stack tunnel: the IPv6 tunnel address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address6: Option<String>,
    /// Server side: the site LAN prefixes routed to this client (routed LANs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lans: Vec<String>,
    pub policy: String,
    pub mode: String,
    /// How the session is carried: `native` (mpquic's protocol), `connect-ip` (CONNECT-IP
    /// between two mpquic ends: bonding as native) or `connect-ip (standard)` (one end speaks
    /// standard CONNECT-IP: IP packets only, one path at a time). Empty: not known yet (a
    /// CONNECT-IP client before its first answer).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub protocol: String,
    /// The congestion controller of this tunnel's paths as it runs: the configured one, or
    /// `bbr (yielding)` where the tunnel carries traffic classes (a server's sessions differ).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub congestion: String,
    /// FEC mode: off, auto, or K/M.
    #[serde(default)]
    pub fec: String,
    pub paths: Vec<PathStatus>,
    /// Drops that belong to no path (every class's together).
    pub drops: BTreeMap<String, u64>,
    /// Per-packet bonding, the peer's flows put back in order here (`mpquic_core::reorder::reseq`):
    /// held, skipped, timeouts, late, duplicates (counters) and holding (packets held now);
    /// every class's together.
    #[serde(default)]
    pub reorder: BTreeMap<String, u64>,
}

/// A traffic class of a tunnel.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ClassStatus {
    pub name: String,
    pub policy: String,
    /// How its packets travel: `datagram` (never on a path's stream), `reliable` (always) or
    /// `auto` (as each path's loss says).
    pub mode: String,
    /// FEC protects its packets (in the tunnel's `fec` mode).
    #[serde(default)]
    pub fec: bool,
    /// Packets put in this class, by a rule (client) or by the class their flow arrived in
    /// (server)...
    #[serde(default)]
    pub classified_packets: u64,
    /// ...and packets in it because no rule matched them, or (server) their flow was not seen
    /// from the client: the default class only.
    #[serde(default)]
    pub unmatched_packets: u64,
    /// Inner packets and bytes of this class sent (over every path) and received.
    #[serde(default)]
    pub tx_packets: u64,
    #[serde(default)]
    pub tx_bytes: u64,
    #[serde(default)]
    pub rx_packets: u64,
    #[serde(default)]
    pub rx_bytes: u64,
    /// Its drops that belong to no path, and its resequencer's figures (as the tunnel's).
    #[serde(default)]
    pub drops: BTreeMap<String, u64>,
    #[serde(default)]
    pub reorder: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct StatusReport {
    pub role: String,
    /// The congestion controller of this instance's sending side (`congestion_algorithm`).
    #[serde(default)]
    pub congestion: String,
    pub tun_name: String,
    pub tun_mtu: u32,
    pub version: String,
    pub uptime_s: f64,
    pub tunnels: Vec<TunnelStatus>,
    /// Drops not attributable to one tunnel (server: no client for the destination, ...).
    pub drops: BTreeMap<String, u64>,
    /// Server: connections refused, by reason (handshake_failed, bad_hello, ...).
    #[serde(default)]
    pub refused: BTreeMap<String, u64>,
    /// Packets read from each queue of the TUN device (the server has one queue per runtime
    /// thread, each with its own reader); empty for a single queue.
    #[serde(default)]
    pub tun_queue_packets: Vec<u64>,
    /// The last configuration reload (SIGHUP or `mpquic reload`), if there was one.
    #[serde(default)]
    pub last_reload: Option<ReloadStatus>,
    /// TLS: the key exchange this instance offers and what its handshakes negotiated.
    #[serde(default)]
    pub tls: TlsStatus,
    /// What the process holds now (churn and soak tests watch these return to a baseline).
    #[serde(default)]
    pub process: ProcessStatus,
    /// The MPTCP lane (`tcp_lane`, `tcp_lane_listen`), when this instance runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<LaneStatus>,
}

/// The MPTCP lane's connections: the client's LAN connections carried, or the server's lane
/// connections taken.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LaneStatus {
    /// Connections taken since start, and those open now.
    pub connections: u64,
    pub active: u64,
    /// Relayed to their destination (server), or whose destination was reached (client).
    pub connected: u64,
    /// Not relayed, by reason: `refused`, `unreachable`, `timed_out`, `not_allowed` (the
    /// destination's answer, reset to the LAN host), `setup_failed` (client: no lane
    /// connection), `bad_request` (server: a handshake or request that failed).
    pub failed: BTreeMap<String, u64>,
    /// Bytes toward the destination and back.
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// Client: the lane's TCP subflows now, by path (a connection has one on each path).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub subflows: BTreeMap<String, u64>,
    /// Client: connections that went out on a lane connection set up ahead, and how many
    /// are ready now.
    #[serde(default)]
    pub ahead: u64,
    #[serde(default)]
    pub ready: u64,
}

/// What the process holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessStatus {
    /// Tasks alive in the async runtime.
    pub tasks: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// Resident memory, bytes.
    pub rss_bytes: u64,
    /// The allocator's blocks in use, bytes: what the process's data takes. RSS can stay above
    /// it after a peak (free blocks between live ones), so a leak shows here first.
    #[serde(default)]
    pub heap_in_use_bytes: u64,
    /// Free memory the allocator holds (part of it already given back to the system).
    #[serde(default)]
    pub heap_free_bytes: u64,
}

/// What this instance's TLS handshakes use.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TlsStatus {
    /// `tls_post_quantum`: the hybrid X25519MLKEM768 offered and preferred.
    pub post_quantum: bool,
    /// Handshakes completed since start, by the key exchange group they negotiated.
    #[serde(default)]
    pub key_exchanges: BTreeMap<String, u64>,
    /// QUIC 1-RTT key updates since start, over all connections (either side's).
    #[serde(default)]
    pub key_updates: u64,
    /// The certificates in use: this instance's, its CA, and (server) each connected client's.
    #[serde(default)]
    pub certificates: Vec<CertificateStatus>,
}

/// One certificate in use and when it expires.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CertificateStatus {
    /// `certificate` (this instance's), `ca`, or `client` (a connected client's).
    pub role: String,
    /// Its subject's CN.
    pub name: String,
    /// Its serial, hex (what `revoked: [serial:HEX]` names).
    pub serial: String,
    /// The end of its validity, Unix time.
    pub expires_unix: i64,
}

/// Certificates this close to their end are flagged in status and the log.
pub const EXPIRY_WARNING_DAYS: i64 = 30;

impl CertificateStatus {
    /// Whole days left (negative: expired), at Unix time `now`.
    pub fn days_left(&self, now: i64) -> i64 {
        (self.expires_unix - now).div_euclid(86_400)
    }
}

/// What the last reload did: applied (what changed), or refused (why; the running
/// configuration stays).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReloadStatus {
    pub ok: bool,
    /// Seconds since the Unix epoch.
    pub at_unix: u64,
    pub message: String,
}

impl PathStatus {
    /// One line on how an `auto` path carries inner packets (`None` in a fixed mode).
    pub fn carry_summary(&self) -> Option<String> {
        let carry = self.carry.as_deref()?;
        let now = match (carry, self.carry_why.as_deref()) {
            ("stream", Some("quiet")) => "on its stream (quiet: no evidence yet that it is clean)",
            ("stream", Some("single")) => {
                "on its stream (one path at a rate its stream carries as well)"
            }
            ("stream", _) => "on its stream (losing: retransmitted, in order)",
            _ => "as datagrams (clean)",
        };
        Some(format!(
            "{now}; loss {:.2}%, to the stream {} time(s), {:.0} s there",
            self.recovery_loss_pct.unwrap_or(0.0),
            self.to_stream,
            self.stream_s
        ))
    }

    /// One line on the link's reordering once it has shown some (`None` before).
    pub fn reorder_summary(&self) -> Option<String> {
        let r = self
            .reordering
            .as_ref()
            .filter(|r| r.reordered_packets > 0)?;
        Some(format!(
            "{} packets overtaken, up to {} deep; {} taken for lost were late; a packet is lost after {} later ones or {:.0} ms past 9/8 of the RTT",
            r.reordered_packets,
            r.depth_packets,
            r.spurious_losses,
            r.loss_threshold_packets,
            r.loss_extra_delay_ms
        ))
    }

    /// One line on the path's role, cap and budget when any is set (`None` for a primary
    /// without limits).
    pub fn limits_summary(&self) -> Option<String> {
        let mut parts = Vec::new();
        if !self.role.is_empty() && self.role != "primary" {
            parts.push(self.role.clone());
        }
        if !self.link.is_empty() {
            let how = match self.link_recognised {
                true => format!(" (recognised: {})", self.link_evidence),
                false => String::new(),
            };
            parts.push(format!(
                "{}{how}: {} packets copied to another path across its reconfigurations, {} \
                 probes not counted there",
                self.link, self.reconfig_copies, self.probes_across_reconfig
            ));
        }
        if self.loss_copies > 0 {
            parts.push(format!(
                "{} small packets copied to another path while it lost data",
                self.loss_copies
            ));
        }
        if self.spare_copies > 0 {
            parts.push(format!(
                "{} small packets copied to a spare path",
                self.spare_copies
            ));
        }
        if self.ce_marked > 0 {
            parts.push(format!(
                "{} packets marked congestion-experienced (ECN) instead of dropped",
                self.ce_marked
            ));
        }
        if self.flows_moved > 0 {
            parts.push(format!(
                "{} bulk flows moved onto it from the best path, {} on it now",
                self.flows_moved, self.flows
            ));
        }
        if let Some(cap) = self.rate_limit_mbit {
            parts.push(format!("capped at {cap} Mbit/s each way"));
        }
        if let Some(b) = &self.budget {
            let gb = |n: u64| n as f64 / 1e9;
            parts.push(format!(
                "budget {:.2} of {:.2} GB used ({:.0}%, {}), {:.2} GB left until {}{}",
                gb(b.used_bytes),
                gb(b.limit_bytes),
                b.used_bytes as f64 * 100.0 / b.limit_bytes.max(1) as f64,
                b.state,
                gb(b.left_bytes),
                b.period_end,
                match &b.runs_out {
                    Some(d) if b.state != "used up" => format!(", runs out {d} at this pace"),
                    _ => String::new(),
                }
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    /// One line on the path's packet size when it is below its link's (`None` otherwise).
    pub fn mtu_summary(&self) -> Option<String> {
        let (now, max) = (self.udp_payload?, self.udp_payload_max?);
        (now < max || self.too_big_sent > 0).then(|| {
            format!(
                "UDP payload {now} of {max} bytes (MTU fall found on the route; {} size change(s), \
                 {} inner packet(s) too big, senders told)",
                self.mtu_changes, self.too_big_sent
            )
        })
    }

    /// One line of what FEC did on this path (`None` without FEC): repair per group now at the
    /// measured loss, overhead, repair sent / received, rebuilt, and the residual it left.
    pub fn fec_summary(&self) -> Option<String> {
        let parity = self.fec_parity?;
        let refused = if self.fec_repair_refused > 0 {
            format!(
                ", {} repair not sent (buffer full)",
                self.fec_repair_refused
            )
        } else {
            String::new()
        };
        Some(format!(
            "repair {parity} per group at {:.1}% loss, overhead {:.0}%, sent {} data + {} repair, \
             got {} repair, rebuilt {}, unrecoverable {} groups ({} pkts){refused}",
            self.fec_loss_pct.unwrap_or(0.0),
            self.fec_overhead_pct.unwrap_or(0.0),
            self.fec_protected_packets,
            self.fec_repair_sent,
            self.fec_repair_received,
            self.fec_recovered,
            self.fec_unrecoverable_groups,
            self.fec_unrecovered_packets,
        ))
    }

    /// One line of the path's pipes (`None` for one pipe): each pipe's port, share of the
    /// bytes sent, RTT and loss.
    pub fn pipes_summary(&self) -> Option<String> {
        if self.pipes.is_empty() {
            return None;
        }
        let total: u64 = self.pipes.iter().map(|p| p.tx_bytes).sum::<u64>().max(1);
        let each: Vec<String> = self
            .pipes
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let loss = if p.sent_packets > 0 {
                    p.lost_packets as f64 * 100.0 / p.sent_packets as f64
                } else {
                    0.0
                };
                format!(
                    "{}.{i} :{} {:.0}% {:.1}ms {loss:.1}%",
                    self.name,
                    p.port,
                    p.tx_bytes as f64 * 100.0 / total as f64,
                    p.rtt_ms
                )
            })
            .collect();
        let kind = match self.transport.as_str() {
            "stripe" => " stripe",
            _ => "",
        };
        Some(format!(
            "{}{kind} (port share rtt loss): {}",
            self.pipes.len(),
            each.join("  ")
        ))
    }
}

impl StatusReport {
    /// Every drop counter, as (tunnel peer or "", path name or "", reason, count): the instance's,
    /// each tunnel's, each path's.
    pub fn all_drops(&self) -> Vec<(Option<&TunnelStatus>, &str, &str, u64)> {
        let mut out: Vec<(Option<&TunnelStatus>, &str, &str, u64)> = self
            .drops
            .iter()
            .map(|(r, n)| (None, "", r.as_str(), *n))
            .collect();
        for t in &self.tunnels {
            out.extend(t.drops.iter().map(|(r, n)| (Some(t), "", r.as_str(), *n)));
            for p in &t.paths {
                out.extend(
                    p.drops
                        .iter()
                        .map(|(r, n)| (Some(t), p.name.as_str(), r.as_str(), *n)),
                );
            }
        }
        out
    }

    /// The first tunnel has its address and every path is up, or standing by while another
    /// carries (CONNECT-IP) (a client's tunnel is ready).
    pub fn first_tunnel_up(&self) -> bool {
        self.tunnels.first().is_some_and(|t| {
            t.address.is_some()
                && t.paths.iter().any(|p| p.state == "up")
                && t.paths
                    .iter()
                    .all(|p| p.state == "up" || p.state == "standby")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The carriage line says why a path is on its stream: a quiet or lone path is not losing.
    #[test]
    fn the_carry_line_says_why() {
        let line = |carry: &str, why: &str| {
            let p = PathStatus {
                carry: Some(carry.into()),
                carry_why: Some(why.into()),
                ..PathStatus::default()
            };
            p.carry_summary().unwrap()
        };
        assert!(line("stream", "loss").starts_with("on its stream (losing"));
        assert!(line("stream", "quiet").starts_with("on its stream (quiet"));
        assert!(line("stream", "single").starts_with("on its stream (one path"));
        assert!(line("datagram", "clean").starts_with("as datagrams (clean)"));
        assert_eq!(
            PathStatus::default().carry_summary(),
            None,
            "a fixed mode has no line"
        );
    }

    /// The reordering line appears once the link has reordered, with what loss detection
    /// learned.
    #[test]
    fn the_reorder_line_appears_once_the_link_reorders() {
        let mut p = PathStatus {
            reordering: Some(Reordering::default()),
            ..PathStatus::default()
        };
        assert_eq!(p.reorder_summary(), None);
        p.reordering = Some(Reordering {
            reordered_packets: 120,
            depth_packets: 60,
            spurious_losses: 7,
            loss_threshold_packets: 76,
            loss_extra_delay_ms: 28.7,
        });
        assert_eq!(
            p.reorder_summary().unwrap(),
            "120 packets overtaken, up to 60 deep; 7 taken for lost were late; a packet is lost after 76 later ones or 29 ms past 9/8 of the RTT"
        );
    }
}
