//! Reaching the server's lane: where it is and with which TLS (`Lane`), a new lane connection
//! (`setup`: MPTCP, then TLS with the client's certificate), and the task that keeps
//! connections set up ahead (`fill`, into `ahead.rs`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use rustls::pki_types::ServerName;
use tracing::debug;

use super::ahead::{Ahead, LaneStream, READY};
use super::socket;

/// The lane's handshakes (MPTCP, TLS) within this.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Between failed attempts to set one up ahead, growing to `RETRY_MAX` (the server may be away
/// a while).
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Where lane connections go and how they are secured.
pub struct Lane {
    pub server: std::net::SocketAddr,
    pub server_name: ServerName<'static>,
    /// New connections' TLS; a reload replaces it (a rotated certificate or CA).
    pub tls: std::sync::RwLock<tokio_rustls::TlsConnector>,
    /// Connections set up ahead (filled by `fill` while the lane runs).
    pub ahead: Ahead,
}

/// A new lane connection, within `SETUP_TIMEOUT`.
pub async fn setup(lane: &Lane) -> Result<LaneStream> {
    let setup = async {
        let s = socket::mptcp_connect(lane.server, None).await?;
        let tls = lane.tls.read().unwrap_or_else(|e| e.into_inner()).clone();
        tls.connect(lane.server_name.clone(), s)
            .await
            .context("TLS handshake with the lane")
    };
    match tokio::time::timeout(SETUP_TIMEOUT, setup).await {
        Ok(r) => r,
        Err(_) => anyhow::bail!("lane setup took over {SETUP_TIMEOUT:?}"),
    }
}

/// Keep `READY` connections set up ahead in `lane.ahead`, until aborted.
pub async fn fill(lane: Arc<Lane>) {
    let mut retry = RETRY_MIN;
    loop {
        if lane.ahead.expire() >= READY {
            lane.ahead.wait().await;
            continue;
        }
        match setup(&lane).await {
            Ok(tls) => {
                lane.ahead.push(tls);
                retry = RETRY_MIN;
            }
            Err(e) => {
                debug!(error = %format!("{e:#}"), "no lane connection set up ahead; trying again");
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(RETRY_MAX);
            }
        }
    }
}
