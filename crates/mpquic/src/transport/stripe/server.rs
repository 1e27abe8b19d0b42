//! The server's stripe socket: one UDP socket (`stripe_port`) for every client's stripe
//! sessions. A packet names its session in its header; the session's keys (from the path's TLS
//! session, set up when its hello was accepted) open it. Packets that name no session, or are
//! too short to name one, are refused here and counted with the listener's refusals
//! (`stripe_malformed`, `stripe_unknown_session`); what a session refuses is a drop of its path.
//! Nothing is allocated for a refused packet, so a flood of garbage costs CPU, not memory.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock, Weak};

use anyhow::{bail, Result};

use super::{controller, keys, Link, Pipe, RecvBatch, StripeTransport};
use crate::config::Congestion;
use crate::io::platform::Platform;
use crate::transport::quic::{QuicTransport, Refused};
use mpquic_core::stripe::{self, Flight};

pub struct StripeServer {
    socket: Arc<dyn quinn::AsyncUdpSocket>,
    port: u16,
    sessions: RwLock<HashMap<u64, Weak<Link>>>,
    congestion: Congestion,
    /// The receive loop, stopped with the server (it frees the port).
    receiving: tokio::task::AbortHandle,
}

impl Drop for StripeServer {
    fn drop(&mut self) {
        self.receiving.abort();
    }
}

impl StripeServer {
    /// Listen on `listen`; refusals are counted through `refused`.
    pub fn start(
        platform: &Platform,
        listen: SocketAddr,
        congestion: Congestion,
        refused: Refused,
    ) -> Result<Arc<StripeServer>> {
        let socket = platform.server_socket(listen)?;
        let port = socket.local_addr()?.port();
        Ok(Arc::new_cyclic(|me: &Weak<StripeServer>| {
            let receiving = tokio::spawn(receive(me.clone(), socket.clone(), refused));
            StripeServer {
                socket,
                port,
                sessions: RwLock::default(),
                congestion,
                receiving: receiving.abort_handle(),
            }
        }))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A path accepted with `stripe {pipes}` in its hello: its session, keyed from the TLS
    /// session of `conn`, known from now on (before the client hears the answer and registers
    /// its pipes). `transport` makes it the path's transport.
    pub(crate) fn session(
        self: &Arc<Self>,
        conn: &quinn::Connection,
        path: &str,
        pipes: u8,
    ) -> Result<Arc<Link>> {
        let keys = keys(conn, path, false)?;
        let session = keys.session;
        let pipes: Vec<Pipe> = (0..pipes.max(1))
            .map(|_| Pipe::new(self.socket.clone(), None))
            .collect();
        let payload = conn.stats().path.current_mtu;
        let link = Link::new(
            false,
            keys,
            pipes,
            Flight::new(controller(self.congestion, payload)),
        );
        {
            let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
            // 64 random bits from the TLS exporter: a clash is a broken peer, not chance.
            if sessions.get(&session).is_some_and(|w| w.strong_count() > 0) {
                bail!("stripe session id already in use");
            }
            sessions.insert(session, Arc::downgrade(&link));
        }
        Ok(link)
    }

    pub(crate) fn transport(
        self: &Arc<Self>,
        quic: Arc<QuicTransport>,
        link: Arc<Link>,
    ) -> Arc<StripeTransport> {
        StripeTransport::new(quic, link, Some(self.clone()))
    }

    /// A session whose path never started (its hello answer failed).
    pub(crate) fn forget_link(&self, link: &Arc<Link>) {
        self.forget(link.session, &Arc::downgrade(link));
    }

    /// The path of `session` ended: forget it (unless a newer one took the id).
    pub(super) fn forget(&self, session: u64, link: &Weak<Link>) {
        let mut sessions = self.sessions.write().unwrap_or_else(|e| e.into_inner());
        if sessions.get(&session).is_some_and(|w| w.ptr_eq(link)) {
            sessions.remove(&session);
        }
    }

    fn find(&self, session: u64) -> Option<Arc<Link>> {
        let sessions = self.sessions.read().unwrap_or_else(|e| e.into_inner());
        sessions.get(&session)?.upgrade()
    }
}

/// The socket's receive loop, for the server's life.
async fn receive(
    server: Weak<StripeServer>,
    socket: Arc<dyn quinn::AsyncUdpSocket>,
    refused: Refused,
) {
    let mut batch = RecvBatch::new();
    let mut touched: Vec<Arc<Link>> = Vec::new();
    loop {
        if batch.recv(&*socket).await.is_err() {
            continue;
        }
        let Some(server) = server.upgrade() else {
            return;
        };
        batch.each(|pkt, from| {
            let Some(id) = stripe::session_of(pkt) else {
                refused(stripe::Refused::Malformed.as_str());
                return;
            };
            match server.find(id) {
                Some(link) => {
                    link.on_packet(pkt, from, None);
                    if !touched.iter().any(|l| Arc::ptr_eq(l, &link)) {
                        touched.push(link);
                    }
                }
                None => refused(stripe::Refused::UnknownSession.as_str()),
            }
        });
        // One TUN write and one feedback per session per batch (`Link::on_packet`).
        for link in touched.drain(..) {
            link.end_batch();
        }
    }
}

/// The stripe transport as the QUIC listener takes it (`QuicListener::start`).
impl crate::transport::quic::RideServer for Arc<StripeServer> {
    fn port(&self) -> u16 {
        StripeServer::port(self)
    }

    fn join(
        &self,
        conn: &quinn::Connection,
        path: &str,
        pipes: u8,
    ) -> Result<Box<dyn crate::transport::quic::Joined>> {
        let link = self.session(conn, path, pipes)?;
        Ok(Box::new(Joined {
            server: self.clone(),
            link,
        }))
    }
}

/// A path's session on the stripe socket, before its transport is made.
struct Joined {
    server: Arc<StripeServer>,
    link: Arc<Link>,
}

impl crate::transport::quic::Joined for Joined {
    fn forget(self: Box<Self>) {
        self.server.forget_link(&self.link);
    }

    fn transport(
        self: Box<Self>,
        t: Arc<QuicTransport>,
    ) -> Arc<dyn crate::transport::PathTransport> {
        self.server.transport(t, self.link)
    }
}
