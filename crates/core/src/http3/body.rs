//! A CONNECT-IP stream's body once the request is answered 2xx, the same at both ends: DATA
//! frames whose payload is a sequence of capsules (RFC 9297 section 3.2). Any other frame is
//! not CONNECT-IP's (H3_FRAME_UNEXPECTED); a malformed capsule makes the message malformed
//! (H3_MESSAGE_ERROR).

use super::frame::{code, err, Frame, FrameReader, H3Error};
use crate::connect_ip::{Capsule, CapsuleReader};

pub struct CapsuleBody {
    frames: FrameReader,
    capsules: CapsuleReader,
}

impl CapsuleBody {
    /// The body after the HEADERS `frames` has read (bytes that followed them stay in it).
    pub fn new(frames: FrameReader) -> CapsuleBody {
        CapsuleBody {
            frames,
            capsules: CapsuleReader::default(),
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        self.frames.push(data);
    }

    /// Every capsule the bytes so far complete, to `each`.
    pub fn read(&mut self, mut each: impl FnMut(Capsule)) -> Result<(), H3Error> {
        while let Some(f) = self.frames.read()? {
            let Frame::Data(d) = f else {
                return Err(err(
                    code::FRAME_UNEXPECTED,
                    "a frame other than DATA in a CONNECT-IP body",
                ));
            };
            self.capsules.push(&d);
            while let Some(c) = self
                .capsules
                .read()
                .map_err(|e| err(code::MESSAGE_ERROR, e.0))?
            {
                each(c);
            }
        }
        Ok(())
    }

    /// The stream ended: an error if it ended inside a frame or a capsule.
    pub fn finish(&self) -> Result<(), H3Error> {
        self.frames.finish()?;
        self.capsules
            .finish()
            .map_err(|e| err(code::MESSAGE_ERROR, e.0))
    }
}
