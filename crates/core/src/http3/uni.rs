//! The peer's unidirectional streams, under the same rules at both ends of a connection
//! (RFC 9114 section 6.2): one control stream, SETTINGS first on it and never closed; QPACK's
//! encoder and decoder streams read and ignored (this end's table capacity is 0, so they carry
//! nothing it needs); unknown and grease types ignored; push streams refused (this end never
//! allows pushes).

use std::collections::HashMap;

use super::frame::{self, code, err, Frame, FrameReader, H3Error, On, Settings};
use crate::varint;

enum Uni {
    /// The stream type has not arrived whole yet.
    Opening(Vec<u8>),
    Control(FrameReader),
    Ignored,
}

/// What a piece of a unidirectional stream brought.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UniNews {
    Nothing,
    /// The peer's SETTINGS arrived (`UniStreams::settings`).
    Settings,
    /// The peer is going away (GOAWAY).
    Goaway,
}

#[derive(Default)]
pub struct UniStreams {
    settings: Option<Settings>,
    control: Option<u64>,
    streams: HashMap<u64, Uni>,
}

impl UniStreams {
    /// The peer's SETTINGS, once they arrived.
    pub fn settings(&self) -> Option<Settings> {
        self.settings
    }

    /// Streams whose type has not arrived yet (the caller bounds them with its own).
    pub fn opening(&self) -> usize {
        (self.streams.values())
            .filter(|u| matches!(u, Uni::Opening(_)))
            .count()
    }

    pub fn knows(&self, stream: u64) -> bool {
        self.streams.contains_key(&stream)
    }

    /// Bytes on the peer's unidirectional `stream` (`fin`: its end). An error closes the
    /// connection (`push`: the code a push stream is refused with at this end).
    pub fn on_bytes(
        &mut self,
        stream: u64,
        data: &[u8],
        fin: bool,
        push: H3Error,
    ) -> Result<Vec<UniNews>, H3Error> {
        let state = self
            .streams
            .entry(stream)
            .or_insert(Uni::Opening(Vec::new()));
        let data = match state {
            Uni::Opening(head) => {
                head.extend_from_slice(data);
                let Some((kind, n)) = varint::read(head) else {
                    if fin {
                        self.streams.remove(&stream);
                    }
                    return Ok(Vec::new());
                };
                let after = head.split_off(n);
                *state = match kind {
                    frame::CONTROL_STREAM if self.control.is_some() => {
                        return Err(err(code::STREAM_CREATION_ERROR, "a second control stream"));
                    }
                    frame::CONTROL_STREAM => {
                        self.control = Some(stream);
                        Uni::Control(FrameReader::new(On::Control))
                    }
                    frame::PUSH_STREAM => return Err(push),
                    _ => Uni::Ignored,
                };
                after
            }
            _ => data.to_vec(),
        };
        let Some(Uni::Control(reader)) = self.streams.get_mut(&stream) else {
            if fin {
                self.streams.remove(&stream);
            }
            return Ok(Vec::new());
        };
        reader.push(&data);
        let mut news = Vec::new();
        while let Some(f) = reader.read()? {
            match f {
                Frame::Settings(s) => {
                    self.settings = Some(s);
                    news.push(UniNews::Settings);
                }
                Frame::Goaway(_) => news.push(UniNews::Goaway),
                _ => {}
            }
        }
        if fin {
            return Err(err(
                code::CLOSED_CRITICAL_STREAM,
                "the control stream closed",
            ));
        }
        Ok(news)
    }

    /// The stream is gone; the control stream's state stays (its end is an error anyway).
    pub fn forget(&mut self, stream: u64) {
        if !matches!(self.streams.get(&stream), Some(Uni::Control(_))) {
            self.streams.remove(&stream);
        }
    }
}

/// This end's control stream: its type, then SETTINGS.
pub fn our_control_stream() -> Vec<u8> {
    let mut control = Vec::new();
    varint::write(frame::CONTROL_STREAM, &mut control);
    control.extend(Settings::ours().encode());
    control
}
