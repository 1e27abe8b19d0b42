//! The server's CONNECT-IP endpoint: its own UDP socket (`masque_listen`), HTTP/3 TLS (ALPN
//! `h3`, a client certificate optional), the same admission gate as the native endpoint, and
//! one driver per connection (`serve.rs`) that hands accepted requests to the server as offers.

use std::sync::{Arc, Mutex, RwLock};

use anyhow::Result;
use tokio::sync::mpsc;

use super::serve;
use super::shared::{Rules, Shared};
use crate::config::{Config, MasqueServer, ServerConfig};
use crate::io::platform::Platform;
use crate::tls;
use crate::transport::admit::{self, Refused};
use crate::transport::{BoxFuture, Listener, Offer};

/// Offers waiting for the server (as on the native endpoint).
const OFFER_QUEUE: usize = 64;

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
    let mut t = crate::transport::quic::settings::transport_config(
        cfg.congestion,
        crate::io::socket::DEFAULT_LINK_MTU,
        None,
    );
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
