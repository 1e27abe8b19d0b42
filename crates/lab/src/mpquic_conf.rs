//! The one place that writes mpquic configurations for a lab: a fresh PKI (CA, server, one
//! certificate per site), the server's YAML and one client YAML per lab client, filled with the
//! lab's addresses. Used by the scenario runner (`sut`) and by `mpquic-lab configs` (the
//! end-to-end tests, the demo).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;

use crate::scenario::MpquicOpts;
use crate::topo::{self, LabState};

/// The server's UDP port in lab configurations, and its stripe port (the seed's).
pub const PORT: u16 = 45017;
pub const STRIPE_PORT: u16 = 46017;
/// The tunnel subnet: the server is .254, client `c` (1..) is .c.
pub const TUNNEL_NET: &str = "10.200.17.0/24";
const TUNNEL_PREFIX: &str = "10.200.17";
pub const SERVER_NAME: &str = "mpquic-server";

/// One mpquic instance's files, for whoever starts it.
#[derive(Debug, Clone, Serialize)]
pub struct Instance {
    /// `server`, or the client's certificate name (`site1`, `site2`...).
    pub name: String,
    /// The namespace to run it in.
    pub ns: String,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub tun_addr: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Written {
    pub pki: PathBuf,
    pub server: Instance,
    pub clients: Vec<Instance>,
}

/// The control socket of instance `who` (`server`, `client1`...) among the files in `dir`.
pub fn socket(dir: &Path, who: &str) -> PathBuf {
    dir.join(format!("{who}.sock"))
}

/// The mpquic binary: `$MPQUIC_BIN`, else the one next to this executable (target/release/).
pub fn mpquic_bin() -> PathBuf {
    std::env::var_os("MPQUIC_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join("mpquic")))
        })
        .unwrap_or_else(|| PathBuf::from("mpquic"))
}

fn mpquic(args: &[&str]) -> Result<()> {
    let bin = mpquic_bin();
    let o = Command::new(&bin)
        .args(args)
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !o.status.success() {
        bail!(
            "mpquic {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(())
}

/// PKI and configs for every client of `lab` into `dir` (created if needed).
pub fn write(lab: &LabState, opts: &MpquicOpts, dir: &Path) -> Result<Written> {
    std::fs::create_dir_all(dir)?;
    let pki = dir.join("pki");
    let p = pki
        .to_str()
        .ok_or_else(|| anyhow!("bad directory {}", dir.display()))?;
    mpquic(&["pki", "init", "--dir", p, "--force"])?;
    mpquic(&[
        "pki",
        "server",
        "--dir",
        p,
        "--name",
        SERVER_NAME,
        "--san",
        topo::SERVER_SERVICE_ADDR,
    ])?;
    let server = Instance {
        name: "server".into(),
        ns: lab.namespaces.server.clone(),
        config: dir.join("server.yaml"),
        socket: socket(dir, "server"),
        tun_addr: format!("{TUNNEL_PREFIX}.254/24"),
    };
    std::fs::write(&server.config, server_yaml(opts, p, &server))?;
    let mut clients = Vec::new();
    for c in 1..=lab.clients.len() {
        let site = format!("site{c}");
        mpquic(&["pki", "client", "--dir", p, "--name", &site])?;
        let inst = Instance {
            ns: lab.client(c)?.client,
            config: dir.join(format!("client{c}.yaml")),
            socket: socket(dir, &format!("client{c}")),
            tun_addr: format!("{TUNNEL_PREFIX}.{c}/24"),
            name: site,
        };
        std::fs::write(&inst.config, client_yaml(lab, c, opts, p, &inst))?;
        clients.push(inst);
    }
    Ok(Written {
        pki,
        server,
        clients,
    })
}

/// `KEY: VALUE` and a newline, or nothing for a value left to mpquic's default.
fn key(name: &str, value: &Option<String>) -> String {
    value
        .as_ref()
        .map(|v| format!("{name}: {v}\n"))
        .unwrap_or_default()
}

fn server_yaml(m: &MpquicOpts, pki: &str, me: &Instance) -> String {
    format!(
        "role: server\nbind_ip: 0.0.0.0\nremote_port: {PORT}\nmulti_conn_enabled: true\n\
         tun_name: mpq0\ntun_cidr: {tun}\nlog_level: info\n\
         tls_cert_file: {pki}/{SERVER_NAME}.crt\ntls_key_file: {pki}/{SERVER_NAME}.key\n\
         {cc}{mode}control_socket: {s}\n{stripe}{lane}{extra}",
        tun = me.tun_addr,
        lane = match m.lane {
            Some(true) => format!("tcp_lane_listen: 0.0.0.0:{}\n", PORT + 1),
            _ => String::new(),
        },
        cc = key("congestion_algorithm", &m.congestion),
        mode = key("transport_mode", &m.mode),
        s = me.socket.display(),
        stripe = match m.transport.iter().flatten().any(|t| t == "stripe") {
            true => format!("stripe_enabled: true\nstripe_port: {STRIPE_PORT}\n"),
            false => String::new(),
        },
        extra = m.extra_yaml,
    )
}

/// The scenario's traffic classes as the client's `classes:` key.
fn classes_yaml(m: &MpquicOpts) -> String {
    let Some(classes) = &m.classes else {
        return String::new();
    };
    let mut top = serde_yaml_ng::Mapping::new();
    top.insert("classes".into(), classes.clone());
    serde_yaml_ng::to_string(&top).unwrap_or_default()
}

fn client_yaml(lab: &LabState, c: usize, m: &MpquicOpts, pki: &str, me: &Instance) -> String {
    let mut y = format!(
        "role: client\nmultipath_enabled: true\nmultipath_policy: {pol}\ntun_name: mpq0\n\
         tun_cidr: {tun}\nlog_level: info\n\
         tls_ca_file: {pki}/ca.crt\ntls_cert_file: {pki}/{site}.crt\ntls_key_file: {pki}/{site}.key\n\
         tls_server_name: {SERVER_NAME}\n{cc}{mode}\
         control_socket: {s}\nstate_dir: {state}\n{fec}{lane}{extra}{classes}multipath_paths:\n",
        lane = match m.lane {
            Some(true) => "tcp_lane: mptcp\n",
            _ => "",
        },
        fec = m.fec.as_ref().map(|f| format!("fec: {f}\n")).unwrap_or_default(),
        classes = classes_yaml(m),
        pol = m.policy,
        tun = me.tun_addr,
        site = me.name,
        cc = key("congestion_algorithm", &m.congestion),
        mode = key("transport_mode", &m.mode),
        s = me.socket.display(),
        // The lab's own directory: a data budget counts from zero in every run.
        state = std::path::absolute(me.socket.parent().unwrap_or(Path::new(".")))
            .unwrap_or_default()
            .display(),
        extra = m.extra_yaml,
    );
    for path in lab.client_paths(c) {
        if m.paths
            .as_ref()
            .is_some_and(|only| !only.contains(&path.client_path))
        {
            continue;
        }
        let i = path.client_path - 1;
        let pick = |v: &Option<Vec<u32>>, default: u32| {
            v.as_ref()
                .and_then(|v| v.get(i).copied())
                .unwrap_or(default)
        };
        let _ = write!(
            y,
            "- name: wan{k}\n  bind_ip: if:{ifn}\n  remote_addr: {addr}\n  remote_port: {PORT}\n  priority: {prio}\n  weight: {weight}\n",
            k = path.client_path,
            ifn = path.client_if,
            addr = topo::SERVER_SERVICE_ADDR,
            prio = pick(&m.priorities, path.client_path as u32),
            weight = pick(&m.weights, 1),
        );
        if m.pipes.is_some() {
            let _ = writeln!(y, "  pipes: {}", pick(&m.pipes, 1));
        }
        if let Some(t) = m.transport.as_ref().and_then(|t| t.get(i)) {
            let _ = writeln!(y, "  transport: {t}");
        }
        if let Some(extra) = m.path_yaml.as_ref().and_then(|e| e.get(i)) {
            for line in extra.split("; ").filter(|l| !l.trim().is_empty()) {
                let _ = writeln!(y, "  {}", line.trim());
            }
        }
    }
    y
}
