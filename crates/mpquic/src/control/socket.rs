//! The instance's control endpoints: `/status` (JSON), `/metrics` (Prometheus) and POST
//! `/reload` (`reload.rs`) on a unix socket readable only by root (mode 0600), `/metrics` alone
//! on `metrics_listen` and the dashboard (`dashboard.rs`) on `dashboard_listen` when configured.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use tracing::{info, warn};

use super::reload::Trigger;
use super::report::{metrics_text, StatusFn};

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
pub fn router(status: StatusFn, reload: Trigger) -> Router {
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
    reload: Trigger,
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
        super::dashboard::serve(d, status.clone()).await?;
    }
    Ok(guard)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::StatusReport;
    use std::os::unix::net::UnixListener;
    use std::sync::Arc;

    /// The control socket alone (no metrics, no dashboard) at `path`.
    async fn serve_at(path: &Path, status: &StatusFn) -> Result<ControlSocket> {
        serve(
            path,
            None,
            None,
            status.clone(),
            super::super::reload::channel().0,
        )
        .await
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
        assert!(super::super::query::listening_sockets(std::process::id())
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
