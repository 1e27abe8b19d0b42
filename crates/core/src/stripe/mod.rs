//! The stripe transport's wire format (seed 000 section 14; docs/PROTOCOL.md section "Stripe"):
//! inner traffic over raw UDP "pipes" beside a path's QUIC connection, each packet encrypted and
//! authenticated on its own, with a replay window. Sans-IO: sealing and opening packets, the
//! replay window and the keys; the sockets, registration timers and pacing live in the shell.
//!
//! The sender's congestion control runs on the receiver's acknowledgements (`feedback.rs`: which
//! counters arrived) in `flight.rs`, which drives one of the core's controllers (`cc`).
//!
//! Keys come from the path's TLS session (`Keys::from_secret`, fed with a TLS exporter of the
//! path's QUIC connection), so only the client that passed the handshake, and the server, can
//! make or read a stripe packet, and a packet from one path's session is refused by another.
//!
//! Packet:
//! ```text
//! 0        1       2                 10                18
//! | ver=1 | type  | session (u64 BE) | counter (u64 BE) | ciphertext | tag (16) |
//! ```
//! The 18-byte header is the AEAD's associated data (authenticated, not encrypted); the nonce is
//! 4 zero bytes and the counter. Each direction has its own key and its own counter, shared by
//! all pipes of the session; the receiver accepts a counter once, within `WINDOW` of the highest
//! it has authenticated (checked only after the tag, so a forged packet cannot move it).

pub mod feedback;
pub mod flight;

pub use feedback::Feedback;
pub use flight::Flight;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};

pub const VERSION: u8 = 1;
pub const HEADER: usize = 18;
pub const TAG: usize = 16;
/// Counters remembered below the highest: later than that is refused as too old.
pub const WINDOW: u64 = 4096;
/// Bytes of TLS exporter output `Keys::from_secret` takes: two keys and the session id.
pub const SECRET_LEN: usize = 72;
/// The exporter label (RFC 8446 section 7.5); the context is the path's name.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-mpquic-stripe";

/// What a stripe packet carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A datagram of the tunnel (an inner packet, or an FEC or bond frame).
    Data = 1,
    /// Client to server: pipe `[index, count]` of the session is at this source address.
    Register = 2,
    /// Server to client: the registration of pipe `[index]` was taken.
    RegisterAck = 3,
    /// Either way, every few seconds on an idle pipe: keeps NAT mappings and the server's
    /// record of the pipe alive. Payload: the pipe's index.
    Keepalive = 4,
    /// Either way: which of the peer's counters arrived (`feedback.rs`), for its congestion
    /// controller. The only type that is not acknowledged itself.
    Feedback = 5,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        match b {
            1 => Some(Kind::Data),
            2 => Some(Kind::Register),
            3 => Some(Kind::RegisterAck),
            4 => Some(Kind::Keepalive),
            5 => Some(Kind::Feedback),
            _ => None,
        }
    }
}

/// Why a received packet was refused (each counted by the shell).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Shorter than a header and a tag, another version, or an unknown type.
    Malformed,
    /// No session with this id (the shell's lookup; `session_of`).
    UnknownSession,
    /// The tag did not verify: forged, corrupted, or sealed with another key.
    Unauthenticated,
    /// A counter seen before, or too far below the highest (`WINDOW`).
    Replayed,
}

impl Refused {
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Malformed => "stripe_malformed",
            Refused::UnknownSession => "stripe_unknown_session",
            Refused::Unauthenticated => "stripe_unauthenticated",
            Refused::Replayed => "stripe_replayed",
        }
    }
}

/// The session id of a packet, to find its session before opening it.
pub fn session_of(pkt: &[u8]) -> Option<u64> {
    (pkt.len() >= HEADER + TAG && pkt[0] == VERSION)
        .then(|| u64::from_be_bytes(pkt[2..10].try_into().expect("8 bytes")))
}

/// One side's keys for a session.
pub struct Keys {
    pub session: u64,
    pub seal: Sealer,
    pub open: Opener,
}

impl Keys {
    /// From `SECRET_LEN` bytes of the path's TLS exporter (`EXPORTER_LABEL`, the path's name
    /// as context): bytes 0..32 key the client's packets, 32..64 the server's, 64..72 are the
    /// session id.
    pub fn from_secret(secret: &[u8; SECRET_LEN], client: bool) -> Keys {
        let key = |k: &[u8]| {
            LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, k).expect("32-byte key"))
        };
        let (c2s, s2c) = (&secret[..32], &secret[32..64]);
        let session = u64::from_be_bytes(secret[64..72].try_into().expect("8 bytes"));
        let (mine, theirs) = if client { (c2s, s2c) } else { (s2c, c2s) };
        Keys {
            session,
            seal: Sealer {
                key: key(mine),
                session,
                counter: 0,
            },
            open: Opener {
                key: key(theirs),
                session,
                window: ReplayWindow::default(),
            },
        }
    }
}

/// Seals this side's packets: one counter for all pipes.
pub struct Sealer {
    key: LessSafeKey,
    session: u64,
    counter: u64,
}

impl Sealer {
    /// Append the packet for `payload` to `out` (header, ciphertext, tag).
    pub fn seal(&mut self, kind: Kind, payload: &[u8], out: &mut Vec<u8>) {
        let counter = self.counter;
        // 2^64 packets are never sent; the session would be rekeyed (a new connection) first.
        self.counter += 1;
        let start = out.len();
        out.extend_from_slice(&header(kind, self.session, counter));
        out.extend_from_slice(payload);
        let (head, body) = out[start..].split_at_mut(HEADER);
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce(counter), Aad::from(&*head), body)
            .expect("ChaCha20-Poly1305 seals any length a datagram has");
        out.extend_from_slice(tag.as_ref());
    }

    /// Packets sealed so far.
    pub fn sealed(&self) -> u64 {
        self.counter
    }
}

/// Opens the peer's packets: the tag first, then the replay window.
pub struct Opener {
    key: LessSafeKey,
    session: u64,
    window: ReplayWindow,
}

impl Opener {
    /// The counters authenticated so far (what `Feedback::from_window` reports).
    pub fn window(&self) -> &ReplayWindow {
        &self.window
    }

    /// Authenticate and decrypt `pkt` in place; the kind and the payload (a part of `pkt`).
    pub fn open<'a>(&mut self, pkt: &'a mut [u8]) -> Result<(Kind, &'a [u8]), Refused> {
        if pkt.len() < HEADER + TAG || pkt[0] != VERSION {
            return Err(Refused::Malformed);
        }
        let kind = Kind::from_u8(pkt[1]).ok_or(Refused::Malformed)?;
        if session_of(pkt) != Some(self.session) {
            return Err(Refused::UnknownSession);
        }
        let counter = u64::from_be_bytes(pkt[10..18].try_into().expect("8 bytes"));
        if !self.window.fresh(counter) {
            return Err(Refused::Replayed);
        }
        let (head, body) = pkt.split_at_mut(HEADER);
        let plain = self
            .key
            .open_in_place(nonce(counter), Aad::from(&*head), body)
            .map_err(|_| Refused::Unauthenticated)?;
        // Only an authentic packet is remembered.
        self.window.mark(counter);
        Ok((kind, plain))
    }
}

fn header(kind: Kind, session: u64, counter: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = VERSION;
    h[1] = kind as u8;
    h[2..10].copy_from_slice(&session.to_be_bytes());
    h[10..18].copy_from_slice(&counter.to_be_bytes());
    h
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// The counters seen within `WINDOW` below the highest (a bitmap, as WireGuard's).
#[derive(Debug, Clone)]
pub struct ReplayWindow {
    /// One past the highest counter seen (0: none yet).
    next: u64,
    bits: [u64; (WINDOW / 64) as usize],
}

impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow {
            next: 0,
            bits: [0; (WINDOW / 64) as usize],
        }
    }
}

impl ReplayWindow {
    /// Newer than every counter seen so far (what may move a peer to a new address: a
    /// reordered or delayed packet from its old one never does).
    pub fn newest(&self, n: u64) -> bool {
        n >= self.next
    }

    /// Not seen, and not too old.
    pub fn fresh(&self, n: u64) -> bool {
        if n >= self.next {
            return true;
        }
        if self.next - n > WINDOW {
            return false;
        }
        let (w, b) = Self::slot(n);
        self.bits[w] & (1 << b) == 0
    }

    /// Remember `n` (call after `fresh` said so and the packet proved authentic).
    pub fn mark(&mut self, n: u64) {
        if n >= self.next {
            // Slide: clear the slots the window moves over (all of them after a long jump).
            let gap = n + 1 - self.next;
            if gap >= WINDOW {
                self.bits = [0; (WINDOW / 64) as usize];
            } else {
                for m in self.next..=n {
                    let (w, b) = Self::slot(m);
                    self.bits[w] &= !(1 << b);
                }
            }
            self.next = n + 1;
        }
        let (w, b) = Self::slot(n);
        self.bits[w] |= 1 << b;
    }

    /// The highest counter seen, if any.
    pub fn largest(&self) -> Option<u64> {
        self.next.checked_sub(1)
    }

    /// Seen (and within the window)?
    pub fn seen(&self, n: u64) -> bool {
        n < self.next && self.next - n <= WINDOW && {
            let (w, b) = Self::slot(n);
            self.bits[w] & (1 << b) != 0
        }
    }

    fn slot(n: u64) -> (usize, u32) {
        let i = n % WINDOW;
        ((i / 64) as usize, (i % 64) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_counter_above_all_seen_is_newest() {
        let mut w = ReplayWindow::default();
        assert!(w.newest(0));
        w.mark(5);
        assert!(!w.newest(5), "seen");
        assert!(!w.newest(3), "older: a reordered or delayed packet");
        assert!(w.newest(6));
    }

    fn secret() -> [u8; SECRET_LEN] {
        std::array::from_fn(|i| i as u8)
    }

    /// The test vector in docs/PROTOCOL.md (checked against Python's `cryptography`:
    /// `ChaCha20Poly1305(bytes(range(32))).encrypt(bytes(12), b"ping", header)`).
    #[test]
    fn vector() {
        let mut client = Keys::from_secret(&secret(), true);
        assert_eq!(client.session, 0x4041_4243_4445_4647);
        let mut out = Vec::new();
        client.seal.seal(Kind::Data, b"ping", &mut out);
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "01014041424344454647000000000000000068d12c56264aed220427e23f1c5b517d59665183"
        );
        let mut server = Keys::from_secret(&secret(), false);
        assert_eq!(server.open.open(&mut out), Ok((Kind::Data, &b"ping"[..])));
    }

    #[test]
    fn each_side_opens_only_the_others_packets_once() {
        let mut c = Keys::from_secret(&secret(), true);
        let mut s = Keys::from_secret(&secret(), false);
        let mut pkts = Vec::new();
        for i in 0..3u8 {
            let mut p = Vec::new();
            c.seal.seal(Kind::Data, &[i; 100], &mut p);
            pkts.push(p);
        }
        // Out of order is fine, a second copy is not.
        for i in [2, 0, 1] {
            let mut p = pkts[i].clone();
            let (kind, payload) = s.open.open(&mut p).unwrap();
            assert_eq!((kind, payload), (Kind::Data, &[i as u8; 100][..]));
        }
        let mut again = pkts[1].clone();
        assert_eq!(s.open.open(&mut again), Err(Refused::Replayed));
        // The client cannot open its own packets (the other direction's key).
        let mut own = pkts[0].clone();
        assert_eq!(c.open.open(&mut own), Err(Refused::Unauthenticated));
    }

    #[test]
    fn forged_tampered_and_foreign_packets_are_refused() {
        let mut c = Keys::from_secret(&secret(), true);
        let mut s = Keys::from_secret(&secret(), false);
        let mut p = Vec::new();
        c.seal.seal(Kind::Register, &[0, 4], &mut p);
        for i in 0..p.len() {
            let mut t = p.clone();
            t[i] ^= 0x01;
            let r = s.open.open(&mut t);
            assert!(r.is_err(), "byte {i} flipped and still opened");
        }
        // A forged packet with a counter far ahead does not move the window: the genuine
        // packet still opens.
        let mut forged = p.clone();
        forged[10..18].copy_from_slice(&1_000_000u64.to_be_bytes());
        assert_eq!(s.open.open(&mut forged), Err(Refused::Unauthenticated));
        assert_eq!(
            s.open.open(&mut p.clone()).map(|(k, _)| k),
            Ok(Kind::Register)
        );
        // Another session's keys (another path, another TLS session).
        let mut other_secret = secret();
        other_secret[0] ^= 0xff;
        let mut other = Keys::from_secret(&other_secret, false);
        assert_eq!(
            other.open.open(&mut p.clone()),
            Err(Refused::Unauthenticated)
        );
        // Garbage of every length: refused, never a panic.
        for n in 0..64 {
            let mut g = vec![0x01u8; n];
            assert!(s.open.open(&mut g).is_err());
        }
        assert_eq!(session_of(&[1u8; 10]), None);
    }

    #[test]
    fn replay_window_slides() {
        let mut w = ReplayWindow::default();
        for n in [0u64, 5, 3, WINDOW + 10] {
            assert!(w.fresh(n));
            w.mark(n);
            assert!(!w.fresh(n));
        }
        // Now the highest is WINDOW + 10: 5 is too old, 11 is within and unseen.
        assert!(!w.fresh(5));
        assert!(w.fresh(11));
        assert!(!w.fresh(10), "exactly WINDOW below the highest is too old");
        // A jump beyond the window forgets everything below.
        w.mark(10 * WINDOW);
        assert!(w.fresh(10 * WINDOW - 1));
        assert!(!w.fresh(10 * WINDOW));
        assert!(!w.fresh(WINDOW + 10));
    }
}
