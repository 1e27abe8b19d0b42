//! Recorded links, replayed: a delay or loss value per fixed step, a capacity as Mahimahi's
//! delivery opportunities, and a schedule of capacities per fixed slot of the wall clock
//! (Starlink changes its capacity every 15 s, at 12, 27, 42 and 57 s past each minute).
//!
//! All of them play on the link's clock from its epoch (`Link::set_epoch`: the shell puts it
//! at the start of a wall-clock minute, so slot boundaries fall where the real ones do), shifted
//! by the spec's `trace_at` (where in the minute the recording's start plays), and repeat when
//! they end.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::units::{parse_duration, parse_rate, ser_ms};

/// Where a recording came from, for status and errors (values are not printed).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Source {
    pub file: String,
    #[serde(serialize_with = "ser_ms", rename = "step_ms")]
    pub step: Duration,
}

/// One value per `step`, repeated when it ends: a one-way delay (ns) or a loss flag (0/1).
#[derive(Debug, Clone, Serialize)]
pub struct StepTrace {
    #[serde(flatten)]
    pub source: Source,
    #[serde(skip)]
    values: Arc<[u64]>,
}

impl PartialEq for StepTrace {
    fn eq(&self, o: &Self) -> bool {
        self.source == o.source && Arc::ptr_eq(&self.values, &o.values)
    }
}

impl StepTrace {
    pub fn new(file: &str, step: Duration, values: Vec<u64>) -> Result<StepTrace, String> {
        if values.is_empty() {
            return Err(format!("{file}: no values"));
        }
        if step.is_zero() {
            return Err(format!("{file}: the step must be above 0"));
        }
        Ok(StepTrace {
            source: Source {
                file: file.into(),
                step,
            },
            values: values.into(),
        })
    }

    /// The value of the step that `t` (time since the trace's start) falls in.
    pub fn at(&self, t: Duration) -> u64 {
        let i = t.as_nanos() / self.source.step.as_nanos();
        self.values[(i % self.values.len() as u128) as usize]
    }

    pub fn min(&self) -> u64 {
        self.values.iter().copied().min().unwrap_or(0)
    }

    /// How long it plays before repeating.
    pub fn period(&self) -> Duration {
        self.source.step * self.values.len() as u32
    }
}

/// Bytes one delivery opportunity carries (Mahimahi's MTU-sized packet).
pub const OPPORTUNITY_BYTES: u64 = 1500;

/// A capacity as Mahimahi records it: the times (ms from the start, ascending) at which one
/// 1500-byte packet may leave the bottleneck, a time repeated for several in that millisecond.
/// The trace repeats every `period` (its last time, as Mahimahi does).
#[derive(Debug, Clone, Serialize)]
pub struct CapacityTrace {
    pub file: String,
    #[serde(serialize_with = "ser_ms", rename = "period_ms")]
    pub period: Duration,
    #[serde(skip)]
    ms: Arc<[u32]>,
}

impl PartialEq for CapacityTrace {
    fn eq(&self, o: &Self) -> bool {
        self.file == o.file && Arc::ptr_eq(&self.ms, &o.ms)
    }
}

impl CapacityTrace {
    pub fn new(file: &str, ms: Vec<u32>) -> Result<CapacityTrace, String> {
        let last = *ms
            .last()
            .ok_or_else(|| format!("{file}: no delivery opportunities"))?;
        if last == 0 {
            return Err(format!(
                "{file}: the last time must be above 0 ms (the period)"
            ));
        }
        if ms.windows(2).any(|w| w[1] < w[0]) {
            return Err(format!("{file}: times must not go down"));
        }
        Ok(CapacityTrace {
            file: file.into(),
            period: Duration::from_millis(u64::from(last)),
            ms: ms.into(),
        })
    }

    /// Opportunities in one period.
    pub fn len(&self) -> usize {
        self.ms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ms.is_empty()
    }

    /// The time of opportunity `i` (`i < len()`) within its period.
    pub fn time_of(&self, i: usize) -> Duration {
        Duration::from_millis(u64::from(self.ms[i]))
    }

    /// The first opportunity at or after `within` (a time within the period): its index, or
    /// `len()` when it is the next period's first.
    pub fn first_at_or_after(&self, within: Duration) -> usize {
        let within = within.as_nanos();
        self.ms
            .partition_point(|&m| u128::from(m) * 1_000_000 < within)
    }

    /// Mean capacity over a period, bits per second.
    pub fn mean_bps(&self) -> u64 {
        (self.ms.len() as u128 * u128::from(OPPORTUNITY_BYTES) * 8 * 1_000_000_000
            / self.period.as_nanos()) as u64
    }
}

/// Capacities per fixed slot of the wall clock: slot `k` starts at `at + k x len` past the
/// epoch. From a list (in turn), or drawn uniformly from a range, per slot, by the link's seed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RateSlots {
    #[serde(serialize_with = "ser_ms", rename = "slot_ms")]
    pub len: Duration,
    #[serde(serialize_with = "ser_ms", rename = "at_ms")]
    pub at: Duration,
    pub rates: SlotRates,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SlotRates {
    List(Vec<u64>),
    Range { low: u64, high: u64 },
}

impl RateSlots {
    /// Starlink's: 15 s slots from 12 s past the minute.
    pub const STARLINK_SLOT: Duration = Duration::from_secs(15);
    pub const STARLINK_AT: Duration = Duration::from_secs(12);

    /// The slot that `t` (since the epoch) falls in; slots before `at` are numbered from the
    /// end of the minute backwards, so the schedule is the same whenever the link starts.
    pub fn slot(&self, t: Duration) -> u64 {
        let len = self.len.as_nanos() as i128;
        let since = t.as_nanos() as i128 - self.at.as_nanos() as i128;
        since.div_euclid(len).rem_euclid(1 << 40) as u64
    }

    /// The rate of slot `k`, bits per second, `seed` drawing a range's.
    pub fn rate(&self, k: u64, seed: u64) -> u64 {
        match &self.rates {
            SlotRates::List(l) => l[(k % l.len() as u64) as usize],
            SlotRates::Range { low, high } => {
                let mut r = super::Rng::new(seed ^ k.wrapping_mul(0x2545_f491_4f6c_dd1d));
                low + ((high - low) as f64 * r.unit()) as u64
            }
        }
    }
}

/// `rate_slots=LEN@AT:R1/R2/...` or `rate_slots=LEN@AT:LOW..HIGH`; `starlink` for
/// `15s@12s:` (Starlink's slots) with the rates after it: `rate_slots=starlink:20mbit..200mbit`.
pub fn parse_rate_slots(v: &str) -> Result<RateSlots, String> {
    const HINT: &str = "use rate_slots=LEN@AT:R1/R2/... or LEN@AT:LOW..HIGH, e.g. \
                        15s@12s:100mbit/40mbit or starlink:20mbit..200mbit";
    let (timing, rates) = v.split_once(':').ok_or(HINT)?;
    let (len, at) = if timing == "starlink" {
        (RateSlots::STARLINK_SLOT, RateSlots::STARLINK_AT)
    } else {
        let (len, at) = timing.split_once('@').unwrap_or((timing, "0s"));
        (parse_duration(len)?, parse_duration(at)?)
    };
    if len.is_zero() {
        return Err(format!("the slot length must be above 0; {HINT}"));
    }
    let rates = if let Some((low, high)) = rates.split_once("..") {
        let (low, high) = (parse_rate(low)?, parse_rate(high)?);
        if high < low {
            return Err(format!("`{rates}`: the range goes down"));
        }
        SlotRates::Range { low, high }
    } else {
        SlotRates::List(rates.split('/').map(parse_rate).collect::<Result<_, _>>()?)
    };
    Ok(RateSlots { len, at, rates })
}

/// The unit of a delay trace's values.
fn unit_ns(unit: &str) -> Option<u64> {
    match unit {
        "ns" => Some(1),
        "us" => Some(1_000),
        "ms" => Some(1_000_000),
        _ => None,
    }
}

/// `FILE[:STEP[:UNIT]]` (a path may itself hold colons: options are taken from the right).
fn split_options(v: &str) -> (&str, Vec<&str>) {
    let mut file = v;
    let mut opts = Vec::new();
    while let Some((head, last)) = file.rsplit_once(':') {
        if opts.len() < 2 && (unit_ns(last).is_some() || parse_duration(last).is_ok()) {
            opts.insert(0, last);
            file = head;
        } else {
            break;
        }
    }
    (file, opts)
}

fn read(file: &str) -> Result<String, String> {
    std::fs::read_to_string(file).map_err(|e| {
        format!("cannot read `{file}`: {e} (a relative path is from the directory the lab runs in)")
    })
}

/// Parse lines of unsigned integers, skipping blank ones; errors give the line.
fn numbers(file: &str, text: &str) -> Result<Vec<u64>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(
            line.parse()
                .map_err(|_| format!("{file}:{}: `{line}` is not a whole number", i + 1))?,
        );
    }
    Ok(out)
}

/// `delay_trace=FILE[:STEP[:UNIT]]`: one one-way delay per STEP (default 10ms) in UNIT (ns, us
/// or ms; default ns, as irtt records them).
pub fn load_delay(v: &str) -> Result<StepTrace, String> {
    let (file, opts) = split_options(v);
    let mut step = Duration::from_millis(10);
    let mut unit = 1;
    for o in opts {
        match unit_ns(o) {
            Some(u) => unit = u,
            None => step = parse_duration(o)?,
        }
    }
    let values = numbers(file, &read(file)?)?;
    StepTrace::new(file, step, values.into_iter().map(|x| x * unit).collect())
}

/// `loss_trace=FILE[:STEP]`: 1 where the step loses what enters the link, 0 where not.
pub fn load_loss(v: &str) -> Result<StepTrace, String> {
    let (file, opts) = split_options(v);
    let step = match opts.first() {
        Some(o) => parse_duration(o)?,
        None => Duration::from_millis(10),
    };
    let values = numbers(file, &read(file)?)?;
    if let Some(bad) = values.iter().position(|&x| x > 1) {
        return Err(format!("{file}: value {} is not 0 or 1", values[bad]));
    }
    StepTrace::new(file, step, values)
}

/// `capacity_trace=FILE`: Mahimahi's format.
pub fn load_capacity(file: &str) -> Result<CapacityTrace, String> {
    let values = numbers(file, &read(file)?)?;
    let ms = values
        .into_iter()
        .map(|x| u32::try_from(x).map_err(|_| format!("{file}: {x} ms is too far")))
        .collect::<Result<Vec<_>, _>>()?;
    CapacityTrace::new(file, ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_come_from_the_right() {
        assert_eq!(split_options("a/b.txt"), ("a/b.txt", vec![]));
        assert_eq!(
            split_options("a/b.txt:10ms:ns"),
            ("a/b.txt", vec!["10ms", "ns"])
        );
        assert_eq!(split_options("c:/x.txt:1ms"), ("c:/x.txt", vec!["1ms"]));
    }

    #[test]
    fn step_values_repeat() {
        let t = StepTrace::new("t", Duration::from_millis(10), vec![5, 6, 7]).unwrap();
        assert_eq!(t.at(Duration::ZERO), 5);
        assert_eq!(t.at(Duration::from_micros(19_999)), 6);
        assert_eq!(t.at(Duration::from_millis(30)), 5);
        assert_eq!(t.min(), 5);
    }

    #[test]
    fn opportunities_repeat_with_the_period() {
        let c = CapacityTrace::new("c", vec![1, 1, 3, 4]).unwrap();
        assert_eq!(c.period, Duration::from_millis(4));
        assert_eq!(c.time_of(0), Duration::from_millis(1));
        assert_eq!(c.time_of(2), Duration::from_millis(3));
        assert_eq!(c.first_at_or_after(Duration::ZERO), 0);
        assert_eq!(c.first_at_or_after(Duration::from_micros(1500)), 2);
        assert_eq!(
            c.first_at_or_after(Duration::from_micros(4001)),
            4,
            "the next period's"
        );
        assert_eq!(c.mean_bps(), 4 * 1500 * 8 * 1000 / 4);
        assert!(CapacityTrace::new("c", vec![2, 1]).is_err());
    }

    #[test]
    fn slots_follow_the_wall_clock() {
        let s = parse_rate_slots("starlink:10mbit/20mbit").unwrap();
        let sec = Duration::from_secs;
        assert_eq!(s.rate(s.slot(sec(12)), 0), 10_000_000);
        assert_eq!(s.rate(s.slot(sec(26)), 0), 10_000_000);
        assert_eq!(s.rate(s.slot(sec(27)), 0), 20_000_000);
        assert_ne!(s.slot(sec(11)), s.slot(sec(12)));
        let r = parse_rate_slots("15s@12s:20mbit..200mbit").unwrap();
        let drawn: Vec<u64> = (0..20).map(|k| r.rate(k, 7)).collect();
        assert!(drawn.iter().all(|x| (20_000_000..=200_000_000).contains(x)));
        assert_eq!(drawn, (0..20).map(|k| r.rate(k, 7)).collect::<Vec<_>>());
        assert!(drawn.windows(2).any(|w| w[0] != w[1]));
        for bad in ["15s", "0s@1s:1mbit", "1s@0s:2mbit..1mbit", "1s:fast"] {
            assert!(parse_rate_slots(bad).is_err(), "{bad}");
        }
    }
}
