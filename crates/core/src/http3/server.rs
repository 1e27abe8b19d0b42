//! The server's side of one HTTP/3 connection that carries CONNECT-IP requests, sans I/O: the
//! shell hands over what arrives on each QUIC stream and sends what this returns. It keeps
//! RFC 9114's connection rules (one control stream each way, SETTINGS first on it, the critical
//! streams never closed, unknown stream types ignored) and reads each request stream: its
//! HEADERS, then its DATA as capsules (RFC 9297). A request is handed up only once the peer's
//! SETTINGS have arrived and say it takes HTTP Datagrams.

use std::collections::HashMap;

use super::body::CapsuleBody;
use super::frame::{self, code, err, Frame, FrameReader, H3Error, On, Settings};
use super::qpack::{self, Field};
use super::uni::{our_control_stream, UniNews, UniStreams};
use crate::connect_ip::Capsule;

/// Streams of the peer this end keeps state for at most (requests and unidirectional ones
/// whose type has not arrived): beyond, new ones are refused (H3_EXCESSIVE_LOAD on the stream).
pub const MAX_STREAMS: usize = 16;

/// What the connection asks of the shell, or tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request's header fields, to judge and answer (`answer`).
    Request { stream: u64, fields: Vec<Field> },
    /// A capsule on an answered request's stream.
    Capsule { stream: u64, capsule: Capsule },
    /// The request stream ended (the client closed its side: the session is over).
    Finished { stream: u64 },
    /// Reset the stream (stop sending and reading) with this code; the connection goes on.
    ResetStream { stream: u64, error: H3Error },
    /// Close the whole connection with this code.
    Close { error: H3Error },
    /// The peer is going away (GOAWAY): no new requests will come.
    Goaway,
}

enum Request {
    /// Waiting for the HEADERS frame.
    Headers(FrameReader),
    /// HEADERS read; waiting for the peer's SETTINGS (or for `answer`).
    Pending(FrameReader, Vec<Field>),
    /// Handed up, not answered yet: its bytes wait in the reader.
    Asked(FrameReader),
    /// Answered 2xx: DATA carries capsules.
    Open(CapsuleBody),
    /// Refused or failed: whatever else arrives is dropped.
    Closed,
}

pub struct ServerConn {
    uni: UniStreams,
    requests: HashMap<u64, Request>,
    closed: bool,
}

impl ServerConn {
    /// A new connection, and the bytes of this end's control stream (its type, then SETTINGS)
    /// to send on a unidirectional stream at once.
    pub fn new() -> (ServerConn, Vec<u8>) {
        let conn = ServerConn {
            uni: UniStreams::default(),
            requests: HashMap::new(),
            closed: false,
        };
        (conn, our_control_stream())
    }

    /// The peer's SETTINGS, once they arrived.
    pub fn peer_settings(&self) -> Option<Settings> {
        self.uni.settings()
    }

    /// Bytes on the peer's unidirectional `stream` (`fin`: its end).
    pub fn on_uni(&mut self, stream: u64, data: &[u8], fin: bool) -> Vec<Event> {
        let mut out = Vec::new();
        if self.closed {
            return out;
        }
        if !self.uni.knows(stream) && self.busy() {
            out.push(Event::ResetStream {
                stream,
                error: err(code::EXCESSIVE_LOAD, "too many streams"),
            });
            return out;
        }
        let push = err(code::STREAM_CREATION_ERROR, "a push stream from a client");
        match self.uni.on_bytes(stream, data, fin, push) {
            Err(e) => return self.fail(e),
            Ok(news) => {
                for n in news {
                    match n {
                        UniNews::Goaway => out.push(Event::Goaway),
                        // Requests that waited for the settings.
                        UniNews::Settings => {
                            let waiting: Vec<u64> = (self.requests.iter())
                                .filter(|(_, r)| matches!(r, Request::Pending(..)))
                                .map(|(s, _)| *s)
                                .collect();
                            for s in waiting {
                                self.release(s, &mut out);
                            }
                        }
                        UniNews::Nothing => {}
                    }
                }
            }
        }
        out
    }

    /// Bytes on the peer's request (bidirectional) `stream` (`fin`: its end).
    pub fn on_request(&mut self, stream: u64, data: &[u8], fin: bool) -> Vec<Event> {
        let mut out = Vec::new();
        if self.closed {
            return out;
        }
        if !self.requests.contains_key(&stream) {
            if self.busy() {
                out.push(Event::ResetStream {
                    stream,
                    error: err(code::REQUEST_REJECTED, "too many streams"),
                });
                return out;
            }
            self.requests
                .insert(stream, Request::Headers(FrameReader::new(On::Request)));
        }
        let state = self.requests.get_mut(&stream).expect("inserted above");
        match state {
            Request::Headers(r) | Request::Pending(r, _) | Request::Asked(r) => r.push(data),
            Request::Open(body) => body.push(data),
            Request::Closed => return out,
        }
        self.read_request(stream, fin, &mut out);
        out
    }

    fn read_request(&mut self, stream: u64, fin: bool, out: &mut Vec<Event>) {
        let Some(state) = self.requests.get_mut(&stream) else {
            return;
        };
        let result: Result<(), H3Error> = match state {
            Request::Headers(r) => match r.read() {
                Ok(Some(Frame::Headers(section))) => {
                    match qpack::decode(&section, frame::MAX_FRAME) {
                        Ok(fields) => {
                            let r = std::mem::replace(r, FrameReader::new(On::Request));
                            *state = Request::Pending(r, fields);
                            Ok(())
                        }
                        Err(e) => Err(err(
                            match e {
                                qpack::QpackError::TooLarge => code::EXCESSIVE_LOAD,
                                _ => code::QPACK_DECOMPRESSION_FAILED,
                            },
                            "a request's field section did not decode",
                        )),
                    }
                }
                Ok(Some(_)) => Err(err(
                    code::FRAME_UNEXPECTED,
                    "a request that does not start with HEADERS",
                )),
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            },
            Request::Open(body) => {
                body.read(|capsule| out.push(Event::Capsule { stream, capsule }))
            }
            // Bytes wait in the reader until the request is answered.
            _ => Ok(()),
        };
        if let Err(e) = result {
            *state = Request::Closed;
            out.push(Event::ResetStream { stream, error: e });
            return;
        }
        if matches!(state, Request::Pending(..)) {
            self.release(stream, out);
        }
        if fin {
            self.end_request(stream, out);
        }
    }

    /// A request whose headers are read goes up once the peer's settings allow it.
    fn release(&mut self, stream: u64, out: &mut Vec<Event>) {
        let Some(settings) = self.uni.settings() else {
            return;
        };
        let Some(state) = self.requests.get_mut(&stream) else {
            return;
        };
        if !matches!(state, Request::Pending(..)) {
            return;
        }
        let Request::Pending(r, fields) = std::mem::replace(state, Request::Closed) else {
            return;
        };
        if !settings.datagram {
            // The client would not take the proxied packets.
            out.push(Event::ResetStream {
                stream,
                error: err(
                    code::DATAGRAM_ERROR,
                    "the client did not enable HTTP Datagrams",
                ),
            });
            return;
        }
        *state = Request::Asked(r);
        out.push(Event::Request { stream, fields });
    }

    fn end_request(&mut self, stream: u64, out: &mut Vec<Event>) {
        let done = match self.requests.get(&stream) {
            Some(Request::Open(body)) => {
                if let Err(e) = body.finish() {
                    out.push(Event::ResetStream { stream, error: e });
                }
                true
            }
            Some(Request::Closed) | None => false,
            // Ended before it was answered: nothing to proxy.
            Some(_) => true,
        };
        self.requests.remove(&stream);
        if done {
            out.push(Event::Finished { stream });
        }
    }

    /// The shell's answer to `Event::Request`: the HEADERS frame to send on the stream. A 2xx
    /// opens the stream's capsules (any that arrived meanwhile come back as events); any other
    /// status ends the request.
    pub fn answer(&mut self, stream: u64, status: u16) -> (Vec<u8>, Vec<Event>) {
        let headers = Self::headers(status, None);
        let mut out = Vec::new();
        match self.requests.get_mut(&stream) {
            Some(state @ Request::Asked(_)) if (200..300).contains(&status) => {
                let Request::Asked(r) = std::mem::replace(state, Request::Closed) else {
                    unreachable!("matched above")
                };
                *state = Request::Open(CapsuleBody::new(r));
                self.read_request(stream, false, &mut out);
            }
            Some(state) => *state = Request::Closed,
            None => {}
        }
        (headers, out)
    }

    /// An answer's HEADERS frame with `status`. A shell that opened a request with `answer`
    /// (to read the capsules that came with it) and then refused it sends this instead.
    /// `hello_ack`: an mpquic server's answer to an mpquic client's hello.
    pub fn headers(status: u16, hello_ack: Option<&str>) -> Vec<u8> {
        let fields = crate::connect_ip::request::answer(status, hello_ack);
        let section = qpack::encode(fields.iter().map(|(n, v)| (*n, v.as_str())));
        frame::frame(frame::HEADERS, &section)
    }

    /// Capsules for the client, framed as a DATA frame for the request stream.
    pub fn capsules(capsules: &[Capsule]) -> Vec<u8> {
        let mut body = Vec::new();
        for c in capsules {
            c.encode(&mut body);
        }
        let mut out = frame::data_header(body.len());
        out.extend(body);
        out
    }

    /// The QUIC stream is gone (both sides finished or reset): its state goes. The shell calls
    /// this for every stream it was handing bytes for, so a stream refused or reset here does
    /// not hold a place among `MAX_STREAMS`.
    pub fn forget(&mut self, stream: u64) {
        self.requests.remove(&stream);
        self.uni.forget(stream);
    }

    /// The peer's request streams and unopened streams held: a bound against a peer that opens
    /// many and sends nothing.
    fn busy(&self) -> bool {
        self.requests.len() + self.uni.opening() >= MAX_STREAMS
    }

    fn fail(&mut self, error: H3Error) -> Vec<Event> {
        self.closed = true;
        vec![Event::Close { error }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect_ip::AddressEntry;
    use std::net::Ipv4Addr;

    fn client_control(datagram: bool) -> Vec<u8> {
        let mut b = vec![frame::CONTROL_STREAM as u8];
        b.extend(
            Settings {
                datagram,
                extended_connect: false,
                ..Settings::default()
            }
            .encode(),
        );
        b
    }

    fn request_headers() -> Vec<u8> {
        let f = crate::connect_ip::request::request("vpn.example", "/vpn", Some("Bearer t"), None);
        frame::frame(frame::HEADERS, &qpack::encode(f))
    }

    fn ask_for(addr: [u8; 4]) -> Capsule {
        Capsule::AddressRequest(vec![AddressEntry {
            request_id: 1,
            addr: Ipv4Addr::from(addr).into(),
            prefix_len: 32,
        }])
    }

    #[test]
    fn a_request_goes_up_answered_opens_its_capsules_and_ends_with_the_stream() {
        let (mut c, ours) = ServerConn::new();
        assert_eq!(ours[0], frame::CONTROL_STREAM as u8);
        // The client's control stream in pieces, and its QPACK streams (ignored).
        let ctl = client_control(true);
        assert!(c.on_uni(2, &ctl[..1], false).is_empty());
        assert!(c.on_uni(2, &ctl[1..], false).is_empty());
        assert!(c.on_uni(6, &[0x02, 0x3f, 0xe1, 0x1f], false).is_empty());
        assert!(c.on_uni(10, &[0x03], false).is_empty());
        assert!(c.peer_settings().unwrap().datagram);
        // HEADERS and a first capsule in one piece.
        let mut bytes = request_headers();
        bytes.extend(ServerConn::capsules(&[ask_for([10, 200, 17, 9])]));
        let ev = c.on_request(0, &bytes, false);
        let [Event::Request { stream: 0, fields }] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        assert!(fields
            .iter()
            .any(|(n, v)| n == b":protocol" && v == b"connect-ip"));
        // Answered: the HEADERS frame, and the capsule that waited.
        let (headers, ev) = c.answer(0, 200);
        assert_eq!(headers[0], frame::HEADERS as u8);
        assert_eq!(
            ev,
            [Event::Capsule {
                stream: 0,
                capsule: ask_for([10, 200, 17, 9])
            }]
        );
        let more = ServerConn::capsules(&[ask_for([10, 200, 17, 10])]);
        let (a, b) = more.split_at(3);
        assert!(c.on_request(0, a, false).is_empty());
        assert_eq!(c.on_request(0, b, false).len(), 1);
        assert_eq!(c.on_request(0, &[], true), [Event::Finished { stream: 0 }]);
    }

    #[test]
    fn a_request_waits_for_the_peers_settings_and_needs_datagrams() {
        let (mut c, _) = ServerConn::new();
        assert!(c.on_request(0, &request_headers(), false).is_empty());
        let ev = c.on_uni(2, &client_control(true), false);
        assert!(
            matches!(ev.as_slice(), [Event::Request { stream: 0, .. }]),
            "{ev:?}"
        );
        let (mut c, _) = ServerConn::new();
        c.on_uni(2, &client_control(false), false);
        let ev = c.on_request(4, &request_headers(), false);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { stream: 4, error }] if error.code == code::DATAGRAM_ERROR),
            "{ev:?}"
        );
    }

    #[test]
    fn connection_errors_close_it() {
        type Opened = Vec<(u64, Vec<u8>, bool)>;
        let cases: Vec<(Opened, u64)> = vec![
            (
                vec![
                    (2, client_control(true), false),
                    (6, client_control(true), false),
                ],
                code::STREAM_CREATION_ERROR,
            ),
            (
                vec![(2, client_control(true), true)],
                code::CLOSED_CRITICAL_STREAM,
            ),
            (
                vec![(2, vec![0x00, 0x07, 0x01, 0x00], false)],
                code::MISSING_SETTINGS,
            ),
            (vec![(2, vec![0x01], false)], code::STREAM_CREATION_ERROR),
        ];
        for (streams, want) in cases {
            let (mut c, _) = ServerConn::new();
            let mut ev = Vec::new();
            for (s, bytes, fin) in streams {
                ev.extend(c.on_uni(s, &bytes, fin));
            }
            assert!(
                matches!(ev.last(), Some(Event::Close { error }) if error.code == want),
                "{ev:?}"
            );
            // Closed: nothing more comes of it.
            assert!(c.on_request(0, &request_headers(), false).is_empty());
        }
        // An unknown (grease) stream type is read and ignored, even when it ends.
        let (mut c, _) = ServerConn::new();
        assert!(c.on_uni(2, &[0x40, 0x21, 1, 2, 3], true).is_empty());
    }

    #[test]
    fn stream_errors_reset_only_the_stream() {
        let (mut c, _) = ServerConn::new();
        c.on_uni(2, &client_control(true), false);
        // DATA before HEADERS; a field section that does not decode.
        let ev = c.on_request(0, &frame::frame(frame::DATA, b"x"), false);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { error, .. }] if error.code == code::FRAME_UNEXPECTED)
        );
        let ev = c.on_request(4, &frame::frame(frame::HEADERS, &[0x05, 0x00]), false);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { error, .. }] if error.code == code::QPACK_DECOMPRESSION_FAILED)
        );
        // A malformed capsule on an answered stream.
        assert_eq!(c.on_request(8, &request_headers(), false).len(), 1);
        c.answer(8, 200);
        let mut bad = frame::data_header(3);
        bad.extend([0x02, 0x01, 0x05]);
        let ev = c.on_request(8, &bad, false);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { stream: 8, error }] if error.code == code::MESSAGE_ERROR),
            "{ev:?}"
        );
        assert!(c.on_request(8, &bad, false).is_empty());
        // A refused request: what follows is dropped.
        assert_eq!(c.on_request(12, &request_headers(), false).len(), 1);
        let (headers, ev) = c.answer(12, 401);
        assert!(ev.is_empty() && !headers.is_empty());
        assert!(c
            .on_request(12, &ServerConn::capsules(&[ask_for([1, 2, 3, 4])]), true)
            .is_empty());
        // The connection itself goes on.
        assert_eq!(c.on_request(16, &request_headers(), false).len(), 1);
    }

    #[test]
    fn streams_held_are_bounded() {
        let (mut c, _) = ServerConn::new();
        for s in 0..MAX_STREAMS as u64 {
            assert!(c
                .on_request(4 * s, &request_headers()[..2], false)
                .is_empty());
        }
        let ev = c.on_request(4 * MAX_STREAMS as u64, &request_headers(), false);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { error, .. }] if error.code == code::REQUEST_REJECTED)
        );
        let ev = c.on_uni(2, &[0x00], false);
        assert!(
            matches!(ev.as_slice(), [Event::ResetStream { error, .. }] if error.code == code::EXCESSIVE_LOAD)
        );
        // Streams gone give their places back.
        c.forget(0);
        assert!(c.on_uni(2, &client_control(true), false).is_empty());
        c.forget(4);
        let ev = c.on_request(4 * MAX_STREAMS as u64, &request_headers(), false);
        assert_eq!(ev.len(), 1, "{ev:?}");
    }
}
