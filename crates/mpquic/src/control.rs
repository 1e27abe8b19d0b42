//! Control endpoints: `/status` (JSON), `/metrics` (Prometheus) and POST `/reload`
//! (`reload.rs`) on a unix socket readable only by root (mode 0600), `/metrics` alone on
//! `metrics_listen` and the dashboard (`dashboard.rs`) on `dashboard_listen` when configured.
//! Also the client half of `mpquic status` and `mpquic reload`.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::http::StatusCode;
use axum::routing::{get, post};
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

/// The control socket of a running instance: removed when dropped (the instance returns from
/// its run, on SIGTERM as well as on an error), so a stopped instance leaves nothing for
/// `mpquic status` to trip on. One killed with SIGKILL does leave its socket; the next
/// instance of the same name replaces it, and `mpquic status` skips sockets nobody answers on.
pub struct ControlSocket {
    path: PathBuf,
    /// Device and inode of the socket file this instance bound: removed only if the file is
    /// still that one (not one a later instance put there).
    id: (u64, u64),
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// The control socket's endpoints: `/status`, `/metrics` and POST `/reload`.
pub fn router(status: StatusFn, reload: crate::reload::Trigger) -> Router {
    let s1 = status.clone();
    Router::new()
        .route("/status", get(move || async move { Json(s1()) }))
        .route(
            "/metrics",
            get(move || async move { metrics_text(&status) }),
        )
        // Only on the root-only socket: changing the configuration is the operator's.
        .route(
            "/reload",
            post(move || async move {
                match reload.reload().await {
                    Ok(what) => (StatusCode::OK, what),
                    Err(e) => (StatusCode::CONFLICT, e),
                }
            }),
        )
}

/// Serve the control socket (and the metrics listener) until the runtime stops; keep the
/// returned guard for as long as the instance runs.
pub async fn serve(
    socket: &Path,
    metrics: Option<std::net::SocketAddr>,
    dashboard: Option<&crate::config::Dashboard>,
    status: StatusFn,
    reload: crate::reload::Trigger,
) -> Result<ControlSocket> {
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
    let guard = {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(socket)?;
        ControlSocket {
            path: socket.to_path_buf(),
            id: (m.dev(), m.ino()),
        }
    };
    let app = router(status.clone(), reload);
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
    if let Some(d) = dashboard {
        crate::dashboard::serve(d, status.clone()).await?;
    }
    Ok(guard)
}

/// The control socket to query when `--socket` is not given: the only one in /run/mpquic that
/// an instance answers on. Sockets nobody listens on (left by an instance killed with SIGKILL)
/// are skipped and named in the error when no live one is left.
pub fn default_socket() -> Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(RUN_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "sock"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    pick_live(RUN_DIR, found)
}

/// The control socket of the instance with process id `pid` (`mpquic reload --pid`, as the
/// systemd unit's ExecReload gives it): the unix socket it listens on, found from its open
/// descriptors and the kernel's socket table, so it holds wherever `control_socket` points and
/// however broken the instance's file is now.
pub fn socket_of_pid(pid: u32) -> Result<PathBuf> {
    let mut found = listening_sockets(pid)?;
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => bail!("process {pid} listens on no control socket (is it mpquic?)"),
        _ => bail!("process {pid} listens on several unix sockets ({found:?}); give --socket"),
    }
}

/// The unix socket paths process `pid` listens on.
fn listening_sockets(pid: u32) -> Result<Vec<PathBuf>> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("no process {pid} (or not ours to look at)"))?;
    let inodes: std::collections::HashSet<String> = fds
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix"))?;
    // "Num RefCount Protocol Flags Type St Inode Path"; a listening socket has flag
    // __SO_ACCEPTCON (0x10000).
    Ok(table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| {
            f.len() >= 8
                && inodes.contains(f[6])
                && u32::from_str_radix(f[3], 16).is_ok_and(|x| x & 0x10000 != 0)
        })
        .map(|f| PathBuf::from(f[7]))
        .collect())
}

/// Of the sockets `found` in `dir`, the one live one (see `default_socket`).
fn pick_live(dir: &str, found: Vec<PathBuf>) -> Result<PathBuf> {
    let (mut live, mut stale, mut unusable) = (Vec::new(), Vec::new(), Vec::new());
    for p in found {
        match UnixStream::connect(&p) {
            Ok(_) => live.push(p),
            // Nobody listens: the instance is gone.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => stale.push(p),
            Err(e) => unusable.push(format!("{}: {e}", p.display())),
        }
    }
    let names = |v: &[PathBuf]| {
        v.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match live.len() {
        1 => Ok(live.remove(0)),
        0 if !unusable.is_empty() => bail!(
            "cannot use the control sockets in {dir} ({}); mpquic status needs root",
            unusable.join("; ")
        ),
        0 if !stale.is_empty() => bail!(
            "no running instance found in {dir}; not answering (left by stopped instances): {}",
            names(&stale)
        ),
        0 => bail!("no running instance found in {dir}; give --socket PATH"),
        _ => bail!(
            "several instances are running; choose one with --socket: {}",
            names(&live)
        ),
    }
}

/// GET `path` over the unix socket; returns the body.
pub fn get_over_socket(socket: &Path, path: &str) -> Result<String> {
    match request_over_socket(socket, "GET", path)? {
        (200, body) => Ok(body),
        (code, body) => bail!("control socket answered {code}: {}", body.trim_end()),
    }
}

/// POST /reload over the unix socket (`mpquic reload`): what changed, or why the instance
/// refused the new file.
pub fn reload_over_socket(socket: &Path) -> Result<String> {
    match request_over_socket(socket, "POST", "/reload")? {
        (200, body) => Ok(body),
        (409, body) => bail!("reload refused: {body}"),
        (code, body) => bail!("control socket answered {code}: {}", body.trim_end()),
    }
}

/// `method path` over the unix socket; returns the status code and the body.
fn request_over_socket(socket: &Path, method: &str, path: &str) -> Result<(u16, String)> {
    let mut s = UnixStream::connect(socket).with_context(|| {
        format!(
            "cannot connect to {} (is the instance running?)",
            socket.display()
        )
    })?;
    // A reload waits for new connections (each at most a few seconds).
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: mpquic\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").context("malformed response")?;
    let code = (head.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .context("malformed response")?;
    Ok((code, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn status_skips_sockets_nobody_answers_on() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let live = dir.path().join("live.sock");
        let _l = UnixListener::bind(&live).unwrap();
        // A socket whose listener is gone: what SIGKILL leaves behind.
        let stale = dir.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());

        assert_eq!(
            pick_live(&d, vec![live.clone(), stale.clone()]).unwrap(),
            live
        );
        let e = pick_live(&d, vec![stale.clone()]).unwrap_err().to_string();
        assert!(
            e.contains("not answering") && e.contains("stale.sock"),
            "{e}"
        );
        let other = dir.path().join("other.sock");
        let _o = UnixListener::bind(&other).unwrap();
        let e = pick_live(&d, vec![live, stale, other])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("several instances") && !e.contains("stale.sock"),
            "{e}"
        );
        let e = pick_live(&d, vec![]).unwrap_err().to_string();
        assert!(e.contains("no running instance"), "{e}");
    }

    /// The control socket alone (no metrics, no dashboard) at `path`.
    async fn serve_at(path: &Path, status: &StatusFn) -> Result<ControlSocket> {
        serve(path, None, None, status.clone(), crate::reload::channel().0).await
    }

    #[tokio::test]
    async fn the_socket_goes_with_the_instance_and_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inst.sock");
        drop(UnixListener::bind(&path).unwrap()); // stale, as after SIGKILL
        let status: StatusFn = Arc::new(StatusReport::default);
        let guard = serve_at(&path, &status).await.unwrap();
        assert!(UnixStream::connect(&path).is_ok());
        // A second instance of the same name is refused while the first answers.
        let e = serve_at(&path, &status).await.err().unwrap();
        assert!(e.to_string().contains("in use"), "{e}");
        // Found from the process id (`mpquic reload --pid`); other tests of this process may
        // listen on sockets of their own.
        assert!(listening_sockets(std::process::id())
            .unwrap()
            .contains(&path));
        drop(guard);
        assert!(!path.exists());

        // A file a later instance put in its place is not removed.
        let guard = serve_at(&path, &status).await.unwrap();
        std::fs::remove_file(&path).unwrap();
        let _later = UnixListener::bind(&path).unwrap();
        drop(guard);
        assert!(path.exists());
    }
}
