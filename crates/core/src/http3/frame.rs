//! HTTP/3 frames (RFC 9114 section 7) on a stream, read as the bytes arrive: a DATA frame's
//! payload is handed on in pieces (a CONNECT-IP stream is one long DATA body of capsules), a
//! HEADERS or SETTINGS frame whole (bounded), unknown and reserved frame types skipped unheld
//! (RFC 9114 section 9); HTTP/2's frame types are an error, and so is a frame on a stream it
//! has no place on.

use crate::varint;

pub const DATA: u64 = 0x00;
pub const HEADERS: u64 = 0x01;
pub const CANCEL_PUSH: u64 = 0x03;
pub const SETTINGS: u64 = 0x04;
pub const PUSH_PROMISE: u64 = 0x05;
pub const GOAWAY: u64 = 0x07;
pub const MAX_PUSH_ID: u64 = 0x0d;

/// Unidirectional stream types (RFC 9114 section 6.2, RFC 9204 section 4.2).
pub const CONTROL_STREAM: u64 = 0x00;
pub const PUSH_STREAM: u64 = 0x01;
pub const QPACK_ENCODER_STREAM: u64 = 0x02;
pub const QPACK_DECODER_STREAM: u64 = 0x03;

pub const SETTING_QPACK_MAX_TABLE_CAPACITY: u64 = 0x01;
pub const SETTING_MAX_FIELD_SECTION_SIZE: u64 = 0x06;
pub const SETTING_QPACK_BLOCKED_STREAMS: u64 = 0x07;
pub const SETTING_ENABLE_CONNECT_PROTOCOL: u64 = 0x08;
pub const SETTING_H3_DATAGRAM: u64 = 0x33;

/// The error codes this end sends or reads (RFC 9114 section 8.1, RFC 9204, RFC 9297).
pub mod code {
    pub const NO_ERROR: u64 = 0x100;
    pub const GENERAL_PROTOCOL_ERROR: u64 = 0x101;
    pub const INTERNAL_ERROR: u64 = 0x102;
    pub const STREAM_CREATION_ERROR: u64 = 0x103;
    pub const CLOSED_CRITICAL_STREAM: u64 = 0x104;
    pub const FRAME_UNEXPECTED: u64 = 0x105;
    pub const FRAME_ERROR: u64 = 0x106;
    pub const EXCESSIVE_LOAD: u64 = 0x107;
    pub const ID_ERROR: u64 = 0x108;
    pub const SETTINGS_ERROR: u64 = 0x109;
    pub const MISSING_SETTINGS: u64 = 0x10a;
    pub const REQUEST_REJECTED: u64 = 0x10b;
    pub const REQUEST_CANCELLED: u64 = 0x10c;
    pub const REQUEST_INCOMPLETE: u64 = 0x10d;
    pub const MESSAGE_ERROR: u64 = 0x10e;
    pub const QPACK_DECOMPRESSION_FAILED: u64 = 0x200;
    pub const DATAGRAM_ERROR: u64 = 0x33;
}

/// The longest HEADERS or SETTINGS frame this end reads (it announces this as its maximum
/// field section size).
pub const MAX_FRAME: usize = 16 * 1024;

/// An error that ends the stream or the connection, with its HTTP/3 code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H3Error {
    pub code: u64,
    pub why: &'static str,
}

impl std::fmt::Display for H3Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (HTTP/3 error 0x{:x})", self.why, self.code)
    }
}

impl std::error::Error for H3Error {}

/// An `H3Error` (one helper for every module here).
pub(crate) const fn err(code: u64, why: &'static str) -> H3Error {
    H3Error { code, why }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A piece of a DATA frame's payload (a frame may come as several).
    Data(Vec<u8>),
    /// A whole HEADERS frame's field section (QPACK-encoded).
    Headers(Vec<u8>),
    Settings(Settings),
    Goaway(u64),
    /// CANCEL_PUSH, MAX_PUSH_ID, PUSH_PROMISE: read and set aside (this end never pushes).
    Push,
}

/// What a stream may carry: a request stream HEADERS and DATA, a control stream SETTINGS first
/// and then GOAWAY and the push frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    Request,
    Control,
}

/// The settings this end cares about (the others are read and ignored, as the RFC requires).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settings {
    pub extended_connect: bool,
    pub datagram: bool,
    pub max_field_section_size: Option<u64>,
    pub qpack_max_table_capacity: u64,
}

impl Settings {
    /// What this end announces: Extended CONNECT, HTTP Datagrams, no QPACK dynamic table.
    pub fn ours() -> Settings {
        Settings {
            extended_connect: true,
            datagram: true,
            max_field_section_size: Some(MAX_FRAME as u64),
            qpack_max_table_capacity: 0,
        }
    }

    /// The SETTINGS frame, framed.
    pub fn encode(&self) -> Vec<u8> {
        let mut value = Vec::new();
        let mut put = |id: u64, v: u64| {
            varint::write(id, &mut value);
            varint::write(v, &mut value);
        };
        put(
            SETTING_QPACK_MAX_TABLE_CAPACITY,
            self.qpack_max_table_capacity,
        );
        put(SETTING_QPACK_BLOCKED_STREAMS, 0);
        if let Some(m) = self.max_field_section_size {
            put(SETTING_MAX_FIELD_SECTION_SIZE, m);
        }
        put(
            SETTING_ENABLE_CONNECT_PROTOCOL,
            u64::from(self.extended_connect),
        );
        put(SETTING_H3_DATAGRAM, u64::from(self.datagram));
        frame(SETTINGS, &value)
    }

    fn parse(mut value: &[u8]) -> Result<Settings, H3Error> {
        let mut s = Settings::default();
        let mut seen = Vec::new();
        while !value.is_empty() {
            let short = err(code::FRAME_ERROR, "SETTINGS cut short");
            let (id, a) = varint::read(value).ok_or(short)?;
            let (v, b) = varint::read(&value[a..]).ok_or(short)?;
            value = &value[a + b..];
            if (0x02..=0x05).contains(&id) {
                return Err(err(code::SETTINGS_ERROR, "an HTTP/2 setting in SETTINGS"));
            }
            if seen.contains(&id) {
                return Err(err(code::SETTINGS_ERROR, "a setting given twice"));
            }
            seen.push(id);
            let flag = |v: u64| match v {
                0 | 1 => Ok(v == 1),
                _ => Err(err(
                    code::SETTINGS_ERROR,
                    "a boolean setting neither 0 nor 1",
                )),
            };
            match id {
                SETTING_ENABLE_CONNECT_PROTOCOL => s.extended_connect = flag(v)?,
                SETTING_H3_DATAGRAM => s.datagram = flag(v)?,
                SETTING_MAX_FIELD_SECTION_SIZE => s.max_field_section_size = Some(v),
                SETTING_QPACK_MAX_TABLE_CAPACITY => s.qpack_max_table_capacity = v,
                _ => {}
            }
        }
        Ok(s)
    }
}

/// A frame of `kind` around `value`, framed.
pub fn frame(kind: u64, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() + 16);
    varint::write(kind, &mut out);
    varint::write(value.len() as u64, &mut out);
    out.extend_from_slice(value);
    out
}

/// A DATA frame's header for a payload of `len` bytes (the payload follows it unframed).
pub fn data_header(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(9);
    varint::write(DATA, &mut out);
    varint::write(len as u64, &mut out);
    out
}

/// The frames of one stream from its bytes as they arrive (`push`, then `read` until it returns
/// `Ok(None)`).
#[derive(Debug)]
pub struct FrameReader {
    on: On,
    buf: Vec<u8>,
    /// Bytes still to come of the DATA frame being read.
    in_data: u64,
    /// Bytes still to pass over of a frame being skipped.
    skip: u64,
    /// A control stream has had its SETTINGS.
    settled: bool,
}

impl FrameReader {
    pub fn new(on: On) -> FrameReader {
        FrameReader {
            on,
            buf: Vec::new(),
            in_data: 0,
            skip: 0,
            settled: false,
        }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        if self.skip > 0 {
            let n = self.skip.min(data.len() as u64) as usize;
            self.skip -= n as u64;
            data = &data[n..];
        }
        self.buf.extend_from_slice(data);
    }

    /// The next frame (or piece of DATA); `Ok(None)` until more bytes arrive.
    pub fn read(&mut self) -> Result<Option<Frame>, H3Error> {
        loop {
            if self.in_data > 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                let n = self.in_data.min(self.buf.len() as u64) as usize;
                self.in_data -= n as u64;
                return Ok(Some(Frame::Data(self.buf.drain(..n).collect())));
            }
            let Some((kind, a)) = varint::read(&self.buf) else {
                return Ok(None);
            };
            let Some((len, b)) = varint::read(&self.buf[a..]) else {
                return Ok(None);
            };
            self.check(kind)?;
            match kind {
                DATA => {
                    self.buf.drain(..a + b);
                    self.in_data = len;
                    continue;
                }
                HEADERS | SETTINGS | GOAWAY | CANCEL_PUSH | MAX_PUSH_ID | PUSH_PROMISE => {}
                // Reserved and unknown types: passed over.
                _ => {
                    let here = len.min((self.buf.len() - a - b) as u64) as usize;
                    self.buf.drain(..a + b + here);
                    self.skip = len - here as u64;
                    if self.skip > 0 {
                        return Ok(None);
                    }
                    continue;
                }
            }
            if len > MAX_FRAME as u64 {
                return Err(err(
                    code::EXCESSIVE_LOAD,
                    "a frame longer than this end reads",
                ));
            }
            let end = a + b + len as usize;
            if self.buf.len() < end {
                return Ok(None);
            }
            let value: Vec<u8> = self.buf[a + b..end].to_vec();
            self.buf.drain(..end);
            let one = |v: &[u8]| match varint::read(v) {
                Some((x, n)) if n == v.len() => Ok(x),
                _ => Err(err(code::FRAME_ERROR, "a frame's value malformed")),
            };
            return Ok(Some(match kind {
                HEADERS => Frame::Headers(value),
                SETTINGS => {
                    self.settled = true;
                    Frame::Settings(Settings::parse(&value)?)
                }
                GOAWAY => Frame::Goaway(one(&value)?),
                _ => Frame::Push,
            }));
        }
    }

    /// Whether a frame of `kind` may come now on this stream.
    fn check(&self, kind: u64) -> Result<(), H3Error> {
        let unexpected = |why| Err(err(code::FRAME_UNEXPECTED, why));
        if matches!(kind, 0x02 | 0x06 | 0x08 | 0x09) {
            return unexpected("an HTTP/2 frame type");
        }
        match self.on {
            On::Control if !self.settled && kind != SETTINGS => Err(err(
                code::MISSING_SETTINGS,
                "the control stream without SETTINGS first",
            )),
            On::Control if matches!(kind, DATA | HEADERS | PUSH_PROMISE) => {
                unexpected("DATA, HEADERS or PUSH_PROMISE on the control stream")
            }
            On::Control if kind == SETTINGS && self.settled => unexpected("a second SETTINGS"),
            On::Request if matches!(kind, SETTINGS | GOAWAY | CANCEL_PUSH | MAX_PUSH_ID) => {
                unexpected("a control frame on a request stream")
            }
            _ => Ok(()),
        }
    }

    /// The stream ended: an error if it ended inside a frame.
    pub fn finish(&self) -> Result<(), H3Error> {
        match self.buf.is_empty() && self.in_data == 0 && self.skip == 0 {
            true => Ok(()),
            false => Err(err(code::FRAME_ERROR, "stream ended inside a frame")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(r: &mut FrameReader) -> Result<Vec<Frame>, H3Error> {
        let mut out = Vec::new();
        while let Some(f) = r.read()? {
            out.push(f);
        }
        Ok(out)
    }

    #[test]
    fn a_control_stream_reads_settings_then_skips_unknown_frames() {
        let mut bytes = Settings::ours().encode();
        // A reserved (grease) frame type 0x21 + 0x1f * 3 with 5000 bytes, then GOAWAY 8.
        bytes.extend(frame(0x21 + 0x1f * 3, &[7; 5000]));
        bytes.extend(frame(GOAWAY, &[8]));
        let mut r = FrameReader::new(On::Control);
        let mut got = Vec::new();
        for chunk in bytes.chunks(100) {
            r.push(chunk);
            assert!(r.buf.len() <= 200);
            got.extend(all(&mut r).unwrap());
        }
        assert_eq!(got, [Frame::Settings(Settings::ours()), Frame::Goaway(8)]);
        r.finish().unwrap();
    }

    #[test]
    fn a_request_streams_data_comes_in_pieces() {
        let mut bytes = frame(HEADERS, b"hdrs");
        bytes.extend(data_header(10));
        bytes.extend(b"0123456789");
        bytes.extend(frame(DATA, b"ab"));
        let mut r = FrameReader::new(On::Request);
        r.push(&bytes[..12]);
        assert_eq!(
            all(&mut r).unwrap(),
            [
                Frame::Headers(b"hdrs".to_vec()),
                Frame::Data(b"0123".to_vec())
            ]
        );
        assert!(r.finish().is_err());
        r.push(&bytes[12..]);
        let data: Vec<u8> = all(&mut r)
            .unwrap()
            .into_iter()
            .flat_map(|f| match f {
                Frame::Data(d) => d,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(data, b"456789ab");
        r.finish().unwrap();
    }

    #[test]
    fn frames_out_of_place_and_bad_settings_are_errors() {
        let cases: [(On, Vec<u8>, u64); 8] = [
            (On::Control, frame(GOAWAY, &[0]), code::MISSING_SETTINGS),
            (
                On::Control,
                [Settings::ours().encode(), frame(HEADERS, b"")].concat(),
                code::FRAME_UNEXPECTED,
            ),
            (
                On::Control,
                [Settings::ours().encode(), Settings::ours().encode()].concat(),
                code::FRAME_UNEXPECTED,
            ),
            (
                On::Request,
                Settings::ours().encode(),
                code::FRAME_UNEXPECTED,
            ),
            (On::Request, frame(0x06, b""), code::FRAME_UNEXPECTED),
            (
                On::Control,
                frame(SETTINGS, &[0x02, 0x00]),
                code::SETTINGS_ERROR,
            ),
            (
                On::Control,
                frame(SETTINGS, &[0x08, 0x01, 0x08, 0x01]),
                code::SETTINGS_ERROR,
            ),
            (
                On::Request,
                frame(HEADERS, &vec![0; MAX_FRAME + 1]),
                code::EXCESSIVE_LOAD,
            ),
        ];
        for (on, bytes, want) in cases {
            let mut r = FrameReader::new(on);
            r.push(&bytes);
            assert_eq!(all(&mut r).map_err(|e| e.code), Err(want), "{bytes:?}");
        }
        let mut r = FrameReader::new(On::Control);
        r.push(&frame(SETTINGS, &[0x33, 0x02]));
        assert_eq!(all(&mut r).unwrap_err().code, code::SETTINGS_ERROR);
    }
}
