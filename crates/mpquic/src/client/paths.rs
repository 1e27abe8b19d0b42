//! The client's paths: each one's task dials, supervises and reconnects it (with backoff, and
//! at once when a reload changes it), installing each connection in the tunnel; what the client
//! keeps per path between connections (`PathSlot`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use mpquic_core::fec::FecMode;
use mpquic_core::path::reconnect;
use mpquic_core::path::standby::Standing;
use mpquic_core::{sessions, PathId, PathSpec};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{standby, tunnel_fec, Assigned, Client};
use crate::config::PathConfig;
use crate::hello::{ClassOf, Hello};
use crate::transport::{Dialed, Known, PathTransport, Unfinished};
use crate::tunnel::{close, Tunnel};
use mpquic_core::path::delivery::Direction;

impl Client {
    /// Path `p` in the tunnel, with its task.
    pub(super) fn start_path(self: &Arc<Self>, p: PathConfig) -> Result<LivePath> {
        let id = self.add_path(&p)?;
        Ok(self.spawn_path(id, p))
    }

    /// The task of path `id` (in the tunnel already).
    pub(super) fn spawn_path(self: &Arc<Self>, id: PathId, p: PathConfig) -> LivePath {
        let (tx, rx) = watch::channel(Arc::new(p));
        let c = self.clone();
        let task = tokio::spawn(async move { c.path_task(id, rx).await }).abort_handle();
        LivePath { cfg: tx, task }
    }

    /// Keep path `id` connected for as long as it is configured (`cfg`: its configuration,
    /// which a reload may change).
    pub(super) async fn path_task(
        self: Arc<Self>,
        id: PathId,
        mut cfg: watch::Receiver<Arc<PathConfig>>,
    ) {
        let mut backoff = reconnect::Backoff::default();
        // Out of the turns when the task ends (the path removed: the task is aborted).
        let _turn = self.turns.as_ref().map(|t| t.member(id));
        // The path's sender goes when it is removed (its tasks are aborted then, too).
        while cfg.has_changed().is_ok() {
            let p = cfg.borrow_and_update().clone();
            if let Some(turns) = self.turns() {
                // A reload may have changed its priority.
                turns.rerank(id, p.priority);
                // One path at a time: it dials once no better one is connected or trying.
                tokio::select! {
                    _ = turns.turn(id) => {}
                    _ = cfg.changed() => continue,
                }
            }
            match self.connect(id, &p).await {
                Ok(transport) => {
                    backoff.succeeded();
                    self.stand(id, &p, Standing::Connected);
                    let after = self.supervise(id, &mut cfg, transport).await;
                    self.stand(id, &cfg.borrow(), after);
                }
                Err(e) => {
                    self.stand(id, &p, Standing::Failed);
                    let wait = backoff.failed();
                    warn!(path = %p.name, error = %format!("{e:#}"), retry_in_ms = wait.as_millis() as u64, "path connect failed");
                    // A changed configuration is tried at once.
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = cfg.changed() => {}
                    }
                }
            }
        }
    }

    /// Path `id` (configured as `p`) now stands so, when the paths take turns.
    pub(super) fn stand(&self, id: PathId, p: &PathConfig, standing: Standing) {
        if let Some(turns) = self.turns() {
            turns.set(id, p.priority, standing);
        }
    }

    /// Watch an installed transport; replace it when it has been unusable for too long, or
    /// when the path's configuration changed. When the paths take turns, also hand over to a
    /// better path that connected, and close the connection once it stops acknowledging
    /// (`standby.rs`). Returns where the path stands when its connection is gone.
    pub(super) async fn supervise(
        &self,
        id: PathId,
        cfg: &mut watch::Receiver<Arc<PathConfig>>,
        transport: Arc<dyn PathTransport>,
    ) -> Standing {
        let tunnel = &self.tunnel;
        let mut p = cfg.borrow().clone();
        let mut now = Installed::new(tunnel, id, transport);
        let mut liveness = standby::Liveness::default();
        let outranked = async {
            match self.turns() {
                Some(turns) => turns.outranked(id).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(outranked);
        let mut sample = tokio::time::interval(standby::SAMPLE_EVERY);
        sample.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // An interval, not a sleep made anew in each turn of the loop: the samples' ticks
        // would keep putting that off.
        let every = Duration::from_millis(250);
        let mut check = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ended = &mut now.closed => {
                    tunnel.remove(id, now.generation);
                    info!(path = %p.name, reason = %ended, "path connection closed");
                    let Some(turns) = self.turns() else {
                        return Standing::Failed;
                    };
                    // The server gave the session to this client's newer connection on another
                    // path (an mpquic server keeps a client's newest): wait for it to connect
                    // before dialing again, or the two would take the session from each other
                    // in turn.
                    if ended.peer_code == Some(close::REPLACED) {
                        // It stands by meanwhile, so that, being the better path, it does not
                        // outrank the newer connection and close it.
                        self.stand(id, &p, Standing::Ready);
                        tokio::select! {
                            _ = turns.another_connected(id) => {}
                            _ = tokio::time::sleep(CONNECT_TIMEOUT) => {}
                        }
                        return Standing::Ready;
                    }
                    return match turns.is_outranked(id) {
                        true => Standing::Ready,
                        false => Standing::Failed,
                    };
                }
                _ = &mut outranked => {
                    now.transport.close(close::REPLACED, "a better path took over");
                    tunnel.remove(id, now.generation);
                    info!(path = %p.name, "a better path connected and carries; this one stands by");
                    return Standing::Ready;
                }
                _ = sample.tick(), if self.turns().is_some_and(|t| t.has_others(id)) => {
                    let verdict = liveness.dead_for(now.transport.as_ref(), Instant::now());
                    self.with_slot(id, |s| {
                        s.quic_rtt = liveness.rtt();
                        s.payload = liveness.payload().or(s.payload);
                    });
                    if let Some(silent) = verdict {
                        now.transport.close(close::PATH_DOWN, "no ACK");
                        tunnel.remove(id, now.generation);
                        warn!(path = %p.name, silent_ms = silent.as_millis() as u64, "path stopped acknowledging; its connection is closed and the next path takes over");
                        return Standing::Failed;
                    }
                }
                changed = cfg.changed() => {
                    if changed.is_err() {
                        return Standing::Failed;
                    }
                    p = cfg.borrow_and_update().clone();
                    if let Some(turns) = self.turns() {
                        turns.rerank(id, p.priority);
                    }
                    // Priority and weight count here at once; the server learns them from
                    // the new connection's hello, made before the old one is closed.
                    tunnel.path(spec_of(&p), sessions::MAX_PATHS_PER_SESSION);
                    // A changed budget counts on from what the period has used.
                    tunnel.set_budget(id, p.data_budget, None);
                    match self.dial(id, &p).await {
                        Ok(new) => {
                            info!(path = %p.name, "path reconfigured; new connection in place");
                            now = Installed::new(tunnel, id, new);
                        }
                        Err(e) => warn!(path = %p.name, error = %format!("{e:#}"), "path reconfigured, but its new connection failed; the old one carries on (the new settings apply at its next reconnect)"),
                    }
                }
                _ = check.tick() => {
                    if let Some(r) = tunnel.take_resize(id) {
                        // The route's MTU changed, or a larger size is tried: a new connection
                        // at that size (the QUIC engine's packet size is fixed per connection);
                        // the old one drains and closes, or carries on if this one fails.
                        let before = self.set_payload(id, Some(r.payload));
                        match self.dial(id, &p).await {
                            Ok(new) => {
                                info!(path = %p.name, payload = r.payload, "path reconnected at a new packet size");
                                now = Installed::new(tunnel, id, new);
                            }
                            Err(e) => {
                                self.set_payload(id, before);
                                let error = format!("{e:#}");
                                if !tunnel.resize_failed(id, r.payload) {
                                    info!(path = %p.name, payload = r.payload, %error, "reconnect at a new packet size failed while the path was down; tried again once it is up");
                                } else if before == Some(mpquic_core::path::pmtu::FLOOR) {
                                    // Connected at the floor only, and larger packets fail
                                    // while those pass: the route's MTU fell.
                                    warn!(path = %p.name, payload = r.payload, %error, "path MTU fell: larger packets do not pass while the smallest do; finding the size that passes");
                                } else {
                                    let level = if r.recheck { "larger packets do not pass yet" } else { "failed" };
                                    info!(path = %p.name, payload = r.payload, %error, "reconnect at a new packet size: {level}");
                                }
                            }
                        }
                        continue;
                    }
                    if tunnel.up_for(id).is_some_and(|u| u >= HELD) {
                        let slot = self.slot(id);
                        if slot.replaced >= 2 && slot.live_unsegmented && !slot.unsegmented {
                            warn!(path = %p.name, replaced = slot.replaced, "path holds without UDP GSO after connections with it failed in a row; it sends without GSO from now on (a NAT on this host that rewrites ports, with checksum offload off, corrupts GSO segments)");
                            self.with_slot(id, |s| s.unsegmented = true);
                        }
                        self.with_slot(id, |s| s.replaced = 0);
                    }
                    if let Some(way) = tunnel.stalled(id) {
                        // Its probes are answered, so the path would never count as unusable
                        // long enough: a new connection now, sending datagrams one by one.
                        let first = !self.slot(id).unsegmented;
                        self.with_slot(id, |s| s.unsegmented = true);
                        let why = match way {
                            Direction::Out => "what this side sends does not arrive",
                            Direction::In => "what the server sends does not arrive",
                        };
                        warn!(path = %p.name, direction = way.as_str(), "path answers its probes but delivers nothing ({why}); its connection is replaced{}",
                              if first { ", sending without UDP GSO from now on (a NAT on this host that rewrites ports, with checksum offload off, corrupts GSO segments)" } else { "" });
                        match self.connect(id, &p).await {
                            Ok(new) => now = Installed::new(tunnel, id, new),
                            Err(e) => info!(path = %p.name, error = %format!("{e:#}"), "path delivers nothing; reconnect failed"),
                        }
                        continue;
                    }
                    if reconnect::should_replace(tunnel.unusable_for(id), self.rtt(id)) {
                        match self.connect(id, &p).await {
                            Ok(new) => {
                                self.with_slot(id, |s| s.replaced += 1);
                                let gso = if self.slot(id).live_unsegmented { " (without UDP GSO)" } else { "" };
                                info!(path = %p.name, "path unusable; replaced its connection{gso}");
                                now = Installed::new(tunnel, id, new);
                            }
                            Err(e) => info!(path = %p.name, error = %format!("{e:#}"), "path still unusable; reconnect failed"),
                        }
                    }
                }
            }
        }
    }

    /// Connect path `idx` (a new connection, or a replacement for one that is unusable). A
    /// route whose MTU fell drops the server's full-size handshake packets, so after a failure
    /// every other attempt is made with QUIC's minimum packet size; once connected,
    /// the MTU watch finds the size that passes (`pmtu.rs`; native protocol only).
    pub(super) async fn connect(
        &self,
        id: PathId,
        p: &PathConfig,
    ) -> Result<Arc<dyn PathTransport>> {
        let tunnel = &self.tunnel;
        let failures = self.slot(id).connect_failures;
        let floor = mpquic_core::path::pmtu::FLOOR;
        let current = self.slot(id).payload;
        // Only where the tunnel watches the size (not over CONNECT-IP: its server answers no
        // size probes), or nothing would find the larger size again.
        let fall_back = failures % 2 == 1 && current != Some(floor) && tunnel.watches_mtu();
        if fall_back {
            self.set_payload(id, Some(floor));
        }
        match self.dial(id, p).await {
            Ok(t) => {
                self.with_slot(id, |s| s.connect_failures = 0);
                if fall_back {
                    let tried = current.unwrap_or(self.link_payload);
                    tunnel.fell_back(id);
                    info!(path = %p.name, tried, payload = floor,
                          "path connected with the smallest packets after an unanswered attempt (an outage or an MTU fall); its size tried again as soon as it is up");
                }
                Ok(t)
            }
            Err(e) => {
                self.with_slot(id, |s| s.connect_failures += 1);
                if fall_back {
                    self.set_payload(id, current);
                }
                Err(e)
            }
        }
    }

    /// The path's RTT as last known: its probes', or its connection's.
    pub(super) fn rtt(&self, id: PathId) -> Option<Duration> {
        self.tunnel.rtt(id).or(self.slot(id).quic_rtt)
    }

    pub(super) async fn dial(&self, id: PathId, p: &PathConfig) -> Result<Arc<dyn PathTransport>> {
        let limit = connect_timeout(self.rtt(id), self.slot(id).connect_failures);
        tokio::time::timeout(limit, self.connect_inner(id, p))
            .await
            .map_err(|_| anyhow!("no answer from the server within {limit:?}"))?
    }

    pub(super) async fn connect_inner(
        &self,
        id: PathId,
        p: &PathConfig,
    ) -> Result<Arc<dyn PathTransport>> {
        let previous = self
            .addr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|a| a.v4);
        let h = Hello {
            session: self.session,
            path: p.name.clone(),
            priority: p.priority,
            weight: p.weight,
            // The first lane's, which a reload may have changed.
            policy: self.tunnel.policy().as_str().into(),
            mode: self.tunnel.mode(),
            addr: self.ccfg.requested.map(|(a, l)| format!("{a}/{l}")),
            previous: previous.map(|(a, l)| format!("{a}/{l}")),
            fec: Some(tunnel_fec(&self.ccfg.classes))
                .filter(|f| *f != FecMode::Off)
                .map(|f| f.to_string()),
            // The dialer numbers the pipes of a path that has several, and says which are
            // stripe paths.
            pipe: None,
            stripe: None,
            instance: Some(self.cfg.tun_name.clone()),
            classes: (self.classes.iter().enumerate())
                .filter(|(_, k)| k.cfg.explicit)
                .map(|(rank, k)| ClassOf {
                    name: k.cfg.name.clone(),
                    rank: rank as u8,
                    default: rank == self.ccfg.classifier.default_class(),
                    policy: k.cfg.policy.as_str().into(),
                    mode: k.cfg.mode,
                    fec: k.cfg.fec != FecMode::Off,
                })
                .collect(),
            routes: self
                .ccfg
                .lan_prefixes
                .iter()
                .map(|p| p.to_string())
                .collect(),
            rate_limit: p.rate_limit,
            metered: p.metered(),
            // Backup while its budget is used up, whatever its configured role.
            role: Some(self.tunnel.role(id))
                .filter(|r| *r != mpquic_core::Role::Primary)
                .map(|r| r.as_str().into()),
            counts: true,
            link: p.link.known().map(Into::into),
        };
        let slot = self.slot(id);
        // A path whose connections keep becoming unusable right after they connect may be
        // losing every GSO batch while single packets pass (the probes, so its health never
        // shows it for long): every second replacement in a row is made without them.
        let unsegmented = slot.unsegmented || slot.replaced % 2 == 1;
        self.with_slot(id, |s| s.live_unsegmented = unsegmented);
        let known = Known {
            payload: slot.payload,
            rtt: self.rtt(id),
            unsegmented,
        };
        let Dialed {
            transport,
            ack,
            carrier,
        } = self.dialer.dial(p, &h, known).await?;
        // Closed if the answer is unusable (or this attempt is given up by its timeout).
        let transport = Unfinished::new(transport);
        if !ack.ok {
            let msg = ack
                .error
                .unwrap_or_else(|| "refused without a reason".into());
            transport.get().close(close::SHUTDOWN, "refused");
            let _ = self
                .fatal
                .try_send(format!("server refused this client: {msg}"));
            bail!("server refused: {msg}");
        }
        self.learn(carrier)?;
        self.set_address(Assigned::from_answer(&ack)?)?;
        transport.get().set_rate_cap(p.rate_limit);
        Ok(transport.keep())
    }

    /// Path `p` in the tunnel (its id; the same one if it was there before).
    pub(super) fn add_path(&self, p: &PathConfig) -> Result<PathId> {
        // The config allows no more than a server session takes.
        let id = (self.tunnel)
            .path(spec_of(p), sessions::MAX_PATHS_PER_SESSION)
            .ok_or_else(|| anyhow!("too many paths"))?;
        let saved = (self.saved_usage.lock().unwrap_or_else(|e| e.into_inner())).remove(&p.name);
        self.tunnel.set_budget(id, p.data_budget, saved);
        self.with_slot(id, |_| ());
        self.stand(id, p, Standing::Ready);
        Ok(id)
    }

    pub(super) fn slot(&self, id: PathId) -> PathSlot {
        self.with_slot(id, |s| *s)
    }

    pub(super) fn with_slot<R>(&self, id: PathId, f: impl FnOnce(&mut PathSlot) -> R) -> R {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if slots.len() <= id.index() {
            slots.resize_with(id.index() + 1, Default::default);
        }
        f(&mut slots[id.index()])
    }

    /// Set path `id`'s packet size for its next connections; returns the previous one.
    pub(super) fn set_payload(&self, id: PathId, payload: Option<u16>) -> Option<u16> {
        self.with_slot(id, |s| std::mem::replace(&mut s.payload, payload))
    }
}

/// Bound on socket setup + handshake + hello for one attempt.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The bound for an attempt on a path whose RTT is known (a redial): the handshake's
/// retransmissions start about three RTTs apart and double (`quic::transport`), so later ones
/// come a second or more apart; an attempt given up after ~40 RTTs (1 s at most 25 ms, never
/// more than `CONNECT_TIMEOUT`) and made again keeps the wait after a path's return under half
/// a second rather than up to one and a half. A long path gets five of its round trips at
/// least (a handshake, the hello and one retransmission of each: 3 s at 600 ms). With no RTT
/// known, each failed attempt in a row doubles the bound, up to four times `CONNECT_TIMEOUT`:
/// a path of a second's round trip whose first Initial is lost needs more than 3 s.
pub(super) fn connect_timeout(rtt: Option<Duration>, failures: u32) -> Duration {
    let unknown = CONNECT_TIMEOUT * (1 << failures.min(2));
    rtt.map_or(unknown, |r| {
        (r * 40).clamp(Duration::from_secs(1), CONNECT_TIMEOUT.max(r * 5))
    })
}

/// A configured path: its configuration, watched by its task, which ends with it.
pub(super) struct LivePath {
    pub(super) cfg: watch::Sender<Arc<PathConfig>>,
    pub(super) task: tokio::task::AbortHandle,
}

impl Drop for LivePath {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the client keeps per path between its connections.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PathSlot {
    /// The UDP payload its connections use when its route carries less than its link (`None`:
    /// the link's), as the tunnel's MTU watch found. Over CONNECT-IP: the largest its last
    /// connection reached, where the next one starts (`quic::client_transport`).
    pub(super) payload: Option<u16>,
    /// Connection attempts failed in a row.
    pub(super) connect_failures: u32,
    /// Its last connection's own RTT estimate, for a path without probes (CONNECT-IP), which
    /// the tunnel has no RTT for.
    pub(super) quic_rtt: Option<Duration>,
    /// Its connections send without UDP GSO batches (`io::socket::Unsegmented`): it answered
    /// its probes while none of its data arrived one way (`path/delivery.rs`), or a connection
    /// without them held after ones with them kept failing.
    pub(super) unsegmented: bool,
    /// Connections replaced in a row because the path was unusable (back to 0 once one holds
    /// `HELD`): every second one is made without UDP GSO (`connect_inner`).
    pub(super) replaced: u32,
    /// The live connection sends without GSO.
    pub(super) live_unsegmented: bool,
}

/// A connection up this long has held: the replacements in a row are over.
const HELD: Duration = Duration::from_secs(10);

/// A path's connection in the tunnel: the transport, its end, and the tunnel's generation for it.
pub(super) struct Installed {
    pub(super) transport: Arc<dyn PathTransport>,
    pub(super) closed: crate::transport::BoxFuture<'static, crate::transport::Closed>,
    pub(super) generation: u64,
}

impl Installed {
    pub(super) fn new(
        tunnel: &Arc<Tunnel>,
        id: PathId,
        transport: Arc<dyn PathTransport>,
    ) -> Installed {
        Installed {
            closed: transport.closed(),
            generation: tunnel.install(id, transport.clone()),
            transport,
        }
    }
}

pub(super) fn spec_of(p: &PathConfig) -> PathSpec {
    PathSpec {
        name: p.name.clone(),
        priority: p.priority,
        weight: p.weight,
        role: p.role,
        rate_limit: p.rate_limit,
        metered: p.metered(),
        link: p.link,
        detect_link: p.detect_link,
    }
}
