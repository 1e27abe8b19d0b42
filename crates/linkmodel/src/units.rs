//! Durations and rates as the link specs write them (`20ms`, `1.5s`, `100mbit`).

use std::time::Duration;

pub(crate) fn split_num(v: &str) -> (f64, &str) {
    let end = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    (v[..end].parse().unwrap_or(f64::NAN), v[end..].trim())
}

pub fn parse_duration(v: &str) -> Result<Duration, String> {
    let (n, unit) = split_num(v);
    let secs = match unit {
        "" if n == 0.0 => 0.0,
        "s" => n,
        "ms" => n / 1e3,
        "us" => n / 1e6,
        _ => f64::NAN,
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{v}` is not a duration (e.g. 20ms, 1.5s, 500us)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

pub fn parse_rate(v: &str) -> Result<u64, String> {
    let (n, unit) = split_num(v);
    let mult = match unit.to_ascii_lowercase().as_str() {
        "bit" | "bps" => 1.0,
        "kbit" | "kbps" | "k" => 1e3,
        "mbit" | "mbps" | "m" => 1e6,
        "gbit" | "gbps" | "g" => 1e9,
        _ => f64::NAN,
    };
    let bps = n * mult;
    if !bps.is_finite() || bps < 1000.0 {
        return Err(format!(
            "`{v}` is not a rate (e.g. 100mbit, 1.5gbit, 800kbit; at least 1kbit)"
        ));
    }
    Ok(bps as u64)
}

/// A duration written as milliseconds (status and results JSON).
pub(crate) fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}
