//! The status report: one structure feeds `mpquic status` (table and `--json`) and `/metrics`.
//! Prometheus metrics are derived from the serialized fields, so adding a field to `PathStatus`
//! adds its metric; there is no second list to keep in step.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

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
    /// The QUIC engine's view of the path.
    pub quic_rtt_ms: Option<f64>,
    pub cwnd_bytes: Option<u64>,
    pub quic_sent_packets: u64,
    pub quic_lost_packets: u64,
    /// lost / sent packets over the connection's life (%).
    pub quic_loss_pct: f64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub rx_bytes: u64,
    pub rx_packets: u64,
    pub flows: u64,
    pub connects: u64,
    pub drops: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct TunnelStatus {
    /// The client's name (server side) or this instance's name (client side).
    pub peer: String,
    pub address: Option<String>,
    pub policy: String,
    pub mode: String,
    pub paths: Vec<PathStatus>,
    pub drops: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct StatusReport {
    pub role: String,
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
}

fn label_escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Metric type from the field name: monotonic counts are counters, everything else a gauge.
fn is_counter(field: &str) -> bool {
    field.ends_with("_bytes") && field != "cwnd_bytes"
        || field.ends_with("_packets")
        || field == "connects"
}

impl StatusReport {
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        let mut families: BTreeMap<String, (bool, Vec<String>)> = BTreeMap::new();
        let mut add = |name: String, counter: bool, labels: String, value: f64| {
            families
                .entry(name)
                .or_insert_with(|| (counter, Vec::new()))
                .1
                .push(format!("{{{labels}}} {value}"));
        };
        let role = label_escape(&self.role);
        add(
            "mpquic_uptime_seconds".into(),
            false,
            format!("role=\"{role}\""),
            self.uptime_s,
        );
        for (reason, n) in &self.drops {
            add(
                "mpquic_drops_total".into(),
                true,
                format!("tunnel=\"\",path=\"\",reason=\"{reason}\""),
                *n as f64,
            );
        }
        for (reason, n) in &self.refused {
            add(
                "mpquic_refused_connections_total".into(),
                true,
                format!("reason=\"{}\"", label_escape(reason)),
                *n as f64,
            );
        }
        for t in &self.tunnels {
            let tl = label_escape(&t.peer);
            for (reason, n) in &t.drops {
                add(
                    "mpquic_drops_total".into(),
                    true,
                    format!("tunnel=\"{tl}\",path=\"\",reason=\"{reason}\""),
                    *n as f64,
                );
            }
            for p in &t.paths {
                let labels = format!("tunnel=\"{tl}\",path=\"{}\"", label_escape(&p.name));
                let up = if p.state == "up" { 1.0 } else { 0.0 };
                add("mpquic_path_up".into(), false, labels.clone(), up);
                for (reason, n) in &p.drops {
                    add(
                        "mpquic_drops_total".into(),
                        true,
                        format!("{labels},reason=\"{reason}\""),
                        *n as f64,
                    );
                }
                let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(p) else {
                    continue;
                };
                for (field, v) in fields {
                    let Some(x) = v.as_f64() else { continue };
                    let counter = is_counter(&field);
                    let name = if counter {
                        format!("mpquic_path_{field}_total")
                    } else {
                        format!("mpquic_path_{field}")
                    };
                    add(name, counter, labels.clone(), x);
                }
            }
        }
        for (name, (counter, samples)) in families {
            let _ = writeln!(
                out,
                "# TYPE {name} {}",
                if counter { "counter" } else { "gauge" }
            );
            for s in samples {
                let _ = writeln!(out, "{name}{s}");
            }
        }
        out
    }

    /// The human table of `mpquic status`.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "mpquic {} {}  tun {} mtu {}  up {:.0}s",
            self.role, self.version, self.tun_name, self.tun_mtu, self.uptime_s
        );
        for t in &self.tunnels {
            let _ = writeln!(
                o,
                "\n{} {}  policy {}  mode {}",
                t.peer,
                t.address.as_deref().unwrap_or("(no address)"),
                t.policy,
                t.mode
            );
            let _ = writeln!(
                o,
                "  {:<10} {:<12} {:>3}/{:<3} {:>15} {:>7} {:>10} {:>12} {:>12} {:>10} {:>10}  drops",
                "PATH", "STATE", "PRI", "W", "RTT ms(s/min)", "LOSS%", "CWND", "TX", "RX", "TX pkts", "RX pkts"
            );
            for p in &t.paths {
                let rtt = match (p.srtt_ms, p.min_rtt_ms) {
                    (Some(s), Some(m)) => format!("{s:.1}/{m:.1}"),
                    _ => "-".into(),
                };
                let drops = nonzero(&p.drops);
                let _ = writeln!(
                    o,
                    "  {:<10} {:<12} {:>3}/{:<3} {:>15} {:>7.1} {:>10} {:>12} {:>12} {:>10} {:>10}  {}",
                    p.name,
                    format!("{} {:.0}s", p.state, p.state_for_s),
                    p.priority,
                    p.weight,
                    rtt,
                    p.probe_loss_pct.max(p.quic_loss_pct),
                    p.cwnd_bytes.map_or("-".into(), human_bytes),
                    human_bytes(p.tx_bytes),
                    human_bytes(p.rx_bytes),
                    p.tx_packets,
                    p.rx_packets,
                    if drops.is_empty() { "-" } else { &drops }
                );
            }
            let td = nonzero(&t.drops);
            if !td.is_empty() {
                let _ = writeln!(o, "  tunnel drops: {td}");
            }
        }
        let gd = nonzero(&self.drops);
        if !gd.is_empty() {
            let _ = writeln!(o, "\ndrops: {gd}");
        }
        let refused = nonzero(&self.refused);
        if !refused.is_empty() {
            let _ = writeln!(o, "refused connections: {refused}");
        }
        if self.tunnels.is_empty() {
            let _ = writeln!(o, "\n(no tunnels)");
        }
        o
    }
}

/// "reason=n ..." for the reasons with a non-zero count.
fn nonzero(drops: &BTreeMap<String, u64>) -> String {
    let parts: Vec<String> = drops
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(r, n)| format!("{r}={n}"))
        .collect();
    parts.join(" ")
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_follow_fields() {
        let mut p = PathStatus {
            name: "wan1".into(),
            state: "up".into(),
            tx_bytes: 10,
            cwnd_bytes: Some(12000),
            ..Default::default()
        };
        p.drops.insert("oversized".into(), 2);
        let r = StatusReport {
            role: "server".into(),
            refused: [("handshake_failed".to_string(), 3)].into(),
            tunnels: vec![TunnelStatus {
                peer: "site\"1".into(),
                paths: vec![p],
                ..Default::default()
            }],
            ..Default::default()
        };
        let m = r.to_prometheus();
        assert!(
            m.contains("# TYPE mpquic_path_tx_bytes_total counter"),
            "{m}"
        );
        assert!(
            m.contains("mpquic_path_tx_bytes_total{tunnel=\"site\\\"1\",path=\"wan1\"} 10"),
            "{m}"
        );
        assert!(m.contains("# TYPE mpquic_path_cwnd_bytes gauge"), "{m}");
        assert!(
            m.contains("mpquic_path_up{tunnel=\"site\\\"1\",path=\"wan1\"} 1"),
            "{m}"
        );
        assert!(m.contains("reason=\"oversized\"} 2"), "{m}");
        assert!(
            m.contains("mpquic_refused_connections_total{reason=\"handshake_failed\"} 3"),
            "{m}"
        );
        assert!(r
            .render()
            .contains("refused connections: handshake_failed=3"));
        assert!(r.render().contains("wan1"));
    }
}
