//! Control: the instance's endpoints (`socket.rs`: the root-only unix socket, the metrics
//! listener; `dashboard.rs`: the web dashboard), what they serve (`report.rs`), a live reload
//! of the configuration (`reload.rs`), and the command line's half (`query.rs`).

pub mod dashboard;
pub mod query;
pub mod reload;
pub mod report;
pub mod socket;

pub use query::{default_socket, get_over_socket, reload_over_socket, socket_of_pid};
pub use report::StatusFn;
pub use socket::{router, serve, ControlSocket};

use anyhow::Result;

use crate::config::Config;
use crate::io::platform::Platform;

/// An instance's control, started: reloads asked for by SIGHUP or `mpquic reload` queue in
/// the returned requests (the role's main loop applies them, `reload::serve_until`); the
/// control socket, metrics listener and dashboard answer with `status`. Keep the socket guard
/// for as long as the instance runs (the socket file goes with it).
pub async fn start(
    platform: &Platform,
    cfg: &Config,
    status: StatusFn,
) -> Result<(ControlSocket, reload::Requests)> {
    let (trigger, requests) = reload::channel();
    let hangup = trigger.clone();
    platform.on_hangup(Box::new(move || hangup.hangup()))?;
    let socket = serve(
        &cfg.control_socket,
        cfg.metrics_listen,
        cfg.dashboard.as_ref(),
        status,
        trigger,
    )
    .await?;
    Ok((socket, requests))
}
