//! `mpquic-lab run SCENARIO.yaml --out DIR`: for each system under test, a fresh lab, the system
//! started, traffic run while the schedule changes the links, counters sampled; then results.json
//! and report.md. A failing step removes the lab and says which step failed. The systems are
//! started by `sut`, report.md and plots are written by `report` and `plot`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::report::write_report;
use crate::scenario::{parse_duration, Kind, Scenario, System, Traffic};
use crate::sut::{
    fill, ns_cmd, route_lan_through, start_mpquic, start_vpn, step, vpn_vars, wait_reachable,
    Named, Procs,
};
use crate::{mpquic_conf, topo};

/// Removes the lab whatever happens to the run (Ctrl-C and SIGTERM included, see
/// `remove_lab_on_interrupt`).
struct LabGuard(String);
impl LabGuard {
    fn new(name: &str) -> LabGuard {
        *CURRENT_LAB.lock().unwrap_or_else(|e| e.into_inner()) = Some(name.to_string());
        LabGuard(name.to_string())
    }
}
impl Drop for LabGuard {
    fn drop(&mut self) {
        topo::teardown(&self.0);
        CURRENT_LAB.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static CURRENT_LAB: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

extern "C" fn on_interrupt(_: libc::c_int) {
    // Only an atomic store: all a signal handler may safely do.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// On SIGINT or SIGTERM, remove the lab of the system being run (its processes die with its
/// namespaces) and exit 130; the run's threads are blocked in iperf3 and ping, so a watcher
/// thread does it. A SIGKILL leaves the lab to `mpquic-lab down --stale`.
fn remove_lab_on_interrupt() {
    // SAFETY: the handler only stores to an atomic. Children get default handlers back at exec.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_interrupt as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_interrupt as *const () as libc::sighandler_t,
        );
    }
    std::thread::spawn(|| loop {
        std::thread::sleep(Duration::from_millis(100));
        if INTERRUPTED.load(Ordering::SeqCst) {
            let lab = CURRENT_LAB.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(name) = lab {
                eprintln!("interrupted: removing lab {name}");
                topo::teardown(&name);
            }
            std::process::exit(130);
        }
    });
}

pub fn run(scenario_path: &Path, out: &Path) -> Result<()> {
    let scn = Scenario::load(scenario_path)?;
    remove_lab_on_interrupt();
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut systems = Vec::new();
    for (system, sys) in scn.systems() {
        eprintln!("== {} / {system}", scn.name);
        let unsupported = match &sys {
            System::Mpquic(opts) => opts.unsupported(),
            _ => Vec::new(),
        };
        let result = if !unsupported.is_empty() {
            json!({"system": system, "status": "unsupported", "reason": format!("needs {} (not in mpquic yet)", unsupported.join(", "))})
        } else {
            match run_system(&scn, &system, &sys, &out.join(&system)) {
                Ok(v) => v,
                Err(e) => json!({"system": system, "status": "failed", "reason": format!("{e:#}")}),
            }
        };
        eprintln!("   {}", result["status"]);
        systems.push(result);
    }
    let report = json!({
        "scenario": scn.name,
        "description": scn.description,
        "paths": scn.paths,
        "schedule": scn.timeline()?.iter().map(|t| json!({"at_s": t.at.as_secs_f64(), "path": t.path, "dir": t.dir, "set": t.set})).collect::<Vec<_>>(),
        "systems": systems,
    });
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    write_report(&report, out)?;
    eprintln!("wrote {}/results.json, report.md and plots", out.display());
    Ok(())
}

fn run_system(scn: &Scenario, system: &str, sys: &System, dir: &Path) -> Result<Value> {
    std::fs::create_dir_all(dir)?;
    let id = std::process::id();
    let name = format!("run{id}");
    let _guard = LabGuard::new(&name);
    let lab = step("lab up", || {
        topo::up(&name, &scn.paths, 1, scn.seed, Some(id))
    })?;
    let mut procs = Procs::default();
    let through_tunnel = (
        lab.namespaces.lan.clone(),
        lab.namespaces.internet.clone(),
        lab.hosts.internet_addr.clone(),
    );
    let (sut_pids, tunnel_if, (src_ns, dst_ns, dst_addr)) = match sys {
        System::Direct(path) => (
            Vec::new(),
            None,
            (
                lab.namespaces.client.clone(),
                lab.namespaces.server.clone(),
                lab.paths[*path].server_addr.clone(),
            ),
        ),
        System::Mptcp => {
            step("kernel MPTCP endpoints on every path", || {
                crate::sut::mptcp_endpoints(&lab)
            })?;
            (
                Vec::new(),
                None,
                (
                    lab.namespaces.client.clone(),
                    lab.namespaces.server.clone(),
                    lab.paths[0].server_addr.clone(),
                ),
            )
        }
        System::Mpquic(opts) => {
            let pids = step("start mpquic", || start_mpquic(opts, &lab, dir, &mut procs))?;
            step("route the LAN through mpquic", || {
                route_lan_through(&lab, 1, "mpq0", mpquic_conf::TUNNEL_NET, true)
            })?;
            (pids, Some("mpq0".to_string()), through_tunnel)
        }
        System::Vpn(def) => {
            let pids = start_vpn(def, &lab, dir, id, &mut procs)?;
            let tun = step(&format!("route the LAN through {system}"), || {
                let vars = vpn_vars(&lab, def, dir, id);
                let tun = fill(&def.tunnel.client_if, &vars)?;
                route_lan_through(&lab, 1, &tun, &fill(&def.tunnel.cidr, &vars)?, true)?;
                wait_reachable(&lab)?;
                Ok(tun)
            })?;
            (pids, Some(tun), through_tunnel)
        }
    };
    // Under kernel MPTCP both ends' iperf3 open MPTCP sockets (mptcpize: an LD_PRELOAD that
    // asks for IPPROTO_MPTCP where the program asks for TCP).
    let launch: Vec<&'static str> = match sys {
        System::Mptcp => vec!["mptcpize", "run"],
        _ => Vec::new(),
    };
    step("start iperf3 servers", || {
        for (i, t) in scn.traffic.iter().enumerate() {
            if matches!(t.kind, Kind::Iperf3) {
                let port = (5201 + i).to_string();
                let mut args = launch.clone();
                args.extend(["iperf3", "-s", "-p", &port]);
                procs.0.push(
                    ns_cmd(&dst_ns, &args)
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()?,
                );
            }
        }
        std::thread::sleep(Duration::from_millis(500));
        Ok(())
    })?;
    // A process parked in the client namespace lets us read its interface counters from /proc.
    let probe = ns_cmd(&lab.namespaces.client, &["sleep", "100000"]).spawn()?;
    let probe_pid = probe.id();
    procs.0.push(probe);
    step("park a process in the client namespace", || {
        // Until `ip netns exec` has entered the namespace, the PID shows the host's interfaces.
        let t = Instant::now();
        while !std::fs::read_to_string(format!("/proc/{probe_pid}/net/dev"))
            .unwrap_or_default()
            .contains("wan1:")
        {
            if t.elapsed() > Duration::from_secs(5) {
                bail!("it does not see the namespace's interfaces after 5 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    })?;

    let warmup = scn.warmup.as_deref().map(parse_duration).transpose()?;
    // A site's background traffic while the system warms up: a ping every 50 ms through it
    // (a tunnel that carries nothing probes its paths slower and learns less of them).
    let background = match warmup {
        Some(_) => Some(
            ns_cmd(&src_ns, &["ping", "-n", "-q", "-i", "0.05", &dst_addr])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()?,
        ),
        None => None,
    };
    let waited = if scn.replays_recordings() {
        step("start at the wall clock's next minute", || {
            wait_for_minute(&name, warmup.unwrap_or_default())
        })
    } else if let Some(w) = warmup {
        step("warm up", || {
            std::thread::sleep(w);
            Ok(())
        })
    } else {
        Ok(())
    };
    if let Some(mut ping) = background {
        let _ = ping.kill();
        let _ = ping.wait();
    }
    waited?;
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    // ping -D stamps replies with the wall clock; this converts them to run time.
    let t0_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let sample_every = parse_duration(&scn.sample)?;
    let npaths = lab.paths.len();
    let sampler = {
        let stop = stop.clone();
        let what = Sampled {
            lab: name.clone(),
            probe: probe_pid,
            npaths,
            // The emulator beside the system: both share the machine's cores.
            pids: sut_pids
                .iter()
                .cloned()
                .chain(
                    lab.emulator_pid
                        .map(|p| ("emulator (mpquic-lab)".to_string(), p)),
                )
                .collect(),
            tunnel_if: tunnel_if.clone(),
            status_sockets: if matches!(sys, System::Mpquic(_)) {
                ["client1", "server"]
                    .iter()
                    .map(|who| (who.to_string(), mpquic_conf::socket(dir, who)))
                    .collect()
            } else {
                Vec::new()
            },
        };
        std::thread::spawn(move || sample(&what, t0, sample_every, &stop))
    };
    let timeline = scn.timeline()?;
    let sched = {
        let name = name.clone();
        std::thread::spawn(move || {
            let mut applied = Vec::new();
            for c in timeline {
                let due = t0 + c.at;
                if let Some(w) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(w);
                }
                let r = topo::control(&name, &format!("set {} {} {}", c.path, c.dir, c.set));
                applied.push(json!({"at_s": c.at.as_secs_f64(), "path": c.path, "set": c.set, "ok": r.is_ok(), "error": r.err().map(|e| e.to_string())}));
            }
            applied
        })
    };
    let handles: Vec<_> = scn
        .traffic
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (t, ns, dst, dst_ns, launch) = (
                t.clone(),
                src_ns.clone(),
                dst_addr.clone(),
                dst_ns.clone(),
                launch.clone(),
            );
            std::thread::spawn(move || {
                let from = Sender {
                    ns: &ns,
                    dst: &dst,
                    dst_ns: &dst_ns,
                    launch: &launch,
                };
                traffic(&t, i, &from, t0, t0_unix)
            })
        })
        .collect();
    let results: Vec<Value> = handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| json!({"error": "traffic thread panicked"}))
        })
        .collect();
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().unwrap_or_default();
    let applied = sched.join().unwrap_or_default();
    let emu_stats = topo::control(&name, "stats")
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok());
    // mpquic's own view at the end (drops by reason, per path), next to the lab's.
    let mpquic_status = matches!(sys, System::Mpquic(_)).then(|| {
        let one = |who: &str| {
            Command::new(mpquic_conf::mpquic_bin())
                .args(["status", "--json", "--socket"])
                .arg(mpquic_conf::socket(dir, who))
                .output()
                .ok()
                .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        };
        json!({"client": one("client1"), "server": one("server")})
    });
    Ok(json!({
        "mpquic_status": mpquic_status,
        "system": system,
        "status": "ok",
        "traffic": results,
        "samples": samples,
        // The run's start on the wall clock: what a link that follows it (Starlink's slots)
        // did at each second of the run.
        "t0_unix": t0_unix,
        "schedule_applied": applied,
        "emulator": emu_stats,
        "path_mean_mbit": mean_rates(&samples, npaths),
    }))
}

/// Where traffic starts: its namespace, the address it goes to, and the command prefix its
/// iperf3 runs under (`mptcpize run` for kernel MPTCP).
struct Sender<'a> {
    ns: &'a str,
    dst: &'a str,
    /// The namespace `dst` is in (a voice call's answerer runs there).
    dst_ns: &'a str,
    launch: &'a [&'static str],
}

/// Links that replay recordings or wall-clock slots play them from an epoch: every system a
/// scenario compares starts its traffic at the start of a wall-clock minute, with the epoch set
/// there, so each meets the same part of the recordings, and the same slots, at the same time
/// into its run (and Starlink's slot boundaries stay at 12, 27, 42 and 57 s past the minute).
/// Waits at least `warmup` and at least 2 s (for the emulator to take the epoch), then up to
/// a minute more.
fn wait_for_minute(lab: &str, warmup: Duration) -> Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let earliest = now + warmup.as_secs_f64().max(2.0);
    let start = (earliest / 60.0).ceil() * 60.0;
    topo::control(lab, &format!("epoch {start:.3}"))?;
    let wait = start
        - std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
    std::thread::sleep(Duration::from_secs_f64(wait.max(0.0)));
    Ok(())
}

/// `mpquic-lab ARGS` (this very binary) in namespace `ns` under `launch` (`mptcpize run` for
/// kernel MPTCP), its output captured: one side of a voice call or of web-like transfers.
fn spawn_lab(ns: &str, launch: &[&str], args: &[&str]) -> std::io::Result<std::process::Child> {
    let exe = std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "mpquic-lab".into());
    let mut argv = launch.to_vec();
    argv.push(exe.as_str());
    argv.extend_from_slice(args);
    ns_cmd(ns, &argv)
        // A side that runs until told (`stalls`) ends when its standard input closes.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

/// What a side started by `spawn_lab` printed (JSON), or its error.
fn lab_output(c: std::process::Child) -> Result<Value> {
    let out = c.wait_with_output()?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// A voice-like call (`voice.rs`) from the source to the destination's namespace, both ways,
/// judged per direction.
fn voice(
    t: &Traffic,
    i: usize,
    from: &Sender,
    label: &str,
    start: Duration,
    dur: Duration,
) -> Value {
    let port = (5300 + i).to_string();
    let rate = t.pps.unwrap_or(50.0);
    let pps = rate.to_string();
    let len = t.length.unwrap_or(200).to_string();
    let secs = dur.as_secs_f64().to_string();
    let side = |ns: &str, role: &str, at: &str| {
        spawn_lab(
            ns,
            &[],
            &[
                "voice",
                role,
                at,
                "--pps",
                &pps,
                "--len",
                &len,
                "--seconds",
                &secs,
            ],
        )
    };
    let result = (|| -> Result<Value> {
        let answer = side(from.dst_ns, "answer", &port)?;
        // The answerer binds its port before the first packet is due.
        std::thread::sleep(Duration::from_millis(200));
        let call = side(from.ns, "call", &format!("{}:{port}", from.dst))?;
        let (call, answer) = (lab_output(call)?, lab_output(answer)?);
        let rows = |v: &Value| -> Vec<[u64; 3]> {
            serde_json::from_value(v["received"].clone()).unwrap_or_default()
        };
        Ok(json!({
            "up": crate::voice::judge(call["sent"].as_u64().unwrap_or(0), &rows(&answer), rate),
            "down": crate::voice::judge(answer["sent"].as_u64().unwrap_or(0), &rows(&call), rate),
        }))
    })();
    let mut v = json!({"label": label, "kind": "voice", "start_s": start.as_secs_f64()});
    match result {
        Ok(r) => {
            v["up"] = r["up"].clone();
            v["down"] = r["down"].clone();
        }
        Err(e) => v["error"] = json!(format!("{e:#}")),
    }
    v
}

/// Web-like transfers (`web.rs`): the source fetches objects from a server in the
/// destination's namespace, `streams` at a time, judged by completion time.
fn web(t: &Traffic, i: usize, from: &Sender, label: &str, start: Duration, dur: Duration) -> Value {
    let port = (5400 + i).to_string();
    let size = t.length.unwrap_or(100_000).to_string();
    let parallel = t.streams.to_string();
    let secs = dur.as_secs_f64().to_string();
    let result = (|| -> Result<Value> {
        let server = spawn_lab(
            from.dst_ns,
            from.launch,
            &["web", "serve", &port, "--seconds", &secs],
        )?;
        // The server binds its port before the first fetch (a fetch that races it fails and
        // is counted, so this only keeps the count clean).
        std::thread::sleep(Duration::from_millis(200));
        let at = format!("{}:{port}", from.dst);
        let args = [
            "web",
            "fetch",
            &at,
            "--size",
            &size,
            "--parallel",
            &parallel,
            "--seconds",
            &secs,
        ];
        let fetched = lab_output(spawn_lab(from.ns, from.launch, &args)?);
        // The server stays up for the fetches' timeout after its time: not waited for.
        let mut server = server;
        let _ = server.kill();
        let _ = server.wait();
        Ok(crate::web::judge(&fetched?, dur.as_secs_f64()))
    })();
    let mut v = json!({"label": label, "kind": "web", "start_s": start.as_secs_f64(),
        "object_bytes": t.length.unwrap_or(100_000), "parallel": t.streams});
    match result {
        Ok(r) => v["result"] = r,
        Err(e) => v["error"] = json!(format!("{e:#}")),
    }
    v
}

/// Traffic item `i`, sent `from`.
fn traffic(t: &Traffic, i: usize, from: &Sender, t0: Instant, t0_unix: f64) -> Value {
    let (src_ns, dst) = (from.ns, from.dst);
    let start = parse_duration(&t.start).unwrap_or_default();
    let dur = parse_duration(&t.duration).unwrap_or_default();
    if let Some(w) = (t0 + start).checked_duration_since(Instant::now()) {
        std::thread::sleep(w);
    }
    let label = t
        .label
        .clone()
        .unwrap_or_else(|| format!("{:?} {i}", t.kind).to_lowercase());
    match t.kind {
        Kind::Iperf3 => match &t.rates {
            Some(rates) => {
                // Rising rates: the sweep ends at the first that fails or loses 1% or more (an
                // unreachable server would otherwise cost a connect timeout per rate). Lost is
                // iperf3's count (gaps below the highest datagram received): what was still in
                // flight when a step ended is not lost, and counting it (as `undelivered`
                // does, reported beside) put a floor of RTT / step under every step: 0.77% on
                // a 30 ms path in 4 s.
                let mut steps: Vec<Value> = Vec::new();
                for r in rates {
                    let v = iperf3(t, i, from, Some(r), &label, start);
                    let fine = sweep_ok(&v);
                    steps.push(v);
                    if !fine {
                        break;
                    }
                }
                // The most delivered with less than 1% lost.
                let best = steps
                    .iter()
                    .filter(|v| sweep_ok(v))
                    .filter_map(|v| v["mbit"].as_f64())
                    .fold(0.0f64, f64::max);
                json!({
                    "label": label, "kind": "iperf3", "protocol": t.protocol, "streams": t.streams,
                    "reverse": t.reverse, "start_s": start.as_secs_f64(), "mbit": best,
                    "sweep": steps,
                })
            }
            None => iperf3(t, i, from, t.rate.as_deref(), &label, start),
        },
        Kind::Voice => voice(t, i, from, &label, start, dur),
        Kind::Web => web(t, i, from, &label, start, dur),
        Kind::Idle => {
            std::thread::sleep(dur);
            json!({"label": label, "kind": "idle", "start_s": start.as_secs_f64(), "duration_s": dur.as_secs_f64()})
        }
        Kind::Ping => {
            let iv = parse_duration(&t.interval).unwrap_or(Duration::from_millis(100));
            let count = ((dur.as_secs_f64() / iv.as_secs_f64()) as u64)
                .max(1)
                .to_string();
            let ivs = format!("{}", iv.as_secs_f64());
            let out = ns_cmd(
                src_ns,
                &["ping", "-n", "-D", "-i", &ivs, "-c", &count, "-W", "1", dst],
            )
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
            let mut seqs = Vec::new();
            let mut rtts = Vec::new();
            // Reply times (ping -D): the send time is the reply time minus the RTT.
            // Send time (run time, s) of each answered ping, by sequence number.
            let mut sent_by_seq = std::collections::BTreeMap::new();
            for l in out.lines() {
                if let (Some(s), Some(r)) = (field(l, "icmp_seq="), field(l, "time=")) {
                    seqs.push(s as u64);
                    rtts.push(r);
                    if let Some(ts) = l
                        .strip_prefix('[')
                        .and_then(|x| x.split(']').next())
                        .and_then(|x| x.parse::<f64>().ok())
                    {
                        sent_by_seq.insert(s as u64, ts - r / 1000.0 - t0_unix);
                    }
                }
            }
            let mut sent_at: Vec<f64> = sent_by_seq.values().copied().collect();
            sent_at.sort_by(|a, b| a.total_cmp(b));
            let sent: u64 = count.parse().unwrap_or(0);
            let mut sorted = rtts.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let pct = |q: f64| {
                sorted
                    .get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1)))
                    .copied()
            };
            // Longest stretch of wall-clock time whose pings got no answer (between the send
            // times of consecutive answered pings, minus one interval).
            let got: std::collections::HashSet<u64> = seqs.iter().copied().collect();
            let longest_gap = sent_at
                .windows(2)
                .map(|w| w[1] - w[0] - iv.as_secs_f64())
                .fold(0.0f64, f64::max)
                .max(0.0);
            let late = rtts.iter().filter(|r| **r > 1000.0).count();
            let by_seq: std::collections::HashMap<u64, f64> =
                seqs.iter().copied().zip(rtts.iter().copied()).collect();
            // An unanswered ping's send time: interpolated between the answered ones around it
            // (ping's real interval is a little longer than asked), else one interval per
            // sequence number from the nearest answered one, else from the scheduled start.
            let iv_s = iv.as_secs_f64();
            let series: Vec<Value> = (1..=sent)
                .map(|k| {
                    let before = sent_by_seq.range(..=k).next_back();
                    let after = sent_by_seq.range(k..).next();
                    let t = match (before, after) {
                        (Some((&sb, &tb)), Some((&sa, &ta))) if sa > sb => {
                            tb + (ta - tb) * (k - sb) as f64 / (sa - sb) as f64
                        }
                        (Some((&sb, &tb)), _) => tb + (k - sb) as f64 * iv_s,
                        (None, Some((&sa, &ta))) => ta - (sa - k) as f64 * iv_s,
                        (None, None) => start.as_secs_f64() + (k - 1) as f64 * iv_s,
                    };
                    json!([(t * 1000.0).round() / 1000.0, by_seq.get(&k)])
                })
                .collect();
            json!({
                "label": label, "kind": "ping", "start_s": start.as_secs_f64(), "sent": sent, "received": got.len(),
                "loss_percent": if sent > 0 { 100.0 * (sent - got.len() as u64) as f64 / sent as f64 } else { 0.0 },
                "rtt_ms": {"min": sorted.first(), "median": pct(0.5), "p99": pct(0.99), "max": sorted.last()},
                "longest_gap_s": longest_gap,
                "late_replies": late,
                // [t_s, rtt_ms or null] per ping sent, t_s from the start of the run.
                "series": series,
            })
        }
    }
}

fn field(line: &str, key: &str) -> Option<f64> {
    let rest = &line[line.find(key)? + key.len()..];
    rest.split(|c: char| c.is_whitespace()).next()?.parse().ok()
}

/// What the sampler reads: the lab's emulator, a process parked in the client namespace (whose
/// /proc/PID/net/dev are that namespace's interfaces), the system's processes, the tunnel.
struct Sampled {
    lab: String,
    probe: u32,
    npaths: usize,
    pids: Named,
    tunnel_if: Option<String>,
    /// mpquic's control sockets (client, server), whose paths' state is sampled too.
    status_sockets: Vec<(String, PathBuf)>,
}

/// What each path of an mpquic side says of itself now (`mpquic status --json`): its
/// controller's view (RTTs, window, pacing rate), where its traffic goes, what it lost and
/// what it dropped (per reason: a stall of an inner flow lines up with the tunnel's own drops
/// or not), so a second that went wrong in a run can be read against what the tunnel believed
/// then.
fn path_states(socket: &Path) -> Value {
    let Some(status) = Command::new(mpquic_conf::mpquic_bin())
        .args(["status", "--json", "--socket"])
        .arg(socket)
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
    else {
        return Value::Null;
    };
    let keys = [
        "name",
        "state",
        "carry",
        "srtt_ms",
        "quic_rtt_ms",
        "min_rtt_ms",
        "cwnd_bytes",
        "pacing_mbit",
        "probe_loss_pct",
        "quic_lost_packets",
        "flows",
        "flows_moved",
        "playout_ms",
        "drops",
    ];
    let paths: Vec<Value> = status["tunnels"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|t| t["paths"].as_array().cloned().unwrap_or_default())
        .map(|p| {
            keys.iter()
                .filter(|k| !p[**k].is_null())
                .map(|k| (k.to_string(), p[*k].clone()))
                .collect::<serde_json::Map<_, _>>()
                .into()
        })
        .collect();
    Value::Array(paths)
}

/// Interface counters of wan1..N and of the tunnel in the client namespace, the emulator's
/// per-path counters, and CPU/RSS of the system's processes.
fn sample(what: &Sampled, t0: Instant, every: Duration, stop: &AtomicBool) -> Vec<Value> {
    let Sampled {
        lab,
        probe,
        npaths,
        pids,
        tunnel_if,
        status_sockets,
    } = what;
    let tick = 100.0;
    let mut out = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let dev = std::fs::read_to_string(format!("/proc/{probe}/net/dev")).unwrap_or_default();
        let paths: Vec<Value> = (1..=*npaths)
            .map(|k| {
                let f = if_counters(&dev, &format!("wan{k}"));
                json!({"rx_bytes": f.first(), "tx_bytes": f.get(8), "rx_packets": f.get(1), "tx_packets": f.get(9)})
            })
            .collect();
        // The kernel drops packets on their way into a tunnel when its TUN queue is full, before
        // the VPN sees them: only the interface's counters show that loss.
        let tunnel = tunnel_if.as_deref().map(|t| {
            let f = if_counters(&dev, t);
            json!({"tx_packets": f.get(9), "tx_dropped": f.get(11), "rx_dropped": f.get(3)})
        });
        let procs: Vec<Value> = pids
            .iter()
            .map(|(name, p)| {
                let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
                let x: Vec<&str> = stat
                    .rsplit(')')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .collect();
                let cpu = x.get(11).and_then(|u| u.parse::<f64>().ok()).unwrap_or(0.0)
                    + x.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
                let status =
                    std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
                let rss = status
                    .lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<u64>().ok());
                json!({"name": name, "pid": p, "cpu_s": cpu / tick, "rss_kib": rss})
            })
            .collect();
        // Packets into each emulated direction and those it dropped (any reason): loss over time.
        let emu: Vec<Value> = topo::control(lab, "stats")
            .ok()
            .and_then(|s| serde_json::from_str::<Value>(&s).ok())
            .and_then(|v| v["paths"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .map(|p| {
                let d = |x: &Value| {
                    let st = &x["stats"];
                    let model: u64 = [
                        "dropped_state",
                        "dropped_mtu",
                        "dropped_loss",
                        "dropped_flow_cap",
                        "dropped_queue",
                        "dropped_codel",
                    ]
                    .iter()
                    .map(|k| st[*k].as_u64().unwrap_or(0))
                    .sum();
                    // The shell's own losses are losses the traffic saw too.
                    let shell: u64 = ["socket_drops", "oversize_drops", "send_errors"]
                        .iter()
                        .map(|k| x[*k].as_u64().unwrap_or(0))
                        .sum();
                    let dropped = model + shell;
                    json!({"in": st["in_packets"], "dropped": dropped})
                };
                json!({"up": d(&p["up"]), "down": d(&p["down"])})
            })
            .collect();
        let mut row = json!({"t_s": t0.elapsed().as_secs_f64(), "paths": paths, "tunnel_if": tunnel, "emulator": emu, "procs": procs});
        if !status_sockets.is_empty() {
            row["mpquic_paths"] = status_sockets
                .iter()
                .map(|(who, socket)| (who.clone(), path_states(socket)))
                .collect::<serde_json::Map<_, _>>()
                .into();
        }
        out.push(row);
        std::thread::sleep(every);
    }
    out
}

/// The counters of interface `name` in a /proc/net/dev text: rx bytes, packets, errs, drop, ...,
/// then tx bytes (index 8), packets (9), errs (10), drop (11), ...
fn if_counters(dev: &str, name: &str) -> Vec<u64> {
    dev.lines()
        .filter_map(|l| l.trim_start().split_once(':'))
        .find(|(n, _)| *n == name)
        .map(|(_, rest)| {
            rest.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Bytes of Ethernet header in each frame the interface counters count.
const ETHERNET_HEADER: f64 = 14.0;

/// Mean Mbit/s per path and direction over the run (client side: tx = upload, rx = download).
fn mean_rates(samples: &[Value], npaths: usize) -> Value {
    let (Some(a), Some(b)) = (samples.first(), samples.last()) else {
        return json!([]);
    };
    let dt = b["t_s"].as_f64().unwrap_or(0.0) - a["t_s"].as_f64().unwrap_or(0.0);
    (0..npaths)
        .map(|i| {
            let d = |k: &str| {
                (b["paths"][i][k]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(a["paths"][i][k].as_u64().unwrap_or(0))) as f64
                    * 8.0
                    / dt.max(1e-9)
                    / 1e6
            };
            // IP packets whole (as a `rate_limit` or a carrier counts them): the frames less
            // their Ethernet headers.
            let ip = |bytes: &str, packets: &str| {
                let frames = d(bytes);
                frames - d(packets) * ETHERNET_HEADER
            };
            json!({"path": i + 1, "up_mbit": d("tx_bytes"), "down_mbit": d("rx_bytes"),
                   "up_ip_mbit": ip("tx_bytes", "tx_packets"), "down_ip_mbit": ip("rx_bytes", "rx_packets")})
        })
        .collect()
}

/// A sweep step that counts: it ran, and lost less than 1%.
fn sweep_ok(v: &Value) -> bool {
    v.get("error").is_none() && v["lost_percent"].as_f64().is_some_and(|l| l < 1.0)
}

/// `net.ipv4.tcp_ecn` in `ns`: its value before, after setting it to `set` (if any).
fn tcp_ecn(ns: &str, set: Option<&str>) -> Option<String> {
    let was = ns_cmd(ns, &["sysctl", "-n", "net.ipv4.tcp_ecn"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|v| !v.is_empty());
    if let Some(v) = set {
        let _ = ns_cmd(ns, &["sysctl", "-qw", &format!("net.ipv4.tcp_ecn={v}")]).status();
    }
    was
}

/// One iperf3 run of traffic item `i` at `rate` (iperf3 -b; UDP defaults to 100M).
fn iperf3(
    t: &Traffic,
    i: usize,
    from: &Sender,
    rate: Option<&str>,
    label: &str,
    start: Duration,
) -> Value {
    let dur = parse_duration(&t.duration).unwrap_or_default();
    let port = (5201 + i).to_string();
    let secs = format!("{}", dur.as_secs().max(1));
    let streams = t.streams.to_string();
    // A server it cannot reach (its path black-holed) fails in 5 s, not at the kernel's SYN
    // timeout of about two minutes.
    let mut args = from.launch.to_vec();
    args.extend([
        "iperf3",
        "-c",
        from.dst,
        "-p",
        &port,
        "-t",
        &secs,
        "-P",
        &streams,
        "-J",
        "-i",
        "1",
        "--connect-timeout",
        "5000",
    ]);
    if t.reverse {
        args.push("-R");
    }
    if t.protocol == "udp" {
        // A 4 MiB socket buffer at both ends (net.core.rmem_max here): with the default 208 KiB
        // the LAN host's iperf3 itself dropped 3056 datagrams of a 300 Mbit/s stream on this
        // 2-core machine (RcvbufErrors), whatever carried them, and the UDP sweeps measured it.
        args.extend(["-u", "-w", "4M"]);
    }
    let rate = rate.map(str::to_string).unwrap_or_else(|| {
        if t.protocol == "udp" {
            "100M".into()
        } else {
            String::new()
        }
    });
    if !rate.is_empty() {
        args.extend(["-b", &rate]);
    }
    let len = t.length.map(|l| l.to_string());
    if let Some(l) = &len {
        args.extend(["-l", l]);
    }
    if let Some(cc) = &t.tcp_congestion {
        args.extend(["-C", cc]);
    }
    // The receiver's ACKs say how long the flows stalled (`stalls.rs`); not under kernel
    // MPTCP, whose TCP ACKs are per subflow.
    let watch = (t.protocol == "tcp" && from.launch.is_empty()).then(|| {
        let receiver = if t.reverse { from.ns } else { from.dst_ns };
        spawn_lab(receiver, &[], &["stalls", &port])
    });
    // What the connecting host asked for while the item ran (results.json `ecn`).
    let ecn_was = t.ecn.then(|| tcp_ecn(from.ns, Some("1")));
    let ecn = t.ecn && tcp_ecn(from.ns, None).as_deref() == Some("1");
    let out = ns_cmd(from.ns, &args).output();
    if let Some(Some(was)) = &ecn_was {
        tcp_ecn(from.ns, Some(was.as_str()));
    }
    let stalls = match watch {
        None => Value::Null,
        Some(w) => match w.map_err(anyhow::Error::from).and_then(lab_output) {
            Ok(v) => v,
            Err(e) => json!({"error": format!("{e:#}")}),
        },
    };
    let v: Value = out
        .ok()
        .and_then(|o| serde_json::from_slice(&o.stdout).ok())
        .unwrap_or_else(|| json!({"error": "iperf3 produced no JSON"}));
    if let Some(e) = v.get("error") {
        return json!({"label": label, "kind": "iperf3", "error": e});
    }
    let end = &v["end"];
    let recv = if end.get("sum_received").is_some() {
        &end["sum_received"]
    } else {
        &end["sum"]
    };
    let intervals: Vec<f64> = v["intervals"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| i["sum"]["bits_per_second"].as_f64().unwrap_or(0.0) / 1e6)
                .collect()
        })
        .unwrap_or_default();
    // The sending TCP's own view per interval, where iperf3 has it (an upload: the sender is
    // the local end): retransmissions, and the first stream's window and smoothed RTT, so a
    // slow second can be told apart as a small window, a long RTT or losses.
    let sender: Vec<Value> = v["intervals"]
        .as_array()
        .filter(|_| t.protocol == "tcp" && !t.reverse)
        .map(|a| {
            a.iter()
                .map(|i| {
                    let s = &i["streams"][0];
                    json!({
                        "retransmits": i["sum"]["retransmits"],
                        "cwnd_kib": s["snd_cwnd"].as_f64().map(|b| (b / 1024.0).round()),
                        "rtt_ms": s["rtt"].as_f64().map(|us| (us / 100.0).round() / 10.0),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    json!({
        "label": label, "kind": "iperf3", "protocol": t.protocol, "streams": t.streams, "reverse": t.reverse,
        "rate": rate,
        // iperf3 names the sending side's algorithm at the end (null for UDP); the scenario's
        // `tcp_congestion` when an older iperf3 does not.
        "tcp_congestion": end["sender_tcp_congestion"].as_str().or(t.tcp_congestion.as_deref()),
        "ecn": ecn,
        "start_s": start.as_secs_f64(),
        "mbit": recv["bits_per_second"].as_f64().unwrap_or(0.0) / 1e6,
        "retransmits": end["sum_sent"]["retransmits"],
        "lost_percent": recv["lost_percent"],
        // UDP: iperf3's loss counts gaps below the highest number received, so packets
        // a tunnel still holds (or dropped at its tail) when the test ends are not in
        // it; sent vs received packets counts them.
        "sent_mbit": end["sum_sent"]["bits_per_second"].as_f64().map(|b| b / 1e6),
        "undelivered_percent": match (end["sum_sent"]["packets"].as_f64(), recv["packets"].as_f64(), recv["lost_packets"].as_f64()) {
            (Some(sent), Some(n), Some(lost)) if sent > 0.0 => Some(100.0 * (sent - (n - lost)).max(0.0) / sent),
            _ => None,
        },
        "intervals_mbit": intervals,
        "intervals_sender": sender,
        "stalls": stalls,
    })
}
