//! The server's CONNECT-IP endpoint: its own UDP socket (`masque_listen`), HTTP/3 TLS (ALPN
//! `h3`, a client certificate optional), the same admission gate as the native endpoint, and
//! one driver per connection (`serve.rs`) that hands accepted requests to the server as offers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use mpquic_core::connect_ip::{Template, TokenHash};
use tokio::sync::mpsc;
use tracing::warn;

use super::serve;
use crate::config::{Config, MasqueServer, ServerConfig};
use crate::platform::Platform;
use crate::tls;
use crate::transport::admit::{self, Refused};
use crate::transport::{BoxFuture, Listener, Offer};

/// Offers waiting for the server (as on the native endpoint).
const OFFER_QUEUE: usize = 64;
/// A refusal's cause is logged at most once in this long (with how many since), so a client
/// retrying with a wrong token cannot fill the log.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// What a request is judged against: swapped whole by a reload.
pub(super) struct Rules {
    pub(super) template: Template,
    pub(super) tokens: Vec<(String, TokenHash)>,
}

/// What the connection drivers share.
pub(super) struct Shared {
    pub(super) rules: RwLock<Arc<Rules>>,
    pub(super) refused: Refused,
    /// Per refusal cause: when it was last logged, and how many since.
    logged: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl Shared {
    pub(super) fn rules(&self) -> Arc<Rules> {
        self.rules.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Count a refusal by `reason`, and log it unless the same cause was logged lately.
    pub(super) fn refuse(&self, reason: &'static str, log: impl FnOnce(u64)) {
        (self.refused)(reason);
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let entry = logged.entry(reason).or_insert((now - LOG_EVERY, 0));
        entry.1 += 1;
        if now.duration_since(entry.0) >= LOG_EVERY {
            log(entry.1);
            *entry = (now, 0);
        }
    }
}

pub struct MasqueListener {
    endpoint: quinn::Endpoint,
    offers: tokio::sync::Mutex<mpsc::Receiver<Offer>>,
    shared: Arc<Shared>,
}

impl MasqueListener {
    pub fn start(
        cfg: &Config,
        scfg: &ServerConfig,
        masque: &MasqueServer,
        platform: &Platform,
        refused: Refused,
    ) -> Result<MasqueListener> {
        let settings = settings(cfg, scfg)?;
        let endpoint = quinn::Endpoint::new_with_abstract_socket(
            quinn::EndpointConfig::default(),
            Some(settings),
            platform.server_socket(masque.listen)?,
            Arc::new(quinn::TokioRuntime),
        )?;
        let shared = Arc::new(Shared {
            rules: RwLock::new(Arc::new(rules(masque))),
            refused: refused.clone(),
            logged: Mutex::default(),
        });
        let (tx, rx) = mpsc::channel(OFFER_QUEUE);
        let s = shared.clone();
        admit::serve(
            endpoint.clone(),
            admit::Gate::new(refused),
            move |incoming, in_flight| {
                let (tx, s) = (tx.clone(), s.clone());
                tokio::spawn(async move {
                    let Some(conn) = admit::handshake(incoming, in_flight, &s.refused).await else {
                        return;
                    };
                    serve::connection(conn, s, tx).await;
                });
            },
        );
        Ok(MasqueListener {
            endpoint,
            offers: tokio::sync::Mutex::new(rx),
            shared,
        })
    }

    /// A reload: TLS files read again and the new `revoked:` list for the handshakes from now
    /// on, the new template and tokens for the requests from now on. The server closes the
    /// sessions of tokens that are gone.
    pub fn install(&self, settings: quinn::ServerConfig, masque: &MasqueServer) {
        self.endpoint.set_server_config(Some(settings));
        *self.shared.rules.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(rules(masque));
    }
}

fn rules(masque: &MasqueServer) -> Rules {
    Rules {
        template: masque.template.clone(),
        tokens: masque.tokens.clone(),
    }
}

/// The endpoint's QUIC and TLS settings, the TLS files read now: the native endpoint's with
/// HTTP/3's ALPN and an optional client certificate, and room for HTTP/3's streams (a control
/// stream and two QPACK streams each way, one request).
pub fn settings(cfg: &Config, scfg: &ServerConfig) -> Result<quinn::ServerConfig> {
    let mut s = crate::transport::quic::server_quic(cfg, scfg, tls::Served::Http3)?;
    let mut t = crate::quic::transport_config(cfg.congestion, crate::quic::DEFAULT_LINK_MTU, None);
    t.max_concurrent_uni_streams(8u32.into());
    t.max_concurrent_bidi_streams(4u32.into());
    s.transport_config(Arc::new(t));
    Ok(s)
}

impl Listener for MasqueListener {
    fn next(&self) -> BoxFuture<'_, Option<Offer>> {
        admit::next_offer(&self.offers)
    }

    fn close(&self, code: u32, reason: &str) -> BoxFuture<'_, ()> {
        admit::close(&self.endpoint, code, reason)
    }
}

/// Logged once per cause (`Shared::refuse`).
pub(super) fn log_refusal(reason: &str, detail: &str, remote: std::net::SocketAddr, count: u64) {
    warn!(%remote, reason, detail, refused_since_last_log = count, "CONNECT-IP request refused");
}
