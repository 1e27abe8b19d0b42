//! A minimal netlink client for the lane's kernel setup: generic netlink (the MPTCP path
//! manager, `endpoints.rs`) and routing (the TPROXY policy route, `tproxy.rs`). Messages are
//! built and read by the pure functions here; the socket sends one request at a time and
//! waits for its answer.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{bail, Context, Result};

pub const NETLINK_ROUTE: libc::c_int = 0;
pub const NETLINK_GENERIC: libc::c_int = 16;
pub const NLM_F_REQUEST: u16 = 1;
pub const NLM_F_ACK: u16 = 4;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
pub const NLA_F_NESTED: u16 = 1 << 15;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

/// A netlink attribute: length, type, value, padded to 4 bytes.
pub fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut out = Vec::with_capacity(len.next_multiple_of(4));
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(len.next_multiple_of(4), 0);
    out
}

/// A netlink message: its header (`kind`, `flags`, `seq`), then `body`.
pub fn message(kind: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let len = 16 + body.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(body);
    out
}

/// A generic netlink body: its header (`cmd`, `version`), then `attrs`.
pub fn genl(cmd: u8, version: u8, attrs: &[u8]) -> Vec<u8> {
    [&[cmd, version, 0, 0][..], attrs].concat()
}

/// The attributes in `b` as (type without flags, value).
pub fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
        let kind = u16::from_ne_bytes([b[2], b[3]]) & !NLA_F_NESTED;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((kind, &b[4..len]));
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    out
}

/// What came back for request `seq` in `buf`: the body of a reply with data (if any came),
/// and whether the ACK came; or the kernel's error.
pub fn reply(buf: &[u8], seq: u32) -> io::Result<(Option<Vec<u8>>, bool)> {
    let mut b = buf;
    let mut data = None;
    while b.len() >= 16 {
        let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let kind = u16::from_ne_bytes([b[4], b[5]]);
        let got_seq = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
        if len < 16 || len > b.len() {
            break;
        }
        if got_seq == seq {
            if kind == NLMSG_ERROR && len >= 20 {
                let err = i32::from_ne_bytes([b[16], b[17], b[18], b[19]]);
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(-err));
                }
                return Ok((data, true));
            }
            data = Some(b[16..len].to_vec());
        }
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    Ok((data, false))
}

pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
}

impl Netlink {
    pub fn open(protocol: libc::c_int) -> io::Result<Netlink> {
        // SAFETY: a plain syscall; the descriptor is owned from here on.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and nobody else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Netlink { fd, seq: 0 })
    }

    /// Send one request (`kind`, `flags` beside REQUEST and ACK, `body`) and wait for its ACK;
    /// returns the body of the reply with data that came before it, if any.
    pub fn request(&mut self, kind: u16, flags: u16, body: &[u8]) -> io::Result<Option<Vec<u8>>> {
        self.seq += 1;
        let msg = message(kind, flags | NLM_F_REQUEST | NLM_F_ACK, self.seq, body);
        // SAFETY: the buffer outlives the call; the kernel is the destination.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 16384];
        let mut data = None;
        loop {
            // SAFETY: `buf` is ours and as long as said.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let (got, acked) = reply(&buf[..n as usize], self.seq)?;
            data = got.or(data);
            if acked {
                return Ok(data);
            }
        }
    }

    /// The id of the generic netlink family `name`.
    pub fn family(&mut self, name: &str) -> Result<u16> {
        let mut z = name.as_bytes().to_vec();
        z.push(0);
        let body = genl(CTRL_CMD_GETFAMILY, 1, &attr(CTRL_ATTR_FAMILY_NAME, &z));
        let Some(payload) = self.request(GENL_ID_CTRL, 0, &body)? else {
            bail!("no answer for the family {name}");
        };
        // After the genl header.
        attrs(payload.get(4..).unwrap_or_default())
            .into_iter()
            .find(|(k, v)| *k == CTRL_ATTR_FAMILY_ID && v.len() >= 2)
            .map(|(_, v)| u16::from_ne_bytes([v[0], v[1]]))
            .with_context(|| format!("the family {name} has no id"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_acks_data_or_errors() {
        let msg = |kind: u16, seq: u32, body: &[u8]| message(kind, 0, seq, body);
        let ack = |seq: u32, err: i32| {
            msg(
                NLMSG_ERROR,
                seq,
                &[&err.to_ne_bytes()[..], &[0u8; 16]].concat(),
            )
        };
        assert_eq!(reply(&ack(3, 0), 3).unwrap(), (None, true));
        assert_eq!(
            reply(&ack(2, 0), 3).unwrap(),
            (None, false),
            "another request's"
        );
        let e = reply(&ack(3, -libc::EEXIST), 3).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
        let both = [msg(0x20, 3, &[1, 2, 3, 4]), ack(3, 0)].concat();
        assert_eq!(reply(&both, 3).unwrap(), (Some(vec![1, 2, 3, 4]), true));
        let a = [attr(1, &[9]), attr(2 | NLA_F_NESTED, &attr(3, &[7, 7]))].concat();
        let got = attrs(&a);
        assert_eq!(got[0], (1, &[9u8][..]));
        assert_eq!(got[1].0, 2);
        assert_eq!(attrs(got[1].1), vec![(3, &[7u8, 7][..])]);
    }
}
