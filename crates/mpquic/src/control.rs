//! Control endpoints: `/status` (JSON) and `/metrics` (Prometheus) on a unix socket readable only
//! by root (mode 0600), and `/metrics` alone on `metrics_listen` when configured. Also the client
//! half of `mpquic status`.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::routing::get;
use axum::{Json, Router};
use tracing::{info, warn};

use crate::status::StatusReport;

pub type StatusFn = Arc<dyn Fn() -> StatusReport + Send + Sync>;

const RUN_DIR: &str = "/run/mpquic";

fn metrics_text(
    status: &StatusFn,
) -> ([(axum::http::header::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            crate::status::CONTENT_TYPE,
        )],
        status().to_openmetrics(),
    )
}

/// Serve the control socket (and the metrics listener) until the runtime stops.
pub async fn serve(
    socket: &Path,
    metrics: Option<std::net::SocketAddr>,
    status: StatusFn,
) -> Result<()> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // A socket left by a crashed instance would make bind fail; one still in use would not be
    // answered by two processes, so check before removing.
    if socket.exists() {
        if UnixStream::connect(socket).is_ok() {
            bail!("{} is in use by a running instance", socket.display());
        }
        let _ = std::fs::remove_file(socket);
    }
    let listener = tokio::net::UnixListener::bind(socket)
        .with_context(|| format!("cannot create control socket {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    let s1 = status.clone();
    let s2 = status.clone();
    let app = Router::new()
        .route("/status", get(move || async move { Json(s1()) }))
        .route("/metrics", get(move || async move { metrics_text(&s2) }));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            warn!(error = %e, "control socket stopped");
        }
    });
    if let Some(addr) = metrics {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for metrics on {addr}"))?;
        let s3 = status.clone();
        let app = Router::new().route("/metrics", get(move || async move { metrics_text(&s3) }));
        info!(%addr, "metrics listening");
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, app).await {
                warn!(error = %e, "metrics listener stopped");
            }
        });
    }
    Ok(())
}

/// The control socket to query when `--socket` is not given: the only one in /run/mpquic.
pub fn default_socket() -> Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(RUN_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "sock"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    match found.len() {
        0 => bail!("no running instance found in {RUN_DIR}; give --socket PATH"),
        1 => Ok(found.remove(0)),
        _ => bail!(
            "several instances are running; choose one with --socket: {}",
            found
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// GET `path` over the unix socket; returns the body.
pub fn get_over_socket(socket: &Path, path: &str) -> Result<String> {
    let mut s = UnixStream::connect(socket).with_context(|| {
        format!(
            "cannot connect to {} (is the instance running?)",
            socket.display()
        )
    })?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: mpquic\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").context("malformed response")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!(
            "control socket answered: {}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(body.to_string())
}
