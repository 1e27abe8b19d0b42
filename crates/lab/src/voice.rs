//! A voice call's packets for scenarios (`kind: voice`): RTP-like, `pps` packets of `len` bytes
//! a second each way. `mpquic-lab voice call HOST PORT` runs on the LAN side and
//! `mpquic-lab voice answer PORT` on the far side; the caller sends first and the answerer
//! sends back to wherever the call comes from (through a NAT or a tunnel, as a softphone's media
//! does). Each side prints what it sent and, for every packet it received, its number, its
//! send time and its arrival time (wall clock: both ends are on this machine).
//!
//! `judge` turns one direction into the figures a call is judged by: a packet later than the
//! one-way budget (ITU-T G.114's 150 ms) is as good as lost to a jitter buffer, so the share
//! lost or late, per call and in its worst second.

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::{json, Value};

/// The budget for one way (ITU-T G.114: above 150 ms a conversation suffers).
pub const ONE_WAY_BUDGET_MS: f64 = 150.0;
/// Bytes each packet starts with: its number and its send time (ns since the epoch).
const HEADER: usize = 16;

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One side of a call: sends `pps` packets of `len` bytes a second to `peer` (once known) for
/// `seconds`, and keeps what arrives until `seconds` plus a second (the last packets in
/// flight). Prints `{"sent": N, "received": [[seq, sent_ns, received_ns], ...]}`.
fn exchange(
    sock: UdpSocket,
    mut peer: Option<SocketAddr>,
    pps: f64,
    len: usize,
    seconds: f64,
) -> Result<Value> {
    let gap = Duration::from_secs_f64(1.0 / pps);
    let len = len.max(HEADER);
    let mut buf = vec![0u8; 65_536];
    // Each packet: its number and send time, then zeros (one buffer, rewritten per packet).
    let mut pkt = vec![0u8; len];
    let mut received = Vec::new();
    let mut sent = 0u64;
    // The caller starts at once; the answerer at the first packet of the call.
    let mut started = peer.map(|_| Instant::now());
    let deadline = Instant::now() + Duration::from_secs_f64(seconds + 10.0);
    loop {
        let now = Instant::now();
        let sending_until = started.map(|s| s + Duration::from_secs_f64(seconds));
        if sending_until.is_some_and(|u| now >= u + Duration::from_secs(1)) || now >= deadline {
            break;
        }
        if let (Some(to), Some(s)) = (peer, started) {
            let due = s + gap * sent as u32;
            if now >= due && sending_until.is_some_and(|u| now < u) {
                pkt[..8].copy_from_slice(&sent.to_be_bytes());
                pkt[8..16].copy_from_slice(&wall_ns().to_be_bytes());
                // A send refused (no route for a moment) is a packet lost, as on a phone.
                let _ = sock.send_to(&pkt, to);
                sent += 1;
                continue;
            }
        }
        let wait = match (started, peer) {
            (Some(s), Some(_)) => (s + gap * sent as u32).saturating_duration_since(now),
            _ => Duration::from_millis(50),
        };
        sock.set_read_timeout(Some(wait.max(Duration::from_micros(200))))?;
        match sock.recv_from(&mut buf) {
            Ok((n, from)) if n >= HEADER => {
                let at = wall_ns();
                let seq = u64::from_be_bytes(buf[..8].try_into().expect("8 bytes"));
                let sent_ns = u64::from_be_bytes(buf[8..16].try_into().expect("8 bytes"));
                received.push([seq, sent_ns, at]);
                // The answerer talks back to where the call comes from, also after a NAT
                // gave it a new port.
                peer = Some(from);
                started.get_or_insert(Instant::now());
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e).context("receiving"),
        }
    }
    Ok(json!({"sent": sent, "received": received}))
}

/// The caller: sends to `host:port` from its first moment.
pub fn call(host: &str, port: u16, pps: f64, len: usize, seconds: f64) -> Result<Value> {
    let to: SocketAddr = format!("{host}:{port}")
        .parse()
        .context("the peer's address")?;
    let sock = UdpSocket::bind("0.0.0.0:0")?;
    exchange(sock, Some(to), pps, len, seconds)
}

/// The answerer: waits for the call on `port`, then talks back from the first packet.
pub fn answer(port: u16, pps: f64, len: usize, seconds: f64) -> Result<Value> {
    let sock = UdpSocket::bind(("0.0.0.0", port)).with_context(|| format!("port {port}"))?;
    exchange(sock, None, pps, len, seconds)
}

/// `mpquic-lab voice ROLE AT`: `call HOST:PORT` or `answer PORT`.
pub fn run(role: &str, at: &str, pps: f64, len: usize, seconds: f64) -> Result<Value> {
    let valid =
        (0.0..=10_000.0).contains(&pps) && pps > 0.0 && seconds.is_finite() && seconds > 0.0;
    if !valid {
        anyhow::bail!("--pps 0..10000 and --seconds above 0");
    }
    match role {
        "call" => {
            let (host, port) = at.rsplit_once(':').context("call HOST:PORT")?;
            call(
                host,
                port.parse().context("call HOST:PORT: the port")?,
                pps,
                len,
                seconds,
            )
        }
        "answer" => answer(
            at.parse().context("answer PORT: the port")?,
            pps,
            len,
            seconds,
        ),
        other => anyhow::bail!("voice {other}: call or answer"),
    }
}

/// Percentile `q` of sorted `xs` (not empty).
pub(crate) fn pct(xs: &[f64], q: f64) -> f64 {
    xs[((xs.len() as f64 * q) as usize).min(xs.len() - 1)]
}

/// One direction of a call: `sent` packets numbered from 0 at `pps`, of which `received`
/// ([seq, sent_ns, received_ns]) arrived. Lost, late (beyond `ONE_WAY_BUDGET_MS`), their share
/// ("bad"), the one-way delay's median and p99, and per second of the call (by send time) the
/// bad share, with the worst second.
pub fn judge(sent: u64, received: &[[u64; 3]], pps: f64) -> Value {
    let mut first = std::collections::HashMap::new();
    for r in received.iter().filter(|r| r[0] < sent) {
        first.entry(r[0]).or_insert(*r);
    }
    let seconds = ((sent as f64 / pps).ceil() as usize).max(1);
    let mut bad_per_second = vec![0u64; seconds];
    let mut sent_per_second = vec![0u64; seconds];
    let mut delays = Vec::new();
    let mut late = 0;
    for seq in 0..sent {
        let second = ((seq as f64 / pps) as usize).min(seconds - 1);
        sent_per_second[second] += 1;
        match first.get(&seq) {
            Some(r) => {
                let ms = r[2].saturating_sub(r[1]) as f64 / 1e6;
                delays.push(ms);
                if ms > ONE_WAY_BUDGET_MS {
                    late += 1;
                    bad_per_second[second] += 1;
                }
            }
            None => bad_per_second[second] += 1,
        }
    }
    let lost = sent - first.len() as u64;
    delays.sort_by(f64::total_cmp);
    let share: Vec<f64> = bad_per_second
        .iter()
        .zip(&sent_per_second)
        .map(|(b, n)| {
            if *n == 0 {
                0.0
            } else {
                *b as f64 / *n as f64 * 100.0
            }
        })
        .collect();
    let worst = share.iter().copied().fold(0.0, f64::max);
    json!({
        "sent": sent,
        "lost": lost,
        "late": late,
        "bad_percent": if sent == 0 { 0.0 } else { (lost + late) as f64 / sent as f64 * 100.0 },
        "one_way_ms": if delays.is_empty() { json!(null) } else {
            json!({"median": pct(&delays, 0.5), "p99": pct(&delays, 0.99), "max": delays[delays.len() - 1]})
        },
        "worst_second_bad_percent": worst,
        "bad_percent_per_second": share,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_is_as_bad_as_lost_and_the_worst_second_shows() {
        let ms = 1_000_000u64;
        // 100 packets at 50/s: 2 s. Lost: 3 and 60; 10..15 late (200 ms); the rest 20 ms.
        let mut got = Vec::new();
        for seq in 0..100u64 {
            if seq == 3 || seq == 60 {
                continue;
            }
            let sent = seq * 20 * ms;
            let delay = if (10..15).contains(&seq) { 200 } else { 20 };
            got.push([seq, sent, sent + delay * ms]);
        }
        got.push([20, 400 * ms, 400 * ms + 5 * ms]); // a duplicate: the first copy counts
        let v = judge(100, &got, 50.0);
        assert_eq!(v["lost"], 2);
        assert_eq!(v["late"], 5);
        assert!((v["bad_percent"].as_f64().unwrap() - 7.0).abs() < 1e-9);
        assert!((v["worst_second_bad_percent"].as_f64().unwrap() - 12.0).abs() < 1e-9);
        assert_eq!(v["one_way_ms"]["median"], 20.0);
        assert_eq!(v["bad_percent_per_second"].as_array().unwrap().len(), 2);
    }
}
