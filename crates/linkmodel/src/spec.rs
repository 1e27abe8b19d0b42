//! A link's behaviour in one direction, written as `key=value` pairs separated by commas, e.g.
//! `rate=100mbit,delay=20ms,jitter=2ms,loss=1%`. The same syntax sets a link up (`--path SPEC`),
//! changes it live (`mpquic-lab set NAME PATH key=value...`) and in a scenario's schedule.

use std::time::Duration;

use serde::Serialize;

use super::trace::{self, CapacityTrace, RateSlots, StepTrace};
pub use super::units::{parse_duration, parse_rate};
use super::units::{ser_ms, split_num};

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JitterDist {
    Uniform,
    Normal,
    Pareto,
}

/// One direction of a lab path: up is client to server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Up,
    Down,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkState {
    Up,
    /// Everything dropped (both directions are set together by `down`).
    Down,
    /// This direction silently drops everything (a one-way black hole).
    Blackhole,
}

/// Gilbert-Elliott two-state loss: `p` = P(good -> bad) and `r` = P(bad -> good) per packet;
/// mean burst length is 1/r packets.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GilbertElliott {
    pub p: f64,
    pub r: f64,
    pub loss_bad: f64,
    pub loss_good: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum QueueLimit {
    #[serde(rename = "ms")]
    Time(#[serde(serialize_with = "ser_ms")] Duration),
    #[serde(rename = "bytes")]
    Bytes(u64),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkSpec {
    /// Bits per second; `None` = unlimited.
    pub rate_bps: Option<u64>,
    #[serde(serialize_with = "ser_ms", rename = "delay_ms")]
    pub delay: Duration,
    #[serde(serialize_with = "ser_ms", rename = "jitter_ms")]
    pub jitter: Duration,
    pub jitter_dist: JitterDist,
    /// Jitter never reorders packets when true.
    pub keep_order: bool,
    /// Bernoulli loss probability (0..1).
    pub loss: f64,
    pub ge: Option<GilbertElliott>,
    pub dup: f64,
    /// Probability that a packet skips the delay (and so overtakes others).
    pub reorder: f64,
    pub queue: QueueLimit,
    pub codel: bool,
    /// Per-flow (5-tuple) rate cap in bits per second.
    pub flow_rate_bps: Option<u64>,
    #[serde(serialize_with = "ser_ms", rename = "flow_queue_ms")]
    pub flow_queue: Duration,
    /// Larger IP packets are dropped.
    pub mtu: Option<u32>,
    pub state: LinkState,
    /// How late the emulator may release a packet while the link is busy, to serve many
    /// packets per wake-up (a lone packet still leaves on time). 0: every packet on time, at
    /// the cost of a wake-up each.
    #[serde(serialize_with = "ser_ms", rename = "slack_ms")]
    pub slack: Duration,
    /// A recorded one-way delay, per step (`trace.rs`): the propagation delay, with `delay`
    /// and `jitter` added to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay_trace: Option<StepTrace>,
    /// A recorded loss, per step: a step marked 1 drops everything that enters the link in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_trace: Option<StepTrace>,
    /// A recorded capacity (Mahimahi's delivery opportunities), in place of `rate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity_trace: Option<CapacityTrace>,
    /// Capacities per fixed slot of the wall clock, in place of `rate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_slots: Option<RateSlots>,
    /// Where in the wall clock's minute the recordings' start plays (they repeat from there).
    #[serde(serialize_with = "ser_ms", rename = "trace_at_ms")]
    pub trace_at: Duration,
    /// Delay and loss recordings repeat after this much of them (their whole length when
    /// longer or unset): 90 s of a 100 s Starlink recording keep its reconfigurations on the
    /// wall clock's 15 s slots when it repeats.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_repeat: Option<Duration>,
}

/// The default `slack`: at 300 Mbit/s a dozen full-size packets per wake-up.
pub const DEFAULT_SLACK: Duration = Duration::from_micros(500);
/// A larger slack would hold input longer than the emulator's sockets are sized for.
const MAX_SLACK: Duration = Duration::from_millis(10);

impl Default for LinkSpec {
    fn default() -> Self {
        LinkSpec {
            rate_bps: None,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            jitter_dist: JitterDist::Uniform,
            keep_order: true,
            loss: 0.0,
            ge: None,
            dup: 0.0,
            reorder: 0.0,
            queue: QueueLimit::Time(Duration::from_millis(100)),
            codel: false,
            flow_rate_bps: None,
            flow_queue: Duration::from_millis(50),
            mtu: None,
            state: LinkState::Up,
            slack: DEFAULT_SLACK,
            delay_trace: None,
            loss_trace: None,
            capacity_trace: None,
            rate_slots: None,
            trace_at: Duration::ZERO,
            trace_repeat: None,
        }
    }
}

pub const KEYS: &[&str] = &[
    "rate",
    "delay",
    "jitter",
    "jitter_dist",
    "keep_order",
    "loss",
    "ge",
    "dup",
    "reorder",
    "queue",
    "codel",
    "flow_rate",
    "flow_queue",
    "mtu",
    "state",
    "slack",
    "delay_trace",
    "loss_trace",
    "capacity_trace",
    "rate_slots",
    "trace_at",
    "trace_repeat",
];

impl LinkSpec {
    pub fn parse(s: &str) -> Result<LinkSpec, String> {
        LinkSpec::parse_dir(s, None)
    }

    /// The spec of direction `dir` (`None`: a link that has no directions, as the simulator's):
    /// keys written `up.KEY=...` or `down.KEY=...` apply to that direction only (a recording of
    /// each direction: `up.delay_trace=...,down.delay_trace=...`).
    pub fn parse_dir(s: &str, dir: Option<Dir>) -> Result<LinkSpec, String> {
        let mut spec = LinkSpec::default();
        spec.apply_dir(s, dir)?;
        Ok(spec)
    }

    /// A lab path's two directions, up then down.
    pub fn parse_both(s: &str) -> Result<(LinkSpec, LinkSpec), String> {
        Ok((
            LinkSpec::parse_dir(s, Some(Dir::Up))?,
            LinkSpec::parse_dir(s, Some(Dir::Down))?,
        ))
    }

    /// Apply `key=value[,key=value...]` changes (also accepts whitespace as separator).
    pub fn apply(&mut self, s: &str) -> Result<(), String> {
        self.apply_dir(s, None)
    }

    /// Apply changes to direction `dir` (`parse_dir`). All or nothing: on an error the spec is
    /// as it was.
    pub fn apply_dir(&mut self, s: &str, dir: Option<Dir>) -> Result<(), String> {
        let mut next = self.clone();
        for item in s.split([',', ' ']).map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| {
                format!("`{item}`: expected key=value (keys: {})", KEYS.join(", "))
            })?;
            let (only, k) = match k.trim().split_once('.') {
                Some(("up", k)) => (Some(Dir::Up), k),
                Some(("down", k)) => (Some(Dir::Down), k),
                Some((other, _)) => {
                    return Err(format!(
                        "`{item}`: `{other}.`: a key's direction is up. or down."
                    ))
                }
                None => (None, k.trim()),
            };
            if only.is_some() && dir.is_none() {
                return Err(format!(
                    "`{item}`: this link has no directions (up./down. keys are the lab's)"
                ));
            }
            if only.is_some() && only != dir {
                // The other direction's: checked there; parsed here too, so an error shows
                // whichever direction is read first.
                LinkSpec::default()
                    .set(k, v.trim())
                    .map_err(|e| format!("`{item}`: {e}"))?;
                continue;
            }
            next.set(k, v.trim())
                .map_err(|e| format!("`{item}`: {e}"))?;
        }
        next.check_capacity()?;
        *self = next;
        Ok(())
    }

    /// One source sets the capacity: `rate`, `capacity_trace` or `rate_slots`.
    fn check_capacity(&self) -> Result<(), String> {
        let set: Vec<&str> = [
            ("rate", self.rate_bps.is_some()),
            ("capacity_trace", self.capacity_trace.is_some()),
            ("rate_slots", self.rate_slots.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, on)| on.then_some(k))
        .collect();
        if set.len() > 1 {
            return Err(format!(
                "{} each set the capacity: keep one (set the others to none)",
                set.join(" and ")
            ));
        }
        Ok(())
    }

    fn set(&mut self, k: &str, v: &str) -> Result<(), String> {
        match k {
            "rate" => self.rate_bps = parse_rate_opt(v)?,
            "delay" => self.delay = parse_duration(v)?,
            "jitter" => self.jitter = parse_duration(v)?,
            "jitter_dist" => {
                self.jitter_dist = match v {
                    "uniform" => JitterDist::Uniform,
                    "normal" => JitterDist::Normal,
                    "pareto" => JitterDist::Pareto,
                    _ => return Err("use uniform, normal or pareto".into()),
                }
            }
            "keep_order" => self.keep_order = parse_bool(v)?,
            "loss" => self.loss = parse_prob(v)?,
            "ge" => self.ge = parse_ge(v)?,
            "dup" => self.dup = parse_prob(v)?,
            "reorder" => self.reorder = parse_prob(v)?,
            "queue" => self.queue = parse_queue(v)?,
            "codel" => self.codel = parse_bool(v)?,
            "flow_rate" => self.flow_rate_bps = parse_rate_opt(v)?,
            "flow_queue" => self.flow_queue = parse_duration(v)?,
            "mtu" => {
                self.mtu = match v {
                    "none" | "0" => None,
                    _ => Some(v.parse().map_err(|_| "mtu is a number of bytes")?),
                }
            }
            "state" => {
                self.state = match v {
                    "up" => LinkState::Up,
                    "down" => LinkState::Down,
                    "blackhole" => LinkState::Blackhole,
                    _ => return Err("use up, down or blackhole".into()),
                }
            }
            "slack" => {
                self.slack = parse_duration(v)?;
                if self.slack > MAX_SLACK {
                    return Err(format!("at most {} ms", MAX_SLACK.as_millis()));
                }
            }
            "delay_trace" => self.delay_trace = none_or(v, trace::load_delay)?,
            "loss_trace" => self.loss_trace = none_or(v, trace::load_loss)?,
            "capacity_trace" => self.capacity_trace = none_or(v, trace::load_capacity)?,
            "rate_slots" => self.rate_slots = none_or(v, trace::parse_rate_slots)?,
            "trace_at" => self.trace_at = parse_duration(v)?,
            "trace_repeat" => {
                self.trace_repeat = none_or(v, parse_duration)?.filter(|d| !d.is_zero())
            }
            _ => {
                let hint = KEYS
                    .iter()
                    .find(|c| c.starts_with(&k[..k.len().min(3)]))
                    .map(|c| format!(" (did you mean `{c}`?)"))
                    .unwrap_or_default();
                return Err(format!(
                    "unknown key `{k}`{hint}; keys: {}",
                    KEYS.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// `none` clears a setting; anything else is parsed by `f`.
fn none_or<T>(v: &str, f: impl Fn(&str) -> Result<T, String>) -> Result<Option<T>, String> {
    if v == "none" {
        Ok(None)
    } else {
        f(v).map(Some)
    }
}

fn parse_rate_opt(v: &str) -> Result<Option<u64>, String> {
    if matches!(v, "none" | "unlimited" | "0") {
        Ok(None)
    } else {
        parse_rate(v).map(Some)
    }
}

pub fn parse_prob(v: &str) -> Result<f64, String> {
    let p = match v.strip_suffix('%') {
        Some(pct) => pct.trim().parse::<f64>().map(|x| x / 100.0),
        None => v.parse::<f64>(),
    }
    .map_err(|_| format!("`{v}` is not a probability (e.g. 1%, 0.01)"))?;
    if !(0.0..=1.0).contains(&p) {
        return Err(format!("`{v}` is outside 0..100%"));
    }
    Ok(p)
}

fn parse_bool(v: &str) -> Result<bool, String> {
    match v {
        "true" | "on" | "yes" | "1" => Ok(true),
        "false" | "off" | "no" | "0" => Ok(false),
        _ => Err("use true or false".into()),
    }
}

fn parse_queue(v: &str) -> Result<QueueLimit, String> {
    if v.ends_with('s') {
        return parse_duration(v).map(QueueLimit::Time);
    }
    let (n, unit) = split_num(v);
    let mult = match unit.to_ascii_lowercase().as_str() {
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        _ => f64::NAN,
    };
    let b = n * mult;
    if !b.is_finite() || b < 1500.0 {
        return Err(format!(
            "`{v}` is not a queue size (e.g. 100ms, 256kb, 1mb; at least 1500b)"
        ));
    }
    Ok(QueueLimit::Bytes(b as u64))
}

/// `ge=P:R[:LOSS_BAD[:LOSS_GOOD]]`, or `ge=none`.
fn parse_ge(v: &str) -> Result<Option<GilbertElliott>, String> {
    if v == "none" {
        return Ok(None);
    }
    let parts: Vec<&str> = v.split(':').collect();
    if !(2..=4).contains(&parts.len()) {
        return Err(
            "use ge=P:R[:LOSS_BAD[:LOSS_GOOD]], e.g. ge=1%:25% (mean burst 4 packets)".into(),
        );
    }
    let p = parse_prob(parts[0])?;
    let r = parse_prob(parts[1])?;
    if r == 0.0 {
        return Err("R (bad -> good) must be above 0, or bursts never end".into());
    }
    Ok(Some(GilbertElliott {
        p,
        r,
        loss_bad: parts.get(2).map_or(Ok(1.0), |s| parse_prob(s))?,
        loss_good: parts.get(3).map_or(Ok(0.0), |s| parse_prob(s))?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_issue_example_and_all_keys() {
        let s = LinkSpec::parse("rate=100mbit,delay=20ms,jitter=2ms,loss=1%").unwrap();
        assert_eq!(s.rate_bps, Some(100_000_000));
        assert_eq!(s.delay, Duration::from_millis(20));
        assert_eq!(s.jitter, Duration::from_millis(2));
        assert!((s.loss - 0.01).abs() < 1e-12);
        let s = LinkSpec::parse(
            "rate=1.5gbit jitter_dist=pareto keep_order=false ge=1%:25% dup=0.5% reorder=1% queue=256kb codel=on flow_rate=20mbit flow_queue=30ms mtu=1400 state=blackhole",
        )
        .unwrap();
        assert_eq!(s.rate_bps, Some(1_500_000_000));
        assert_eq!(s.ge.unwrap().r, 0.25);
        assert_eq!(s.queue, QueueLimit::Bytes(256_000));
        assert_eq!(s.state, LinkState::Blackhole);
        assert_eq!(s.mtu, Some(1400));
        assert!(serde_json::to_string(&s)
            .unwrap()
            .contains("\"delay_ms\":0.0"));
    }

    #[test]
    fn direction_keys_apply_to_their_direction() {
        let text = "delay=10ms,up.delay=20ms,down.loss=1%";
        let up = LinkSpec::parse_dir(text, Some(Dir::Up)).unwrap();
        let down = LinkSpec::parse_dir(text, Some(Dir::Down)).unwrap();
        assert_eq!(up.delay, Duration::from_millis(20));
        assert_eq!(up.loss, 0.0);
        assert_eq!(down.delay, Duration::from_millis(10));
        assert!((down.loss - 0.01).abs() < 1e-12);
        let e = LinkSpec::parse(text).unwrap_err();
        assert!(e.contains("no directions"), "{e}");
        let e = LinkSpec::parse_dir("down.dleay=1ms", Some(Dir::Up)).unwrap_err();
        assert!(e.contains("unknown key"), "{e}");
        let e = LinkSpec::parse_dir("left.delay=1ms", Some(Dir::Up)).unwrap_err();
        assert!(e.contains("up. or down."), "{e}");
        // All or nothing.
        let mut s = LinkSpec::parse("delay=5ms").unwrap();
        assert!(s.apply("delay=9ms,loss=200%").is_err());
        assert_eq!(s.delay, Duration::from_millis(5));
    }

    #[test]
    fn errors_say_what_is_wrong() {
        for (bad, needle) in [
            ("rate=fast", "not a rate"),
            ("delay=20", "not a duration"),
            ("loss=120%", "outside"),
            ("dleay=2ms", "unknown key `dleay`"),
            ("rate", "expected key=value"),
            ("ge=1%:0%", "bursts never end"),
            ("state=sideways", "up, down or blackhole"),
        ] {
            let e = LinkSpec::parse(bad).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
