//! PNG plots of a scenario run, drawn from its results.json (so `mpquic-lab plot DIR` can redraw
//! an old run): per system, throughput per path and in total over time (upload and download),
//! RTT over time with lost pings marked, and loss over time (the emulator's drops per path and
//! direction, and each ping's loss per second).
//!
//! Text needs a TrueType font; it comes from the system (Debian: fonts-dejavu-core, or
//! MPQUIC_LAB_FONT=path) rather than fontconfig, so no C libraries are linked.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::Result;
use plotters::prelude::*;
use serde_json::Value;

/// One drawn plot: the system it belongs to, its file (relative to the run's directory), a title.
pub struct Plot {
    pub system: String,
    pub file: String,
    pub title: String,
}

/// What `draw_all` made, and why it made nothing (no font) or skipped a plot.
#[derive(Default)]
pub struct Plots {
    pub plots: Vec<Plot>,
    pub problems: Vec<String>,
}

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn register_font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let env = std::env::var("MPQUIC_LAB_FONT").ok();
        let path = env
            .iter()
            .map(String::as_str)
            .chain(FONT_CANDIDATES.iter().copied())
            .find(|p| Path::new(p).exists())
            .ok_or("no font for the plots: apt-get install fonts-dejavu-core, or set MPQUIC_LAB_FONT to a .ttf")?;
        let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
        // plotters keeps fonts for the life of the process.
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes.leak())
            .map_err(|_| format!("{path}: not a usable TrueType font"))
    })
    .clone()
}

const W: u32 = 1100;
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

/// Draw every plot of a run into `out/SYSTEM/`. Never fails the run: problems are returned.
pub fn draw_all(report: &Value, out: &Path) -> Plots {
    let mut res = Plots::default();
    if let Err(e) = register_font() {
        res.problems.push(e);
        return res;
    }
    let events: Vec<(f64, String)> = report["schedule"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["at_s"].as_f64().unwrap_or(0.0),
                format!("p{} {}", c["path"], c["set"].as_str().unwrap_or("")),
            )
        })
        .collect();
    let slots = slot_schedules(report);
    for s in report["systems"].as_array().into_iter().flatten() {
        if s["status"] != "ok" {
            continue;
        }
        let mut events = events.clone();
        events.extend(slot_boundaries(&slots, s));
        let system = s["system"].as_str().unwrap_or("system").to_string();
        let dir = out.join(&system);
        let _ = std::fs::create_dir_all(&dir);
        let jobs: [(&str, &str, DrawFn); 3] = [
            ("throughput.png", "throughput per path", throughput),
            ("rtt.png", "RTT of the pings", rtt),
            ("loss.png", "loss", loss),
        ];
        for (file, what, f) in jobs {
            let title = format!(
                "{} / {system}: {what}",
                report["scenario"].as_str().unwrap_or("")
            );
            match f(s, &events, &dir.join(file), &title) {
                Ok(true) => res.plots.push(Plot {
                    system: system.clone(),
                    file: format!("{system}/{file}"),
                    title,
                }),
                Ok(false) => {}
                Err(e) => res.problems.push(format!("{system}/{file}: {e:#}")),
            }
        }
    }
    res
}

/// The wall-clock slot schedules (`rate_slots=`: Starlink's reconfigurations) of the
/// scenario's paths, as (length, offset), once each.
fn slot_schedules(report: &Value) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    for spec in report["paths"].as_array().into_iter().flatten() {
        for kv in spec.as_str().unwrap_or("").split(',') {
            let Some((key, v)) = kv.split_once('=') else {
                continue;
            };
            if !key.ends_with("rate_slots") {
                continue;
            }
            if let Ok(r) = mpquic_linkmodel::trace::parse_rate_slots(v) {
                let s = (r.len.as_secs_f64(), r.at.as_secs_f64());
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
    }
    out
}

/// Where the slot boundaries fell in system `s`'s run (its `t0_unix`), as events to mark.
fn slot_boundaries(slots: &[(f64, f64)], s: &Value) -> Vec<(f64, String)> {
    let (Some(t0), Some(end)) = (
        s["t0_unix"].as_f64(),
        (s["samples"].as_array()).and_then(|v| v.last()?["t_s"].as_f64()),
    ) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for &(len, at) in slots {
        let mut t = at + len * ((t0 - at) / len).ceil() - t0;
        while t <= end {
            out.push((t, "slot".to_string()));
            t += len;
        }
    }
    out
}

/// Draws one plot; `Ok(false)` when the run has no data for it.
type DrawFn = fn(&Value, &[(f64, String)], &Path, &str) -> Result<bool>;

/// A named line of (t, y) points.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
}

/// Rate per sample interval from cumulative counters: `get(sample)` -> counter.
fn rates(samples: &[Value], get: impl Fn(&Value) -> Option<f64>, scale: f64) -> Vec<(f64, f64)> {
    samples
        .windows(2)
        .filter_map(|w| {
            let (t0, t1) = (w[0]["t_s"].as_f64()?, w[1]["t_s"].as_f64()?);
            let d = get(&w[1])? - get(&w[0])?;
            (t1 > t0).then(|| (t1, d.max(0.0) * scale / (t1 - t0)))
        })
        .collect()
}

/// Percent of the packets offered in each sample interval that were dropped; `get` reads a
/// sample's (offered, dropped) counters. Both deltas come from the same pair of samples, so a
/// sample missing a counter is skipped rather than pairing one interval's drops with another's.
fn drop_share(samples: &[Value], get: impl Fn(&Value) -> Option<(f64, f64)>) -> Vec<(f64, f64)> {
    samples
        .windows(2)
        .filter_map(|w| {
            let (t0, t1) = (w[0]["t_s"].as_f64()?, w[1]["t_s"].as_f64()?);
            let ((o0, d0), (o1, d1)) = (get(&w[0])?, get(&w[1])?);
            let (offered, dropped) = ((o1 - o0).max(0.0), (d1 - d0).max(0.0));
            let pct = if offered > 0.0 {
                100.0 * dropped / offered
            } else {
                0.0
            };
            (t1 > t0).then_some((t1, pct))
        })
        .collect()
}

fn throughput(s: &Value, events: &[(f64, String)], file: &Path, title: &str) -> Result<bool> {
    let samples = s["samples"].as_array().cloned().unwrap_or_default();
    if samples.len() < 2 {
        return Ok(false);
    }
    let npaths = samples[0]["paths"].as_array().map_or(0, Vec::len);
    if npaths == 0 {
        return Ok(false);
    }
    let mut panels = Vec::new();
    for (key, label) in [("tx_bytes", "upload"), ("rx_bytes", "download")] {
        let mut lines: Vec<Series> = (0..npaths)
            .map(|i| Series {
                name: format!("path {}", i + 1),
                points: rates(&samples, |v| v["paths"][i][key].as_f64(), 8.0 / 1e6),
            })
            .collect();
        // The total from the summed counters: no index pairing of the per-path series, which
        // a sample missing one path's counters would break.
        let total = Series {
            name: "total".into(),
            points: rates(
                &samples,
                |v| (0..npaths).map(|i| v["paths"][i][key].as_f64()).sum(),
                8.0 / 1e6,
            ),
        };
        lines.push(total);
        panels.push((
            format!("{label}, Mbit/s on the client's WAN interfaces"),
            lines,
        ));
    }
    draw_panels(file, title, &panels, events, "Mbit/s")?;
    Ok(true)
}

fn pings(s: &Value) -> Vec<&Value> {
    s["traffic"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["kind"] == "ping" && t["series"].is_array())
        .collect()
}

fn rtt(s: &Value, events: &[(f64, String)], file: &Path, title: &str) -> Result<bool> {
    let pings = pings(s);
    if pings.is_empty() {
        return Ok(false);
    }
    // A few late replies (seconds) would flatten everything else: the axis stops at a cap and
    // anything above it is drawn on the top edge, as the legend says.
    let mut all: Vec<f64> = pings
        .iter()
        .flat_map(|p| p["series"].as_array().into_iter().flatten())
        .filter_map(|x| x[1].as_f64())
        .collect();
    all.sort_by(f64::total_cmp);
    let max = all.last().copied().unwrap_or(1.0);
    let p99 = all
        .get((all.len() as f64 * 0.99) as usize)
        .copied()
        .unwrap_or(max);
    let median = all.get(all.len() / 2).copied().unwrap_or(max);
    let cap = max.min((p99 * 1.5).max(median * 4.0)).max(1.0);
    let t_max = pings
        .iter()
        .filter_map(|p| p["series"].as_array()?.last()?[0].as_f64())
        .fold(1.0, f64::max);
    let root = BitMapBackend::new(file, (W, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_max, 0.0..cap * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("time, s")
        .y_desc("RTT, ms")
        .label_style(("sans-serif", 13))
        // No fine grid: it costs PNG size (the catalogue's plots are committed) and adds little.
        .light_line_style(TRANSPARENT)
        .bold_line_style(BLACK.mix(0.12))
        .draw()?;
    mark_events(&mut chart, events, cap * 1.05)?;
    for (i, p) in pings.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, Option<f64>)> = p["series"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|x| (x[0].as_f64().unwrap_or(0.0), x[1].as_f64()))
            .collect();
        let above = pts
            .iter()
            .filter(|(_, r)| r.is_some_and(|r| r > cap))
            .count();
        let lost = pts.iter().filter(|(_, r)| r.is_none()).count();
        let mut name = p["label"].as_str().unwrap_or("ping").to_string();
        if above > 0 {
            name += &format!(" ({above} above {cap:.0} ms, drawn at the top)");
        }
        chart
            .draw_series(
                pts.iter().filter_map(|(t, r)| {
                    r.map(|r| Circle::new((*t, r.min(cap)), 2, color.filled()))
                }),
            )?
            .label(name)
            .legend(move |(x, y)| Circle::new((x + 10, y), 3, color.filled()));
        chart
            .draw_series(
                pts.iter()
                    .filter(|(_, r)| r.is_none())
                    .map(|(t, _)| Cross::new((*t, 0.0), 4, RED.stroke_width(2))),
            )?
            .label(format!("lost ({lost})"))
            .legend(|(x, y)| Cross::new((x + 10, y), 4, RED.stroke_width(2)));
    }
    legend(&mut chart)?;
    root.present()?;
    Ok(true)
}

fn loss(s: &Value, events: &[(f64, String)], file: &Path, title: &str) -> Result<bool> {
    let samples = s["samples"].as_array().cloned().unwrap_or_default();
    let mut emu_lines = Vec::new();
    let npaths = samples
        .first()
        .and_then(|v| v["emulator"].as_array())
        .map_or(0, Vec::len);
    for i in 0..npaths {
        for dir in ["up", "down"] {
            // `in` counts every packet offered to the link, the dropped ones included.
            let points = drop_share(&samples, |v| {
                let d = &v["emulator"][i][dir];
                Some((d["in"].as_f64()?, d["dropped"].as_f64()?))
            });
            if points.iter().any(|p| p.1 > 0.0) || i == 0 && dir == "up" {
                emu_lines.push(Series {
                    name: format!("path {} {dir}", i + 1),
                    points,
                });
            }
        }
    }
    // The client kernel's drops at the tunnel interface (its queue full), next to the links'.
    // `tx_packets` counts only what was sent, so the packets offered are sent + dropped.
    let points = drop_share(&samples, |v| {
        let t = &v["tunnel_if"];
        let dropped = t["tx_dropped"].as_f64()?;
        Some((t["tx_packets"].as_f64()? + dropped, dropped))
    });
    if points.iter().any(|p| p.1 > 0.0) {
        emu_lines.push(Series {
            name: "client tunnel interface (kernel queue)".into(),
            points,
        });
    }
    let mut ping_lines = Vec::new();
    for p in pings(s) {
        // Share of each second's pings that got no answer.
        let mut bins: std::collections::BTreeMap<u64, (u32, u32)> = Default::default();
        for x in p["series"].as_array().into_iter().flatten() {
            let b = bins.entry(x[0].as_f64().unwrap_or(0.0) as u64).or_default();
            b.0 += 1;
            b.1 += u32::from(x[1].is_null());
        }
        ping_lines.push(Series {
            name: p["label"].as_str().unwrap_or("ping").to_string(),
            points: bins
                .iter()
                .map(|(t, (n, l))| (*t as f64 + 0.5, 100.0 * f64::from(*l) / f64::from(*n)))
                .collect(),
        });
    }
    // A call's packets lost or later than its budget, per second, each way.
    let mut voice_lines = Vec::new();
    for t in s["traffic"].as_array().into_iter().flatten() {
        if t["kind"] != "voice" {
            continue;
        }
        let start = t["start_s"].as_f64().unwrap_or(0.0);
        for dir in ["up", "down"] {
            let per_s = t[dir]["bad_percent_per_second"].as_array();
            let points: Vec<(f64, f64)> = (per_s.into_iter().flatten().enumerate())
                .filter_map(|(k, v)| Some((start + k as f64 + 0.5, v.as_f64()?)))
                .collect();
            if !points.is_empty() {
                voice_lines.push(Series {
                    name: format!("{} {dir}", t["label"].as_str().unwrap_or("voice")),
                    points,
                });
            }
        }
    }
    let mut panels = Vec::new();
    if !emu_lines.is_empty() {
        panels.push((
            "packets dropped by the emulated links (any reason) and at the client's tunnel interface, % per sample".to_string(),
            emu_lines,
        ));
    }
    if !ping_lines.is_empty() {
        panels.push((
            "pings without an answer, % per second".to_string(),
            ping_lines,
        ));
    }
    if !voice_lines.is_empty() {
        panels.push((
            "voice-like streams: packets lost or later than 150 ms one way, % per second"
                .to_string(),
            voice_lines,
        ));
    }
    if panels.is_empty() {
        return Ok(false);
    }
    draw_panels(file, title, &panels, events, "%")?;
    Ok(true)
}

/// Panels stacked vertically, sharing the time axis; each a set of lines with a legend.
fn draw_panels(
    file: &Path,
    title: &str,
    panels: &[(String, Vec<Series>)],
    events: &[(f64, String)],
    unit: &str,
) -> Result<()> {
    let root = BitMapBackend::new(file, (W, 60 + 330 * panels.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let t_max = panels
        .iter()
        .flat_map(|(_, ls)| ls.iter().flat_map(|l| l.points.iter().map(|p| p.0)))
        .fold(1.0, f64::max);
    for (area, (sub, lines)) in root.split_evenly((panels.len(), 1)).iter().zip(panels) {
        let y_max = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.1))
            .fold(0.0, f64::max);
        // Room above the highest point; a panel with nothing in it still gets an axis.
        let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(sub, ("sans-serif", 15))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("time, s")
            .y_desc(unit)
            .label_style(("sans-serif", 13))
            .light_line_style(TRANSPARENT)
            .bold_line_style(BLACK.mix(0.12))
            .draw()?;
        mark_events(&mut chart, events, y_max)?;
        for (i, l) in lines.iter().enumerate() {
            // The last line of a throughput panel is the total: black and thicker.
            let style = if l.name == "total" {
                BLACK.stroke_width(2)
            } else {
                COLORS[i % COLORS.len()].stroke_width(2)
            };
            chart
                .draw_series(LineSeries::new(l.points.iter().copied(), style))?
                .label(&l.name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        }
        legend(&mut chart)?;
    }
    root.present()?;
    Ok(())
}

type Chart<'a> = ChartContext<
    'a,
    BitMapBackend<'a>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The schedule's changes as dashed grey verticals, labelled at the top.
fn mark_events(chart: &mut Chart<'_>, events: &[(f64, String)], y_max: f64) -> Result<()> {
    let grey = RGBColor(150, 150, 150);
    // A periodic schedule (a handover every 15 s) would bury the plot in labels: label the first
    // few only.
    for (k, (t, what)) in events.iter().enumerate() {
        chart.draw_series(DashedLineSeries::new(
            [(*t, 0.0), (*t, y_max)],
            4,
            3,
            grey.stroke_width(1),
        ))?;
        if k < 6 {
            chart.draw_series(std::iter::once(Text::new(
                what.clone(),
                (*t, y_max * 0.97),
                ("sans-serif", 11).into_font().color(&grey),
            )))?;
        }
    }
    Ok(())
}

fn legend(chart: &mut Chart<'_>) -> Result<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .draw()?;
    Ok(())
}
