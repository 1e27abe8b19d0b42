//! The server's side: one endpoint on the listening socket; each connection handshaken, asked for
//! its hello and offered to the server.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use mpquic_core::admission;
use tokio::sync::mpsc;
use tracing::warn;

use super::pipes::{PipeKey, PipeSets, QuicPipes};
use super::{controller, settings, QuicTransport, RideServer};
use crate::config::{Config, TransportMode};
use crate::hello::{self, Hello, HelloAck};
use crate::io::platform::Platform;
use crate::tls;
use crate::transport::admit::{self, InFlight, Refused};
use crate::transport::close;
use crate::transport::{BoxFuture, Carrier, Listener, Offer, OfferReply, PathTransport};

/// Bound on the server's wait for a client's hello after the handshake.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Offers waiting for the server to take them; beyond this, new connections wait in the accept
/// loop (backpressure, not loss).
const OFFER_QUEUE: usize = 64;

/// The server's QUIC session setup: one endpoint on the listening socket; each connection is
/// handshaken (client certificate required), named by its certificate's CN and asked for its
/// hello, each in its own task, and offered to the server. Failures before the offer are
/// logged and counted through `refused` (by reason).
pub struct QuicListener {
    endpoint: quinn::Endpoint,
    offers: tokio::sync::Mutex<mpsc::Receiver<Offer>>,
}

/// What the listener's connection tasks share: the refusal counter, the pipe sets, and the
/// controller a pipe set's group gets.
struct Accepting {
    refused: Refused,
    pipes: PipeSets,
    congestion: crate::config::Congestion,
    /// `stripe_enabled`: the stripe transport that stripe paths join.
    stripe: Option<Arc<dyn RideServer>>,
}

impl QuicListener {
    pub fn start(
        cfg: &Config,
        scfg: &crate::config::ServerConfig,
        platform: &Platform,
        refused: Refused,
        stripe: Option<Arc<dyn RideServer>>,
    ) -> Result<QuicListener> {
        let server_config = server_quic(cfg, scfg, tls::Served::Native)?;
        let endpoint = quinn::Endpoint::new_with_abstract_socket(
            quinn::EndpointConfig::default(),
            Some(server_config),
            platform.server_socket(scfg.listen)?,
            Arc::new(quinn::TokioRuntime),
        )?;
        let (tx, rx) = mpsc::channel(OFFER_QUEUE);
        let ep = endpoint.clone();
        let accepting = Arc::new(Accepting {
            refused: refused.clone(),
            pipes: PipeSets::default(),
            congestion: cfg.congestion,
            stripe,
        });
        admit::serve(ep, admit::Gate::new(refused), move |incoming, in_flight| {
            let (tx, accepting) = (tx.clone(), accepting.clone());
            tokio::spawn(async move {
                if let Some(offer) = offer(incoming, accepting, in_flight).await {
                    // The server is gone when the queue is closed; nothing to answer.
                    let _ = tx.send(offer).await;
                }
            });
        });
        Ok(QuicListener {
            endpoint,
            offers: tokio::sync::Mutex::new(rx),
        })
    }
}

/// The listener's QUIC and TLS settings, the TLS files read now.
pub fn server_quic(
    cfg: &Config,
    scfg: &crate::config::ServerConfig,
    served: tls::Served,
) -> Result<quinn::ServerConfig> {
    let cert = cfg.cert_file.clone().context("tls_cert_file is required")?;
    let key = cfg.key_file.clone().context("tls_key_file is required")?;
    let crypto = tls::server_crypto(
        &cert,
        &key,
        &scfg.client_ca_file,
        cfg.tls_post_quantum,
        &scfg.revoked,
        served,
    )?;
    let mut server_config =
        quinn::ServerConfig::with_crypto(Arc::new(tls::key_update::CountedServer(Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(Arc::new(crypto))
                .context("TLS config unusable for QUIC")?,
        ))));
    server_config.transport_config(settings::transport(
        cfg.congestion,
        crate::io::socket::DEFAULT_LINK_MTU,
        None,
    ));
    // Initials waiting for the accept loop (which decides at once): bounded well below
    // quinn's defaults (65536 of them, 100 MiB), so a flood cannot grow the server's memory.
    server_config
        .max_incoming(2 * admission::MAX_HANDSHAKES)
        .incoming_buffer_size(64 << 10)
        .incoming_buffer_size_total(8 << 20);
    Ok(server_config)
}

impl QuicListener {
    /// A reload's settings (`server_quic`: TLS files read again, the new `revoked:` list)
    /// for the handshakes from now on; running connections keep theirs.
    pub fn install(&self, settings: quinn::ServerConfig) {
        self.endpoint.set_server_config(Some(settings));
    }
}

impl Listener for QuicListener {
    fn next(&self) -> BoxFuture<'_, Option<Offer>> {
        admit::next_offer(&self.offers)
    }

    fn close(&self, code: u32, reason: &str) -> BoxFuture<'_, ()> {
        admit::close(&self.endpoint, code, reason)
    }
}

/// One incoming connection up to its offer: handshake, identity, hello. A pipe after a path's
/// first joins that pipe's set here, without an offer (`pipes.rs`).
async fn offer(
    incoming: quinn::Incoming,
    accepting: Arc<Accepting>,
    in_flight: InFlight,
) -> Option<Offer> {
    let refused = &accepting.refused;
    let remote = incoming.remote_address();
    let conn = admit::handshake(incoming, in_flight, refused).await?;
    let named = tls::certificate::of_peer(&conn).and_then(|c| Some((c.name.clone()?, c)));
    let Some((identity, certificate)) = named else {
        warn!(%remote, "client certificate has no common name; refused");
        refused("no_common_name");
        conn.close(close::REFUSED.into(), b"certificate has no common name");
        return None;
    };
    let hello = tokio::time::timeout(HELLO_TIMEOUT, async {
        let (send, mut recv) = conn.accept_bi().await?;
        let h: Hello = hello::read(&mut recv).await?;
        anyhow::Ok((send, recv, h))
    })
    .await;
    let (send, recv, hello) = match hello {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            warn!(client = %identity, %remote, error = %e, "bad hello; connection closed");
            refused("bad_hello");
            conn.close(close::PROTOCOL.into(), b"bad hello");
            return None;
        }
        Err(_) => {
            warn!(client = %identity, %remote, "no hello within {HELLO_TIMEOUT:?}; connection closed");
            refused("hello_timeout");
            conn.close(close::PROTOCOL.into(), b"no hello");
            return None;
        }
    };
    let stripe = match (hello.stripe, &accepting.stripe) {
        (None, _) => None,
        (Some(_), _) if hello.pipe.is_some() => {
            warn!(client = %identity, %remote, "hello asks for stripe and QUIC pipes at once; connection closed");
            refused("bad_hello");
            conn.close(close::PROTOCOL.into(), b"stripe and pipes");
            return None;
        }
        (Some(s), Some(server)) => Some((server.clone(), s.pipes)),
        (Some(_), None) => {
            warn!(client = %identity, %remote, path = %hello.path, "stripe path refused: stripe_enabled is not set");
            refused("stripe_disabled");
            let ack = HelloAck {
                ok: false,
                error: Some("this server has no stripe transport (stripe_enabled: false)".into()),
                ..Default::default()
            };
            refuse_on(conn, send, ack).await;
            return None;
        }
    };
    let pipe = match hello.pipe {
        None => None,
        Some(p) if p.count < 2 || p.index >= p.count => {
            warn!(client = %identity, %remote, index = p.index, count = p.count, "bad pipe numbers in hello; connection closed");
            refused("bad_hello");
            conn.close(close::PROTOCOL.into(), b"bad pipe numbers");
            return None;
        }
        Some(p) => {
            let key = (identity.clone(), hello.session, hello.path.clone());
            if p.index > 0 {
                join_pipe(&accepting, key, p, conn, send, recv, hello.mode).await;
                return None;
            }
            Some((accepting.clone(), key, p.count))
        }
    };
    Some(Offer {
        identity,
        certificate: Some(certificate),
        carrier: Carrier::Native,
        remote,
        reply: Box::new(QuicOffer {
            conn,
            send,
            recv,
            mode: hello.mode,
            pipe,
            stripe: stripe.map(|(server, pipes)| (server, hello.path.clone(), pipes)),
        }),
        hello,
    })
}

/// A later pipe of a path: joins the set its pipe 0 made, answered as pipe 0 was; refused
/// (and counted) when there is no such set.
async fn join_pipe(
    accepting: &Accepting,
    key: PipeKey,
    p: hello::PipeOf,
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
    mode: TransportMode,
) {
    let set = accepting.pipes.get(&key).filter(|s| s.count() == p.count);
    let Some(set) = set else {
        let (client, _, path) = &key;
        warn!(%client, %path, pipe = p.index, "pipe without its path's first pipe; refused");
        (accepting.refused)("pipe_without_path");
        let ack = HelloAck {
            ok: false,
            error: Some(format!(
                "pipe {} of path `{path}`: the path's pipe 0 is not connected",
                p.index
            )),
            ..Default::default()
        };
        refuse_on(conn, send, ack).await;
        return;
    };
    if hello::write(&mut send, &set.ack).await.is_err() {
        return;
    }
    set.add(QuicTransport::new(conn, send, recv, None, mode, None));
}

/// The connection behind an offer, waiting for the server's answer.
struct QuicOffer {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    mode: TransportMode,
    /// Pipe 0 of a path with pipes: where its set is kept, under which key, and how many.
    pipe: Option<(Arc<Accepting>, PipeKey, u8)>,
    /// A stripe path: the stripe transport, the path's name and its pipe count.
    stripe: Option<(Arc<dyn RideServer>, String, u8)>,
}

/// Answer `ack` (a refusal) and close the connection once it has reached the client (bounded).
async fn refuse_on(conn: quinn::Connection, mut send: quinn::SendStream, ack: HelloAck) {
    let _ = hello::write(&mut send, &ack).await;
    let _ = send.finish();
    let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
    let reason = ack.error.unwrap_or_default();
    conn.close(close::REFUSED.into(), reason.as_bytes());
}

impl OfferReply for QuicOffer {
    fn accept(
        self: Box<Self>,
        ack: HelloAck,
    ) -> BoxFuture<'static, Result<Arc<dyn PathTransport>>> {
        Box::pin(async move {
            let QuicOffer {
                conn,
                mut send,
                recv,
                mode,
                pipe,
                stripe,
            } = *self;
            if let Some((server, path, pipes)) = stripe {
                // The session is known before the client hears the answer and registers.
                let ack = HelloAck {
                    stripe_port: Some(server.port()),
                    ..ack
                };
                let joined = server.join(&conn, &path, pipes)?;
                if let Err(e) = hello::write(&mut send, &ack).await {
                    joined.forget();
                    return Err(e.context("cannot answer the hello"));
                }
                let t = QuicTransport::new(conn, send, recv, None, mode, None);
                return Ok(joined.transport(t));
            }
            hello::write(&mut send, &ack)
                .await
                .context("cannot answer the hello")?;
            let t = QuicTransport::new(conn, send, recv, None, mode, None);
            let Some((accepting, key, count)) = pipe else {
                return Ok(t as Arc<dyn PathTransport>);
            };
            // Kept as soon as the answer is queued: the client dials the other pipes when it has
            // the answer, a handshake later.
            let group = controller::PipeGroup::new(
                accepting.congestion,
                mpquic_core::packet::mtu::udp_payload(crate::io::socket::DEFAULT_LINK_MTU),
            );
            let set = QuicPipes::new(group, count, ack, t);
            accepting.pipes.insert(key, &set);
            Ok(set as Arc<dyn PathTransport>)
        })
    }

    fn refuse(self: Box<Self>, ack: HelloAck) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let QuicOffer { conn, send, .. } = *self;
            refuse_on(conn, send, ack).await;
        })
    }
}
