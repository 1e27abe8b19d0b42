//! The server's gate in front of each QUIC endpoint it listens on (the native protocol's and
//! CONNECT-IP's): every Initial judged at once by the core's admission rules (handshakes in
//! flight bounded, in all and per source; a Retry when busy), each admitted handshake bounded
//! in time, and every refusal counted by reason.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mpquic_core::admission::{Admission, Verdict};
use tracing::warn;

use crate::tls;

/// Bound on a client's TLS handshake at the server: a few round trips even on a slow, lossy
/// path; a stalled handshake holds a place among the bounded few in flight.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Counts a refused connection by reason (the server's status and metrics).
pub type Refused = Arc<dyn Fn(&'static str) + Send + Sync>;

/// One endpoint's admission state and its refusal counter.
pub(crate) struct Gate {
    admission: Mutex<Admission>,
    pub(crate) refused: Refused,
}

impl Gate {
    pub(crate) fn new(refused: Refused) -> Arc<Gate> {
        Arc::new(Gate {
            admission: Mutex::default(),
            refused,
        })
    }
}

/// An admitted handshake's place in the gate, given back when it ends however it ends (done,
/// failed, timed out, or its task dropped).
pub(crate) struct InFlight(Arc<Gate>, IpAddr);

impl Drop for InFlight {
    fn drop(&mut self) {
        (self.0.admission.lock().unwrap_or_else(|e| e.into_inner())).done(self.1);
    }
}

/// Accept `endpoint`'s connections for as long as it is open: each admitted one goes to
/// `each` with its place (which it gives back by dropping it), the others are retried or
/// ignored and counted.
pub(crate) fn serve(
    endpoint: quinn::Endpoint,
    gate: Arc<Gate>,
    each: impl Fn(quinn::Incoming, InFlight) + Send + 'static,
) {
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let src = incoming.remote_address().ip();
            let verdict = (gate.admission.lock().unwrap_or_else(|e| e.into_inner()))
                .on_initial(src, incoming.remote_address_validated());
            match verdict {
                Verdict::Accept => each(incoming, InFlight(gate.clone(), src)),
                Verdict::Retry => match incoming.retry() {
                    Ok(()) => (gate.refused)("retry"),
                    Err(e) => {
                        e.into_incoming().ignore();
                        (gate.refused)("handshake_overload");
                    }
                },
                Verdict::Ignore(reason) => {
                    incoming.ignore();
                    (gate.refused)(reason);
                }
            }
        }
    });
}

/// An admitted connection's TLS handshake, bounded by `HANDSHAKE_TIMEOUT`; its place is given
/// back once it ends. A failure is logged and counted.
pub(crate) async fn handshake(
    incoming: quinn::Incoming,
    in_flight: InFlight,
    refused: &Refused,
) -> Option<quinn::Connection> {
    let remote = incoming.remote_address();
    // A handshake that does not finish in time gives its place back (`admission.rs`): without
    // this bound a stalled one held it for the whole idle timeout (15 s).
    let handshake = match tokio::time::timeout(HANDSHAKE_TIMEOUT, incoming).await {
        Ok(h) => h,
        Err(_) => {
            refused("handshake_timeout");
            return None;
        }
    };
    drop(in_flight);
    match handshake {
        Ok(c) => Some(c),
        Err(quinn::ConnectionError::TransportError(e))
            if e.code == quinn_proto::TransportErrorCode::crypto(tls::revocation::ALERT) =>
        {
            // Logged with the client's name by the verifier.
            refused("revoked");
            None
        }
        Err(e) => {
            warn!(%remote, error = %e, "handshake failed; client refused");
            refused("handshake_failed");
            None
        }
    }
}

/// `Listener::next` of an endpoint whose connection tasks queue their offers in `offers`.
pub(crate) fn next_offer(
    offers: &tokio::sync::Mutex<tokio::sync::mpsc::Receiver<super::Offer>>,
) -> super::BoxFuture<'_, Option<super::Offer>> {
    Box::pin(async move { offers.lock().await.recv().await })
}

/// `Listener::close`: every connection of `endpoint` closed with `code`, waiting (bounded) for
/// the peers to hear it.
pub(crate) fn close<'a>(
    endpoint: &'a quinn::Endpoint,
    code: u32,
    reason: &str,
) -> super::BoxFuture<'a, ()> {
    endpoint.close(code.into(), reason.as_bytes());
    Box::pin(async move {
        let _ = tokio::time::timeout(Duration::from_millis(300), endpoint.wait_idle()).await;
    })
}
