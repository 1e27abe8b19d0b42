//! The client's side of one HTTP/3 connection carrying one CONNECT-IP request, sans I/O: the
//! shell sends this end's control stream at once, waits for `Event::Ready` (the server's
//! SETTINGS allow Extended CONNECT and HTTP Datagrams, RFC 9220 section 3), sends `request`'s
//! HEADERS on a new request stream, and hands over what arrives; the answer, then the
//! server's capsules, come back as events.

use super::body::CapsuleBody;
use super::frame::{self, code, err, Frame, FrameReader, H3Error, On};
use super::qpack;
use super::uni::{our_control_stream, UniNews, UniStreams};
use crate::connect_ip::{request, Capsule};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The server's settings allow a CONNECT-IP request now.
    Ready,
    /// The server's settings arrived without Extended CONNECT or HTTP Datagrams: it cannot
    /// serve CONNECT-IP.
    Unsupported,
    /// The final answer's status: 2xx opens the capsules, anything else ends the request.
    /// `hello_ack`: an mpquic server's answer to the hello the request carried
    /// (`request::HELLO_ACK_FIELD`, with a refusal too); none from any other server.
    Answer {
        status: u16,
        hello_ack: Option<String>,
    },
    Capsule(Capsule),
    /// The server ended the request stream.
    Finished,
    ResetStream {
        error: H3Error,
    },
    Close {
        error: H3Error,
    },
    Goaway,
}

enum Answer {
    Waiting(FrameReader),
    Open(CapsuleBody),
    Closed,
}

pub struct ClientConn {
    uni: UniStreams,
    answer: Answer,
    closed: bool,
}

impl ClientConn {
    /// A new connection, and the bytes of this end's control stream to send at once.
    pub fn new() -> (ClientConn, Vec<u8>) {
        let conn = ClientConn {
            uni: UniStreams::default(),
            answer: Answer::Waiting(FrameReader::new(On::Request)),
            closed: false,
        };
        (conn, our_control_stream())
    }

    /// The HEADERS frame of the request, for the request stream; `hello`: an mpquic client's
    /// (`request::HELLO_FIELD`).
    pub fn request(
        authority: &str,
        path: &str,
        authorization: Option<&str>,
        hello: Option<&str>,
    ) -> Vec<u8> {
        let fields = request::request(authority, path, authorization, hello);
        frame::frame(frame::HEADERS, &qpack::encode(fields))
    }

    /// Bytes on one of the server's unidirectional streams.
    pub fn on_uni(&mut self, stream: u64, data: &[u8], fin: bool) -> Vec<Event> {
        if self.closed {
            return Vec::new();
        }
        // This end never sends MAX_PUSH_ID: a push stream has no push ID it may use.
        let push = H3Error {
            code: code::ID_ERROR,
            why: "a push stream though no push was allowed",
        };
        match self.uni.on_bytes(stream, data, fin, push) {
            Err(error) => {
                self.closed = true;
                vec![Event::Close { error }]
            }
            Ok(news) => (news.into_iter())
                .filter_map(|n| match n {
                    UniNews::Settings => Some(match self.uni.settings() {
                        Some(s) if s.extended_connect && s.datagram => Event::Ready,
                        _ => Event::Unsupported,
                    }),
                    UniNews::Goaway => Some(Event::Goaway),
                    UniNews::Nothing => None,
                })
                .collect(),
        }
    }

    /// Bytes on the request stream (the server's answer, then its capsules).
    pub fn on_request(&mut self, data: &[u8], fin: bool) -> Vec<Event> {
        let mut out = Vec::new();
        if self.closed {
            return out;
        }
        let result = self.read(data, &mut out);
        if let Err(error) = result {
            self.answer = Answer::Closed;
            out.push(Event::ResetStream { error });
            return out;
        }
        if fin {
            match &self.answer {
                Answer::Open(body) => {
                    if let Err(error) = body.finish() {
                        out.push(Event::ResetStream { error });
                    }
                    out.push(Event::Finished);
                }
                Answer::Waiting(_) => out.push(Event::ResetStream {
                    error: err(
                        code::REQUEST_INCOMPLETE,
                        "the request stream ended without an answer",
                    ),
                }),
                Answer::Closed => {}
            }
            self.answer = Answer::Closed;
        }
        out
    }

    fn read(&mut self, data: &[u8], out: &mut Vec<Event>) -> Result<(), H3Error> {
        match &mut self.answer {
            Answer::Waiting(r) => r.push(data),
            Answer::Open(body) => body.push(data),
            Answer::Closed => return Ok(()),
        }
        loop {
            match &mut self.answer {
                Answer::Waiting(r) => match r.read()? {
                    Some(Frame::Headers(section)) => {
                        let fields = qpack::decode(&section, frame::MAX_FRAME).map_err(|_| {
                            err(
                                code::QPACK_DECOMPRESSION_FAILED,
                                "an answer's field section did not decode",
                            )
                        })?;
                        let hello_ack = request::field(&fields, request::HELLO_ACK_FIELD)
                            .map(|v| String::from_utf8_lossy(v).into_owned());
                        let status = match request::check_answer(&fields) {
                            Ok(s) => s,
                            // An interim answer (1xx) comes before the final one.
                            Err(_) if status_of(&fields).is_some_and(|s| s < 200) => continue,
                            Err(_) => {
                                let status = status_of(&fields).ok_or(err(
                                    code::MESSAGE_ERROR,
                                    "an answer without a :status",
                                ))?;
                                self.answer = Answer::Closed;
                                out.push(Event::Answer { status, hello_ack });
                                return Ok(());
                            }
                        };
                        let r = std::mem::replace(r, FrameReader::new(On::Request));
                        self.answer = Answer::Open(CapsuleBody::new(r));
                        out.push(Event::Answer { status, hello_ack });
                    }
                    Some(_) => {
                        return Err(err(
                            code::FRAME_UNEXPECTED,
                            "an answer that does not start with HEADERS",
                        ))
                    }
                    None => return Ok(()),
                },
                Answer::Open(body) => return body.read(|c| out.push(Event::Capsule(c))),
                Answer::Closed => return Ok(()),
            }
        }
    }
}

fn status_of(fields: &[qpack::Field]) -> Option<u16> {
    fields
        .iter()
        .find(|(n, _)| n == b":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::super::server::{self, ServerConn};
    use super::*;
    use crate::connect_ip::{AddressEntry, IpRange};
    use std::net::Ipv4Addr;

    /// Our client against our server, byte for byte: control streams both ways, the request,
    /// the answer and the capsules each way.
    #[test]
    fn our_client_and_our_server_agree() {
        let (mut srv, srv_ctl) = ServerConn::new();
        let (mut cli, cli_ctl) = ClientConn::new();
        assert_eq!(cli.on_uni(3, &srv_ctl, false), [Event::Ready]);
        assert!(srv.on_uni(2, &cli_ctl, false).is_empty());
        let req = ClientConn::request(
            "vpn.example:443",
            "/.well-known/masque/ip/*/*/",
            Some("Bearer t"),
            Some("aGk"),
        );
        let ev = srv.on_request(0, &req, false);
        let [server::Event::Request { stream: 0, fields }] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        let judged = crate::connect_ip::request::judge(
            fields,
            &crate::connect_ip::Template::default(),
            Some("site1"),
            &[],
        );
        assert_eq!(judged.map(|a| a.identity), Ok("site1".to_string()));
        let hello = crate::connect_ip::request::field(fields, "mpquic-hello");
        assert_eq!(hello, Some(&b"aGk"[..]));
        // Opened now, answered with the server's hello answer once it decided.
        let (_, early) = srv.answer(0, 200);
        assert!(early.is_empty());
        let headers = ServerConn::headers(200, Some("b2s"));
        let assign = Capsule::AddressAssign(vec![AddressEntry {
            request_id: 0,
            addr: Ipv4Addr::new(10, 200, 17, 5).into(),
            prefix_len: 32,
        }]);
        let routes = Capsule::RouteAdvertisement(vec![IpRange::everything(false)]);
        let body = ServerConn::capsules(&[assign.clone(), routes.clone()]);
        let mut ev = cli.on_request(&headers, false);
        ev.extend(cli.on_request(&body[..5], false));
        ev.extend(cli.on_request(&body[5..], false));
        assert_eq!(
            ev,
            [
                Event::Answer {
                    status: 200,
                    hello_ack: Some("b2s".into())
                },
                Event::Capsule(assign),
                Event::Capsule(routes)
            ]
        );
        assert_eq!(cli.on_request(&[], true), [Event::Finished]);
    }

    #[test]
    fn a_refusal_an_unsupported_server_and_broken_answers() {
        let (mut cli, _) = ClientConn::new();
        let no_dgram = [
            &[0u8][..],
            &super::super::frame::Settings {
                extended_connect: true,
                ..Default::default()
            }
            .encode(),
        ]
        .concat();
        assert_eq!(cli.on_uni(3, &no_dgram, false), [Event::Unsupported]);
        // 401, after an interim 103; what follows is ignored.
        let interim = frame::frame(frame::HEADERS, &qpack::encode([(":status", "103")]));
        let no = frame::frame(frame::HEADERS, &qpack::encode([(":status", "401")]));
        let ev = cli.on_request(&[interim, no].concat(), false);
        assert_eq!(
            ev,
            [Event::Answer {
                status: 401,
                hello_ack: None
            }]
        );
        assert!(cli
            .on_request(&frame::frame(frame::DATA, b"x"), true)
            .is_empty());
        // DATA first; the stream ending before an answer; a push stream.
        let (mut cli, _) = ClientConn::new();
        let ev = cli.on_request(&frame::frame(frame::DATA, b"x"), false);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { error }] if error.code == code::FRAME_UNEXPECTED)
        );
        let (mut cli, _) = ClientConn::new();
        let ev = cli.on_request(&[], true);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { error }] if error.code == code::REQUEST_INCOMPLETE)
        );
        let ev = cli.on_uni(7, &[0x01, 0x00], false);
        assert!(matches!(ev.as_slice(), [Event::Close { error }] if error.code == code::ID_ERROR));
    }
}
