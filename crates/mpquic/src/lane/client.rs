//! The client's MPTCP lane, started when a class has `tcp_lane: mptcp` (with the paths it starts
//! with; a reload does not change the lane's endpoints): an MPTCP endpoint per
//! path (`endpoints.rs`), the TPROXY rules and listener (`tproxy.rs`), and a `carry` task per
//! LAN connection taken. Everything it set up in the kernel goes when `Running` is dropped.

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use rustls::pki_types::ServerName;
use tokio::sync::Semaphore;
use tracing::{info, warn};

use super::carry::{self, Lane};
use super::endpoints::{self, Endpoint};
use super::tproxy;
use crate::config::{Bind, ClientConfig, Config, PathConfig};
use crate::tls::{self, Served};

/// LAN connections carried at once; more wait in the listener's backlog.
const MAX_CONNECTIONS: usize = 4096;

pub struct Running {
    pub view: Arc<View>,
    task: tokio::task::AbortHandle,
    _taken: tproxy::Taken,
    _endpoints: Option<endpoints::Installed>,
}

/// What status reads of the lane: its counters, and which path each subflow address is.
pub struct View {
    counters: Arc<carry::Counters>,
    server: std::net::SocketAddr,
    paths: Vec<(IpAddr, String)>,
}

impl View {
    pub fn status(&self) -> crate::status::LaneStatus {
        let text = std::fs::read_to_string("/proc/self/net/tcp").unwrap_or_default();
        let by_addr = super::subflows::count(&text, self.server);
        let mut subflows = std::collections::BTreeMap::new();
        for (a, n) in by_addr {
            let name = (self.paths.iter())
                .find(|(p, _)| *p == IpAddr::V4(a))
                .map_or_else(|| a.to_string(), |(_, name)| name.clone());
            *subflows.entry(name).or_default() += n;
        }
        self.counters.status(subflows)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The lane of `ccfg`'s `tcp_lane` classes (`None` without any).
pub async fn start(
    cfg: &Config,
    ccfg: &ClientConfig,
    paths: &[PathConfig],
) -> Result<Option<Running>> {
    let lanes: Vec<usize> = (ccfg.classes.iter().enumerate())
        .filter(|(_, k)| k.tcp_lane)
        .map(|(i, _)| i)
        .collect();
    if lanes.is_empty() {
        return Ok(None);
    }
    let first = paths.first().ok_or_else(|| anyhow!("no path"))?;
    let server = tokio::net::lookup_host((first.remote_addr.as_str(), ccfg.tcp_lane_port))
        .await?
        .next()
        .ok_or_else(|| anyhow!("{} has no address", first.remote_addr))?;
    let cert_key = cfg.cert_file.as_deref().zip(cfg.key_file.as_deref());
    let crypto = tls::client_crypto(
        ccfg.ca_file.as_deref(),
        ccfg.insecure_skip_verify,
        cert_key,
        cfg.tls_post_quantum,
        Served::Lane,
    )?;
    let lane = Arc::new(Lane {
        server,
        server_name: ServerName::try_from(ccfg.server_name.clone()).context("tls_server_name")?,
        tls: tokio_rustls::TlsConnector::from(Arc::new(crypto)),
    });
    // A subflow from every path's address, on its device; a backup path's marked so.
    let mut devices = Vec::new();
    let mut eps = Vec::new();
    let mut names = Vec::new();
    for p in paths {
        let backup = p.role.is_backup();
        match &p.bind {
            Bind::Interface(name) => {
                devices.push(name.clone());
                match crate::tun::interface_v4(name) {
                    Ok(a) => {
                        names.push((IpAddr::V4(a), p.name.clone()));
                        eps.push(Endpoint {
                            addr: IpAddr::V4(a),
                            ifindex: Some(tproxy::ifindex(name)?),
                            backup,
                        })
                    }
                    Err(e) => {
                        warn!(path = %p.name, error = %e, "MPTCP lane: the path's device has no IPv4 address; no subflow on it")
                    }
                }
            }
            Bind::Ip(ip) => {
                names.push((*ip, p.name.clone()));
                eps.push(Endpoint {
                    addr: *ip,
                    ifindex: None,
                    backup,
                })
            }
            Bind::Any => {}
        }
    }
    let installed = match eps.is_empty() {
        true => None,
        false => Some(endpoints::install(&eps, eps.len().max(2) as u32)?),
    };
    let (listener, port) = tproxy::listener()?;
    let mark = mark_of(&cfg.tun_name);
    let taken = tproxy::take(
        &cfg.tun_name,
        &devices,
        &ccfg.classifier,
        &lanes,
        port,
        mark,
    )?;
    let counters = Arc::new(carry::Counters::default());
    let c = counters.clone();
    let task = tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            match listener.accept().await {
                Ok((s, _)) => {
                    let Ok(dst) = s.local_addr() else { continue };
                    let (lane, c) = (lane.clone(), c.clone());
                    tokio::spawn(async move {
                        carry::carry(s, dst, lane, c).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    warn!(error = %e, "MPTCP lane: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
    })
    .abort_handle();
    info!(server = %server, subflow_endpoints = eps.len(), classes = ?lanes, "MPTCP lane: the classes' TCP connections go over kernel MPTCP");
    Ok(Some(Running {
        view: Arc::new(View {
            counters,
            server,
            paths: names,
        }),
        task,
        _taken: taken,
        _endpoints: installed,
    }))
}

/// The instance's mark and routing table: one per TUN device name.
fn mark_of(tun: &str) -> u32 {
    let h = tun
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    0x4d50_0000 | (h & 0xffff)
}
