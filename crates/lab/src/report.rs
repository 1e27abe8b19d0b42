//! report.md and the plots of a run, from its results (also `mpquic-lab plot DIR` for a finished
//! run): per system the traffic results, mean rate per path, CPU and RSS per process, and where
//! packets were lost besides the links.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

/// Plots and report.md from a run's results.
pub(crate) fn write_report(report: &Value, out: &Path) -> Result<()> {
    let plots = crate::plot::draw_all(report, out);
    for p in &plots.problems {
        eprintln!("plots: {p}");
    }
    std::fs::write(out.join("report.md"), markdown(report, &plots))?;
    Ok(())
}

/// `mpquic-lab plot DIR`: redraw the plots and report.md of a finished run from its results.json.
pub fn redraw(dir: &Path) -> Result<()> {
    let p = dir.join("results.json");
    let text = std::fs::read_to_string(&p).with_context(|| format!("{}", p.display()))?;
    let report: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))?;
    write_report(&report, dir)
}

/// Process `i`'s CPU (% of one core) between samples `a` and `b`.
fn cpu_percent(a: &Value, b: &Value, i: usize) -> f64 {
    let cpu = |v: &Value| v["procs"][i]["cpu_s"].as_f64().unwrap_or(0.0);
    let dt = b["t_s"].as_f64().unwrap_or(0.0) - a["t_s"].as_f64().unwrap_or(0.0);
    100.0 * (cpu(b) - cpu(a)) / dt.max(1e-9)
}

/// Process `i`'s name in a sample (its pid when it has none).
fn proc_name(v: &Value, i: usize) -> String {
    v["procs"][i]["name"]
        .as_str()
        .map_or_else(|| format!("pid {}", v["procs"][i]["pid"]), String::from)
}

/// CPU (% of one core over the run) and RSS at the first and last sample and at most, per
/// process of the system: the numbers a stability run is about.
fn process_table(o: &mut String, samples: &[Value]) {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return;
    };
    let n = last["procs"].as_array().map_or(0, Vec::len);
    if n == 0 {
        return;
    }
    let _ = writeln!(
        o,
        "\n| process | CPU % of a core | RSS first / last / max MiB |\n|---|---|---|"
    );
    for i in 0..n {
        let rss = |v: &Value| v["procs"][i]["rss_kib"].as_f64().unwrap_or(0.0) / 1024.0;
        let max = samples.iter().map(rss).fold(0.0, f64::max);
        let _ = writeln!(
            o,
            "| {} | {:.1} | {:.1} / {:.1} / {:.1} |",
            proc_name(last, i),
            cpu_percent(first, last, i),
            rss(first),
            rss(last),
            max
        );
    }
}

/// Packets the client's kernel dropped at the tunnel interface (its queue full: the VPN did not
/// read fast enough), which no VPN counter can show.
fn tunnel_drops(o: &mut String, samples: &[Value]) {
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        return;
    };
    let d = |k: &str| {
        last["tunnel_if"][k]
            .as_u64()
            .zip(first["tunnel_if"][k].as_u64())
            .map(|(b, a)| b.saturating_sub(a))
    };
    if let (Some(sent), Some(dropped)) = (d("tx_packets"), d("tx_dropped")) {
        let _ = writeln!(
            o,
            "\nClient tunnel interface: {dropped} of {} packets dropped by the kernel on their way into the tunnel ({:.2}%; queue full).",
            sent + dropped,
            100.0 * dropped as f64 / (sent + dropped).max(1) as f64
        );
    }
}

/// An idle window: each process's CPU between the first and the last sample inside it.
fn idle_line(t: &Value, samples: &[Value]) -> String {
    let from = t["start_s"].as_f64().unwrap_or(0.0);
    let to = from + t["duration_s"].as_f64().unwrap_or(0.0);
    let inside: Vec<&Value> = samples
        .iter()
        .filter(|v| v["t_s"].as_f64().is_some_and(|x| x >= from && x <= to))
        .collect();
    let (Some(a), Some(b)) = (inside.first(), inside.last()) else {
        return "no traffic (no samples in the window)".into();
    };
    let dt = b["t_s"].as_f64().unwrap_or(0.0) - a["t_s"].as_f64().unwrap_or(0.0);
    let n = b["procs"].as_array().map_or(0, Vec::len);
    let procs: Vec<String> = (0..n)
        .map(|i| format!("{} {:.2}%", proc_name(b, i), cpu_percent(a, b, i)))
        .collect();
    format!("no traffic; CPU over {dt:.0} s of it: {}", procs.join(", "))
}

/// Frames the emulator itself lost outside its link model (receive ring full, longer than the
/// MTU, send failed) and how late it released packets: a run with lab losses or large lateness
/// measured the lab, not the system.
fn emulator_health(o: &mut String, emu: &Value) {
    let mut lost = Vec::new();
    let (mut late_ns, mut out) = (0u64, 0u64);
    for p in emu["paths"].as_array().into_iter().flatten() {
        for dir in ["up", "down"] {
            let x = &p[dir];
            for k in ["socket_drops", "oversize_drops", "send_errors"] {
                let n = x[k].as_u64().unwrap_or(0);
                if n > 0 {
                    lost.push(format!("path {} {dir}: {k} {n}", p["index"]));
                }
            }
            late_ns += x["stats"]["late_ns_total"].as_u64().unwrap_or(0);
            out += x["stats"]["out_packets"].as_u64().unwrap_or(0);
        }
    }
    if emu.is_object() {
        let _ = writeln!(
            o,
            "\nEmulator: {}; packets left {:.0} us after their model time on average.",
            if lost.is_empty() {
                "no frame lost outside the link model".to_string()
            } else {
                format!("frames lost outside the link model: {}", lost.join(", "))
            },
            late_ns as f64 / out.max(1) as f64 / 1000.0
        );
    }
}

/// mpquic's drop counters at the end of the run, every non-zero one (status --json of each side).
fn mpquic_drops(o: &mut String, status: &Value) {
    if !status.is_object() {
        return;
    }
    let mut lines = Vec::new();
    for (who, st) in final_statuses(status) {
        let Some(st) = st else {
            lines.push(format!("{who} status unreadable"));
            continue;
        };
        for (_, path, reason, n) in st.all_drops() {
            if n > 0 {
                let scope = match path.is_empty() {
                    true => String::new(),
                    false => format!("{path}: "),
                };
                lines.push(format!("{who} {scope}{reason} {n}"));
            }
        }
        // The tunnels' path-less drops again by class, where there are classes.
        for c in st.tunnels.iter().flat_map(|t| &t.classes) {
            for (reason, n) in c.drops.iter().filter(|(_, n)| **n > 0) {
                lines.push(format!("{who} (class {}: {reason} {n})", c.name));
            }
        }
    }
    let _ = writeln!(
        o,
        "\nmpquic drops at the end: {}.",
        if lines.is_empty() {
            "none".to_string()
        } else {
            lines.join(", ")
        }
    );
}

/// Traffic classes at the end of the run, side by side: what each side put in each class and
/// carried in it, and its drops.
fn mpquic_classes(o: &mut String, status: &Value) {
    let statuses = final_statuses(status);
    let classes = |who: &str| -> Vec<mpquic_status::ClassStatus> {
        statuses
            .iter()
            .filter(|(w, _)| *w == who)
            .flat_map(|(_, s)| s.iter().flat_map(|s| s.tunnels.clone()))
            .flat_map(|t| t.classes)
            .collect()
    };
    let (client, server) = (classes("client"), classes("server"));
    if client.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "
Traffic classes at the end (packets put in the class: by a rule / unmatched; MB sent):

| class | policy / mode | client packets | MB up | server packets | MB down | drops |
|---|---|---|---|---|---|---|"
    );
    let drops = |c: &mpquic_status::ClassStatus| c.drops.values().sum::<u64>();
    for c in &client {
        let s = server.iter().find(|s| s.name == c.name);
        let _ = writeln!(
            o,
            "| {} | {} / {} | {} / {} | {:.1} | {} | {} | {} |",
            c.name,
            c.policy,
            c.mode,
            c.classified_packets,
            c.unmatched_packets,
            c.tx_bytes as f64 / 1e6,
            s.map_or("-".into(), |s| format!(
                "{} / {}",
                s.classified_packets, s.unmatched_packets
            )),
            s.map_or("-".into(), |s| format!("{:.1}", s.tx_bytes as f64 / 1e6)),
            drops(c) + s.map_or(0, drops),
        );
    }
}

/// FEC at the end of the run, per side and path that had it: what the sender added and what
/// the receiver rebuilt or could not (the residual loss FEC left).
fn mpquic_fec(o: &mut String, status: &Value) {
    let mut lines = Vec::new();
    for (who, st) in final_statuses(status) {
        for t in st.iter().flat_map(|s| &s.tunnels) {
            for p in &t.paths {
                if let Some(fec) = p.fec_summary() {
                    lines.push(format!("{who} {} (fec {}): {fec}", p.name, t.fec));
                }
            }
        }
    }
    if !lines.is_empty() {
        let _ = writeln!(o, "\nFEC at the end:\n");
        for l in lines {
            let _ = writeln!(o, "- {l}");
        }
    }
}

/// Each side's final status (`None`: unreadable), from a run's `mpquic_status` (no entries when
/// the run had no mpquic).
fn final_statuses(status: &Value) -> Vec<(&'static str, Option<mpquic_status::StatusReport>)> {
    if !status.is_object() {
        return Vec::new();
    }
    ["client", "server"]
        .into_iter()
        .map(|who| (who, serde_json::from_value(status[who].clone()).ok()))
        .collect()
}

/// Mbit/s with the digits that matter: a ping-only run moves a few kbit/s.
fn mbit(x: f64) -> String {
    if x < 10.0 {
        format!("{x:.3}")
    } else {
        format!("{x:.1}")
    }
}

fn markdown(r: &Value, plots: &crate::plot::Plots) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# {}\n\n{}\n",
        r["scenario"].as_str().unwrap_or(""),
        r["description"].as_str().unwrap_or("")
    );
    for p in &plots.problems {
        let _ = writeln!(o, "Plots: {p}\n");
    }
    let _ = writeln!(o, "Paths:");
    for (i, p) in r["paths"].as_array().into_iter().flatten().enumerate() {
        let _ = writeln!(o, "- path {}: `{}`", i + 1, p.as_str().unwrap_or(""));
    }
    if let Some(s) = r["schedule"].as_array().filter(|s| !s.is_empty()) {
        let _ = writeln!(o, "\nSchedule:");
        for c in s {
            let _ = writeln!(
                o,
                "- t={}s path {} {}: `{}`",
                c["at_s"],
                c["path"],
                c["dir"].as_str().unwrap_or(""),
                c["set"].as_str().unwrap_or("")
            );
        }
    }
    for s in r["systems"].as_array().into_iter().flatten() {
        let _ = writeln!(
            o,
            "\n## {} ({})\n",
            s["system"].as_str().unwrap_or(""),
            s["status"].as_str().unwrap_or("")
        );
        if let Some(reason) = s["reason"].as_str() {
            let _ = writeln!(o, "{reason}\n");
            continue;
        }
        let _ = writeln!(o, "| traffic | result |\n|---|---|");
        for t in s["traffic"].as_array().into_iter().flatten() {
            let line = if let Some(e) = t.get("error") {
                format!("error: {e}")
            } else if let Some(steps) = t["sweep"].as_array() {
                let each: Vec<String> = steps
                    .iter()
                    .map(|v| match v.get("error") {
                        Some(e) => format!("{}: error {e}", v["rate"].as_str().unwrap_or("?")),
                        None => format!(
                            "{}: {:.1} ({:.2}% lost)",
                            v["rate"].as_str().unwrap_or("?"),
                            v["mbit"].as_f64().unwrap_or(0.0),
                            v["undelivered_percent"].as_f64().unwrap_or(0.0)
                        ),
                    })
                    .collect();
                format!(
                    "**{:.1} Mbit/s** delivered below 1% loss (UDP sweep{}: {})",
                    t["mbit"].as_f64().unwrap_or(0.0),
                    if t["reverse"] == true {
                        ", reverse"
                    } else {
                        ""
                    },
                    each.join(", ")
                )
            } else if t["kind"] == "iperf3" {
                let extra = if t["protocol"] == "udp" {
                    format!(
                        "lost {:.2}% (iperf3), {:.2}% of {:.1} Mbit/s sent not delivered",
                        t["lost_percent"].as_f64().unwrap_or(0.0),
                        t["undelivered_percent"].as_f64().unwrap_or(0.0),
                        t["sent_mbit"].as_f64().unwrap_or(0.0)
                    )
                } else {
                    format!(
                        "retransmits {}{}",
                        t["retransmits"],
                        stalls_text(&t["stalls"], s["t0_unix"].as_f64())
                    )
                };
                format!(
                    "{:.1} Mbit/s ({} {} stream(s){}), {extra}",
                    t["mbit"].as_f64().unwrap_or(0.0),
                    t["protocol"].as_str().unwrap_or(""),
                    t["streams"],
                    if t["reverse"] == true {
                        ", reverse"
                    } else {
                        ""
                    },
                )
            } else if t["kind"] == "voice" {
                let dir = |d: &Value| {
                    format!(
                        "{:.2}% lost or later than 150 ms ({} lost, {} late of {}), one way median {} p99 {} ms, worst second {:.0}%",
                        d["bad_percent"].as_f64().unwrap_or(0.0),
                        d["lost"],
                        d["late"],
                        d["sent"],
                        d["one_way_ms"]["median"].as_f64().map_or("-".into(), |x| format!("{x:.1}")),
                        d["one_way_ms"]["p99"].as_f64().map_or("-".into(), |x| format!("{x:.1}")),
                        d["worst_second_bad_percent"].as_f64().unwrap_or(0.0)
                    )
                };
                format!("voice up: {}; down: {}", dir(&t["up"]), dir(&t["down"]))
            } else if t["kind"] == "web" && t["error"].is_string() {
                format!("web: error {}", t["error"].as_str().unwrap_or(""))
            } else if t["kind"] == "web" {
                let r = &t["result"];
                let ms = |q: &str| {
                    r["completion_ms"][q]
                        .as_f64()
                        .map_or("-".into(), |x| format!("{x:.0}"))
                };
                format!(
                    "web: {} objects of {} bytes, {} at a time, {} failed; completion median {} p95 {} max {} ms",
                    r["fetched"], t["object_bytes"], t["parallel"], r["failed"],
                    ms("median"), ms("p95"), ms("max")
                )
            } else if t["kind"] == "idle" {
                idle_line(t, s["samples"].as_array().map_or(&[][..], Vec::as_slice))
            } else {
                format!(
                    "{}/{} received ({:.1}% loss, {} after more than 1 s), RTT median {} p99 {} ms, longest gap {:.2} s",
                    t["received"], t["sent"], t["loss_percent"].as_f64().unwrap_or(0.0), t["late_replies"], t["rtt_ms"]["median"], t["rtt_ms"]["p99"],
                    t["longest_gap_s"].as_f64().unwrap_or(0.0)
                )
            };
            let _ = writeln!(o, "| {} | {line} |", t["label"].as_str().unwrap_or(""));
        }
        let _ = writeln!(
            o,
            "\n| path | mean up Mbit/s | mean down Mbit/s |\n|---|---|---|"
        );
        for p in s["path_mean_mbit"].as_array().into_iter().flatten() {
            let _ = writeln!(
                o,
                "| {} | {} | {} |",
                p["path"],
                mbit(p["up_mbit"].as_f64().unwrap_or(0.0)),
                mbit(p["down_mbit"].as_f64().unwrap_or(0.0))
            );
        }
        let samples = s["samples"].as_array().map_or(&[][..], Vec::as_slice);
        process_table(&mut o, samples);
        tunnel_drops(&mut o, samples);
        mpquic_classes(&mut o, &s["mpquic_status"]);
        mpquic_drops(&mut o, &s["mpquic_status"]);
        mpquic_fec(&mut o, &s["mpquic_status"]);
        emulator_health(&mut o, &s["emulator"]);
        let _ = writeln!(o);
        for p in plots
            .plots
            .iter()
            .filter(|p| s["system"] == p.system.as_str())
        {
            let _ = writeln!(o, "![{}]({})\n", p.title, p.file);
        }
    }
    o
}

/// A TCP transfer's stalls (`stalls.rs`) for its report line: the longest, and those over the
/// threshold with when they began (seconds into the run, with the run's start on the wall
/// clock), or nothing where they were not watched.
fn stalls_text(st: &Value, t0_unix: Option<f64>) -> String {
    if let Some(e) = st.get("error") {
        return format!("; stalls not watched: {}", e.as_str().unwrap_or(""));
    }
    let Some(longest) = st["longest_ms"].as_f64() else {
        return String::new();
    };
    let at = |unix: f64| t0_unix.map_or(format!("{unix:.1}"), |t0| format!("{:.1} s", unix - t0));
    let listed: Vec<String> = st["stalls"]
        .as_array()
        .into_iter()
        .flatten()
        .take(12)
        .map(|x| {
            format!(
                "{:.0} ms at {}",
                x[1].as_f64().unwrap_or(0.0),
                at(x[0].as_f64().unwrap_or(0.0))
            )
        })
        .collect();
    let drops = st["capture_drops"].as_u64().unwrap_or(0);
    format!(
        "; longest stall {longest:.0} ms, {} of {} ms or more{}{}",
        st["over_threshold"],
        st["threshold_ms"],
        if listed.is_empty() {
            String::new()
        } else {
            format!(" ({})", listed.join(", "))
        },
        if drops > 0 {
            format!(" ({drops} ACKs not captured)")
        } else {
            String::new()
        }
    )
}
