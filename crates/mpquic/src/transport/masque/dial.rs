//! The client's CONNECT-IP request on a handshaken HTTP/3 connection (`protocol: masque`): our
//! control stream, the server's SETTINGS awaited (Extended CONNECT and HTTP Datagrams), the
//! request (with the bearer token, our hello in `mpquic-hello`, and an ADDRESS_REQUEST for the
//! address this client had, so a new path or a reconnection keeps it), then the answer. An
//! mpquic server answers the hello (`mpquic-hello-ack`): that answer is `request`'s, and the
//! session is the native one. A standard server ignores the hello: its first ADDRESS_ASSIGN
//! is made into the answer a hello would have had. The connection's driver goes on in its own
//! task for the session's life: a session the server ends (the stream finished or reset, an
//! address taken back) closes the connection, and the client dials again.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};

use anyhow::{anyhow, Result};
use mpquic_core::connect_ip::{AddressEntry, Capsule};
use mpquic_core::http3::client::{ClientConn, Event};
use mpquic_core::http3::frame::code;
use mpquic_core::http3::server::ServerConn;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use super::streams::{read_stream, spawn_acceptors, Input, INBOX};
use crate::config::{parse_cidr, parse_cidr6, MasqueClient};
use crate::hello::{self, Hello, HelloAck};
use crate::transport::Carrier;

/// What the request got.
pub(crate) struct Answered {
    /// The request stream (its datagrams' prefix).
    pub stream: u64,
    /// The answer, as a hello's (a refusal, an HTTP status, is one with `ok: false`).
    pub ack: HelloAck,
    pub carrier: Carrier,
}

/// Make the CONNECT-IP request on `conn` for `authority` (the server's name and port), with
/// `hello`; `ask`: the IPv4 address to ask for.
pub(crate) async fn request(
    conn: &quinn::Connection,
    authority: String,
    m: &MasqueClient,
    hello: &Hello,
    ask: Option<Ipv4Addr>,
) -> Result<Answered> {
    let (h3, control) = ClientConn::new();
    let mut ours = conn.open_uni().await?;
    ours.write_all(&control).await?;
    let (tx, inbox) = mpsc::channel(INBOX);
    spawn_acceptors(conn, tx.clone());
    let (done, answered) = oneshot::channel();
    let d = Driver {
        conn: conn.clone(),
        h3,
        inbox: tx,
        authority,
        m: m.clone(),
        hello: hello::to_field(hello)?,
        ask,
        send: None,
        stream: None,
        stops: HashMap::new(),
        done: Some(done),
        assigned: None,
    };
    tokio::spawn(d.run(inbox, ours));
    answered
        .await
        .map_err(|_| anyhow!("the connection closed before the server answered"))?
}

struct Driver {
    conn: quinn::Connection,
    h3: ClientConn,
    inbox: mpsc::Sender<Input>,
    authority: String,
    m: MasqueClient,
    /// Our hello, as the request's `mpquic-hello` field.
    hello: String,
    ask: Option<Ipv4Addr>,
    /// The request stream, once made.
    send: Option<quinn::SendStream>,
    stream: Option<u64>,
    /// Kept so the readers go on (dropping one stops its stream), until their streams end.
    stops: HashMap<u64, oneshot::Sender<u32>>,
    /// Where the answer goes, until it has.
    done: Option<oneshot::Sender<Result<Answered>>>,
    /// The addresses the session was given.
    assigned: Option<(Ipv4Addr, Option<IpAddr>)>,
}

impl Driver {
    async fn run(mut self, mut inbox: mpsc::Receiver<Input>, _ours: quinn::SendStream) {
        loop {
            let input = tokio::select! {
                i = inbox.recv() => i,
                _ = self.conn.closed() => None,
            };
            let Some(input) = input else { break };
            if let Input::Data { id, fin: true, .. } | Input::Gone { id } = &input {
                self.stops.remove(id);
            }
            let events = match input {
                Input::Opened { id, stop, .. } => {
                    self.stops.insert(id, stop);
                    continue;
                }
                Input::Data {
                    id,
                    uni: true,
                    data,
                    fin,
                } => self.h3.on_uni(id, &data, fin),
                Input::Data {
                    uni: false,
                    data,
                    fin,
                    ..
                } => self.h3.on_request(&data, fin),
                Input::Gone { id } if Some(id) == self.stream => {
                    self.end("the server reset the request stream");
                    break;
                }
                Input::Gone { .. } => continue,
            };
            for e in events {
                if let Err(why) = self.on_event(e).await {
                    self.end(&why);
                    return;
                }
            }
        }
        self.fail(anyhow!("the connection closed before the server answered"));
    }

    async fn on_event(&mut self, e: Event) -> Result<(), String> {
        match e {
            Event::Ready => {
                let (mut send, recv) = self.conn.open_bi().await.map_err(|e| e.to_string())?;
                let auth = self.m.token.as_ref().map(|t| format!("Bearer {t}"));
                let mut bytes = ClientConn::request(
                    &self.authority,
                    &self.m.path,
                    auth.as_deref(),
                    Some(&self.hello),
                );
                if let Some(a) = self.ask {
                    let ask = Capsule::AddressRequest(vec![AddressEntry {
                        request_id: 1,
                        addr: a.into(),
                        prefix_len: 32,
                    }]);
                    bytes.extend(ServerConn::capsules(&[ask]));
                }
                send.write_all(&bytes).await.map_err(|e| e.to_string())?;
                self.stream = Some(quinn::VarInt::from(send.id()).into_inner());
                self.send = Some(send);
                tokio::spawn(read_stream(None, recv, false, self.inbox.clone()));
            }
            Event::Unsupported => {
                return Err(
                    "the server does not offer CONNECT-IP (Extended CONNECT and HTTP Datagrams)"
                        .into(),
                )
            }
            Event::Answer {
                status,
                hello_ack: Some(v),
            } => {
                let ack: HelloAck = hello::from_field(v.as_bytes())
                    .map_err(|e| format!("the server's mpquic-hello-ack: {e:#}"))?;
                let ok = ack.ok && (200..300).contains(&status);
                if ok {
                    // Its ADDRESS_ASSIGN, which follows for standard clients, names the same.
                    self.assigned = Some(assigned_in(&ack)?);
                }
                self.answer(ack, Carrier::ConnectIp);
                if !ok {
                    return Err(format!("refused with {status}"));
                }
            }
            Event::Answer { status, .. } if (200..300).contains(&status) => {}
            Event::Answer { status, .. } => {
                let ack = HelloAck {
                    ok: false,
                    error: Some(format!(
                        "CONNECT-IP request answered {status}{}",
                        hint(status)
                    )),
                    ..Default::default()
                };
                self.answer(ack, Carrier::StandardConnectIp);
                return Err(format!("refused with {status}"));
            }
            Event::Capsule(Capsule::AddressAssign(list)) => self.on_assign(&list)?,
            Event::Capsule(Capsule::RouteAdvertisement(ranges)) => {
                info!(
                    ranges = ranges.len(),
                    "CONNECT-IP routes advertised by the server"
                )
            }
            Event::Capsule(_) => {}
            Event::Finished => return Err("the server ended the session".into()),
            Event::ResetStream { error } | Event::Close { error } => {
                return Err(format!("HTTP/3: {error}"))
            }
            Event::Goaway => {}
        }
        Ok(())
    }

    /// The server's assignment: the first answers the request; a later one that takes the
    /// address away ends the session (the client dials again and is told the new one).
    fn on_assign(&mut self, list: &[AddressEntry]) -> Result<(), String> {
        let given = |v4: bool| {
            list.iter()
                .find(|e| e.addr.is_ipv4() == v4 && !e.addr.is_unspecified())
                .map(|e| e.addr)
        };
        let v4 = match given(true) {
            Some(IpAddr::V4(a)) => a,
            _ => return Err("the server assigned no IPv4 address".into()),
        };
        let v6 = given(false);
        match self.assigned {
            None => {
                if let Some(a) = self.ask.filter(|a| *a != v4) {
                    warn!(asked = %a, given = %v4, "CONNECT-IP server gave another address than the one this client had");
                }
                self.assigned = Some((v4, v6));
                let ack = HelloAck {
                    ok: true,
                    addr: Some(format!("{v4}/32")),
                    addr6: v6.map(|a| format!("{a}/128")),
                    ..Default::default()
                };
                self.answer(ack, Carrier::StandardConnectIp);
            }
            Some(before) if before != (v4, v6) => {
                return Err(format!("the server changed the session's address to {v4}"))
            }
            Some(_) => {}
        }
        Ok(())
    }

    fn answer(&mut self, ack: HelloAck, carrier: Carrier) {
        if let (Some(done), Some(stream)) = (self.done.take(), self.stream) {
            let _ = done.send(Ok(Answered {
                stream,
                ack,
                carrier,
            }));
        }
    }

    fn fail(&mut self, e: anyhow::Error) {
        if let Some(done) = self.done.take() {
            let _ = done.send(Err(e));
        }
    }

    /// The session is over: the connection closes (the path's transport sees it and the client
    /// dials again).
    fn end(&mut self, why: &str) {
        self.fail(anyhow!("CONNECT-IP: {why}"));
        self.conn.close(
            quinn::VarInt::from_u32(code::NO_ERROR as u32),
            why.as_bytes(),
        );
    }
}

/// The addresses an mpquic server's answer gives, as its ADDRESS_ASSIGN names them.
fn assigned_in(ack: &HelloAck) -> Result<(Ipv4Addr, Option<IpAddr>), String> {
    let v6 = ack.addr6.as_deref().and_then(parse_cidr6);
    match ack.addr.as_deref().and_then(parse_cidr) {
        Some((v4, _)) => Ok((v4, v6.map(|(a, _)| a.into()))),
        None => Err("the server's mpquic-hello-ack gives no IPv4 address".into()),
    }
}

/// What to check for a refusal's status.
fn hint(status: u16) -> &'static str {
    match status {
        401 => " (masque_token missing or not the server's)",
        404 => " (masque_path is not a path the server serves)",
        501 => " (the server does not serve this kind of request)",
        _ => "",
    }
}
