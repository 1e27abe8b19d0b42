//! A path's limits for metered and backup links (docs/CONFIG.md "Metered links"): `rate_limit`
//! (Mbit/s each way), `role` (primary, backup, overflow) and `data_budget` (bytes per day or
//! month, persisted in `state_dir`).

use mpquic_core::path::budget::{Budget, Period};
use mpquic_core::Role as PathRole;
use serde::Deserialize;

use super::checker::Checker;
use std::path::PathBuf;

use super::{PathKind, RawConfig, RawPath};

/// `data_budget:` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBudget {
    /// Bytes: a number, or text with a unit (`30GB`, `500 MB`, `2GiB`).
    limit: Size,
    /// `month` (default) or `day`.
    period: Option<String>,
    /// A monthly budget's first day (1-31, default 1; a shorter month starts it on its last).
    reset_day: Option<u32>,
    /// Warn past this share (%; default 80).
    warn_at: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

/// A path's `rate_limit`, `role` and `data_budget`, checked.
pub(super) struct Limits {
    pub rate_limit: Option<u64>,
    pub role: PathRole,
    pub data_budget: Option<Budget>,
}

/// Where the budgets are kept when `state_dir` is not set.
const DEFAULT_STATE_DIR: &str = "/var/lib/mpquic";

/// `state_dir`: an absolute directory (the service's working directory is not its home).
pub(super) fn state_dir(raw: &RawConfig, c: &mut Checker) -> PathBuf {
    let dir = PathBuf::from(raw.state_dir.as_deref().unwrap_or(DEFAULT_STATE_DIR));
    if !dir.is_absolute() {
        c.at(
            "state_dir",
            format!("`state_dir: {}`: an absolute path", dir.display()),
            Some(format!("e.g. state_dir: {DEFAULT_STATE_DIR}")),
        );
    }
    dir
}

pub(super) fn path_limits(
    p: &RawPath,
    at: &dyn Fn(&str) -> String,
    pipes: u8,
    transport: PathKind,
    c: &mut Checker,
) -> Limits {
    let rate_limit = match p.rate_limit {
        None => None,
        Some(m) if m.is_finite() && (0.1..=100_000.0).contains(&m) => {
            Some((m * 1e6).round() as u64)
        }
        Some(m) => {
            c.at(
                &at("rate_limit"),
                format!("`rate_limit: {m}`: Mbit/s from 0.1 to 100000"),
                Some("e.g. rate_limit: 5 for 5 Mbit/s each way; leave it out for no cap".into()),
            );
            None
        }
    };
    let role = match p.role.as_deref() {
        None => PathRole::Primary,
        Some(r) => PathRole::parse(r).unwrap_or_else(|| {
            c.unknown_value(&at("role"), "role", r, &["primary", "backup", "overflow"]);
            PathRole::Primary
        }),
    };
    let data_budget = p.data_budget.as_ref().and_then(|b| budget(b, at, c));
    // The pipes' and stripe sockets' senders pace each on its own; the stripe sockets' bytes
    // are not counted (the pipes' are summed).
    for (key, set, pipes_too) in [
        ("rate_limit", rate_limit.is_some(), true),
        ("data_budget", data_budget.is_some(), false),
    ] {
        if set && ((pipes_too && pipes > 1) || transport == PathKind::Stripe) {
            c.at(
                &at(key),
                format!(
                    "path `{}`: `{key}` is not applied to {} paths",
                    p.name,
                    if pipes_too {
                        "pipes or stripe"
                    } else {
                        "stripe"
                    }
                ),
                Some(format!(
                    "remove `pipes` / `transport: stripe` from this path, or its `{key}`"
                )),
            );
        }
    }
    Limits {
        rate_limit,
        role,
        data_budget,
    }
}

fn budget(b: &RawBudget, at: &dyn Fn(&str) -> String, c: &mut Checker) -> Option<Budget> {
    let limit = match &b.limit {
        Size::Bytes(n) => Some(*n),
        Size::Text(t) => parse_size(t),
    }
    .filter(|&n| n >= 1_000_000);
    if limit.is_none() {
        c.at(
            &at("data_budget.limit"),
            "`data_budget.limit`: bytes, at least 1 MB".into(),
            Some("e.g. limit: 30GB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)".into()),
        );
    }
    let reset_day = b.reset_day.unwrap_or(1);
    if !(1..=31).contains(&reset_day) {
        c.at(
            &at("data_budget.reset_day"),
            format!("`reset_day: {reset_day}`: a day of the month, 1 to 31"),
            Some("a month shorter than that starts the budget on its last day".into()),
        );
    }
    let period = match b.period.as_deref() {
        None | Some("month") => Period::Month {
            reset_day: reset_day.clamp(1, 31) as u8,
        },
        Some("day") => {
            if b.reset_day.is_some() {
                c.at(
                    &at("data_budget.reset_day"),
                    "`reset_day` is for a monthly budget; a daily one starts at 00:00 UTC".into(),
                    None,
                );
            }
            Period::Day
        }
        Some(other) => {
            c.unknown_value(
                &at("data_budget.period"),
                "period",
                other,
                &["month", "day"],
            );
            Period::Day
        }
    };
    let warn_at = b.warn_at.unwrap_or(80.0);
    if !(warn_at.is_finite() && (1.0..=100.0).contains(&warn_at)) {
        c.at(
            &at("data_budget.warn_at"),
            format!("`warn_at: {warn_at}`: a share of the limit in %, 1 to 100"),
            None,
        );
    }
    Some(Budget {
        limit: limit?,
        period,
        warn_at: warn_at / 100.0,
    })
}

/// `30GB`, `500 MB`, `1.5TB`, `2GiB`, `1000000`: bytes (SI units are powers of ten, as
/// carriers bill; the `i` ones powers of two).
fn parse_size(t: &str) -> Option<u64> {
    let t = t.trim();
    let split = t
        .find(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().ok()?;
    let scale: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    let bytes = n * scale;
    (bytes.is_finite() && bytes < 1e18).then_some(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_take_si_and_binary_units() {
        assert_eq!(parse_size("30GB"), Some(30_000_000_000));
        assert_eq!(parse_size(" 500 MB "), Some(500_000_000));
        assert_eq!(parse_size("1.5TB"), Some(1_500_000_000_000));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("1000000"), Some(1_000_000));
        for bad in ["", "GB", "5 gigs", "1.2.3MB", "-5MB"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }
}
