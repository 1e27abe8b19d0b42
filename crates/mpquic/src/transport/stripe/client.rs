//! The client's side of a stripe path: its pipes (one UDP socket each, bound as the path says,
//! so each is its own 5-tuple), their registration with the server's stripe socket, and their
//! receive loops.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};

use super::{
    controller, keys, Link, Pipe, RecvBatch, StripeTransport, REGISTER_DEADLINE, REGISTER_RESEND,
};
use crate::config::{Congestion, PathConfig};
use crate::io::platform::Platform;
use crate::transport::quic::QuicTransport;
use crate::transport::PathTransport;
use mpquic_core::stripe::Flight;

/// The stripe transport as the QUIC dialer takes it (`QuicDialer::with_stripe`).
pub fn ride(platform: Platform, cc: Congestion) -> crate::transport::quic::RideClient {
    Arc::new(move |quic, p, port| {
        let platform = platform.clone();
        Box::pin(async move {
            let t = connect(quic, &p, &platform, port, cc).await?;
            Ok(t as Arc<dyn crate::transport::PathTransport>)
        })
    })
}

/// Open `p.pipes` pipes to `port` on the server `quic` is connected to, and register them
/// under the session of `quic`'s TLS session. Fails when no pipe is answered within
/// `REGISTER_DEADLINE` (the server has no stripe socket there, or UDP to it is blocked);
/// pipes answered later are used from then on.
pub async fn connect(
    quic: Arc<QuicTransport>,
    p: &PathConfig,
    platform: &Platform,
    port: u16,
    cc: Congestion,
) -> Result<Arc<StripeTransport>> {
    let keys = keys(quic.connection(), &p.name, true)?;
    let server = SocketAddr::new(quic.remote().ip(), port);
    let mut pipes = Vec::new();
    for _ in 0..p.pipes.max(1) {
        pipes.push(Pipe::new(
            platform.client_socket(&p.bind, server)?,
            Some(server),
        ));
    }
    let payload = quic.stats().udp_payload.unwrap_or(1200);
    let link = Link::new(true, keys, pipes, Flight::new(controller(cc, payload)));
    // The pipes' receive loops, for the path's life (they end with its connection): started
    // before registration, which needs them, and never replaced. (A first version ran loops of
    // their own during registration and new ones at `start`: a socket notifies one waiting
    // task, and when the old loop polled last before it was stopped, the new one was never
    // woken: a pipe's packets went unread, 50 of 300 in the in-process test.) What arrives
    // before `start` is kept for the sink (`Link::early`).
    let conn = quic.connection().clone();
    for i in 0..link.pipes.len() {
        tokio::spawn(receive(link.clone(), i, conn.clone()));
    }
    let registered = register(&link).await;
    if !registered {
        bail!(
            "no answer from the stripe port {server} within {REGISTER_DEADLINE:?} (is stripe_enabled set on the server, and UDP to that port open?)"
        );
    }
    Ok(StripeTransport::new(quic, link, None))
}

/// Send REGISTER on every pipe not yet answered, every `REGISTER_RESEND`, until all are
/// answered or the deadline passes; true when at least one was.
async fn register(link: &Arc<Link>) -> bool {
    let deadline = Instant::now() + REGISTER_DEADLINE;
    loop {
        let answered = link.register_unanswered();
        if answered == link.pipes.len() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return answered > 0;
        }
        let wait = REGISTER_RESEND.min(deadline - now);
        let _ = tokio::time::timeout(wait, link.registered.notified()).await;
    }
}

/// Pipe `i`'s receive loop, until the path's connection ends.
async fn receive(link: Arc<Link>, i: usize, conn: quinn::Connection) {
    let socket = link.pipes[i].socket.clone();
    let mut batch = RecvBatch::new();
    loop {
        tokio::select! {
            r = batch.recv(&*socket) => if r.is_err() {
                continue;
            },
            _ = conn.closed() => return,
        }
        batch.each(|pkt, from| {
            if pkt.len() < mpquic_core::stripe::HEADER + mpquic_core::stripe::TAG {
                link.drop_received(mpquic_core::DropReason::Malformed);
                return;
            }
            link.on_packet(pkt, from, Some(i));
        });
        link.end_batch();
    }
}
