//! The `mpquic` command: runs an instance from its configuration file, and the tools around it
//! (check-config, pki, status, reload, man). What it runs is the library (src/lib.rs).

use mpquic::io::platform::Platform;
use mpquic::{client, config, control, pki, runtime, server, status};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use config::{Config, RoleConfig};

#[derive(Parser)]
#[command(
    name = "mpquic",
    version,
    about = "Multipath QUIC VPN: bond and fail over WAN links through one tunnel"
)]
struct Cli {
    /// Run the instance described by this YAML file (same as `mpquic run --config FILE`).
    #[arg(long, short, global = false)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run an instance (client or server, from the file's `role`).
    Run {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a configuration file; exit status 0 when it is usable.
    CheckConfig { file: PathBuf },
    /// Issue the CA, server and client certificates.
    Pki {
        #[command(subcommand)]
        cmd: PkiCmd,
    },
    /// Manual pages (roff) built from this help: mpquic.1 on stdout, or with DIR mpquic.1 and
    /// mpquic-COMMAND.1 for each command written there (the Debian package installs them).
    #[command(hide = true)]
    Man { dir: Option<PathBuf> },
    /// Show the paths of a running instance.
    Status {
        /// Control socket (default: the only one in /run/mpquic an instance answers on).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Machine-readable output (with --watch: one JSON line per refresh).
        #[arg(long)]
        json: bool,
        /// Refresh every SECONDS (default 1) until interrupted; an instance that stops
        /// answering is shown as an error line and queried again at the next refresh.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "1")]
        watch: Option<f64>,
    },
    /// Apply the instance's configuration file again without a restart (as SIGHUP does):
    /// paths added, removed or changed (client), the `clients:` list (server). A file that does
    /// not load, or that changes a key fixed at start, is refused and the running
    /// configuration stays; the outcome is printed, logged and shown by `mpquic status`.
    Reload {
        /// Control socket (default: the only one in /run/mpquic an instance answers on).
        #[arg(long, conflicts_with = "pid")]
        socket: Option<PathBuf>,
        /// The instance with this process id (the systemd unit's ExecReload gives $MAINPID):
        /// exits non-zero when it refuses the file, so `systemctl reload` reports it.
        #[arg(long)]
        pid: Option<u32>,
    },
}

#[derive(Subcommand)]
enum PkiCmd {
    /// Create DIR/ca.crt and DIR/ca.key.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// Replace an existing CA (invalidates every certificate it signed).
        #[arg(long)]
        force: bool,
    },
    /// Issue DIR/NAME.crt and DIR/NAME.key for a server.
    Server {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        name: String,
        /// Extra DNS name or IP address the server is reached by (repeatable).
        #[arg(long)]
        san: Vec<String>,
    },
    /// Issue DIR/NAME.crt and DIR/NAME.key for a client; NAME is its identity.
    Client {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        name: String,
    },
    /// Make a bearer token for a CONNECT-IP client without a certificate: prints the token
    /// (for the client) and the server's `masque_tokens` entry (a salted hash of it).
    Token {
        /// The client's name (its identity in status and logs).
        name: String,
    },
}

/// Logs on stderr (journald takes them from there): text, or with `json` one JSON object per
/// line whose keys are the event's fields (`path`, `tunnel`, `class`, ...), for log shippers.
fn init_logging(level: &str, json: bool) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .unwrap_or_else(|| format!("warn,mpquic={level},mpquic_core={level}"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_target(false)
        .with_writer(std::io::stderr);
    match json {
        true => fmt.json().flatten_event(true).init(),
        false => fmt
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

fn run_instance(path: &std::path::Path) -> anyhow::Result<()> {
    let cfg = Config::load(path)?;
    init_logging(&cfg.log_level, cfg.log_json);
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    runtime::return_freed_memory();
    let rt = match cfg.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build()?,
    };
    rt.spawn(runtime::trim_task());
    rt.block_on(async move {
        match cfg.role.clone() {
            RoleConfig::Client(c) => client::run(cfg, c, Platform::system()).await,
            RoleConfig::Server(s) => server::run(cfg, s, Platform::system()).await,
        }
    })?;
    // Background tasks (blocked reads) must not delay exit.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    Ok(())
}

/// `mpquic man [DIR]`.
fn man_pages(dir: Option<PathBuf>) -> anyhow::Result<()> {
    use anyhow::Context;
    use clap::CommandFactory;
    let cmd = Cli::command();
    let Some(dir) = dir else {
        return Ok(clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?);
    };
    let write = |name: &str, page: clap::Command| -> anyhow::Result<()> {
        let path = dir.join(format!("{name}.1"));
        let mut f = std::fs::File::create(&path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(clap_mangen::Man::new(page).render(&mut f)?)
    };
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        // The page's title and name read `mpquic-status`, as its reference in mpquic.1 does.
        let name = format!("mpquic-{}", sub.get_name());
        write(&name, sub.clone().name(name.clone()))?;
    }
    write("mpquic", cmd)
}

/// `mpquic status`: the instance's report once, or with `watch` refreshed until interrupted.
fn status_cmd(socket: Option<PathBuf>, json: bool, watch: Option<f64>) -> anyhow::Result<()> {
    use std::io::Write;
    let socket = match socket {
        Some(s) => s,
        None => control::default_socket()?,
    };
    let once = || -> anyhow::Result<String> {
        let body = control::get_over_socket(&socket, "/status")?;
        Ok(match json {
            true => format!("{}\n", body.trim_end()),
            false => serde_json::from_str::<status::StatusReport>(&body)?.render(),
        })
    };
    let Some(every) = watch else {
        print!("{}", once()?);
        return Ok(());
    };
    if !(every.is_finite() && (0.1..=3600.0).contains(&every)) {
        anyhow::bail!("--watch {every}: give a refresh interval from 0.1 to 3600 seconds");
    }
    let mut out = std::io::stdout().lock();
    loop {
        let shown = match (once(), json) {
            (Ok(text), true) => text,
            // One JSON object per line for scripts; errors go to stderr.
            (Err(e), true) => {
                eprintln!("mpquic: {e:#}");
                String::new()
            }
            // Clear the terminal, then a header like watch(1)'s.
            (r, false) => format!(
                "\x1b[H\x1b[2JEvery {every}s: mpquic status --socket {}    {} UTC\n\n{}",
                socket.display(),
                utc_clock(),
                r.unwrap_or_else(|e| format!("mpquic: {e:#}\n"))
            ),
        };
        // A closed pipe (`| head`) ends the watch quietly.
        if out
            .write_all(shown.as_bytes())
            .and_then(|_| out.flush())
            .is_err()
        {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs_f64(every));
    }
}

/// The time of day in UTC, HH:MM:SS.
fn utc_clock() -> String {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match (cli.cmd, cli.config) {
        (Some(Cmd::Run { config }), _) | (None, Some(config)) => run_instance(&config),
        (Some(Cmd::CheckConfig { file }), _) => match Config::load(&file) {
            Ok(cfg) => {
                for w in &cfg.warnings {
                    eprintln!("{}: warning: {w}", file.display());
                }
                println!("{}: ok", file.display());
                Ok(())
            }
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        },
        (Some(Cmd::Pki { cmd }), _) => match cmd {
            PkiCmd::Init { dir, force } => pki::init(&dir, force),
            PkiCmd::Server { dir, name, san } => {
                pki::issue(&dir, &name, pki::Kind::Server { sans: san }).map(|_| ())
            }
            PkiCmd::Client { dir, name } => pki::issue(&dir, &name, pki::Kind::Client).map(|_| ()),
            PkiCmd::Token { name } => pki::token(&name).map(|(token, entry)| {
                println!("token (give it to the client; it is not stored anywhere):\n{token}\n");
                println!("server file, under masque_tokens:\n{entry}");
            }),
        },
        (
            Some(Cmd::Status {
                socket,
                json,
                watch,
            }),
            _,
        ) => status_cmd(socket, json, watch),
        (Some(Cmd::Reload { socket, pid }), _) => match (socket, pid) {
            (Some(s), _) => Ok(s),
            (None, Some(pid)) => control::socket_of_pid(pid),
            (None, None) => control::default_socket(),
        }
        .and_then(|s| control::reload_over_socket(&s))
        .map(|what| println!("reloaded: {what}")),
        (Some(Cmd::Man { dir }), _) => man_pages(dir),
        (None, None) => {
            eprintln!("mpquic: give --config FILE or a command; see mpquic --help");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mpquic: {e:#}");
            ExitCode::FAILURE
        }
    }
}
