//! The client's side: a socket and a QUIC connection per path, the hello, the path's transport.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use tracing::info;

use super::pipes::QuicPipes;
use super::{controller, settings, QuicTransport, RideClient};
use crate::config::{Config, PathConfig, PathKind};
use crate::hello::{self, Hello, HelloAck};
use crate::io::platform::Platform;
use crate::tls;
use crate::transport::close;
use crate::transport::{BoxFuture, Carrier, Dialed, Dialer, Known, PathTransport, Unfinished};

/// The client's TLS (its files read now) and QUIC settings for links of `link_mtu`.
fn client_quic(
    cfg: &Config,
    ccfg: &crate::config::ClientConfig,
    link_mtu: u32,
) -> Result<quinn::ClientConfig> {
    let cert_key = match (&cfg.cert_file, &cfg.key_file) {
        (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
        _ => None,
    };
    let crypto = tls::client_crypto(
        ccfg.ca_file.as_deref(),
        ccfg.insecure_skip_verify,
        cert_key,
        cfg.tls_post_quantum,
        match ccfg.masque {
            None => tls::Served::Native,
            Some(_) => tls::Served::Http3,
        },
    )?;
    let mut client = quinn::ClientConfig::new(Arc::new(tls::key_update::CountedClient(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .context("TLS config unusable for QUIC")?,
    ))));
    client.transport_config(settings::client_transport(
        cfg.congestion,
        link_mtu,
        None,
        ccfg.masque.is_some(),
        None,
    ));
    Ok(client)
}

/// The client's QUIC session setup: a socket per path (bound as the path says), the handshake
/// with the client certificate, then the hello.
pub struct QuicDialer {
    /// TLS and QUIC settings of new connections; a reload rebuilds them (`reload_tls`).
    client: std::sync::RwLock<quinn::ClientConfig>,
    congestion: crate::config::Congestion,
    /// The smallest MTU of the client's links (the QUIC packet size follows it).
    link_mtu: u32,
    server_name: String,
    platform: Platform,
    /// The client's `stripe_port`, over the one the server announces.
    stripe_port: Option<u16>,
    /// The stripe transport, when the shell plugged it in (`with_stripe`).
    stripe: Option<RideClient>,
    /// `protocol: masque`: a CONNECT-IP request (`masque::request`) instead of the hello.
    masque: Option<crate::config::MasqueClient>,
}

impl QuicDialer {
    /// TLS from the instance's files; QUIC settings for links of `link_mtu`.
    pub fn new(
        cfg: &Config,
        ccfg: &crate::config::ClientConfig,
        link_mtu: u32,
        platform: Platform,
    ) -> Result<QuicDialer> {
        Ok(QuicDialer {
            client: std::sync::RwLock::new(client_quic(cfg, ccfg, link_mtu)?),
            congestion: cfg.congestion,
            link_mtu,
            server_name: ccfg.server_name.clone(),
            platform,
            stripe_port: ccfg.stripe_port,
            stripe: None,
            masque: ccfg.masque.clone(),
        })
    }

    /// With the stripe transport for `transport: stripe` paths.
    pub fn with_stripe(mut self, ride: RideClient) -> QuicDialer {
        self.stripe = Some(ride);
        self
    }

    async fn dial_inner(&self, p: &PathConfig, h: &Hello, known: Known) -> Result<Dialed> {
        let remote: SocketAddr = tokio::net::lookup_host((p.remote_addr.as_str(), p.remote_port))
            .await
            .with_context(|| format!("cannot resolve {}", p.remote_addr))?
            .next()
            .ok_or_else(|| anyhow!("{} has no address", p.remote_addr))?;
        // A smaller payload is announced to the server (it caps what the server sends) and is
        // this side's packet size and floor: the route carries no more. (Over CONNECT-IP it is
        // the size a connection reached, where the next one starts: `client_transport`.)
        let standard = self.masque.is_some();
        let link_mtu = match known.payload {
            Some(p) if !standard => {
                mpquic_core::packet::mtu::link_mtu_for_payload(p).min(self.link_mtu)
            }
            _ => self.link_mtu,
        };
        let mut client = (self.client.read().unwrap_or_else(|e| e.into_inner())).clone();
        if link_mtu != self.link_mtu || known.rtt.is_some() || known.payload.is_some() {
            client.transport_config(settings::client_transport(
                self.congestion,
                link_mtu,
                known.rtt,
                standard,
                known.payload.filter(|_| standard),
            ));
        }
        let to = &Target {
            remote,
            link_mtu,
            client,
            unsegmented: known.unsegmented,
        };
        if let Some(m) = &self.masque {
            return self.dial_connect_ip(p, to, h, m).await;
        }
        let native = |(transport, ack): (Arc<dyn PathTransport>, HelloAck)| Dialed {
            transport,
            ack,
            carrier: Carrier::Native,
        };
        if p.transport == PathKind::Stripe {
            return self.dial_stripe(p, to, h).await.map(native);
        }
        if p.pipes <= 1 {
            let (t, ack) = self.dial_one(p, to, h).await?;
            return Ok(native((t, ack)));
        }
        // Pipe 0 joins the session like a path; the others then join pipe 0 (`pipes.rs`).
        let hello_for = |index: u8| Hello {
            pipe: Some(hello::PipeOf {
                index,
                count: p.pipes,
            }),
            ..h.clone()
        };
        let (first, ack) = self.dial_one(p, to, &hello_for(0)).await?;
        if !ack.ok {
            return Ok(native((first, ack)));
        }
        let group = controller::PipeGroup::new(
            self.congestion,
            mpquic_core::packet::mtu::udp_payload(to.link_mtu),
        );
        let set = Unfinished::new(QuicPipes::new(group, p.pipes, ack.clone(), first));
        let hellos: Vec<Hello> = (1..p.pipes).map(hello_for).collect();
        let rest =
            futures_util::future::join_all(hellos.iter().map(|hk| self.dial_one(p, to, hk))).await;
        let mut failed = None;
        for (k, r) in (1..p.pipes).zip(rest) {
            match r {
                Ok((t, a)) if a.ok => {
                    set.get().add(t);
                }
                Ok((t, a)) => {
                    t.close(close::SHUTDOWN, "refused");
                    let why = a.error.unwrap_or_else(|| "refused".into());
                    failed.get_or_insert_with(|| anyhow!("pipe {k}: {why}"));
                }
                Err(e) => {
                    failed.get_or_insert(e.context(format!("pipe {k}")));
                }
            }
        }
        if let Some(e) = failed {
            set.get()
                .close(close::SHUTDOWN, "a pipe of the path failed");
            return Err(e);
        }
        Ok(native((set.keep(), ack)))
    }

    /// A stripe path: one QUIC connection (hello, keys, control), then its stripe pipes
    /// registered with the server's stripe socket (`stripe::client`).
    async fn dial_stripe(
        &self,
        p: &PathConfig,
        to: &Target,
        h: &Hello,
    ) -> Result<(Arc<dyn PathTransport>, HelloAck)> {
        let h = Hello {
            stripe: Some(hello::StripeOf { pipes: p.pipes }),
            ..h.clone()
        };
        let (quic, ack) = self.dial_one(p, to, &h).await?;
        if !ack.ok {
            return Ok((quic, ack));
        }
        // Its pipes' receive loops hold the connection from the start of registration.
        let quic = Unfinished::new(quic);
        let Some(port) = self.stripe_port.or(ack.stripe_port) else {
            return Err(anyhow!(
                "the server accepted the path but named no stripe port"
            ));
        };
        let ride = self
            .stripe
            .as_ref()
            .context("a stripe path, but this client has no stripe transport")?;
        let t = ride(quic.get().clone(), p.clone(), port).await?;
        quic.keep();
        Ok((t, ack))
    }

    /// One QUIC connection to `to` over its own socket, and its hello exchange.
    async fn dial_one(
        &self,
        p: &PathConfig,
        to: &Target,
        h: &Hello,
    ) -> Result<(Arc<QuicTransport>, HelloAck)> {
        let (endpoint, conn) = self.handshake(p, to).await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        hello::write(&mut send, h).await?;
        let ack: HelloAck = hello::read(&mut recv)
            .await
            .context("no hello answer from the server")?;
        let link_payload = mpquic_core::packet::mtu::udp_payload(self.link_mtu);
        let transport =
            QuicTransport::new(conn, send, recv, Some(endpoint), h.mode, Some(link_payload));
        Ok((transport, ack))
    }

    /// A CONNECT-IP path (`protocol: masque`): the handshake, then the request with the hello
    /// in it (`masque::request`), whose answer says what the server speaks.
    async fn dial_connect_ip(
        &self,
        p: &PathConfig,
        to: &Target,
        h: &Hello,
        m: &crate::config::MasqueClient,
    ) -> Result<Dialed> {
        let (endpoint, conn) = self.handshake(p, to).await?;
        // The address this client has (or asks for) is asked for again: a new path, or a
        // reconnection, keeps it.
        let ask = (h.previous.as_deref().or(h.addr.as_deref()))
            .and_then(crate::config::parse_cidr)
            .map(|(a, _)| a);
        let authority = format!("{}:{}", self.server_name, to.remote.port());
        let answered = crate::transport::masque::request(&conn, authority, m, h, ask).await?;
        let link_payload = mpquic_core::packet::mtu::udp_payload(self.link_mtu);
        let transport = QuicTransport::http_datagrams(
            conn,
            answered.stream,
            Some(endpoint),
            Some(link_payload),
        );
        Ok(Dialed {
            transport,
            ack: answered.ack,
            carrier: answered.carrier,
        })
    }

    /// A QUIC connection to `to` over the path's own socket, handshaken.
    async fn handshake(
        &self,
        p: &PathConfig,
        to: &Target,
    ) -> Result<(quinn::Endpoint, quinn::Connection)> {
        let Target {
            remote,
            link_mtu,
            client,
            unsegmented,
        } = to;
        let (remote, link_mtu) = (*remote, *link_mtu);
        let mut socket = self.platform.client_socket(&p.bind, remote)?;
        if *unsegmented {
            socket = Arc::new(crate::io::socket::Unsegmented(socket));
        }
        let endpoint = quinn::Endpoint::new_with_abstract_socket(
            settings::client_endpoint(link_mtu),
            None,
            socket,
            Arc::new(quinn::TokioRuntime),
        )?;
        let started = Instant::now();
        let conn = endpoint
            .connect_with(client.clone(), remote, &self.server_name)?
            .await
            .with_context(|| format!("handshake with {remote} failed"))?;
        // What the handshake cost, for the operator and bench/handshake.py (post-quantum
        // against classic key exchange).
        let stats = conn.stats();
        let server_cert = tls::certificate::of_peer(&conn);
        info!(
            path = %p.name,
            %remote,
            server_serial = %server_cert.as_ref().map_or("?", |c| c.serial.as_str()),
            handshake_ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
            sent_bytes = stats.udp_tx.bytes,
            received_bytes = stats.udp_rx.bytes,
            "QUIC handshake done"
        );
        Ok((endpoint, conn))
    }
}

impl Dialer for QuicDialer {
    fn dial<'a>(
        &'a self,
        path: &'a PathConfig,
        hello: &'a Hello,
        known: Known,
    ) -> BoxFuture<'a, Result<Dialed>> {
        Box::pin(self.dial_inner(path, hello, known))
    }

    fn reload_tls(&self, cfg: &Config, ccfg: &crate::config::ClientConfig) -> Result<()> {
        let client = client_quic(cfg, ccfg, self.link_mtu)?;
        *self.client.write().unwrap_or_else(|e| e.into_inner()) = client;
        Ok(())
    }
}

/// Where one dial goes: the server's address, the link MTU its packets fill, and the QUIC
/// configuration for that size and the path's known RTT.
struct Target {
    remote: SocketAddr,
    link_mtu: u32,
    client: quinn::ClientConfig,
    /// Send without UDP GSO batches (`Known::unsegmented`).
    unsegmented: bool,
}
