//! The client (site) side: one transport per WAN path (a QUIC connection, each on its own socket
//! bound to its interface: `transport::quic::QuicDialer`), all feeding one `Tunnel`. A path whose
//! connection dies, or that stays unusable (black-holed, server restarted), is reconnected in the
//! background while the others carry on.
//!
//! With traffic classes (`classes:`), each class is such a tunnel of its own (its bond, and on
//! every path its own connection, so its own congestion controller and queues), and the TUN
//! reader puts each packet in its class (`classify::Classifier`); the classes share the TUN
//! device and the tunnel address.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use mpquic_core::fec::FecMode;
use mpquic_core::{reconnect, sessions, DropReason, HealthMode, PathId, PathSpec};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::config::{parse_cidr, ClassConfig, ClientConfig, Config, Congestion};
use crate::hello::{ClassOf, Hello};
use crate::platform::Platform;
use crate::status::StatusReport;
use crate::transport::quic::QuicDialer;
use crate::transport::{Dialer, PathTransport};
use crate::tun::Tun;
use crate::tunnel::{close, Carriage, ClassTag, Routed, Shares, Tunnel};
use crate::{quic, runtime};

/// Bound on socket setup + handshake + hello for one attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

struct Client {
    cfg: Config,
    ccfg: ClientConfig,
    session: u64,
    tun: Arc<Tun>,
    /// The traffic classes in priority order (one, implicit, without `classes:`).
    classes: Vec<Class>,
    /// The address the server gave us (set on the TUN device).
    addr: Mutex<Option<(Ipv4Addr, u8)>>,
    /// A refusal from the server that retrying cannot fix (e.g. address not allowed).
    fatal: mpsc::Sender<String>,
    mtu: u32,
    /// The UDP payload of the client's links.
    link_payload: u16,
}

/// One traffic class: its tunnel over the paths, and per path its connections.
struct Class {
    cfg: ClassConfig,
    tunnel: Arc<Tunnel>,
    /// The class's own TUN device (`tun_name` of the class), read by its own reader.
    own_tun: Option<Arc<Tun>>,
    /// The tunnel's id of each configured path, in config order.
    path_ids: Vec<PathId>,
    /// Dials with the class's congestion controller.
    dialer: Box<dyn Dialer>,
    /// Per path (config order): the UDP payload its connections use when its route carries
    /// less than its link (`None`: the link's), as the tunnel's MTU watch found.
    payload: Mutex<Vec<Option<u16>>>,
    /// Per path: connection attempts failed in a row.
    connect_failures: Vec<AtomicU32>,
    /// Packets the classifier put in this class by a rule / because no rule matched.
    classified: AtomicU64,
    unmatched: AtomicU64,
}

pub async fn run(cfg: Config, ccfg: ClientConfig, platform: Platform) -> Result<()> {
    let link_mtu = ccfg
        .paths
        .iter()
        .map(|p| platform.link_mtu(&p.bind))
        .min()
        .unwrap_or(quic::DEFAULT_LINK_MTU);
    // A per-packet policy numbers every packet (`wire::BOND_HEADER` more bytes in front).
    let bond_header = if ccfg.classes.iter().any(|k| k.policy.per_packet()) {
        mpquic_core::wire::BOND_HEADER as u32
    } else {
        0
    };
    let mtu = runtime::tun_mtu(&cfg, link_mtu.saturating_sub(bond_header));
    let tun = Arc::new(runtime::open_tun(&platform, &cfg, &cfg.tun_name, mtu)?);
    let classes = ccfg
        .classes
        .iter()
        .enumerate()
        .map(|(rank, k)| {
            let own = match &k.tun_name {
                Some(name) => Some(Arc::new(runtime::open_tun(&platform, &cfg, name, mtu)?)),
                None => None,
            };
            Class::new(&cfg, &ccfg, k, rank, own, &tun, link_mtu, &platform)
        })
        .collect::<Result<Vec<_>>>()?;
    // The first refusal ends the process; later ones (other paths) are dropped.
    let (fatal_tx, mut fatal_rx) = mpsc::channel(1);
    let client = Arc::new(Client {
        session: runtime::random_u64(),
        tun: tun.clone(),
        classes,
        addr: Mutex::new(None),
        fatal: fatal_tx,
        mtu,
        link_payload: mpquic_core::mtu::udp_payload(link_mtu),
        cfg,
        ccfg,
    });
    info!(tun = %client.cfg.tun_name, mtu, paths = client.ccfg.paths.len(), policy = client.ccfg.policy.as_str(), "client starting");
    for (rank, k) in client.classes.iter().filter(|k| k.cfg.explicit).enumerate() {
        info!(class = %k.cfg.name, rank, policy = k.cfg.policy.as_str(), mode = k.cfg.mode.as_str(), congestion = k.cfg.congestion.as_str(), fec = %k.cfg.fec, "traffic class");
    }

    let started = Instant::now();
    let status_client = client.clone();
    // Held until run returns: the socket file goes with the instance.
    let _control = crate::control::serve(
        &client.cfg.control_socket,
        client.cfg.metrics_listen,
        client.cfg.dashboard.as_ref(),
        Arc::new(move || status_client.status(started)),
    )
    .await?;

    let mut path_tasks = Vec::new();
    for k in 0..client.classes.len() {
        for i in 0..client.ccfg.paths.len() {
            let c = client.clone();
            path_tasks.push(tokio::spawn(async move { c.path_task(k, i).await }));
        }
        let t = client.classes[k].tunnel.clone();
        tokio::spawn(async move { t.run_timers().await });
    }
    let c = client.clone();
    tokio::spawn(async move { c.tun_reader().await });
    for k in 0..client.classes.len() {
        if client.classes[k].own_tun.is_some() {
            let c = client.clone();
            tokio::spawn(async move { c.class_tun_reader(k).await });
        }
    }

    let result = tokio::select! {
        _ = platform.stopped() => Ok(()),
        msg = fatal_rx.recv() => Err(anyhow!(msg.unwrap_or_default())),
    };
    // Stop reconnecting first, or the closed paths would be dialled again at once.
    for t in &path_tasks {
        t.abort();
    }
    for k in &client.classes {
        k.tunnel.close_all(close::SHUTDOWN, "client shutting down");
    }
    // Give the close frames a moment to leave; the TUN device goes with the process.
    tokio::time::sleep(Duration::from_millis(50)).await;
    info!("client stopped");
    result
}

impl Client {
    fn status(&self, started: Instant) -> StatusReport {
        let addr = *self.addr.lock().unwrap_or_else(|e| e.into_inner());
        StatusReport {
            role: "client".into(),
            congestion: self.cfg.congestion.as_str().into(),
            tun_name: self.cfg.tun_name.clone(),
            tun_mtu: self.mtu,
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: started.elapsed().as_secs_f64(),
            tunnels: self
                .classes
                .iter()
                .map(|k| {
                    let mut st = k.tunnel.status(addr.map(|(a, p)| format!("{a}/{p}")));
                    if k.cfg.explicit {
                        st.classified_packets = k.classified.load(Ordering::Relaxed);
                        st.unmatched_packets = k.unmatched.load(Ordering::Relaxed);
                    }
                    st
                })
                .collect(),
            drops: Default::default(),
            refused: Default::default(),
            tun_queue_packets: Vec::new(),
        }
    }

    async fn tun_reader(&self) {
        let classifier = &self.ccfg.classifier;
        let default = &self.classes[classifier.default_class()];
        let mut shares = Shares::default();
        // Per class: packets put in it by a rule, and without one (added to the counters once
        // per batch).
        let mut counts = vec![(0u64, 0u64); self.classes.len()];
        self.tun
            .read_loop(
                self.mtu,
                mpquic_core::mtu::tcp_mss(self.mtu),
                |batch, infos, drops| {
                    default
                        .tunnel
                        .drop_unsent(DropReason::Oversized, drops.oversized);
                    default
                        .tunnel
                        .drop_unsent(DropReason::Malformed, drops.unsplit);
                    for (i, info) in infos.iter().enumerate() {
                        let (k, matched) = classifier.classify(info.as_ref());
                        shares.add(&self.classes[k].tunnel, i);
                        match matched {
                            true => counts[k].0 += 1,
                            false => counts[k].1 += 1,
                        }
                    }
                    shares.send(batch, infos);
                    for (k, (m, u)) in self.classes.iter().zip(&mut counts) {
                        k.classified.fetch_add(std::mem::take(m), Ordering::Relaxed);
                        k.unmatched.fetch_add(std::mem::take(u), Ordering::Relaxed);
                    }
                },
            )
            .await
    }

    /// A class's own TUN device: everything read from it goes in the class (counted as put
    /// there by a rule: the device is the rule).
    async fn class_tun_reader(&self, k: usize) {
        let class = &self.classes[k];
        let Some(tun) = &class.own_tun else { return };
        let mut routed = Routed::default();
        let mut all: Vec<usize> = Vec::new();
        tun.read_loop(
            self.mtu,
            mpquic_core::mtu::tcp_mss(self.mtu),
            |batch, infos, drops| {
                let t = &class.tunnel;
                t.drop_unsent(DropReason::Oversized, drops.oversized);
                t.drop_unsent(DropReason::Malformed, drops.unsplit);
                all.clear();
                all.extend(0..batch.len());
                t.send_batch(batch, &all, infos, &mut routed);
                class
                    .classified
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            },
        )
        .await
    }

    /// Keep path `idx` connected for the life of the process.
    async fn path_task(self: Arc<Self>, k: usize, idx: usize) {
        let name = &self.ccfg.paths[idx].name;
        let mut backoff = reconnect::Backoff::default();
        loop {
            match self.connect(k, idx).await {
                Ok(transport) => {
                    backoff.succeeded();
                    self.supervise(k, idx, transport).await;
                }
                Err(e) => {
                    let wait = backoff.failed();
                    warn!(path = %name, error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64, "path connect failed");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Watch an installed transport; replace it when it has been unusable for too long.
    async fn supervise(&self, k: usize, idx: usize, transport: Arc<dyn PathTransport>) {
        let class = &self.classes[k];
        let name = &self.ccfg.paths[idx].name;
        let id = class.path_ids[idx];
        let mut closed = transport.closed();
        let mut generation = class.tunnel.install(id, transport);
        loop {
            tokio::select! {
                reason = &mut closed => {
                    class.tunnel.remove(id, generation);
                    info!(path = %name, reason = %reason, "path connection closed");
                    return;
                }
                _ = tokio::time::sleep(Duration::from_millis(250)) => {
                    if let Some(r) = class.tunnel.take_resize(id) {
                        // The route's MTU changed, or a larger size is tried: a new connection
                        // at that size (the QUIC engine's packet size is fixed per connection);
                        // the old one drains and closes, or carries on if this one fails.
                        let before = class.set_payload(idx, Some(r.payload));
                        match self.dial(k, idx).await {
                            Ok(new) => {
                                info!(path = %name, payload = r.payload, "path reconnected at a new packet size");
                                closed = new.closed();
                                generation = class.tunnel.install(id, new);
                            }
                            Err(e) => {
                                class.set_payload(idx, before);
                                class.tunnel.resize_failed(id, r.payload);
                                let level = if r.recheck { "larger packets do not pass yet" } else { "failed" };
                                info!(path = %name, payload = r.payload, error = %format!("{e:#}"), "reconnect at a new packet size: {level}");
                            }
                        }
                        continue;
                    }
                    if reconnect::should_replace(class.tunnel.unusable_for(id)) {
                        match self.connect(k, idx).await {
                            Ok(new) => {
                                info!(path = %name, "path unusable; replaced its connection");
                                closed = new.closed();
                                generation = class.tunnel.install(id, new);
                            }
                            Err(e) => info!(path = %name, error = %format!("{e:#}"), "path still unusable; reconnect failed"),
                        }
                    }
                }
            }
        }
    }

    /// Connect path `idx` (a new connection, or a replacement for one that is unusable). A
    /// route whose MTU fell drops the server's full-size handshake packets, so after a failure
    /// every other attempt is made with QUIC's minimum packet size; once connected,
    /// the MTU watch finds the size that passes (`pmtu.rs`).
    async fn connect(&self, k: usize, idx: usize) -> Result<Arc<dyn PathTransport>> {
        let class = &self.classes[k];
        let failures = class.connect_failures[idx].load(Ordering::Relaxed);
        let floor = mpquic_core::pmtu::FLOOR;
        let current = class.payload(idx);
        let fall_back = failures % 2 == 1 && current != Some(floor);
        if fall_back {
            class.set_payload(idx, Some(floor));
        }
        match self.dial(k, idx).await {
            Ok(t) => {
                class.connect_failures[idx].store(0, Ordering::Relaxed);
                if fall_back {
                    let tried = current.unwrap_or(self.link_payload);
                    class.tunnel.fell_back(class.path_ids[idx]);
                    warn!(path = %self.ccfg.paths[idx].name, tried, payload = floor,
                          "path connected only with the smallest packets (an MTU fall, or the server was away); larger ones tried again in 2 s");
                }
                Ok(t)
            }
            Err(e) => {
                class.connect_failures[idx].fetch_add(1, Ordering::Relaxed);
                if fall_back {
                    class.set_payload(idx, current);
                }
                Err(e)
            }
        }
    }

    async fn dial(&self, k: usize, idx: usize) -> Result<Arc<dyn PathTransport>> {
        tokio::time::timeout(CONNECT_TIMEOUT, self.connect_inner(k, idx))
            .await
            .map_err(|_| anyhow!("no answer from the server within {CONNECT_TIMEOUT:?}"))?
    }

    async fn connect_inner(&self, k: usize, idx: usize) -> Result<Arc<dyn PathTransport>> {
        let class = &self.classes[k];
        let p = &self.ccfg.paths[idx];
        let requested = self
            .addr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .or(self.ccfg.requested);
        let h = Hello {
            session: self.session,
            path: p.name.clone(),
            priority: p.priority,
            weight: p.weight,
            policy: class.cfg.policy.as_str().into(),
            mode: class.cfg.mode,
            addr: requested.map(|(a, l)| format!("{a}/{l}")),
            fec: (class.cfg.fec != FecMode::Off).then(|| class.cfg.fec.to_string()),
            // The dialer numbers the pipes of a path that has several, and says which are
            // stripe paths.
            pipe: None,
            stripe: None,
            instance: Some(self.cfg.tun_name.clone()),
            class: class.cfg.explicit.then(|| ClassOf {
                name: class.cfg.name.clone(),
                rank: k as u8,
                default: k == self.ccfg.classifier.default_class(),
            }),
            routes: (self.ccfg.lan_prefixes.iter())
                .map(|p| format!("{}/{}", p.addr, p.len))
                .collect(),
        };
        let (transport, ack) = class.dialer.dial(p, &h, class.payload(idx)).await?;
        if !ack.ok {
            let msg = ack
                .error
                .unwrap_or_else(|| "refused without a reason".into());
            transport.close(close::SHUTDOWN, "refused");
            let _ = self
                .fatal
                .try_send(format!("server refused this client: {msg}"));
            bail!("server refused: {msg}");
        }
        let (a, l) = ack
            .addr
            .as_deref()
            .and_then(parse_cidr)
            .ok_or_else(|| anyhow!("server sent no usable address"))?;
        self.set_address(a, l)?;
        Ok(transport)
    }

    fn set_address(&self, a: Ipv4Addr, l: u8) -> Result<()> {
        let mut cur = self.addr.lock().unwrap_or_else(|e| e.into_inner());
        if *cur != Some((a, l)) {
            // The classes' own devices carry the same address (policy routing picks the device).
            let own = self.classes.iter().filter_map(|k| k.own_tun.as_ref());
            for tun in std::iter::once(&self.tun).chain(own) {
                tun.set_ipv4(a, l)
                    .context("cannot set the tunnel address")?;
            }
            info!(address = %format!("{a}/{l}"), tun = %self.cfg.tun_name, "tunnel address assigned");
            *cur = Some((a, l));
        }
        Ok(())
    }
}

impl Class {
    /// Class `k` (`rank`) of the client: its tunnel with the client's paths, writing to its own
    /// TUN device (`own`) or the instance's (`tun`), and a dialer with its congestion
    /// controller.
    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: &Config,
        ccfg: &ClientConfig,
        k: &ClassConfig,
        rank: usize,
        own: Option<Arc<Tun>>,
        tun: &Arc<Tun>,
        link_mtu: u32,
        platform: &Platform,
    ) -> Result<Class> {
        let tunnel = Tunnel::new(
            cfg.tun_name.clone(),
            own.clone().unwrap_or_else(|| tun.clone()),
            None,
            // The client probes every path; the server follows its view (core health.rs).
            HealthMode::Probe,
            Carriage {
                mode: k.mode,
                policy: k.policy,
                fec: k.fec,
                class: k.explicit.then(|| ClassTag {
                    name: k.name.clone(),
                    rank: rank as u8,
                    marks: None,
                }),
            },
        );
        let path_ids = ccfg
            .paths
            .iter()
            .map(|p| {
                tunnel
                    .path(
                        PathSpec {
                            name: p.name.clone(),
                            priority: p.priority,
                            weight: p.weight,
                        },
                        // The config allows no more than a server session takes.
                        sessions::MAX_PATHS_PER_SESSION,
                    )
                    .ok_or_else(|| anyhow!("too many paths"))
            })
            .collect::<Result<Vec<_>>>()?;
        // A class below another keeps out of its way at a shared bottleneck: its bbr probes
        // gently (scenario 17: critical ping p99 +7 ms beside 8 bulk uploads with bulk's
        // probes at 1.25x, ... at 1.1x).
        let congestion = match k.congestion {
            Congestion::Bbr if k.explicit && rank > 0 => Congestion::BbrYielding,
            c => c,
        };
        let class_cfg = Config {
            congestion,
            ..cfg.clone()
        };
        let dialer = Box::new(QuicDialer::new(
            &class_cfg,
            ccfg,
            link_mtu,
            platform.clone(),
        )?);
        Ok(Class {
            cfg: k.clone(),
            tunnel,
            own_tun: own,
            path_ids,
            dialer,
            payload: Mutex::new(vec![None; ccfg.paths.len()]),
            connect_failures: (0..ccfg.paths.len()).map(|_| AtomicU32::new(0)).collect(),
            classified: AtomicU64::new(0),
            unmatched: AtomicU64::new(0),
        })
    }

    fn payload(&self, idx: usize) -> Option<u16> {
        self.payload.lock().unwrap_or_else(|e| e.into_inner())[idx]
    }

    /// Set path `idx`'s packet size for its next connections; returns the previous one.
    fn set_payload(&self, idx: usize, payload: Option<u16>) -> Option<u16> {
        std::mem::replace(
            &mut self.payload.lock().unwrap_or_else(|e| e.into_inner())[idx],
            payload,
        )
    }
}
