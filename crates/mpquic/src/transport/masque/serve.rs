//! One CONNECT-IP connection at the server: the QUIC streams read into the core's HTTP/3
//! connection (`ServerConn`), its events acted on. One task (`Driver`) owns the connection's
//! state; each stream has a reader task that feeds it through one bounded inbox.
//!
//! One CONNECT-IP request per connection: it is judged (`connect_ip::request::judge`: method,
//! protocol, path against the template, the client's certificate or bearer token), then
//! offered to the server as a path of the client's session, which assigns its address (an
//! ADDRESS_REQUEST that came with the request is honoured when the address is free, as a
//! native client's `addr` is). The answer is 200 with ADDRESS_ASSIGN and ROUTE_ADVERTISEMENT,
//! or the refusal's status. The session ends with the request stream, or the connection.
//!
//! An mpquic client's request carries its hello (`mpquic-hello`): the path is then offered as
//! a native one (its session, path name, policy; probes and bond headers in the datagrams),
//! and the answer carries the server's hello answer (`mpquic-hello-ack`), so the client's
//! paths bond over CONNECT-IP as over the native protocol. Without one, the request is a
//! standard client's: a session of one path, IP packets only.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use mpquic_core::connect_ip::{request, AddressEntry, Capsule, IpRange, Scope};
use mpquic_core::http3::frame::code;
use mpquic_core::http3::server::{Event, ServerConn};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info};

use super::shared::{log_refusal, Shared};
use super::streams::{spawn_acceptors, Input};
use crate::config::TransportMode;
use crate::hello::{self, Hello, HelloAck};
use crate::tls::certificate::{self, Facts};
use crate::transport::quic::QuicTransport;
use crate::transport::{BoxFuture, Carrier, Offer, OfferReply, PathTransport};

/// A connection that has not made its request by then is closed (it holds a task and a place
/// in the endpoint's connections).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a refusal waits for its answer to reach the client before the connection closes.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// The session's path name in status (one path: a standard client does not bond).
const PATH_NAME: &str = "masque";

/// The server's answer to an offer.
enum Decision {
    Accept(HelloAck),
    Refuse(HelloAck),
}

/// The accepted request.
struct Session {
    stream: u64,
    identity: String,
    /// The request carried an mpquic client's hello: the answer carries the server's.
    mpquic: bool,
    /// What the ADDRESS_REQUESTs that came with the request asked for (ID, address), answered
    /// with the first assignment.
    asked: Vec<(u64, IpAddr)>,
    /// Waiting for the server's decision: the capsules that arrived meanwhile.
    pending: Option<Vec<Capsule>>,
    /// What is assigned (request ID 0), once accepted.
    assigned: Vec<AddressEntry>,
}

struct Driver {
    conn: quinn::Connection,
    h3: ServerConn,
    shared: Arc<Shared>,
    remote: SocketAddr,
    certificate: Option<Facts>,
    sends: HashMap<u64, quinn::SendStream>,
    stops: HashMap<u64, oneshot::Sender<u32>>,
    offers: mpsc::Sender<Offer>,
    session: Option<Session>,
    decision: Option<oneshot::Receiver<Decision>>,
    done: bool,
}

/// Serve one handshaken connection until it closes.
pub(super) async fn connection(
    conn: quinn::Connection,
    shared: Arc<Shared>,
    offers: mpsc::Sender<Offer>,
) {
    let (h3, control) = ServerConn::new();
    // Our control stream: its type and SETTINGS (Extended CONNECT, HTTP Datagrams), kept open
    // for the connection's life (closing it is a connection error).
    let Ok(mut ours) = conn.open_uni().await else {
        return;
    };
    if ours.write_all(&control).await.is_err() {
        return;
    }
    let (inbox_tx, mut inbox) = mpsc::channel(super::streams::INBOX);
    spawn_acceptors(&conn, inbox_tx);
    let mut d = Driver {
        remote: conn.remote_address(),
        certificate: certificate::of_peer(&conn),
        conn,
        h3,
        shared,
        sends: HashMap::new(),
        stops: HashMap::new(),
        offers,
        session: None,
        decision: None,
        done: false,
    };
    let deadline = tokio::time::sleep(REQUEST_TIMEOUT);
    tokio::pin!(deadline);
    while !d.done {
        tokio::select! {
            input = inbox.recv() => match input {
                Some(input) => d.on_input(input).await,
                None => break,
            },
            decision = wait(&mut d.decision) => {
                d.decision = None;
                d.on_decision(decision).await;
            }
            _ = &mut deadline, if d.session.is_none() => {
                d.shared.refuse("no_request", |n| log_refusal("no_request", "no CONNECT-IP request in time", d.remote, n));
                d.close(code::NO_ERROR, "no request");
            }
            _ = d.conn.closed() => break,
        }
    }
    drop(ours);
}

/// The server's decision, when one is awaited (else never).
async fn wait(rx: &mut Option<oneshot::Receiver<Decision>>) -> Option<Decision> {
    match rx {
        Some(rx) => rx.await.ok(),
        None => std::future::pending().await,
    }
}

impl Driver {
    async fn on_input(&mut self, input: Input) {
        // A stream whose end arrived has no reader left to stop.
        if let Input::Data { id, fin: true, .. } = &input {
            self.stops.remove(id);
        }
        let events = match input {
            Input::Opened { id, send, stop } => {
                if let Some(s) = send {
                    self.sends.insert(id, s);
                }
                self.stops.insert(id, stop);
                return;
            }
            Input::Data {
                id,
                uni: true,
                data,
                fin,
            } => self.h3.on_uni(id, &data, fin),
            Input::Data {
                id,
                uni: false,
                data,
                fin,
            } => self.h3.on_request(id, &data, fin),
            Input::Gone { id } => {
                self.forget(id);
                if self.is_session(id) {
                    self.close(code::REQUEST_CANCELLED, "request stream reset");
                }
                return;
            }
        };
        for e in events {
            self.on_event(e).await;
        }
    }

    fn is_session(&self, id: u64) -> bool {
        self.session.as_ref().is_some_and(|s| s.stream == id)
    }

    async fn on_event(&mut self, e: Event) {
        match e {
            Event::Request { stream, fields } => self.on_request(stream, fields).await,
            Event::Capsule { stream, capsule } if self.is_session(stream) => {
                match self.session.as_mut().and_then(|s| s.pending.as_mut()) {
                    Some(waiting) => waiting.push(capsule),
                    None => self.on_capsule(capsule).await,
                }
            }
            Event::Capsule { .. } => {}
            Event::Finished { stream } => {
                if self.is_session(stream) {
                    self.close(code::NO_ERROR, "session ended");
                }
            }
            Event::ResetStream { stream, error } => {
                let session = self.is_session(stream);
                let reason = if session {
                    "malformed_capsule"
                } else {
                    "stream_error"
                };
                let remote = self.remote;
                self.shared
                    .refuse(reason, |n| log_refusal(reason, error.why, remote, n));
                if let Some(mut s) = self.sends.remove(&stream) {
                    let _ = s.reset(to_code(error.code));
                }
                if let Some(stop) = self.stops.remove(&stream) {
                    let _ = stop.send(error.code as u32);
                }
                self.h3.forget(stream);
                if session {
                    self.close(error.code, error.why);
                }
            }
            Event::Close { error } => {
                let remote = self.remote;
                self.shared.refuse("http3_error", |n| {
                    log_refusal("http3_error", error.why, remote, n)
                });
                self.close(error.code, error.why);
            }
            Event::Goaway => {}
        }
    }

    /// A request: judged, then offered to the server (the answer waits for its decision).
    async fn on_request(&mut self, stream: u64, fields: Vec<mpquic_core::http3::qpack::Field>) {
        if self.session.is_some() {
            return self
                .refuse(
                    stream,
                    429,
                    "second_request",
                    "one CONNECT-IP request per connection",
                )
                .await;
        }
        let rules = self.shared.rules();
        let name = self.certificate.as_ref().and_then(|c| c.name.as_deref());
        let accepted = match request::judge(&fields, &rules.template, name, &rules.tokens) {
            Ok(a) => a,
            Err(r) => return self.refuse(stream, r.status, r.reason, "").await,
        };
        if accepted.scope
            != (Scope {
                target: None,
                protocol: None,
            })
        {
            // Forwarding only to a target or a protocol would need a destination filter per
            // session; the whole space is what this server serves.
            return self
                .refuse(
                    stream,
                    501,
                    "scope_unsupported",
                    "only the whole IP space (`*`) is served",
                )
                .await;
        }
        let hello = match request::field(&fields, request::HELLO_FIELD) {
            Some(v) => match mpquic_hello(v) {
                Ok(h) => Some(h),
                Err((reason, why)) => return self.refuse(stream, 400, reason, &why).await,
            },
            None => None,
        };
        // Opened now for the capsules that came with it; its HEADERS go with the decision.
        let (_, events) = self.h3.answer(stream, 200);
        let mut early = Vec::new();
        for e in events {
            if let Event::Capsule { capsule, .. } = e {
                early.push(capsule);
            }
        }
        // Early ADDRESS_REQUESTs are answered by the first assignment; the session asks the
        // registry for their first IPv4 address (its IPv6 one follows from it).
        let (asked, later): (Vec<Capsule>, Vec<Capsule>) = early
            .into_iter()
            .partition(|c| matches!(c, Capsule::AddressRequest(_)));
        let asked: Vec<(u64, IpAddr)> = (asked.iter())
            .flat_map(|c| match c {
                Capsule::AddressRequest(list) => list.clone(),
                _ => Vec::new(),
            })
            .map(|e| (e.request_id, e.addr))
            .collect();
        let want = asked
            .iter()
            .find(|(_, a)| a.is_ipv4() && !a.is_unspecified());
        let mpquic = hello.is_some();
        let hello = hello.unwrap_or_else(|| Hello {
            // Each connection is a new session: a client that reconnects replaces its old one,
            // keeping its address when it is free.
            session: crate::runtime::random_u64(),
            path: PATH_NAME.into(),
            priority: 1,
            weight: 1,
            policy: "failover".into(),
            mode: TransportMode::Datagram,
            addr: want.map(|(_, a)| format!("{a}/32")),
            previous: None,
            fec: None,
            pipe: None,
            stripe: None,
            instance: None,
            classes: Vec::new(),
            routes: Vec::new(),
            rate_limit: None,
            metered: false,
            role: None,
            counts: false,
            link: None,
        });
        let (tx, rx) = oneshot::channel();
        let offer = Offer {
            identity: accepted.identity.clone(),
            certificate: self.certificate.clone().filter(|c| c.name.is_some()),
            remote: self.remote,
            hello,
            carrier: match mpquic {
                true => Carrier::ConnectIp,
                false => Carrier::StandardConnectIp,
            },
            reply: Box::new(MasqueOffer {
                conn: self.conn.clone(),
                stream,
                decision: tx,
            }),
        };
        self.session = Some(Session {
            stream,
            identity: accepted.identity,
            mpquic,
            asked,
            pending: Some(later),
            assigned: Vec::new(),
        });
        self.decision = Some(rx);
        if self.offers.send(offer).await.is_err() {
            // The server is shutting down.
            self.close(code::NO_ERROR, "server shutting down");
        }
    }

    /// Refuse request `stream` with `status`: counted by `reason`, logged once per cause, the
    /// answer sent and the stream finished.
    async fn refuse(&mut self, stream: u64, status: u16, reason: &'static str, detail: &str) {
        let remote = self.remote;
        self.shared
            .refuse(reason, |n| log_refusal(reason, detail, remote, n));
        let (headers, _) = self.h3.answer(stream, status);
        self.finish_with(stream, &headers).await;
    }

    async fn finish_with(&mut self, stream: u64, bytes: &[u8]) {
        self.stops.remove(&stream);
        self.h3.forget(stream);
        if let Some(mut send) = self.sends.remove(&stream) {
            if send.write_all(bytes).await.is_ok() {
                let _ = send.finish();
            }
            // Dropped here: quinn still delivers what was written.
        }
    }

    async fn on_decision(&mut self, decision: Option<Decision>) {
        let Some(session) = self.session.as_mut() else {
            return;
        };
        let stream = session.stream;
        match decision {
            Some(Decision::Accept(ack)) => {
                let mut assigned = Vec::new();
                let v4 = ack.addr.as_deref().and_then(address);
                let v6 = ack.addr6.as_deref().and_then(address);
                for (a, len) in [(v4, 32), (v6, 128)] {
                    if let Some(a) = a {
                        assigned.push(AddressEntry {
                            request_id: 0,
                            addr: a,
                            prefix_len: len,
                        });
                    }
                }
                session.assigned = assigned;
                let mut answer = ServerConn::headers(200, session.hello_ack(&ack).as_deref());
                let asked = std::mem::take(&mut session.asked);
                let routes = ranges(v6.is_some());
                let early = session.pending.take().unwrap_or_default();
                let assign = self.assignment(asked);
                answer.extend(ServerConn::capsules(&[
                    assign,
                    Capsule::RouteAdvertisement(routes),
                ]));
                info!(client = %self.session.as_ref().map_or("", |s| &s.identity), remote = %self.remote, address = ?v4, address6 = ?v6, "CONNECT-IP session open");
                if !self.write(stream, &answer).await {
                    return self.close(code::INTERNAL_ERROR, "cannot answer");
                }
                for c in early {
                    self.on_capsule(c).await;
                }
            }
            // Refused by the server (logged there), or no decision (the server is gone).
            // Counted there too (`refused`), as a native client's refusal is.
            Some(Decision::Refuse(ack)) => {
                let headers = ServerConn::headers(403, session.hello_ack(&ack).as_deref());
                self.session = None;
                self.finish_with(stream, &headers).await;
                self.linger_and_close();
            }
            None => {
                self.session = None;
                self.finish_with(stream, &ServerConn::headers(403, None))
                    .await;
                self.linger_and_close();
            }
        }
    }

    /// Close the connection once a refusal had time to reach the client.
    fn linger_and_close(&mut self) {
        let conn = self.conn.clone();
        tokio::spawn(async move {
            tokio::time::sleep(REFUSAL_LINGER).await;
            conn.close(to_code(code::NO_ERROR), b"refused");
        });
        self.done = true;
    }

    /// An ADDRESS_ASSIGN with every address the session has, each asked one answered: with
    /// the request's ID when it is one of them (or asked "any address" of its family), else
    /// refused (all zeros, the full prefix length: RFC 9484 section 4.7.1) and counted.
    fn assignment(&self, asked: Vec<(u64, IpAddr)>) -> Capsule {
        let assigned = self
            .session
            .as_ref()
            .map(|s| s.assigned.clone())
            .unwrap_or_default();
        let mut out = assigned.clone();
        for (id, want) in asked {
            let family = |a: &IpAddr| a.is_ipv4() == want.is_ipv4();
            match assigned
                .iter()
                .position(|e| family(&e.addr) && (e.addr == want || want.is_unspecified()))
            {
                Some(i) => out[i].request_id = id,
                None => {
                    let remote = self.remote;
                    let detail = format!("{want} is not this client's to have");
                    self.shared.refuse("address_refused", |n| {
                        log_refusal("address_refused", &detail, remote, n)
                    });
                    let (addr, prefix_len) = match want {
                        IpAddr::V4(_) => (IpAddr::V4(Ipv4Addr::UNSPECIFIED), 32),
                        IpAddr::V6(_) => (IpAddr::V6(Ipv6Addr::UNSPECIFIED), 128),
                    };
                    out.push(AddressEntry {
                        request_id: id,
                        addr,
                        prefix_len,
                    });
                }
            }
        }
        Capsule::AddressAssign(out)
    }

    /// A capsule on the open session's stream.
    async fn on_capsule(&mut self, c: Capsule) {
        let Some(stream) = self.session.as_ref().map(|s| s.stream) else {
            return;
        };
        match c {
            Capsule::AddressRequest(list) => {
                let asked = list.iter().map(|e| (e.request_id, e.addr)).collect();
                let reply = ServerConn::capsules(&[self.assignment(asked)]);
                if !self.write(stream, &reply).await {
                    self.close(code::INTERNAL_ERROR, "cannot answer");
                }
            }
            // IP packets belong in QUIC DATAGRAMs (the client enabled them: the request was
            // held until its SETTINGS said so); on the stream they are not read.
            Capsule::Datagram { .. } => (self.shared.refused)("datagram_capsule_dropped"),
            // What the client can reach or has: the server routes only its assigned address.
            Capsule::RouteAdvertisement(_) | Capsule::AddressAssign(_) => {
                debug!(remote = %self.remote, "client's own address or route capsule ignored")
            }
        }
    }

    async fn write(&mut self, stream: u64, bytes: &[u8]) -> bool {
        match self.sends.get_mut(&stream) {
            Some(send) => send.write_all(bytes).await.is_ok(),
            None => false,
        }
    }

    fn forget(&mut self, id: u64) {
        self.sends.remove(&id);
        self.stops.remove(&id);
        self.h3.forget(id);
    }

    fn close(&mut self, code: u64, why: &str) {
        self.conn.close(to_code(code), why.as_bytes());
        self.done = true;
    }
}

impl Session {
    /// The answer's `mpquic-hello-ack` value, when the request carried a hello.
    fn hello_ack(&self, ack: &HelloAck) -> Option<String> {
        self.mpquic.then(|| hello::to_field(ack).ok()).flatten()
    }
}

/// An mpquic client's hello from its request's field, if this endpoint can carry what it asks:
/// datagram mode only (a path's stream would be an HTTP/3 request stream of its own), no
/// pipes or stripe (each is a path of the native endpoint). Else the refusal's reason and why.
fn mpquic_hello(value: &[u8]) -> Result<Hello, (&'static str, String)> {
    let h: Hello = hello::from_field(value)
        .map_err(|e| ("malformed_hello", format!("mpquic-hello: {e:#}")))?;
    if h.mode != TransportMode::Datagram || h.classes.iter().any(|c| c.mode.has_stream()) {
        return Err((
            "hello_unsupported",
            format!(
                "transport_mode {} over CONNECT-IP: datagram only",
                h.mode.as_str()
            ),
        ));
    }
    if h.pipe.is_some() || h.stripe.is_some() {
        return Err((
            "hello_unsupported",
            "pipes and stripe paths over CONNECT-IP".into(),
        ));
    }
    Ok(h)
}

/// The whole IPv4 space, and IPv6's with a dual-stack tunnel: where the client may send.
fn ranges(v6: bool) -> Vec<IpRange> {
    let mut r = vec![IpRange::everything(false)];
    if v6 {
        r.push(IpRange::everything(true));
    }
    r
}

/// The address of "a.b.c.d/len" or "x::y/len".
fn address(s: &str) -> Option<IpAddr> {
    s.split('/').next()?.parse().ok()
}

fn to_code(c: u64) -> quinn::VarInt {
    quinn::VarInt::from_u64(c).unwrap_or(quinn::VarInt::from_u32(code::INTERNAL_ERROR as u32))
}

/// An offered request, waiting for the server's decision (sent to the driver, which writes
/// the answer).
struct MasqueOffer {
    conn: quinn::Connection,
    stream: u64,
    decision: oneshot::Sender<Decision>,
}

impl OfferReply for MasqueOffer {
    fn accept(
        self: Box<Self>,
        ack: HelloAck,
    ) -> BoxFuture<'static, anyhow::Result<Arc<dyn PathTransport>>> {
        Box::pin(async move {
            let MasqueOffer {
                conn,
                stream,
                decision,
            } = *self;
            decision
                .send(Decision::Accept(ack))
                .map_err(|_| anyhow::anyhow!("the connection is gone"))?;
            Ok(QuicTransport::http_datagrams(conn, stream, None, None) as Arc<dyn PathTransport>)
        })
    }

    fn refuse(self: Box<Self>, ack: HelloAck) -> BoxFuture<'static, ()> {
        let _ = self.decision.send(Decision::Refuse(ack));
        Box::pin(async {})
    }
}
