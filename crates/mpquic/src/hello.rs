//! The control exchange at the start of every path connection (docs/PROTOCOL.md): the client
//! opens a bidirectional stream and sends a `Hello`; the server answers with a `HelloAck`. In
//! reliable mode the same stream then carries the path's packets.
//!
//! Framing: version byte (1), 2-byte big-endian length, JSON body of at most 4096 bytes. Read
//! and written on any byte stream (a QUIC stream today).

use anyhow::{bail, Result};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::config::TransportMode;

pub const VERSION: u8 = 4;
const MAX_BODY: usize = 4096;

/// A mode on the wire: its configuration name (`TransportMode::as_str`).
mod mode_name {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    use crate::config::TransportMode;

    pub fn serialize<S: Serializer>(m: &TransportMode, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(m.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TransportMode, D::Error> {
        let name = String::deserialize(d)?;
        TransportMode::parse(&name)
            .ok_or_else(|| D::Error::unknown_variant(&name, TransportMode::NAMES))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Hello {
    /// Random per client process: a new value means a restarted client (old state is dropped).
    pub session: u64,
    pub path: String,
    pub priority: u32,
    pub weight: u32,
    pub policy: String,
    #[serde(with = "mode_name")]
    pub mode: TransportMode,
    /// The tunnel address the client asks for (its `tun_cidr`), "a.b.c.d/len"; the server
    /// decides.
    pub addr: Option<String>,
    /// The address the client had (a reconnection): the server gives it back if it is free,
    /// unless the client asks for another or `clients:` reserves another for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    /// FEC for the tunnel, both directions (`off`, `auto`, `K/M`); absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fec: Option<String>,
    /// This connection is one of the path's pipes (`pipes: N`); absent: the path's only one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipe: Option<PipeOf>,
    /// The path carries its datagrams in stripe packets over this many UDP sockets
    /// (`transport: stripe`); absent: in the QUIC connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stripe: Option<StripeOf>,
    /// The client instance (its TUN device's name): one site may run several instances with
    /// one certificate (seed 000: one per traffic class, cr2 / br2 / df2), each its own session
    /// with its own address. Absent: the identity's only instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The instance's traffic classes (`classes:`) in priority order, the same on every
    /// connection: each is a lane of the tunnel over every path (`wire::CLASSED`). Empty: the
    /// instance has no classes (one lane, with `policy`, `mode` and `fec` above).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub classes: Vec<ClassOf>,
    /// The site LAN prefixes the client announces (`lan_prefixes`, "a.b.c.d/len"), routed to
    /// its session when its `clients:` entry on the server allows them; absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<String>,
    /// The path's `rate_limit` (bits/s, each direction): the server paces its side under it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<u64>,
    /// The path has a `data_budget`: the server moves no bulk flow onto it either
    /// (`bond::spill`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub metered: bool,
    /// The path's role now (`backup`, `overflow`; absent: primary): the server sends on a
    /// backup only as the client would. Its probes say it from then on (`wire`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The client judges its paths by what they deliver: the server's probe replies carry its
    /// counts for the path (`path/delivery.rs`; docs/PROTOCOL.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub counts: bool,
    /// The path's `link` (`starlink`; absent: nothing known): the server copies small packets
    /// across its reconfigurations as the client does (`path::reconfig`). A server that does
    /// not know the value ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
}

/// A traffic class: its name, its rank (its lane: 0 = highest priority), whether it is the
/// class that takes what no rule matches (the server sends flows it has not seen in it), and
/// how its packets travel, both ways: its policy, its carriage (`datagram`: never on a path's
/// stream; `reliable`: always; `auto`: as the path's loss says) and whether FEC protects them
/// (in the connection's `fec` mode).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClassOf {
    pub name: String,
    pub rank: u8,
    pub default: bool,
    pub policy: String,
    #[serde(with = "mode_name")]
    pub mode: TransportMode,
    #[serde(default)]
    pub fec: bool,
}

/// A stripe path: how many pipes (UDP sockets) the client registers.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct StripeOf {
    pub pipes: u8,
}

/// Which pipe of how many. Pipe 0 joins the session like a path; the others join pipe 0's
/// path (same client identity, session and path name) and are refused without it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PipeOf {
    pub index: u8,
    pub count: u8,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct HelloAck {
    pub ok: bool,
    pub error: Option<String>,
    /// The client's tunnel address, "a.b.c.d/len".
    pub addr: Option<String>,
    pub server_addr: Option<String>,
    pub mtu: Option<u32>,
    /// A dual-stack tunnel: the client's IPv6 tunnel address, "x:y::z/len".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr6: Option<String>,
    /// A stripe path: the UDP port of the server's stripe socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stripe_port: Option<u16>,
}

pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>> {
    let body = serde_json::to_vec(msg)?;
    if body.len() > MAX_BODY {
        bail!("control message too large");
    }
    let mut out = Vec::with_capacity(3 + body.len());
    out.push(VERSION);
    out.extend_from_slice(&(body.len() as u16).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// `msg` as an HTTP field value (CONNECT-IP: `connect_ip::request::HELLO_FIELD` and
/// `HELLO_ACK_FIELD`): its framing as on a stream, version byte first, in unpadded base64url.
pub fn to_field<T: Serialize>(msg: &T) -> Result<String> {
    Ok(URL_SAFE_NO_PAD.encode(encode(msg)?))
}

/// The message in a field value `to_field` made; an error names what is wrong with it.
pub fn from_field<T: DeserializeOwned>(value: &[u8]) -> Result<T> {
    let framed = URL_SAFE_NO_PAD
        .decode(value.trim_ascii())
        .map_err(|e| anyhow::anyhow!("not base64url: {e}"))?;
    match framed.as_slice() {
        [version, ..] if *version != VERSION => {
            bail!("peer speaks control protocol version {version}, this build speaks {VERSION}")
        }
        [_, hi, lo, body @ ..] if usize::from(u16::from_be_bytes([*hi, *lo])) == body.len() => {
            Ok(serde_json::from_slice(body)?)
        }
        _ => bail!("truncated or padded control message"),
    }
}

pub async fn write<T: Serialize>(s: &mut (impl AsyncWrite + Unpin), msg: &T) -> Result<()> {
    s.write_all(&encode(msg)?).await?;
    Ok(())
}

pub async fn read<T: DeserializeOwned>(r: &mut (impl AsyncRead + Unpin)) -> Result<T> {
    let mut head = [0u8; 3];
    r.read_exact(&mut head).await?;
    if head[0] != VERSION {
        bail!(
            "peer speaks control protocol version {}, this build speaks {VERSION}",
            head[0]
        );
    }
    let len = usize::from(u16::from_be_bytes([head[1], head[2]]));
    if len > MAX_BODY {
        bail!("control message of {len} bytes exceeds {MAX_BODY}");
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(serde_json::from_slice(&body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector() {
        let ack = HelloAck {
            ok: false,
            error: Some("x".into()),
            ..Default::default()
        };
        let b = encode(&ack).unwrap();
        assert_eq!(b[0], 4);
        let body = br#"{"ok":false,"error":"x","addr":null,"server_addr":null,"mtu":null}"#;
        assert_eq!(&b[1..3], &(body.len() as u16).to_be_bytes());
        assert_eq!(&b[3..], body);
    }

    #[test]
    fn in_a_field() {
        let ack = HelloAck {
            ok: true,
            addr: Some("10.9.0.2/24".into()),
            ..Default::default()
        };
        let v = to_field(&ack).unwrap();
        assert!(v
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_eq!(from_field::<HelloAck>(v.as_bytes()).unwrap(), ack);
        let framed = encode(&ack).unwrap();
        for (bad, why) in [
            (b"@@".to_vec(), "base64"),
            (URL_SAFE_NO_PAD.encode([9, 0, 0]).into_bytes(), "version 9"),
            (
                URL_SAFE_NO_PAD.encode(&framed[..10]).into_bytes(),
                "truncated",
            ),
        ] {
            let e = from_field::<HelloAck>(&bad).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }
}
