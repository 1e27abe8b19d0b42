//! QUIC engine settings and UDP sockets. One place decides the transport parameters for both
//! sides, so client and server cannot disagree on windows, MTU or timeouts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use quinn::congestion::{BbrConfig, CubicConfig, NewRenoConfig};
use quinn::{MtuDiscoveryConfig, TransportConfig};
use socket2::{Domain, Protocol, Socket, Type};
use tracing::warn;

use crate::config::{Bind, Congestion};
use crate::tun;

/// Path MTU assumed when it cannot be read from the interface.
pub const DEFAULT_LINK_MTU: u32 = 1500;

/// A connection with no packets at all for this long is closed. Path health decides far sooner
/// (probes every 100 ms); this only bounds how long a dead connection's state is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(15);
/// Datagrams the engine may queue beyond its congestion window: about 40 ms at 100 Mbit/s. Kept
/// small because a deep queue here is latency for every flow on the path.
const DATAGRAM_SEND_BUFFER: usize = 512 * 1024;

pub fn transport(cc: Congestion, link_mtu: u32) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_idle_timeout(Some(IDLE_TIMEOUT.try_into().expect("valid idle timeout")));
    let payload = mpquic_core::mtu::udp_payload(link_mtu);
    t.initial_mtu(payload);
    let mut mtud = MtuDiscoveryConfig::default();
    mtud.upper_bound(payload);
    t.mtu_discovery_config(Some(mtud));
    t.datagram_receive_buffer_size(Some(4 << 20));
    t.datagram_send_buffer_size(DATAGRAM_SEND_BUFFER);
    // Reliable mode: one stream carries a whole path; windows sized for ~100 ms at 1 Gbit/s.
    t.stream_receive_window((16u32 << 20).into());
    t.receive_window((32u32 << 20).into());
    t.send_window(32 << 20);
    t.max_concurrent_bidi_streams(4u32.into());
    t.max_concurrent_uni_streams(0u32.into());
    match cc {
        Congestion::Cubic => t.congestion_controller_factory(Arc::new(CubicConfig::default())),
        Congestion::Newreno => t.congestion_controller_factory(Arc::new(NewRenoConfig::default())),
        Congestion::Bbr => t.congestion_controller_factory(Arc::new(BbrConfig::default())),
    };
    Arc::new(t)
}

/// Larger kernel socket buffers absorb bursts at Gbit/s rates; as root the sysctl cap is bypassed.
fn grow_buffers(s: &Socket) {
    let size: libc::c_int = 8 << 20;
    for (force, normal) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        // SAFETY: setsockopt with a valid int option value on an owned socket.
        let rc = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                force,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            let _ = if normal == libc::SO_RCVBUF {
                s.set_recv_buffer_size(size as usize)
            } else {
                s.set_send_buffer_size(size as usize)
            };
        }
    }
}

/// The server's listening socket.
pub fn server_socket(listen: SocketAddr) -> Result<UdpSocket> {
    let s = Socket::new(
        Domain::for_address(listen),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    if listen.is_ipv6() {
        let _ = s.set_only_v6(false);
    }
    grow_buffers(&s);
    s.bind(&listen.into())
        .with_context(|| format!("cannot listen on udp {listen}"))?;
    Ok(s.into())
}

/// A client path's socket: bound to the WAN interface (SO_BINDTODEVICE) or address it names.
pub fn client_socket(bind: &Bind, remote: SocketAddr) -> Result<UdpSocket> {
    let s = Socket::new(
        Domain::for_address(remote),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    let unspecified = if remote.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let local = match bind {
        Bind::Any => unspecified,
        Bind::Ip(ip) => *ip,
        Bind::Interface(name) => {
            s.bind_device(Some(name.as_bytes()))
                .with_context(|| format!("cannot bind to interface {name} (SO_BINDTODEVICE)"))?;
            match (remote.is_ipv4(), tun::interface_v4(name)) {
                (true, Ok(a)) => IpAddr::V4(a),
                (true, Err(e)) => {
                    warn!(interface = %name, error = %e, "interface has no IPv4 address; binding to the device only");
                    unspecified
                }
                (false, _) => unspecified,
            }
        }
    };
    grow_buffers(&s);
    s.bind(&SocketAddr::new(local, 0).into())
        .with_context(|| format!("cannot bind udp socket to {local}"))?;
    Ok(s.into())
}

/// MTU of the link a path uses, for deriving the TUN MTU.
pub fn link_mtu(bind: &Bind) -> u32 {
    match bind {
        Bind::Interface(name) => tun::interface_mtu(name).unwrap_or(DEFAULT_LINK_MTU),
        _ => DEFAULT_LINK_MTU,
    }
}
