//! Sessions at the server: an offer (an authenticated client's hello on a new connection)
//! judged by the core's registry and joined to its session, whose tunnel gets the path; the
//! session's terms (policy, FEC, lanes) from its first hello.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use anyhow::Result;
use mpquic_core::classify::Prefix;
use mpquic_core::fec::FecMode;
use mpquic_core::path::reconfig::LinkKind;
use mpquic_core::sessions::{self, Presence};
use mpquic_core::{HealthMode, PacketInfo, PathId, PathSpec, Policy};
use tracing::{info, warn};

use super::{Server, MAX_CLASSES};
use crate::hello::{ClassOf, Hello, HelloAck};
use crate::io::tun::Tun;
use crate::tls::certificate::Facts;
use crate::tls::revocation;
use crate::transport::{Carrier, Offer};
use crate::tunnel::{close, Carriage, LaneSpec, Sources, Tunnel};

impl Server {
    /// A path offered by an authenticated client: join its session (or refuse), answer, and
    /// put the path's transport into the session's tunnel.
    pub(super) async fn handle(&self, offer: Offer) {
        let Offer {
            identity: name,
            certificate,
            remote,
            hello: h,
            carrier,
            reply,
        } = offer;
        match self.join(&name, certificate, &h, carrier) {
            Ok((tunnel, addr, path)) => {
                let scfg = self.scfg();
                let ack = HelloAck {
                    ok: true,
                    addr: Some(format!("{addr}/{}", scfg.prefix)),
                    server_addr: Some(scfg.tun_addr.to_string()),
                    mtu: Some(self.mtu),
                    addr6: self.address6(addr),
                    ..Default::default()
                };
                match reply.accept(ack).await {
                    Ok(transport) => {
                        transport.set_rate_cap(h.rate_limit);
                        tunnel.install(path, transport);
                    }
                    Err(e) => {
                        warn!(client = %name, %remote, error = %format!("{e:#}"), "path not set up")
                    }
                }
            }
            Err(msg) => {
                warn!(client = %name, %remote, reason = %msg, "client refused");
                self.refuse("refused");
                reply
                    .refuse(HelloAck {
                        ok: false,
                        error: Some(msg),
                        ..Default::default()
                    })
                    .await;
            }
        }
    }

    /// Attach a path to the client's session (and with classes to its class's tunnel), creating
    /// or replacing the session as needed. Returns the tunnel, its address and the path's id in
    /// it.
    pub(super) fn join(
        &self,
        identity: &str,
        certificate: Option<Facts>,
        h: &Hello,
        carrier: Carrier,
    ) -> Result<(Arc<Tunnel>, std::net::Ipv4Addr, PathId), String> {
        let (policy, fec) = terms(h)?;
        let name = sessions::session_name(identity, h.instance.as_deref());
        let lans = self.allowed_lans(&name, identity, &h.routes)?;
        let plan = self.scfg().address_plan();
        let mut registry = self.write();
        if let Some((a, _)) = h.previous.as_deref().and_then(crate::config::parse_cidr) {
            registry.remember(&name, a);
        }
        let joined = registry.join(
            &plan,
            &name,
            identity,
            h.session,
            h.addr.as_deref(),
            Instant::now(),
            |_| {
                let made = self.made.fetch_add(1, Ordering::Relaxed) as usize;
                Arc::new(Session {
                    identity: identity.to_string(),
                    certificates: Mutex::default(),
                    tun: self.queues[made % self.queues.len()].clone(),
                    lans: lans.clone(),
                    tunnel: RwLock::new(None),
                })
            },
        )?;
        if joined.created && !lans.is_empty() {
            registry.set_routes(&name, &lans)?;
            info!(client = %name, lans = %h.routes.join(","), "site LAN routed to the client");
        }
        drop(registry);
        if let Some(c) = certificate {
            joined.value.remember(c);
        }
        if let Some(old) = &joined.replaced {
            info!(client = %name, "client restarted; replacing its old session");
            old.close_all(close::REPLACED, "replaced by a new session");
        }
        if joined.created {
            info!(client = %name, address = %joined.addr, policy = policy.as_str(), mode = h.mode.as_str(), "client session started");
        }
        let tunnel =
            self.session_tunnel(&joined.value, &name, joined.addr, h, (policy, fec), carrier)?;
        if h.counts {
            tunnel.peer_reads_counts();
        }
        let role = match h.role.as_deref() {
            None => mpquic_core::Role::Primary,
            Some(r) => mpquic_core::Role::parse(r).ok_or_else(|| format!("unknown role `{r}`"))?,
        };
        let spec = PathSpec {
            name: h.path.clone(),
            priority: h.priority,
            weight: h.weight.max(1),
            role,
            rate_limit: h.rate_limit,
            metered: h.metered,
            // A value this build does not know is nothing known (a newer client's).
            link: (h.link.as_deref())
                .and_then(LinkKind::parse)
                .unwrap_or_default(),
            // The client recognises the link; its probes say what it found.
            detect_link: false,
        };
        let path = tunnel
            .path(spec, sessions::MAX_PATHS_PER_SESSION)
            .ok_or_else(|| {
                format!(
                    "too many paths in this session (at most {})",
                    sessions::MAX_PATHS_PER_SESSION
                )
            })?;
        Ok((tunnel, joined.addr, path))
    }

    /// The site LAN prefixes a client announced, if its `clients:` entry (by session name or
    /// identity) allows each of them (each inside an allowed prefix); else the refusal.
    pub(super) fn allowed_lans(
        &self,
        name: &str,
        identity: &str,
        announced: &[String],
    ) -> Result<Vec<Prefix>, String> {
        let scfg = self.scfg();
        let allowed: Vec<&Prefix> = (scfg.routes.iter())
            .filter(|(n, _)| n == name || n == identity)
            .map(|(_, p)| p)
            .collect();
        announced
            .iter()
            .map(|s| {
                let p = Prefix::parse(s)
                    .filter(|p| *p == p.network() && s.contains('/'))
                    .ok_or_else(|| format!("LAN prefix `{s}` is not a network prefix"))?;
                match allowed.iter().any(|a| a.covers(&p)) {
                    true => Ok(p),
                    false => Err(format!(
                        "LAN prefix {s} is not allowed for this client (server `clients:` routes)"
                    )),
                }
            })
            .collect()
    }

    /// The session's tunnel, made by its first connection with a lane per class the hello
    /// lists (one without classes); a later connection must list the same classes.
    pub(super) fn session_tunnel(
        &self,
        session: &Session,
        name: &str,
        addr: std::net::Ipv4Addr,
        h: &Hello,
        (policy, fec): (Policy, FecMode),
        carrier: Carrier,
    ) -> Result<Arc<Tunnel>, String> {
        let mut slot = session.tunnel.write().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = slot.as_ref() {
            if st.classes != h.classes {
                return Err("this session's connections disagree on traffic classes".into());
            }
            // The client reloaded with another policy (no classes): its paths reconnect with it.
            if h.classes.is_empty() {
                st.tunnel.set_policy(policy)?;
            }
            return Ok(st.tunnel.clone());
        }
        let lanes = lanes_of(h, policy, fec)?;
        for c in &h.classes {
            info!(client = %name, class = %c.name, rank = c.rank, policy = %c.policy, mode = c.mode.as_str(), fec = c.fec, "traffic class started");
        }
        let n = lanes.len();
        let tunnel = Tunnel::new(
            name.to_string(),
            session.tun.clone(),
            Some(Sources {
                addr,
                addr6: self.ipv6.map(|p| p.v6_of(addr)),
                lans: session.lans.clone(),
            }),
            // A standard CONNECT-IP client neither probes nor answers probes: its one path is
            // up while its connection is.
            match carrier.plain() {
                true => HealthMode::Transport,
                false => HealthMode::Follow,
            },
            self.cfg.congestion,
            Carriage {
                fec,
                lanes,
                marks: !h.classes.is_empty(),
            },
        );
        let t = tunnel.clone();
        let timers = tokio::spawn(async move { t.run_timers().await }).abort_handle();
        *slot = Some(SessionTunnel {
            tunnel: tunnel.clone(),
            classes: h.classes.clone(),
            default: h.classes.iter().position(|c| c.default).unwrap_or(0),
            classified: (0..n).map(|_| AtomicU64::new(0)).collect(),
            unmatched: (0..n).map(|_| AtomicU64::new(0)).collect(),
            timers,
            carrier,
        });
        Ok(tunnel)
    }
}

/// What the shell keeps per session; the rules (which session a path joins, replacement,
/// expiry, addresses, the path bound) are the core's `sessions::Registry`. A session has one
/// tunnel, made by its first connection, with a lane per traffic class of the client instance
/// (one without classes).
pub(super) struct Session {
    /// The client's identity (its certificate's name): which `clients:` entries apply.
    pub(super) identity: String,
    /// The certificates its connections presented (one, unless the client rotated its
    /// certificate while the session ran): a reload that revokes one closes the session.
    pub(super) certificates: Mutex<Vec<Facts>>,
    /// The TUN queue the session's tunnel writes to (`Server::queues`).
    pub(super) tun: Arc<Tun>,
    /// The site LAN prefixes routed to this session (announced, allowed by `clients:`).
    pub(super) lans: Vec<Prefix>,
    pub(super) tunnel: RwLock<Option<SessionTunnel>>,
}

/// A session's tunnel and its classes.
pub(super) struct SessionTunnel {
    pub(super) tunnel: Arc<Tunnel>,
    /// The classes as the session's first hello listed them (every later one must agree).
    pub(super) classes: Vec<ClassOf>,
    /// The lane of flows the client has not sent on (its default class; 0 without classes).
    pub(super) default: usize,
    /// Per lane: packets sent in it because their flow arrived in it / (default class) because
    /// their flow was not seen.
    pub(super) classified: Vec<AtomicU64>,
    pub(super) unmatched: Vec<AtomicU64>,
    /// The task serving the tunnel's timers; it ends with the session.
    pub(super) timers: tokio::task::AbortHandle,
    /// How the session's first connection came (status).
    pub(super) carrier: Carrier,
}

impl Drop for SessionTunnel {
    fn drop(&mut self) {
        self.timers.abort();
    }
}

impl Session {
    pub(super) fn tunnel(&self) -> Option<Arc<Tunnel>> {
        let t = self.tunnel.read().unwrap_or_else(|e| e.into_inner());
        t.as_ref().map(|t| t.tunnel.clone())
    }

    pub(super) fn presence(&self) -> Presence {
        match self.tunnel() {
            Some(t) if t.connected_paths() > 0 => Presence::Connected,
            Some(t) if t.peer_leaving() => Presence::Left,
            _ => Presence::Away,
        }
    }

    pub(super) fn close_all(&self, code: u32, reason: &str) {
        if let Some(t) = self.tunnel() {
            t.close_all(code, reason);
        }
    }

    pub(super) fn remember(&self, cert: Facts) {
        let mut certs = self.certificates.lock().unwrap_or_else(|e| e.into_inner());
        if !certs.iter().any(|c| c.serial == cert.serial) {
            // Bounded: a client rotates rarely; the newest few are what a revocation names.
            if certs.len() == 4 {
                certs.remove(0);
            }
            certs.push(cert);
        }
    }

    /// A client known by a token only (no certificate) whose token is not among `tokens`.
    pub(super) fn token_gone(&self, tokens: &[&str]) -> bool {
        let certs = self.certificates.lock().unwrap_or_else(|e| e.into_inner());
        certs.is_empty() && !tokens.contains(&self.identity.as_str())
    }

    pub(super) fn revoked_by(&self, list: &[String]) -> bool {
        let certs = self.certificates.lock().unwrap_or_else(|e| e.into_inner());
        certs.iter().any(|c| revocation::is_revoked(list, c))
    }

    /// The tunnel and lane an inner packet for this client goes through: with classes, the
    /// class its flow arrived in, else the default class (both counted). `false`: the session
    /// has no tunnel yet (its first connection is still being set up).
    pub(super) fn pick(
        &self,
        info: &PacketInfo,
        now: Instant,
        to: impl FnOnce(&Arc<Tunnel>, usize),
    ) -> bool {
        let t = self.tunnel.read().unwrap_or_else(|e| e.into_inner());
        let Some(st) = t.as_ref() else {
            return false;
        };
        let lane = match st.classes.is_empty() {
            true => 0,
            false => match st.tunnel.lane_of(info.flow_hash(), now) {
                Some(lane) => {
                    st.classified[lane].fetch_add(1, Ordering::Relaxed);
                    lane
                }
                None => {
                    st.unmatched[st.default].fetch_add(1, Ordering::Relaxed);
                    st.default
                }
            },
        };
        to(&st.tunnel, lane);
        true
    }
}

/// The policy and FEC mode a hello asks for (an unknown one refuses it).
pub(crate) fn terms(h: &Hello) -> Result<(Policy, FecMode), String> {
    let policy =
        Policy::parse(&h.policy).ok_or_else(|| format!("unknown policy `{}`", h.policy))?;
    let fec = match h.fec.as_deref() {
        Some(f) => FecMode::parse(f)?,
        None => FecMode::Off,
    };
    Ok((policy, fec))
}

/// The lanes of a session's tunnel from its first hello: one per class it lists, in rank
/// order, each with its policy, carriage and FEC; one lane of the hello's own settings without
/// classes. A list that is not one (ranks out of order, a name twice, not exactly one default,
/// too many, carriages that the connection's mode does not carry) is refused.
pub(crate) fn lanes_of(h: &Hello, policy: Policy, fec: FecMode) -> Result<Vec<LaneSpec>, String> {
    if h.classes.is_empty() {
        return Ok(vec![LaneSpec {
            name: None,
            policy,
            mode: h.mode,
            fec: fec != FecMode::Off,
            tun: None,
        }]);
    }
    if h.classes.len() > MAX_CLASSES {
        return Err(format!("too many traffic classes (at most {MAX_CLASSES})"));
    }
    for (i, c) in h.classes.iter().enumerate() {
        if usize::from(c.rank) != i {
            return Err(format!("class `{}`: rank {} out of order", c.name, c.rank));
        }
        if h.classes[..i].iter().any(|o| o.name == c.name) {
            return Err(format!("class `{}` listed twice", c.name));
        }
    }
    if h.classes.iter().filter(|c| c.default).count() != 1 {
        return Err("traffic classes: exactly one must be the default".into());
    }
    if Carriage::connection_mode(h.classes.iter().map(|c| c.mode)) != h.mode {
        return Err(format!(
            "traffic classes: their modes are not carried by a connection in mode {}",
            h.mode.as_str()
        ));
    }
    h.classes
        .iter()
        .map(|c| {
            Ok(LaneSpec {
                name: Some(c.name.clone()),
                policy: Policy::parse(&c.policy)
                    .ok_or_else(|| format!("class `{}`: unknown policy `{}`", c.name, c.policy))?,
                mode: c.mode,
                fec: c.fec,
                tun: None,
            })
        })
        .collect()
}
