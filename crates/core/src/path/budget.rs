//! A metered path's data budget (`data_budget`): so many bytes a day, or a month from a reset
//! day, both directions counted; what is left, when it runs out at the pace so far, and where
//! the path stands (within it, past its warning share, used up: the path then carries only as a
//! backup).
//!
//! Sans-IO, with one difference from the rest of the core: a budget resets on calendar days,
//! which the monotonic clock does not know, so time comes in as wall-clock seconds since the
//! UNIX epoch, in UTC. The shell keeps `Usage` across restarts in a state file
//! (`Usage::to_line`, `Usage::parse`).

/// Seconds in a day.
const DAY: i64 = 86_400;

/// How often the budget starts again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// Every day at 00:00 UTC.
    Day,
    /// Every month on `reset_day` (1-31) at 00:00 UTC; a month shorter than that resets on its
    /// last day.
    Month { reset_day: u8 },
}

/// The budget of one path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Bytes per period, both directions together.
    pub limit: u64,
    pub period: Period,
    /// The share of `limit` past which the path warns (0.8: at 80%).
    pub warn_at: f64,
}

/// What a path has used in its current period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// When the period began (seconds since the epoch, UTC).
    pub since: i64,
    pub used: u64,
}

/// Where a path stands against its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    Within,
    /// Past `warn_at`.
    Warn,
    /// Used up: the path carries only as a backup until the period ends.
    Exhausted,
}

impl Budget {
    /// A new period's usage, for a path first metered at `now`.
    pub fn start(&self, now: i64) -> Usage {
        Usage {
            since: self.period_start(now),
            used: 0,
        }
    }

    /// When the period that holds `now` began.
    pub fn period_start(&self, now: i64) -> i64 {
        match self.period {
            Period::Day => now - now.rem_euclid(DAY),
            Period::Month { reset_day } => {
                let (y, m, d) = civil(now.div_euclid(DAY));
                let (y, m) = match d >= reset_on(y, m, reset_day) {
                    true => (y, m),
                    false => previous(y, m),
                };
                days_from_civil(y, m, reset_on(y, m, reset_day)) * DAY
            }
        }
    }

    /// When the period that began at `start` ends (the next one begins).
    pub fn period_end(&self, start: i64) -> i64 {
        match self.period {
            Period::Day => start + DAY,
            Period::Month { reset_day } => {
                let (y, m, _) = civil(start.div_euclid(DAY));
                let (y, m) = next(y, m);
                days_from_civil(y, m, reset_on(y, m, reset_day)) * DAY
            }
        }
    }

    /// `usage` at `now`: as it is, or afresh once its period has ended (a restart after the
    /// reset finds last period's count in the state file). A clock set back keeps the count:
    /// a budget is never forgotten for a wrong clock.
    pub fn current(&self, usage: Usage, now: i64) -> Usage {
        match now >= self.period_end(usage.since) {
            true => self.start(now),
            false => usage,
        }
    }

    /// Count `bytes` sent or received at `now`.
    pub fn add(&self, usage: &mut Usage, bytes: u64, now: i64) {
        *usage = self.current(*usage, now);
        usage.used = usage.used.saturating_add(bytes);
    }

    pub fn standing(&self, usage: &Usage) -> Standing {
        if usage.used >= self.limit {
            Standing::Exhausted
        } else if usage.used as f64 >= self.warn_at * self.limit as f64 {
            Standing::Warn
        } else {
            Standing::Within
        }
    }

    /// Bytes left in the period.
    pub fn left(&self, usage: &Usage) -> u64 {
        self.limit.saturating_sub(usage.used)
    }

    /// When the budget runs out at the pace the period has had so far (its use over the time
    /// since it began); `None` when that pace does not use it up before the period ends.
    pub fn runs_out(&self, usage: &Usage, now: i64) -> Option<i64> {
        if usage.used >= self.limit {
            return Some(now);
        }
        let elapsed = now - usage.since;
        if usage.used == 0 || elapsed <= 0 {
            return None;
        }
        let rate = usage.used as f64 / elapsed as f64;
        let at = now + (self.left(usage) as f64 / rate).ceil() as i64;
        (at < self.period_end(usage.since)).then_some(at)
    }
}

impl Usage {
    /// The state file's line for it.
    pub fn to_line(&self) -> String {
        format!("mpquic-budget 1 {} {}", self.since, self.used)
    }

    /// A line `to_line` wrote; `None` for anything else (the shell then starts afresh, and
    /// says so).
    pub fn parse(line: &str) -> Option<Usage> {
        let mut f = line.split_ascii_whitespace();
        let (Some("mpquic-budget"), Some("1"), Some(since), Some(used), None) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return None;
        };
        Some(Usage {
            since: since.parse().ok()?,
            used: used.parse().ok()?,
        })
    }
}

/// A path's budget as the tunnel keeps it: what it has used, fed from its connection's byte
/// counters (`on_wire`), which start from zero with each new connection (`reconnected`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Meter {
    pub budget: Budget,
    pub usage: Usage,
    /// The current connection's bytes already counted.
    seen: u64,
    standing: Standing,
}

impl Meter {
    /// Metering from `now`, with what a state file said was used (`None`: nothing yet).
    pub fn new(budget: Budget, usage: Option<Usage>, now: i64) -> Meter {
        let usage = usage.map_or_else(|| budget.start(now), |u| budget.current(u, now));
        Meter {
            budget,
            usage,
            seen: 0,
            standing: budget.standing(&usage),
        }
    }

    /// A new connection carries the path: its counters start from zero.
    pub fn reconnected(&mut self) {
        self.seen = 0;
    }

    /// The connection's bytes so far, both directions, at `now`: what is new is counted.
    /// `in_flight`: what the path will still carry of what it has taken already (at its pace,
    /// for about a round trip): the budget is used up when that would use it up, so the path
    /// stops taking traffic in time to end at its limit, not past it. Used up stays used up
    /// until the period ends. Returns the new standing when it changed (a warning crossed, used
    /// up, a new period).
    pub fn on_wire(&mut self, total: u64, in_flight: u64, now: i64) -> Option<Standing> {
        // Counters that went back belong to a connection `reconnected` was not told of.
        let new = total.checked_sub(self.seen).unwrap_or(total);
        self.seen = total;
        let period = self.usage.since;
        self.budget.add(&mut self.usage, new, now);
        let latched = self.standing == Standing::Exhausted && self.usage.since == period;
        let standing = match self.usage.used.saturating_add(in_flight) >= self.budget.limit {
            true => Standing::Exhausted,
            false if latched => Standing::Exhausted,
            false => self.budget.standing(&self.usage),
        };
        (standing != self.standing).then(|| {
            self.standing = standing;
            standing
        })
    }

    pub fn standing(&self) -> Standing {
        self.standing
    }
}

/// The UTC date of `secs` since the epoch, as `YYYY-MM-DD`.
pub fn iso_date(secs: i64) -> String {
    let (y, m, d) = civil(secs.div_euclid(DAY));
    format!("{y:04}-{m:02}-{d:02}")
}

/// The day of month `y`-`m` a budget with `reset_day` resets on.
fn reset_on(y: i64, m: u32, reset_day: u8) -> u32 {
    u32::from(reset_day.clamp(1, 31)).min(days_in_month(y, m))
}

fn previous(y: i64, m: u32) -> (i64, u32) {
    match m {
        1 => (y - 1, 12),
        _ => (y, m - 1),
    }
}

fn next(y: i64, m: u32) -> (i64, u32) {
    match m {
        12 => (y + 1, 1),
        _ => (y, m + 1),
    }
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        4 | 6 | 9 | 11 => 30,
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a date in the proleptic Gregorian calendar (H. Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let (m, d) = (i64::from(m), i64::from(d));
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day since 1970-01-01 (`civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(y: i64, m: u32, d: u32, hour: i64) -> i64 {
        days_from_civil(y, m, d) * DAY + hour * 3600
    }

    fn monthly(reset_day: u8) -> Budget {
        Budget {
            limit: 100_000_000,
            period: Period::Month { reset_day },
            warn_at: 0.8,
        }
    }

    #[test]
    fn the_calendar_round_trips() {
        for days in (-800_000..800_000).step_by(97) {
            let (y, m, d) = civil(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(iso_date(at(2026, 12, 1, 23)), "2026-12-01");
        assert_eq!(civil(days_from_civil(2028, 2, 29)), (2028, 2, 29));
    }

    #[test]
    fn a_month_runs_from_its_reset_day_and_a_short_month_resets_on_its_last() {
        let b = monthly(15);
        assert_eq!(b.period_start(at(2026, 11, 28, 13)), at(2026, 11, 15, 0));
        assert_eq!(b.period_start(at(2026, 11, 15, 0)), at(2026, 11, 15, 0));
        assert_eq!(b.period_start(at(2026, 11, 14, 23)), at(2026, 10, 15, 0));
        assert_eq!(b.period_start(at(2027, 1, 3, 1)), at(2026, 12, 15, 0));
        assert_eq!(b.period_end(at(2026, 12, 15, 0)), at(2027, 1, 15, 0));
        let b = monthly(31);
        assert_eq!(b.period_start(at(2027, 2, 28, 5)), at(2027, 2, 28, 0));
        assert_eq!(b.period_start(at(2027, 3, 30, 5)), at(2027, 2, 28, 0));
        assert_eq!(b.period_end(at(2027, 2, 28, 0)), at(2027, 3, 31, 0));
        assert_eq!(b.period_start(at(2028, 2, 29, 5)), at(2028, 2, 29, 0));
        let daily = Budget {
            period: Period::Day,
            ..monthly(1)
        };
        assert_eq!(
            daily.period_start(at(2026, 11, 28, 13)),
            at(2026, 11, 28, 0)
        );
        assert_eq!(daily.period_end(at(2026, 11, 28, 0)), at(2026, 11, 29, 0));
    }

    #[test]
    fn usage_counts_warns_runs_out_and_starts_again_with_the_period() {
        let b = monthly(1);
        let now = at(2026, 11, 1, 0);
        let mut u = b.start(now);
        b.add(&mut u, 50_000_000, at(2026, 11, 6, 0));
        assert_eq!(b.standing(&u), Standing::Within);
        assert_eq!(b.left(&u), 50_000_000);
        // 50 MB in 5 days: the other 50 go in the next 5.
        assert_eq!(
            b.runs_out(&u, at(2026, 11, 6, 0)),
            Some(at(2026, 11, 11, 0))
        );
        b.add(&mut u, 30_000_000, at(2026, 11, 7, 0));
        assert_eq!(b.standing(&u), Standing::Warn);
        b.add(&mut u, 20_000_000, at(2026, 11, 8, 0));
        assert_eq!(b.standing(&u), Standing::Exhausted);
        assert_eq!(b.left(&u), 0);
        // The next period starts afresh, also for a count read back after a restart.
        b.add(&mut u, 1, at(2026, 12, 1, 0));
        assert_eq!(
            u,
            Usage {
                since: at(2026, 12, 1, 0),
                used: 1
            }
        );
        let old = Usage {
            since: at(2026, 10, 1, 0),
            used: 99,
        };
        assert_eq!(
            b.current(old, at(2026, 11, 2, 0)),
            b.start(at(2026, 11, 2, 0))
        );
        assert_eq!(
            b.current(u, at(2026, 11, 30, 0)),
            u,
            "a clock set back keeps the count"
        );
        // A slow pace does not run out within the period.
        let slow = Usage {
            since: at(2026, 11, 1, 0),
            used: 1_000_000,
        };
        assert_eq!(b.runs_out(&slow, at(2026, 11, 10, 0)), None);
    }

    #[test]
    fn a_meter_counts_each_connection_from_zero_and_says_when_its_standing_changes() {
        let b = monthly(1);
        let t = at(2026, 11, 20, 0);
        let mut m = Meter::new(
            b,
            Some(Usage {
                since: at(2026, 11, 1, 0),
                used: 70_000_000,
            }),
            t,
        );
        assert_eq!(m.standing(), Standing::Within);
        assert_eq!(m.on_wire(5_000_000, 0, t), None);
        assert_eq!(m.on_wire(15_000_000, 0, t), Some(Standing::Warn));
        assert_eq!(m.usage.used, 85_000_000);
        // A new connection: its counters start again.
        m.reconnected();
        assert_eq!(m.on_wire(10_000_000, 0, t), None);
        // What it has in flight would use up the rest: used up now, and it stays so when the
        // path goes quiet.
        assert_eq!(
            m.on_wire(14_000_000, 1_500_000, t),
            Some(Standing::Exhausted)
        );
        assert_eq!(m.usage.used, 99_000_000);
        assert_eq!(m.on_wire(15_000_000, 0, t), None);
        assert_eq!(m.usage.used, 100_000_000);
        // Counters that went back without a word: a connection the meter was not told of.
        assert_eq!(m.on_wire(1_000, 0, t), None);
        assert_eq!(m.usage.used, 100_001_000);
        // The next period: within again, with no traffic at all.
        assert_eq!(
            m.on_wire(1_000, 0, at(2026, 12, 1, 0)),
            Some(Standing::Within)
        );
        assert_eq!(m.usage.used, 0);
        // Last month's count from a state file starts afresh.
        let stale = Meter::new(b, Some(m.usage), at(2027, 1, 2, 0));
        assert_eq!(stale.usage, b.start(at(2027, 1, 2, 0)));
    }

    #[test]
    fn the_state_line_round_trips_and_anything_else_is_refused() {
        let u = Usage {
            since: 1_795_000_000,
            used: 123_456_789,
        };
        assert_eq!(Usage::parse(&u.to_line()), Some(u));
        for bad in [
            "",
            "mpquic-budget 2 1 2",
            "mpquic-budget 1 x 2",
            "mpquic-budget 1 1 2 3",
            "junk",
        ] {
            assert_eq!(Usage::parse(bad), None, "{bad}");
        }
    }
}
