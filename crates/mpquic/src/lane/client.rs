//! The client's MPTCP lane, started when a class has `tcp_lane: mptcp`: an MPTCP endpoint per
//! path (`endpoints.rs`), the TPROXY rules and listener (`tproxy.rs`), and a `carry` task per
//! LAN connection taken. A reload reads its TLS files again and makes the endpoints and rules
//! follow the paths and the classes' rules (`Live::apply`); the lane's server address (the
//! first path's at start) and port stay. Everything it set up in the kernel goes when
//! `Running` is dropped.

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use rustls::pki_types::ServerName;
use tokio::sync::Semaphore;
use tracing::{info, warn};

use super::carry;
use super::dial::{self, Lane};
use super::endpoints::{self, Endpoint};
use super::nft::Table;
use super::tproxy;
use crate::config::{Bind, ClientConfig, Config, PathConfig};
use crate::tls::{self, Served};
use mpquic_core::classify::Classifier;

/// LAN connections carried at once; more wait in the listener's backlog.
const MAX_CONNECTIONS: usize = 4096;

pub struct Running {
    pub live: Arc<Live>,
    task: tokio::task::AbortHandle,
    ahead: tokio::task::AbortHandle,
    _taken: tproxy::Taken,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
        self.ahead.abort();
        // The endpoints go with the lane, not with the last holder of `live`.
        self.live.lock().installed.take();
    }
}

/// The running lane as status reads it and a reload changes it.
pub struct Live {
    counters: Arc<carry::Counters>,
    lane: Arc<Lane>,
    /// The TPROXY table (`tproxy::take`); a reload loads it again.
    table: Table,
    paths: std::sync::Mutex<Paths>,
}

/// The lane's view of the client's paths.
struct Paths {
    /// Each path's address and name (status: subflows by path).
    names: Vec<(IpAddr, String)>,
    /// The paths' devices, whose connections are not taken.
    devices: Vec<String>,
    installed: Option<endpoints::Installed>,
}

/// A reload's new lane settings, read before anything changes (`Live::prepare`).
pub struct Prepared {
    tls: tokio_rustls::TlsConnector,
    wanted: Wanted,
}

impl Live {
    pub fn status(&self) -> crate::status::LaneStatus {
        let text = std::fs::read_to_string("/proc/self/net/tcp").unwrap_or_default();
        let by_addr = super::subflows::count(&text, self.lane.server);
        let names = self.lock().names.clone();
        let mut subflows = std::collections::BTreeMap::new();
        for (a, n) in by_addr {
            let name = (names.iter())
                .find(|(p, _)| *p == IpAddr::V4(a))
                .map_or_else(|| a.to_string(), |(_, name)| name.clone());
            *subflows.entry(name).or_default() += n;
        }
        self.counters.status(subflows, self.lane.ahead.len())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Paths> {
        self.paths.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A reload's TLS (its files read again) and paths, checked before anything changes.
    pub fn prepare(&self, cfg: &Config, ccfg: &ClientConfig) -> Result<Prepared> {
        Ok(Prepared {
            tls: connector(cfg, ccfg)?,
            wanted: wanted(&ccfg.paths)?,
        })
    }

    /// Apply a reload: new connections use the new TLS (a rotated certificate), the
    /// endpoints follow the paths (only changed ones are touched), the TPROXY table follows
    /// the classes' rules and the paths' devices. What changed, for the reload's message.
    pub fn apply(&self, new: Prepared, classifier: &Classifier) -> Result<String> {
        *self.lane.tls.write().unwrap_or_else(|e| e.into_inner()) = new.tls;
        self.lane.ahead.clear();
        let mut paths = self.lock();
        let (removed, added) = match (&mut paths.installed, new.wanted.endpoints.is_empty()) {
            (Some(i), _) => i.update(&new.wanted.endpoints)?,
            (None, true) => (0, 0),
            (None, false) => {
                paths.installed = Some(endpoints::install(&new.wanted.endpoints)?);
                (0, new.wanted.endpoints.len())
            }
        };
        paths.names = new.wanted.names;
        paths.devices = new.wanted.devices;
        tproxy::rules(&self.table, &paths.devices, classifier)?;
        Ok(format!(
            "MPTCP lane: TLS read again, endpoints {removed} removed / {added} added, rules loaded again"
        ))
    }
}

/// What the paths ask of the kernel: an endpoint per path with an address.
struct Wanted {
    endpoints: Vec<Endpoint>,
    devices: Vec<String>,
    names: Vec<(IpAddr, String)>,
}

/// A subflow from every path's address, on its device; a backup path's marked so.
fn wanted(paths: &[PathConfig]) -> Result<Wanted> {
    let mut w = Wanted {
        endpoints: Vec::new(),
        devices: Vec::new(),
        names: Vec::new(),
    };
    for p in paths {
        let backup = p.role.is_backup();
        match &p.bind {
            Bind::Interface(name) => {
                w.devices.push(name.clone());
                match crate::io::interface::first_ipv4(name) {
                    Ok(a) => {
                        w.names.push((IpAddr::V4(a), p.name.clone()));
                        w.endpoints.push(Endpoint {
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
                w.names.push((*ip, p.name.clone()));
                w.endpoints.push(Endpoint {
                    addr: *ip,
                    ifindex: None,
                    backup,
                })
            }
            Bind::Any => {}
        }
    }
    Ok(w)
}

/// The lane's TLS client: the client's certificate, the CA it verifies the server with.
fn connector(cfg: &Config, ccfg: &ClientConfig) -> Result<tokio_rustls::TlsConnector> {
    let cert_key = cfg.cert_file.as_deref().zip(cfg.key_file.as_deref());
    let crypto = tls::client_crypto(
        ccfg.ca_file.as_deref(),
        ccfg.insecure_skip_verify,
        cert_key,
        cfg.tls_post_quantum,
        Served::Lane,
    )?;
    Ok(tokio_rustls::TlsConnector::from(Arc::new(crypto)))
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
    let lane = Arc::new(Lane {
        server,
        server_name: ServerName::try_from(ccfg.server_name.clone()).context("tls_server_name")?,
        tls: std::sync::RwLock::new(connector(cfg, ccfg)?),
        ahead: Default::default(),
    });
    let w = wanted(paths)?;
    let installed = match w.endpoints.is_empty() {
        true => None,
        false => Some(endpoints::install(&w.endpoints)?),
    };
    let (listener, port) = tproxy::listener()?;
    let table = Table {
        tun: cfg.tun_name.clone(),
        lanes,
        port,
        mark: mark_of(&cfg.tun_name),
    };
    let taken = tproxy::take(&table, &w.devices, &ccfg.classifier)?;
    let counters = Arc::new(carry::Counters::default());
    let (c, l) = (counters.clone(), lane.clone());
    let task = tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            match listener.accept().await {
                Ok((s, _)) => {
                    let Ok(dst) = s.local_addr() else { continue };
                    let (lane, c) = (l.clone(), c.clone());
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
    // After the endpoints: connections set up ahead get a subflow on every path.
    let ahead = tokio::spawn(dial::fill(lane.clone())).abort_handle();
    info!(server = %server, subflow_endpoints = w.endpoints.len(), classes = ?table.lanes, "MPTCP lane: the classes' TCP connections go over kernel MPTCP");
    Ok(Some(Running {
        live: Arc::new(Live {
            counters,
            lane,
            table,
            paths: std::sync::Mutex::new(Paths {
                names: w.names,
                devices: w.devices,
                installed,
            }),
        }),
        task,
        ahead,
        _taken: taken,
    }))
}

/// The instance's mark and routing table: one per TUN device name.
fn mark_of(tun: &str) -> u32 {
    let h = tun
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    0x4d50_0000 | (h & 0xffff)
}
