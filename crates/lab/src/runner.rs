//! `mpquic-lab run SCENARIO.yaml --out DIR`: for each system under test, a fresh lab, the system
//! started, traffic run while the schedule changes the links, counters sampled; then results.json
//! and report.md. A failing step removes the lab and says which step failed.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::scenario::{parse_duration, Kind, MpquicOpts, Scenario, System, Traffic, VpnDef};
use crate::topo::{self, LabState};

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

/// Processes this run started; SIGTERM on drop.
#[derive(Default)]
struct Procs(Vec<Child>);
impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // SAFETY: signalling a child we started.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

fn ns_cmd(ns: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    c
}

fn mpquic_bin() -> PathBuf {
    std::env::var_os("MPQUIC_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join("mpquic")))
        })
        .unwrap_or_else(|| PathBuf::from("mpquic"))
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

/// Plots and report.md from a run's results.
fn write_report(report: &Value, out: &Path) -> Result<()> {
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

fn step<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    f().with_context(|| format!("step `{name}` failed"))
}

fn run_system(scn: &Scenario, system: &str, sys: &System, dir: &Path) -> Result<Value> {
    std::fs::create_dir_all(dir)?;
    let id = std::process::id();
    let name = format!("run{id}");
    let _guard = LabGuard::new(&name);
    let lab = step("lab up", || topo::up(&name, &scn.paths, scn.seed, Some(id)))?;
    let mut procs = Procs::default();
    let through_tunnel = (
        lab.namespaces.lan.clone(),
        lab.namespaces.internet.clone(),
        lab.hosts.internet_addr.clone(),
    );
    let (sut_pids, tunnel_if, (src_ns, dst_ns, dst_addr)) = match sys {
        System::Direct => (
            Vec::new(),
            None,
            (
                lab.namespaces.client.clone(),
                lab.namespaces.server.clone(),
                lab.paths[0].server_addr.clone(),
            ),
        ),
        System::Mpquic(opts) => {
            let pids = step("start mpquic", || start_mpquic(opts, &lab, dir, &mut procs))?;
            step("route the LAN through mpquic", || {
                route_lan_through(&lab, "mpq0", MPQUIC_TUNNEL_NET)
            })?;
            (pids, Some("mpq0".to_string()), through_tunnel)
        }
        System::Vpn(def) => {
            let pids = start_vpn(def, &lab, dir, id, &mut procs)?;
            let tun = step(&format!("route the LAN through {system}"), || {
                let vars = vpn_vars(&lab, dir, id);
                let tun = fill(&def.tunnel.client_if, &vars)?;
                route_lan_through(&lab, &tun, &fill(&def.tunnel.cidr, &vars)?)?;
                wait_reachable(&lab)?;
                Ok(tun)
            })?;
            (pids, Some(tun), through_tunnel)
        }
    };
    step("start iperf3 servers", || {
        for (i, t) in scn.traffic.iter().enumerate() {
            if matches!(t.kind, Kind::Iperf3) {
                let port = (5201 + i).to_string();
                procs.0.push(
                    ns_cmd(&dst_ns, &["iperf3", "-s", "-p", &port])
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
            pids: sut_pids.clone(),
            tunnel_if: tunnel_if.clone(),
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
            let (t, src, dst) = (t.clone(), src_ns.clone(), dst_addr.clone());
            std::thread::spawn(move || traffic(&t, i, &src, &dst, t0, t0_unix))
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
            Command::new(mpquic_bin())
                .args(["status", "--json", "--socket"])
                .arg(dir.join(format!("{who}.sock")))
                .output()
                .ok()
                .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        };
        json!({"client": one("client"), "server": one("server")})
    });
    Ok(json!({
        "mpquic_status": mpquic_status,
        "system": system,
        "status": "ok",
        "traffic": results,
        "samples": samples,
        "schedule_applied": applied,
        "emulator": emu_stats,
        "path_mean_mbit": mean_rates(&samples, npaths),
    }))
}

/// PKI, configs from templates filled with the lab's addresses, server and client started, routes.
/// The system's processes, by name (`mpquic server`, `client: wireguard-go`...), for sampling.
type Named = Vec<(String, u32)>;

fn start_mpquic(m: &MpquicOpts, lab: &LabState, dir: &Path, procs: &mut Procs) -> Result<Named> {
    let bin = mpquic_bin();
    let b = bin.to_str().ok_or_else(|| anyhow!("bad mpquic path"))?;
    let pki = dir.join("pki");
    let p = pki.to_str().unwrap_or_default();
    for args in [
        vec!["pki", "init", "--dir", p, "--force"],
        vec![
            "pki",
            "server",
            "--dir",
            p,
            "--name",
            "mpquic-server",
            "--san",
            topo::SERVER_SERVICE_ADDR,
        ],
        vec!["pki", "client", "--dir", p, "--name", "site1"],
    ] {
        let o = Command::new(b)
            .args(&args)
            .output()
            .with_context(|| format!("running {b}"))?;
        if !o.status.success() {
            bail!(
                "mpquic {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
    let server_sock = dir.join("server.sock");
    let client_sock = dir.join("client.sock");
    let server = format!(
        "role: server\nbind_ip: 0.0.0.0\nremote_port: 45017\ntun_name: mpq0\ntun_cidr: 10.200.17.254/24\n\
         tls_cert_file: {p}/mpquic-server.crt\ntls_key_file: {p}/mpquic-server.key\n\
         congestion_algorithm: {cc}\ntransport_mode: {mode}\ncontrol_socket: {s}\n",
        cc = m.congestion,
        mode = m.mode,
        s = server_sock.display()
    );
    let mut client = format!(
        "role: client\nmultipath_enabled: true\nmultipath_policy: {pol}\ntun_name: mpq0\ntun_cidr: 10.200.17.1/24\n\
         tls_ca_file: {p}/ca.crt\ntls_cert_file: {p}/site1.crt\ntls_key_file: {p}/site1.key\n\
         tls_server_name: mpquic-server\ncongestion_algorithm: {cc}\ntransport_mode: {mode}\ncontrol_socket: {s}\n\
         multipath_paths:\n",
        pol = m.policy,
        cc = m.congestion,
        mode = m.mode,
        s = client_sock.display()
    );
    for (i, path) in lab.paths.iter().enumerate() {
        let prio = m
            .priorities
            .as_ref()
            .and_then(|v| v.get(i).copied())
            .unwrap_or(i as u32 + 1);
        let weight = m
            .weights
            .as_ref()
            .and_then(|v| v.get(i).copied())
            .unwrap_or(1);
        let _ = write!(
            client,
            "- name: wan{k}\n  bind_ip: if:{ifn}\n  remote_addr: {addr}\n  remote_port: 45017\n  priority: {prio}\n  weight: {weight}\n",
            k = path.index,
            ifn = path.client_if,
            addr = topo::SERVER_SERVICE_ADDR
        );
    }
    std::fs::write(dir.join("server.yaml"), server)?;
    std::fs::write(dir.join("client.yaml"), client)?;
    let mut pids = Vec::new();
    for (who, ns) in [
        ("server", &lab.namespaces.server),
        ("client", &lab.namespaces.client),
    ] {
        let log = std::fs::File::create(dir.join(format!("{who}.log")))?;
        let cfg = dir.join(format!("{who}.yaml"));
        let child = ns_cmd(ns, &[b, "--config", cfg.to_str().unwrap_or_default()])
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        pids.push((format!("mpquic {who}"), child.id()));
        procs.0.push(child);
        if who == "server" {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    let t0 = Instant::now();
    loop {
        let o = Command::new(b)
            .args(["status", "--json", "--socket"])
            .arg(&client_sock)
            .output()?;
        if o.status.success() {
            let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            let t = &v["tunnels"][0];
            let up = t["paths"]
                .as_array()
                .is_some_and(|p| p.iter().all(|x| x["state"] == "up"));
            if t["address"].is_string() && up {
                break;
            }
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let log = std::fs::read_to_string(dir.join("client.log")).unwrap_or_default();
            bail!("tunnel not up within 20 s; client log:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(pids)
}

/// The subnet of the server's tunnel in the mpquic configuration this runner writes.
const MPQUIC_TUNNEL_NET: &str = "10.200.17.0/24";

/// Make the LAN host reach the internet host through the client's tunnel interface: a route to
/// the internet subnet over the tunnel, the LAN masqueraded behind the client's tunnel address,
/// and the internet host's way back to the tunnel subnet via the server. The same for every VPN.
fn route_lan_through(lab: &LabState, tun_if: &str, tunnel_net: &str) -> Result<()> {
    let (inet_net, gw) = (topo::INTERNET_NET, topo::INTERNET_GW);
    topo::ns_run(
        &lab.namespaces.client,
        &format!("ip route replace {inet_net} dev {tun_if}"),
    )?;
    topo::ns_run(
        &lab.namespaces.client,
        &format!("nft -f - <<'EOF'\nadd table ip labnat\nadd chain ip labnat post {{ type nat hook postrouting priority 100 ; }}\nadd rule ip labnat post oifname {tun_if} masquerade\nEOF"),
    )?;
    topo::ns_run(
        &lab.namespaces.internet,
        &format!("ip route replace {tunnel_net} via {gw}"),
    )?;
    Ok(())
}

/// The LAN host reaches the internet host (only possible through a tunnel: the client router has
/// no other route to it), within 20 s.
fn wait_reachable(lab: &LabState) -> Result<()> {
    let t0 = Instant::now();
    let ping = format!("ping -n -c 1 -W 1 {}", lab.hosts.internet_addr);
    while topo::ns_run(&lab.namespaces.lan, &ping).is_err() {
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("the internet host is not reachable from the LAN host through the tunnel within 20 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// The values a VPN definition's `{{name}}` placeholders may use.
fn vpn_vars(lab: &LabState, dir: &Path, id: u32) -> Vec<(String, String)> {
    let mut v = vec![
        ("id".to_string(), id.to_string()),
        ("dir".into(), dir.display().to_string()),
        ("server_addr".into(), lab.hosts.server_service_addr.clone()),
        ("lan_addr".into(), lab.hosts.lan_addr.clone()),
        ("internet_addr".into(), lab.hosts.internet_addr.clone()),
        ("internet_net".into(), topo::INTERNET_NET.into()),
    ];
    for p in &lab.paths {
        let k = p.index;
        v.push((format!("path{k}_if"), p.client_if.clone()));
        v.push((format!("path{k}_addr"), p.client_addr.clone()));
        v.push((format!("path{k}_server_addr"), p.server_addr.clone()));
    }
    v
}

/// `template` with every `{{name}}` replaced; an unknown name is an error that lists the known.
fn fill(template: &str, vars: &[(String, String)]) -> Result<String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(i) = rest.find("{{") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| anyhow!("unclosed `{{{{` in `{template}`"))?;
        let key = after[..end].trim();
        let val = vars.iter().find(|(k, _)| k == key).ok_or_else(|| {
            let known: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
            anyhow!(
                "unknown placeholder `{{{{{key}}}}}` (known: {})",
                known.join(", ")
            )
        })?;
        out.push_str(&val.1);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// A VPN from its definition: setup commands, daemons (started in their namespaces, logs in
/// DIR/daemon-N.log), configure commands. Each command is its own named step.
fn start_vpn(
    def: &VpnDef,
    lab: &LabState,
    dir: &Path,
    id: u32,
    procs: &mut Procs,
) -> Result<Named> {
    let vars = vpn_vars(lab, dir, id);
    let ns_of = |c: &crate::scenario::NsCmd| match c.ns.as_str() {
        "lan" => lab.namespaces.lan.clone(),
        "client" => lab.namespaces.client.clone(),
        "server" => lab.namespaces.server.clone(),
        _ => lab.namespaces.internet.clone(),
    };
    let one_off = |what: &str, cmds: &[crate::scenario::NsCmd]| -> Result<()> {
        for (i, c) in cmds.iter().enumerate() {
            step(&format!("{what}[{i}] ({}: {})", c.ns, c.cmd), || {
                let o = ns_cmd(&ns_of(c), &["sh", "-c", &fill(&c.cmd, &vars)?])
                    .envs(&c.env)
                    .output()?;
                if !o.status.success() {
                    bail!(
                        "exit {}: {}",
                        o.status,
                        String::from_utf8_lossy(&o.stderr).trim()
                    );
                }
                Ok(())
            })?;
        }
        Ok(())
    };
    one_off("setup", &def.setup)?;
    let mut pids = Vec::new();
    for (i, c) in def.daemons.iter().enumerate() {
        let child = step(&format!("daemons[{i}] ({}: {})", c.ns, c.cmd), || {
            let log = std::fs::File::create(dir.join(format!("daemon-{i}.log")))?;
            // `exec` so that the PID sampled for CPU and RSS is the daemon's own.
            let cmd = format!("exec {}", fill(&c.cmd, &vars)?);
            Ok(ns_cmd(&ns_of(c), &["sh", "-c", &cmd])
                .envs(&c.env)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?)
        })?;
        let prog = c.cmd.split_whitespace().next().unwrap_or("daemon");
        pids.push((format!("{}: {prog}", c.ns), child.id()));
        procs.0.push(child);
    }
    // Daemons that create their interfaces need a moment; one that exits at once is an error.
    std::thread::sleep(Duration::from_millis(500));
    for (i, child) in procs.0.iter_mut().rev().take(def.daemons.len()).enumerate() {
        if let Ok(Some(status)) = child.try_wait() {
            let k = def.daemons.len() - 1 - i;
            let log =
                std::fs::read_to_string(dir.join(format!("daemon-{k}.log"))).unwrap_or_default();
            bail!(
                "step `daemons[{k}]` failed: exited at once ({status}): {}",
                log.trim()
            );
        }
    }
    one_off("configure", &def.configure)?;
    Ok(pids)
}

fn traffic(t: &Traffic, i: usize, src_ns: &str, dst: &str, t0: Instant, t0_unix: f64) -> Value {
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
        Kind::Iperf3 => {
            let port = (5201 + i).to_string();
            let secs = format!("{}", dur.as_secs().max(1));
            let streams = t.streams.to_string();
            let mut args = vec![
                "iperf3", "-c", dst, "-p", &port, "-t", &secs, "-P", &streams, "-J", "-i", "1",
            ];
            if t.reverse {
                args.push("-R");
            }
            if t.protocol == "udp" {
                args.push("-u");
            }
            let rate = t.rate.clone().unwrap_or_else(|| {
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
            let out = ns_cmd(src_ns, &args).output();
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
            json!({
                "label": label, "kind": "iperf3", "protocol": t.protocol, "streams": t.streams, "reverse": t.reverse,
                "tcp_congestion": v["start"]["tcp_congestion"],
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
            })
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
    } = what;
    let tick = 100.0;
    let mut out = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let dev = std::fs::read_to_string(format!("/proc/{probe}/net/dev")).unwrap_or_default();
        let paths: Vec<Value> = (1..=*npaths)
            .map(|k| {
                let f = if_counters(&dev, &format!("wan{k}"));
                json!({"rx_bytes": f.first(), "tx_bytes": f.get(8)})
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
                    let dropped: u64 = [
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
                    json!({"in": st["in_packets"], "dropped": dropped})
                };
                json!({"up": d(&p["up"]), "down": d(&p["down"])})
            })
            .collect();
        out.push(json!({"t_s": t0.elapsed().as_secs_f64(), "paths": paths, "tunnel_if": tunnel, "emulator": emu, "procs": procs}));
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
            json!({"path": i + 1, "up_mbit": d("tx_bytes"), "down_mbit": d("rx_bytes")})
        })
        .collect()
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
    let dt = last["t_s"].as_f64().unwrap_or(0.0) - first["t_s"].as_f64().unwrap_or(0.0);
    let _ = writeln!(
        o,
        "\n| process | CPU % of a core | RSS first / last / max MiB |\n|---|---|---|"
    );
    for i in 0..n {
        let cpu = |v: &Value| v["procs"][i]["cpu_s"].as_f64().unwrap_or(0.0);
        let rss = |v: &Value| v["procs"][i]["rss_kib"].as_f64().unwrap_or(0.0) / 1024.0;
        let max = samples.iter().map(rss).fold(0.0, f64::max);
        let _ = writeln!(
            o,
            "| {} | {:.0} | {:.1} / {:.1} / {:.1} |",
            last["procs"][i]["name"]
                .as_str()
                .map_or_else(|| format!("pid {}", last["procs"][i]["pid"]), String::from),
            100.0 * (cpu(last) - cpu(first)) / dt.max(1e-9),
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

/// mpquic's drop counters at the end of the run, every non-zero one (status --json of each side).
fn mpquic_drops(o: &mut String, status: &Value) {
    let mut lines = Vec::new();
    for who in ["client", "server"] {
        let st = &status[who];
        let mut add = |scope: String, drops: &Value| {
            for (reason, n) in drops.as_object().into_iter().flatten() {
                if n.as_u64().unwrap_or(0) > 0 {
                    lines.push(format!("{who} {scope}{reason} {n}"));
                }
            }
        };
        add(String::new(), &st["drops"]);
        for t in st["tunnels"].as_array().into_iter().flatten() {
            add(String::new(), &t["drops"]);
            for p in t["paths"].as_array().into_iter().flatten() {
                add(
                    format!("{}: ", p["name"].as_str().unwrap_or("?")),
                    &p["drops"],
                );
            }
        }
    }
    if status.is_object() {
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
            } else if t["kind"] == "iperf3" {
                let extra = if t["protocol"] == "udp" {
                    format!(
                        "lost {:.2}% (iperf3), {:.2}% of {:.1} Mbit/s sent not delivered",
                        t["lost_percent"].as_f64().unwrap_or(0.0),
                        t["undelivered_percent"].as_f64().unwrap_or(0.0),
                        t["sent_mbit"].as_f64().unwrap_or(0.0)
                    )
                } else {
                    format!("retransmits {}", t["retransmits"])
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
        mpquic_drops(&mut o, &s["mpquic_status"]);
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

#[cfg(test)]
mod tests {
    use super::fill;

    #[test]
    fn placeholders_are_filled_and_unknown_ones_refused() {
        let vars = vec![("id".to_string(), "42".to_string())];
        assert_eq!(
            fill("wg set wgc{{id}} x {{ id }}; nft { type nat ; }", &vars).unwrap(),
            "wg set wgc42 x 42; nft { type nat ; }"
        );
        let e = fill("{{idd}}", &vars).unwrap_err().to_string();
        assert!(
            e.contains("unknown placeholder `{{idd}}`") && e.contains("known: id"),
            "{e}"
        );
        assert!(fill("{{id", &vars).is_err());
    }
}
