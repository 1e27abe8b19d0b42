//! The human table of `mpquic status`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::StatusReport;

impl StatusReport {
    /// The human table of `mpquic status`.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "mpquic {} {}  tun {} mtu {}  cc {}  up {:.0}s  rss {:.1} MiB (heap in use {:.1})  fds {}  tasks {}",
            self.role,
            self.version,
            self.tun_name,
            self.tun_mtu,
            self.congestion,
            self.uptime_s,
            self.process.rss_bytes as f64 / (1 << 20) as f64,
            self.process.heap_in_use_bytes as f64 / (1 << 20) as f64,
            self.process.open_fds,
            self.process.tasks
        );
        if !self.tun_queue_packets.is_empty() {
            let per: Vec<String> = self.tun_queue_packets.iter().map(u64::to_string).collect();
            let _ = writeln!(
                o,
                "tun queues {}, packets read per queue: {}",
                per.len(),
                per.join(" / ")
            );
        }
        let _ = writeln!(
            o,
            "tls 1.3, key exchange {}{}; key updates {}",
            match self.tls.post_quantum {
                true => "post-quantum (X25519MLKEM768 first)",
                false => "classic (tls_post_quantum: false)",
            },
            match self.tls.key_exchanges.is_empty() {
                true => String::new(),
                false => format!("; handshakes: {}", nonzero(&self.tls.key_exchanges)),
            },
            self.tls.key_updates
        );
        let now = unix_now() as i64;
        for c in &self.tls.certificates {
            let days = c.days_left(now);
            let flag = match days {
                d if d < 0 => "  EXPIRED",
                d if d < crate::EXPIRY_WARNING_DAYS => "  EXPIRES SOON",
                _ => "",
            };
            let _ = writeln!(
                o,
                "  {} {} serial {}: {} days left{flag}",
                c.role, c.name, c.serial, days
            );
        }
        if let Some(r) = &self.last_reload {
            let _ = writeln!(
                o,
                "last reload {} s ago: {} {}",
                unix_now().saturating_sub(r.at_unix),
                match r.ok {
                    true => "applied:",
                    false => "REFUSED (the running configuration stays):",
                },
                r.message
            );
        }
        for t in &self.tunnels {
            let lans = match t.lans.is_empty() {
                true => String::new(),
                false => format!("  lan {}", t.lans.join(",")),
            };
            let address6 = match &t.address6 {
                Some(a) => format!(" {a}"),
                None => String::new(),
            };
            let _ = writeln!(
                o,
                "\n{} {}{address6}{lans}  policy {}  mode {}{}{}{}{}",
                t.peer,
                t.address.as_deref().unwrap_or("(no address)"),
                t.policy,
                t.mode,
                match t.protocol.as_str() {
                    "" | "native" => String::new(),
                    p => format!("  over {p}"),
                },
                match t.congestion.as_str() {
                    c if c.is_empty() || c == self.congestion => String::new(),
                    c => format!("  cc {c}"),
                },
                match t.fec.as_str() {
                    "" | "off" => String::new(),
                    f => format!("  fec {f}"),
                },
                probing(t)
            );
            let _ = writeln!(
                o,
                "  {:<10} {:<12} {:>3}/{:<3} {:>15} {:>7} {:>10} {:>20} {:>12} {:>12} {:>10} {:>10}  drops",
                "PATH", "STATE", "PRI", "W", "RTT ms(s/min)", "LOSS%", "CWND", "Mbit/s tx/rx (share)", "TX", "RX", "TX pkts", "RX pkts"
            );
            let total_tx: f64 = t.paths.iter().map(|p| p.tx_mbit).sum();
            for p in &t.paths {
                let rtt = match (p.srtt_ms, p.min_rtt_ms) {
                    (Some(s), Some(m)) => format!("{s:.1}/{m:.1}"),
                    _ => "-".into(),
                };
                let drops = nonzero(&p.drops);
                // The path's part of what the tunnel sends now.
                let share = match total_tx > 0.0 {
                    true => format!(" ({:.0}%)", p.tx_mbit * 100.0 / total_tx),
                    false => String::new(),
                };
                let _ = writeln!(
                    o,
                    "  {:<10} {:<12} {:>3}/{:<3} {:>15} {:>7.1} {:>10} {:>20} {:>12} {:>12} {:>10} {:>10}  {}",
                    p.name,
                    format!("{} {:.0}s", p.state, p.state_for_s),
                    p.priority,
                    p.weight,
                    rtt,
                    p.probe_loss_pct.max(p.quic_loss_pct),
                    p.cwnd_bytes.map_or("-".into(), human_bytes),
                    format!("{:.1}/{:.1}{share}", p.tx_mbit, p.rx_mbit),
                    human_bytes(p.tx_bytes),
                    human_bytes(p.rx_bytes),
                    p.tx_packets,
                    p.rx_packets,
                    if drops.is_empty() { "-" } else { &drops }
                );
            }
            for p in &t.paths {
                if let Some(limits) = p.limits_summary() {
                    let _ = writeln!(o, "  limits {:<3} {limits}", p.name);
                }
                if let Some(carry) = p.carry_summary() {
                    let _ = writeln!(o, "  carry {:<4} {carry}", p.name);
                }
                if let Some(fec) = p.fec_summary() {
                    let _ = writeln!(o, "  fec {:<6} {fec}", p.name);
                }
                if let Some(mtu) = p.mtu_summary() {
                    let _ = writeln!(o, "  mtu {:<6} {mtu}", p.name);
                }
                if let Some(r) = p.reorder_summary() {
                    let _ = writeln!(o, "  reorder {:<4} {r}", p.name);
                }
                if let Some(pipes) = p.pipes_summary() {
                    let _ = writeln!(o, "  pipes {:<4} {pipes}", p.name);
                }
                if let Some(d) = p.playout_ms.filter(|d| *d > 0.0) {
                    let _ = writeln!(
                        o,
                        "  playout {:<6} TCP held to a steady {d:.0} ms (head-of-line waits on a lossy path; bulk flows for 20 s after)",
                        p.name
                    );
                }
            }
            for c in &t.classes {
                let _ = writeln!(
                    o,
                    "  class {} ({} packets{})  policy {}  mode {}{}{}",
                    c.name,
                    c.classified_packets,
                    match c.unmatched_packets {
                        0 => String::new(),
                        n => format!(", {n} unmatched"),
                    },
                    c.policy,
                    c.mode,
                    if c.fec { "  fec" } else { "" },
                    match nonzero(&c.drops) {
                        d if d.is_empty() => String::new(),
                        d => format!("  drops: {d}"),
                    }
                );
            }
            let reorder = nonzero(&t.reorder);
            if !reorder.is_empty() {
                let _ = writeln!(o, "  reorder: {reorder}");
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
        if let Some(l) = &self.lane {
            let subflows: Vec<String> =
                l.subflows.iter().map(|(p, n)| format!("{p} {n}")).collect();
            let failed = nonzero(&l.failed);
            let _ = writeln!(
                o,
                "MPTCP lane: {} open, {} taken ({} relayed{}), {} up / {} down{}{}",
                l.active,
                l.connections,
                l.connected,
                match l.ahead + l.ready {
                    0 => String::new(),
                    _ => format!("; {} set up ahead, {} ready", l.ahead, l.ready),
                },
                human_bytes(l.bytes_up),
                human_bytes(l.bytes_down),
                match subflows.is_empty() {
                    true => String::new(),
                    false => format!("; subflows {}", subflows.join(", ")),
                },
                match failed.is_empty() {
                    true => String::new(),
                    false => format!("; not relayed: {failed}"),
                }
            );
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
/// "  probes every N ms" when the paths agree on an interval (a quiet tunnel probes slower).
fn probing(t: &crate::TunnelStatus) -> String {
    let mut intervals = t.paths.iter().filter_map(|p| p.probe_interval_ms);
    match intervals.next() {
        Some(first) if intervals.all(|i| i == first) => format!("  probes every {first:.0} ms"),
        _ => String::new(),
    }
}

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

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use crate::{StatusReport, TunnelStatus};

    /// A server's sessions run the configured controller or, with classes, its yielding form:
    /// the tunnel's line names it only where it differs from the instance's.
    #[test]
    fn a_tunnel_whose_controller_differs_says_so() {
        let tunnel = |peer: &str, cc: &str| TunnelStatus {
            peer: peer.into(),
            congestion: cc.into(),
            ..Default::default()
        };
        let report = StatusReport {
            role: "server".into(),
            congestion: "bbr".into(),
            tunnels: vec![tunnel("plain", "bbr"), tunnel("classes", "bbr (yielding)")],
            ..Default::default()
        };
        let table = report.render();
        let line = |peer: &str| {
            let start = format!("{peer} ");
            table
                .lines()
                .find(|l| l.starts_with(&start))
                .unwrap()
                .to_string()
        };
        assert!(!line("plain").contains("cc "), "{table}");
        assert!(line("classes").contains("  cc bbr (yielding)"), "{table}");
    }
}
