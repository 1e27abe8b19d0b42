//! Metered paths (`data_budget`): each path's budget fed from its connection's byte counters
//! at every poll; a budget used up makes the path a backup until its period ends (`Role`,
//! `PathSet::candidates`).

use crate::path::budget::{Budget, Meter, Standing, Usage};
use crate::path::reconfig::WallClock;
use std::time::{Duration, Instant};

use crate::PathId;

use super::{LinkStats, Polled, TunnelCore};

/// A metered path: its budget, and the pace it uses it at now (bytes/s over the polls of the
/// last `PACE_WINDOW` or more: the path's throughput figures come a second late, and a
/// download that starts near the end of a budget would overrun it by that second).
#[derive(Debug, Clone, Copy)]
pub(super) struct Metered {
    meter: Meter,
    mark: Option<(Instant, u64)>,
    rate: u64,
}

const PACE_WINDOW: Duration = Duration::from_millis(50);
/// The least a path is taken to have in flight (its queues, the peer hearing of the change).
const IN_FLIGHT_MIN: Duration = Duration::from_millis(20);

impl Metered {
    fn pace(&mut self, now: Instant) {
        let used = self.meter.usage.used;
        match self.mark {
            Some((at, was)) if now.saturating_duration_since(at) >= PACE_WINDOW => {
                let secs = now.saturating_duration_since(at).as_secs_f64();
                self.rate = (used.saturating_sub(was) as f64 / secs) as u64;
                self.mark = Some((now, used));
            }
            Some(_) => {}
            None => self.mark = Some((now, used)),
        }
    }
}

impl TunnelCore {
    /// Meter `path` against `budget` (`None`: not metered), from `usage` (read back from a
    /// state file; `None`: nothing used yet). `now`: wall-clock seconds since the epoch (a
    /// budget resets on calendar days).
    pub fn set_budget(
        &mut self,
        path: PathId,
        budget: Option<Budget>,
        usage: Option<Usage>,
        now: i64,
    ) {
        if self.meters.len() <= path.index() {
            self.meters.resize(path.index() + 1, None);
        }
        let meter = budget.map(|b| {
            // A changed budget (a reload) keeps what the period has used.
            let usage = usage.or(self.meters[path.index()].map(|m| m.meter.usage));
            Meter::new(b, usage, now)
        });
        self.meters[path.index()] = meter.map(|meter| Metered {
            meter,
            mark: None,
            rate: 0,
        });
        let used_up = meter.is_some_and(|m| m.standing() == Standing::Exhausted);
        self.router.set_used_up(path, used_up, None);
    }

    pub fn meter(&self, path: PathId) -> Option<&Meter> {
        self.meters.get(path.index())?.as_ref().map(|m| &m.meter)
    }

    /// The wall clock, read by the shell before each `poll`: for the budgets (their days and
    /// months) and for links that reconfigure on its schedule (`path::reconfig`).
    pub fn set_wall_clock(&mut self, clock: WallClock) {
        self.wall = clock.unix_secs();
        self.router.set_wall_clock(clock);
    }

    /// A new connection carries `path`: its byte counters start from zero.
    pub(super) fn meter_reconnected(&mut self, path: PathId) {
        if let Some(Some(m)) = self.meters.get_mut(path.index()) {
            m.meter.reconnected();
        }
    }

    /// Count what each metered path's connection carried since the last poll; report the
    /// standings that changed (`Polled::budgets`), and make a path whose budget is used up a
    /// backup (and a primary again when its period starts over).
    /// Returns when to look again: soon when a budget is about to run out at the path's
    /// current rate (a poll every probe interval would let 100 Mbit/s overshoot 100 MB by
    /// more than 1%).
    pub(super) fn poll_budgets(
        &mut self,
        now: Instant,
        links: &[Option<LinkStats>],
        out: &mut Polled,
    ) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let ids: Vec<PathId> = self.router.paths().ids().collect();
        for id in ids {
            let Some(Some(metered)) = self.meters.get_mut(id.index()) else {
                continue;
            };
            let link = links.get(id.index()).copied().flatten();
            // What the path will still carry of what it took: two round trips (a controller's
            // window is up to two BDPs; at least `IN_FLIGHT_MIN`) at its pace.
            let rtt = (link.and_then(|l| l.rtt).unwrap_or_default() * 2).max(IN_FLIGHT_MIN);
            let in_flight = (metered.rate as f64 * rtt.as_secs_f64()) as u64;
            let m = &mut metered.meter;
            // No connection: nothing new, but a new period still starts on time.
            let changed = match link.and_then(|l| l.wire_bytes) {
                Some(total) => m.on_wire(total, in_flight, self.wall),
                None => {
                    m.reconnected();
                    m.on_wire(0, 0, self.wall)
                }
            };
            if let Some(standing) = changed {
                self.router
                    .set_used_up(id, standing == Standing::Exhausted, Some(now));
                out.budgets.push((id, standing));
            }
            let left = m.budget.left(&m.usage);
            let used_up = m.standing() == Standing::Exhausted;
            metered.pace(now);
            if !used_up {
                if let Some(at) = check_again(now, left, metered.rate) {
                    next = Some(next.map_or(at, |n| n.min(at)));
                }
            }
        }
        next
    }
}

/// Within this of running out at the current rate, a budget is looked at again at half the
/// time left (never sooner than `CHECK_MIN`).
const CHECK_WITHIN: Duration = Duration::from_secs(1);
const CHECK_MIN: Duration = Duration::from_millis(5);

/// When to look at a budget with `left` bytes at `rate` bytes/s again (`None`: no sooner than
/// the tunnel's other timers).
fn check_again(now: Instant, left: u64, rate: u64) -> Option<Instant> {
    if rate == 0 {
        return None;
    }
    let runs_out = Duration::from_secs_f64(left as f64 / rate as f64);
    (runs_out < CHECK_WITHIN).then(|| now + (runs_out / 2).max(CHECK_MIN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_about_to_run_out_is_looked_at_sooner() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(check_again(now, 100_000_000, 12_500_000), None);
        assert_eq!(check_again(now, 1_250_000, 12_500_000), Some(now + ms(50)));
        assert_eq!(check_again(now, 1_000, 12_500_000), Some(now + ms(5)));
        assert_eq!(check_again(now, 1_000, 0), None);
    }
}
